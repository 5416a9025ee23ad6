"""The one error tree of the project, and the one place that maps errors to exit codes.

Every error raised on purpose by ``elastic`` or ``agent`` derives from
:class:`ElasticError`. Third-party errors are translated at the boundary where
they occur, with the original chained as ``__cause__``.

Exit codes (documented for operators and scripts):

====  ===========================================================
0     success
1     the job failed (a worker failed and the restart budget is spent)
      (0 and 1 also for an agent started after its job ended; 0 after a
      SIGTERM drain unless ``--drain-exit-code`` says otherwise)
2     bad input: a flag, a config file, an environment variable
3     the etcd store cannot be reached or answered with an error (also: etcd
      refused our certificate, user, password or a permission)
4     rendezvous failed (timed out, fenced off, duplicate node id)
5     an agent asked over gRPC could not be reached
6     this node left the job unfit to train: its GPUs failed the check
      before a round (``--gpu-check enforce``), or a worker of its last
      round outlived SIGKILL (the replacement cannot start)
70    internal error (a bug: please report it with the log)
====  ===========================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_STORE = 3
EXIT_RENDEZVOUS = 4
EXIT_AGENT_UNREACHABLE = 5
EXIT_NODE_UNFIT = 6
EXIT_INTERNAL = 70


EXIT_CODES_HELP = ("Exit codes: 0 success, "
                   "1 the job failed, 2 bad input, 3 etcd unreachable, 4 rendezvous failed, "
                   "5 agent unreachable, 6 this node left the job unfit (GPU check), "
                   "70 internal error (a bug: report it with the log).")


class ElasticError(Exception):
    """Base of every error this project raises on purpose."""

    exit_code = EXIT_INTERNAL


class ConfigError(ElasticError):
    """Bad input from the user: a flag, an environment variable or a config file."""

    exit_code = EXIT_BAD_INPUT


class InvalidRequestError(ConfigError):
    """A gRPC request to an agent carries a value it refuses (a negative rank,
    a NaN, a checkpoint path outside the root): the caller gets
    INVALID_ARGUMENT with the message, which names the method and the field."""


class StoreError(ElasticError):
    """The key-value store (etcd) failed a request."""

    exit_code = EXIT_STORE


class StoreUnavailableError(StoreError):
    """The store cannot be reached; the message names the endpoints tried."""


class StoreTimeoutError(StoreError):
    """A store request did not complete within its deadline."""


class StoreAuthError(StoreError):
    """etcd and this client do not accept each other, or etcd refused a request
    for lack of permission: the server's certificate is not signed by the CA
    given, the server wants a client certificate (or refused ours), it refused
    the user and password, or the user's role lacks a permission on the job's
    prefix. Retrying does not help: the message says what to change. Exit code
    3, like every store error."""


class WatchCompactedError(StoreError):
    """A watch asked for history the store has already compacted away.

    The watcher must re-read the current state and watch again from there.
    """

    def __init__(self, message: str, compact_revision: int):
        super().__init__(message)
        self.compact_revision = compact_revision


class LeaseLostError(StoreError):
    """A lease expired or was revoked; keys written under it are gone."""


class AgentUnreachableError(ElasticError):
    """An agent's gRPC server did not answer (down, frozen, or the address is wrong)."""

    exit_code = EXIT_AGENT_UNREACHABLE


class AgentAuthError(AgentUnreachableError):
    """This client and an agent do not accept each other's TLS certificates:
    the agent's is not signed by ``--tls-ca``, does not name the address (or
    ``--tls-server-name``), or the agent refused this client's (none, or one
    of another CA). Retrying does not help: the message says what to change.
    Exit code 5, like every unreachable agent."""


class RequestRefusedError(ElasticError):
    """An agent or the job refused a control request (drain, restart) as it
    was made: the client is not authorised, or it came too soon after the
    last. The message says what to change or when to try again. Exit code 2."""

    exit_code = EXIT_BAD_INPUT


class NotAuthorisedError(RequestRefusedError):
    """A control request came without a client certificate verified against
    the agent's ``--tls-ca`` (gRPC PERMISSION_DENIED)."""


class RateLimitedError(RequestRefusedError):
    """An operator restart came less than ``--operator-restart-interval``
    after the last one of the job (gRPC RESOURCE_EXHAUSTED); ``next_at`` is
    the wall time from which the next is taken (0.0 when unknown)."""

    def __init__(self, message: str, next_at: float = 0.0):
        super().__init__(message)
        self.next_at = next_at


class WorkerSpawnError(ElasticError):
    """A worker process could not be started (missing interpreter, no file
    descriptors, unwritable log directory). The cause is chained."""

    exit_code = EXIT_JOB_FAILED


class GpuError(ElasticError):
    """NVML (the NVIDIA management library, through ``pynvml``) failed a query
    or did not answer within its deadline. The NVML error is chained. Caught
    by the GPU check, which turns it into a reason (:mod:`agent.gpu_health`);
    never the end of the agent."""


class GpuUnavailableError(GpuError):
    """NVML cannot be used on this host: ``pynvml`` (the ``nvidia-ml-py``
    package) is not installed, ``libnvidia-ml.so`` is not found, or the
    NVIDIA driver is not loaded. A host without GPUs says so too."""


class NodeUnfitError(ElasticError):
    """This node cannot take part in the job as it is: its GPUs failed
    ``--gpu-check enforce`` before it joined (the message says how). It does
    not join, so the others never restart for it. Exit code 6."""

    exit_code = EXIT_NODE_UNFIT


class RendezvousError(ElasticError):
    """The rendezvous could not produce a round for this node."""

    exit_code = EXIT_RENDEZVOUS


class RendezvousTimeoutError(RendezvousError):
    """No round including this node was committed within the join timeout."""


class FencedError(RendezvousError):
    """A write was refused because its round is no longer the current round."""


class JobEndedError(RendezvousError):
    """The job has already ended (its last round carries an outcome): there is
    nothing to join. A restarted unit or pod of a job that succeeded exits 0
    (it has nothing left to do, and must not crash-loop); of a failed one, 1."""

    def __init__(self, message: str, succeeded: bool):
        super().__init__(message)
        self.succeeded = succeeded
        self.exit_code = EXIT_OK if succeeded else EXIT_JOB_FAILED


class DuplicateNodeError(RendezvousError):
    """Another live agent is already registered under this node id."""


class MalformedRecordError(RendezvousError):
    """A key under the job's prefix holds something that is not a valid record."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"malformed record at key {key!r}: {problem}")
        self.key = key
        self.problem = problem


class CheckpointError(ElasticError):
    """A checkpoint could not be saved, verified or restored."""


class CheckpointWriteError(CheckpointError):
    """A save failed; nothing was committed and the previous checkpoint is intact.

    The message names the directory being written and the OS error (e.g.
    ``[Errno 28] No space left on device``); ``directory`` and ``errno`` carry
    them for code (``errno`` is None when the cause was not an OS error).
    """

    def __init__(self, message: str, directory: str, errno: int | None = None):
        super().__init__(message)
        self.directory = directory
        self.errno = errno


class CheckpointCorruptError(CheckpointError):
    """Committed checkpoints exist but none passed verification (a missing,
    truncated or corrupt file, or missing metadata); the message names them."""


def exit_code_for(exc: BaseException) -> int:
    """The process exit code for an error that ends a command."""
    if isinstance(exc, ElasticError):
        return exc.exit_code
    return EXIT_INTERNAL
