"""What each worker of a round is told: torchrun's environment plus elasticd's own.

The variables torch 2.13's ``LocalElasticAgent`` sets for each worker, with
the same names and meanings: ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK`` (the
node's rank), ``ROLE_RANK``, ``ROLE_NAME`` (``--role``), ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE`` (the nodes), ``ROLE_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID`` (the job id),
``TORCHELASTIC_USE_AGENT_STORE`` (``False``: the workers' group rendezvous at
``MASTER_ADDR:MASTER_PORT``, with no store of the agent's), and, read when the
interpreter or torch starts (:func:`startup_env`), ``OMP_NUM_THREADS=1``
unless the agent's environment sets it.

Not set, unlike torchrun: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (torchrun: 1
unless set). torch's default, 3 (``SkipCleanUp``: ProcessGroupNCCL.hpp's
``ErrorHandlingMode``, read in 2.6.0 and 2.13.0), ends a worker whose
collective failed or timed out at once; 1 (``TearDown``) first aborts its
NCCL communicators, and ``ncclCommAbort`` can hang (torch's reason for 3),
most of all when a peer is gone, which is every failure elasticd restarts
from: the worker would then wait for the agent's SIGKILL. Skipping the
clean-up loses nothing, since the process ends. A value in the agent's
environment still reaches the workers (they inherit it).
``TORCHELASTIC_ERROR_FILE`` is set by the supervisor, per rank and round
(:func:`agent.worker_output.rank_files`); ``CUDA_VISIBLE_DEVICES`` is inherited.

What differs: ``TORCHELASTIC_RESTART_COUNT`` is the number of rounds this
node started workers in before this one, whatever ended them (a failure, a
node joining or leaving, an operator's restart); 0 in the node's first round.
torchrun counts only the restarts after a failure on its own node, so under
elasticd it grows faster, and "above 0" still means "this node has run
workers of this job before": the usual test for resuming from a checkpoint.
A node that joins late starts at 0, as under torchrun; ``ELASTIC_ROUND`` is
the job-wide count. ``TORCHELASTIC_MAX_RESTARTS`` is ``--max-restarts``:
failures allowed within ``--restart-window``, not over the job's life.
"""

from __future__ import annotations

from typing import Mapping

from agent.netaddr import SYSTEM_NETWORK, HostNetwork, socket_ifname_env
from elastic import worker_env
from elastic.rendezvous.api import Round


def worker_envs(round_: Round, node_id: str, *, job_id: str, restart_count: int,
                max_restarts: int, agent_socket: str, checkpoint_dir: str | None,
                hang_timeout_s: float, lease_ttl_s: float = 0.0,
                role: str = "default", heartbeat_socket: str = "",
                memory_dir: str | None = None) -> list[dict[str, str]]:
    """The environment of each local worker of ``node_id`` in ``round_``, by local rank
    (torchrun's variables are those of the module docstring; elasticd's own,
    those of :mod:`elastic.worker_env`).

    Global ranks are dense and follow node ranks: a node's first rank is the
    number of workers on the nodes before it (nodes may differ in nproc; the
    round's placement of the node says it, see :mod:`elastic.rendezvous.placement`).
    Raises ValueError if the node is not a member of the round, or the round
    does not place it (see ``RendezvousNode.placed_round``).
    """
    me, placed = round_.member(node_id), round_.placement(node_id)
    if me is None or placed is None:
        raise ValueError(f"node {node_id} is not a member of round {round_.number}")
    first_rank = placed.first_rank
    common = {
        "WORLD_SIZE": str(round_.world_size),
        "LOCAL_WORLD_SIZE": str(me.nproc),
        "GROUP_RANK": str(me.node_rank),
        "GROUP_WORLD_SIZE": str(len(round_.members)),
        "ROLE_NAME": role,
        "ROLE_WORLD_SIZE": str(round_.world_size),
        "MASTER_ADDR": round_.master_addr,
        "MASTER_PORT": str(round_.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        worker_env.ROUND: str(round_.number),
        worker_env.JOB_ID: job_id,
        worker_env.NODE_ID: node_id,
        worker_env.AGENT_SOCKET: agent_socket,
        worker_env.HANG_TIMEOUT_S: f"{hang_timeout_s:g}",
        worker_env.LEASE_TTL_S: f"{lease_ttl_s:g}",
    }
    if heartbeat_socket:
        common[worker_env.HEARTBEAT_SOCKET] = heartbeat_socket
    if checkpoint_dir:
        common[worker_env.CHECKPOINT_DIR] = checkpoint_dir
    if memory_dir:
        common[worker_env.MEMORY_DIR] = memory_dir
    envs = []
    for local_rank in range(me.nproc):
        rank = first_rank + local_rank
        envs.append({**common, "RANK": str(rank), "LOCAL_RANK": str(local_rank),
                     "ROLE_RANK": str(rank)})
    return envs


def startup_env(nproc: int, environ: Mapping[str, str], advertise_addr: str | None = None, *,
                net: HostNetwork = SYSTEM_NETWORK) -> dict[str, str]:
    """Variables every worker of this node gets in every round, read when the
    interpreter or torch starts (so warm workers must be started with them).

    ``environ`` is the agent's environment: a variable set there is never
    overridden. ``OMP_NUM_THREADS=1`` with several workers per node.
    ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` name the interface that
    carries ``advertise_addr`` (see :func:`agent.netaddr.socket_ifname_env`:
    none, and a warning, when no interface does); none without
    ``advertise_addr``. Never raises.
    """
    env: dict[str, str] = {}
    if nproc > 1 and "OMP_NUM_THREADS" not in environ:
        # As torchrun: several workers on one node each using every core would
        # oversubscribe it.
        env["OMP_NUM_THREADS"] = "1"
    if advertise_addr:
        env.update(socket_ifname_env(advertise_addr, environ, net=net))
    return env
