"""elasticd's configuration: one table of options, one frozen, validated object.

Every option can be given three ways; the first one found wins:

1. a command-line flag (``--hang-timeout 60``),
2. an environment variable ``ELASTIC_`` + the option in upper snake case
   (``ELASTIC_HANG_TIMEOUT=60``),
3. a YAML file given with ``--config`` (or ``ELASTIC_CONFIG``), keys in snake
   case (``hang_timeout: 60``),

and otherwise the default. torchrun's command line counts as flags: its names
for our options (``--rdzv-id`` for ``--job-id``, ``--nproc_per_node``), its
``--rdzv-conf`` keys, and its own flags, honoured or refused with one line
(:mod:`agent.torchrun_cli`). Unknown keys in the file are an error (a file that
silently ignores a setting is worse than none); unknown ``ELASTIC_*``
variables get a warning. A key left empty in the file (``log_dir:``) means
"not given".

The file's scalars are read as the text they were written as
(:mod:`agent.config_file`), and each option parses its own, exactly as it
parses a flag.

:func:`load` builds the :class:`AgentConfig` in three steps: :func:`resolve`
takes each option from its first source, :func:`validate` checks the job,
its nodes, this node and the credentials together, and :func:`discover` asks
the host (its devices, the script on disk or PATH, its network). An option
whose value a field takes as it is names that field (:attr:`Option.field`);
the others feed the fields the later steps work out. The configuration's
parts for the rendezvous, the reactor and the supervisor come from
:class:`AgentConfig`'s own methods.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import shlex
import shutil
import socket
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from agent import torchrun_cli
from agent.config_file import read_file
from agent.console import ConsoleFilter, Streams, parse_local_ranks, parse_streams
from agent.devices import SYSTEM_DEVICES, HostDevices, parse_nproc_per_node, resolve_nproc
from agent.goodput import DEFAULT_WINDOW_S as DEFAULT_GOODPUT_WINDOW_S
from agent.gpu_health import GPU_CHECK_MODES, GpuExpectation, expected_gpus
from agent.health import HangTimeouts
from agent.memory_tier import DEFAULT_ROOT as DEFAULT_MEMORY_ROOT
from agent.netaddr import SYSTEM_NETWORK, HostNetwork, choose_advertise_addr
from agent.reactor import Settings
from agent.stragglers import ACTIONS as STRAGGLER_ACTIONS
from agent.stragglers import DEFAULT_THRESHOLD, DEFAULT_WINDOW_S, StragglerPolicy
from agent.supervisor import Entrypoint
from elastic import __version__, worker_env
from elastic.errors import EXIT_CODES_HELP, ConfigError
from elastic.failpoints import ENV_VAR as FAILPOINT_ENV
from elastic.hostport import HostPort
from elastic.joblog import JobLogger
from elastic.options import non_negative, positive
from elastic.records import cap_text, valid_host, validate_id
from elastic.rendezvous.config import (
    DEFAULT_EXIT_BARRIER_TIMEOUT_S,
    DEFAULT_FREEZE_TIMEOUT_S,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_WINDOW_S,
    DEFAULT_SETTLE_S,
    DEFAULT_START_TIMEOUT_S,
    RendezvousConfig,
    default_freeze_timeout_s,
    parse_nnodes,
)
from agent.tls import AgentTLS, agent_tls_from_options
from elastic.rendezvous.operator import DEFAULT_OPERATOR_RESTART_INTERVAL_S
from elastic.store.api import DEFAULT_CONNECT_TIMEOUT_S
from elastic.store.security import PASSWORD_ENV, EtcdSecurity, security_from_options

log = logging.getLogger(__name__)

# --hang-timeout-first: a first step may compile, load data and restore a checkpoint.
DEFAULT_HANG_TIMEOUT_FIRST_S = 600.0

# The training script from the environment (systemd's EnvironmentFile, a pod's
# env): the script, its arguments split like a shell, "run it with -m", and
# "execute it directly, not with python" (torchrun's --no-python).
SCRIPT_ENV = ("ELASTIC_SCRIPT", "ELASTIC_SCRIPT_ARGS", "ELASTIC_MODULE", "ELASTIC_NO_PYTHON")
# Variables the agent sets for its workers or they inherit from it
# (elastic.worker_env), and the failpoints: not options, never warned about.
WORKER_ENV = worker_env.NOT_OPTIONS | {FAILPOINT_ENV}


def _text(name: str, raw: Any) -> str:
    """Text as given; ConfigError for a list or mapping (or an explicitly tagged
    YAML number), which would otherwise become its Python repr."""
    if not isinstance(raw, str):
        raise ConfigError(f"--{name} {raw!r}: expected text")
    return raw


def _flag(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"--{name} {raw!r}: expected true or false")


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def parse(name: str, raw: Any) -> str:
        text = str(raw).strip().lower()
        if text not in allowed:
            raise ConfigError(f"--{name} {raw!r}: expected one of {', '.join(allowed)}")
        return text
    return parse


def _straggler_threshold(name: str, raw: Any) -> float:
    value = non_negative(float)(name, raw)
    if 0 < value <= 1:
        raise ConfigError(f"--{name} {raw!r}: must be above 1 (1.2: 20% slower than its "
                          "peers) or 0 (straggler detection off)")
    return value


def _port(name: str, raw: Any) -> int:
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 5 or int(text) > 65535:
        raise ConfigError(f"--{name} {raw!r}: expected a port number 0-65535 (0: off)")
    return int(text)


def default_state_dir(environ: Mapping[str, str]) -> str:
    """Where the agent keeps rank logs and error files when --state-dir is not
    given: systemd's ``$STATE_DIRECTORY`` (from ``StateDirectory=``), else
    ``/var/lib/elasticd`` for root, else ``$XDG_STATE_HOME/elasticd`` (by
    default ``~/.local/state/elasticd``)."""
    if environ.get("STATE_DIRECTORY"):
        return environ["STATE_DIRECTORY"].split(":")[0]
    if os.geteuid() == 0:
        return "/var/lib/elasticd"
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                         "state")
    return os.path.join(base, "elasticd")


def _host_port(name: str, raw: Any) -> str:
    """``HOST:PORT``, or ``:PORT`` for the advertised address (filled in by
    :func:`discover`), as written."""
    text = str(raw)
    try:
        HostPort.parse(text, host_optional=True)
    except ValueError:
        raise ConfigError(f"--{name} {raw!r}: expected HOST:PORT, e.g. 10.0.0.11:29401, or "
                          ":PORT for the advertised address") from None
    return text


def _on_advertised(listen: str | None, advertised: str) -> str | None:
    """``:PORT`` becomes the advertised address with that port."""
    if listen is not None and listen.startswith(":"):
        return str(HostPort(advertised, HostPort.parse(listen, host_optional=True).port))
    return listen


def _absolute_path(name: str, raw: Any) -> str | None:
    """A path made absolute; None for an empty one (not given)."""
    path = _text(name, raw)
    return os.path.abspath(path) if path else None


def _names(name: str, raw: Any) -> tuple[str, ...]:
    """A list of names: comma-separated text (a flag, a variable) or a YAML
    list of strings; empty entries dropped."""
    if isinstance(raw, list) and all(isinstance(item, str) for item in raw):
        items = raw
    elif isinstance(raw, str):
        items = raw.split(",")
    else:
        raise ConfigError(f"--{name} {raw!r}: expected names separated by commas")
    return tuple(item.strip() for item in items if item.strip())


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(name: str, raw: Any) -> int:
    """Bytes: a whole number with an optional binary unit K, M, G or T (``8G``)."""
    text = str(raw).strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS else ""
    number = text[:len(text) - len(unit)]
    if not (number.isascii() and number.isdigit()) or len(number) > 15:
        raise ConfigError(f"--{name} {raw!r}: expected a size in bytes, e.g. 8G, 512M or 0")
    return int(number) * _SIZE_UNITS[unit]


def _rack(name: str, raw: Any) -> str:
    """A rack's name: an id's characters (it is compared, logged and shown)."""
    text = _text(name, raw).strip()
    return validate_id("rack", text) if text else ""


def _readable_file(name: str, raw: Any) -> str:
    """A path to a file this process can read, made absolute; ConfigError naming
    the option otherwise (checked at start, not when the file is first needed)."""
    path = _text(name, raw)
    if not os.path.isfile(path):
        raise ConfigError(f"--{name} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"--{name} {path}: not readable by this user")
    return os.path.abspath(path)


@dataclass(frozen=True)
class Option:
    """One option: its flag ``--name`` (also ``--name_with_underscores``, as
    torchrun spells flags), ``ELASTIC_NAME`` and the file key ``name``.
    ``parse(flag, raw)`` turns what was written into the value, or raises
    ConfigError naming ``--flag``. ``torchrun``: torchrun's other flags for the
    same option (its ``--rdzv-conf`` keys: :mod:`agent.torchrun_cli`);
    ``short``: a one-letter flag (``-r``). ``field``: the
    :class:`AgentConfig` field that takes the parsed value as it is; None for
    an option that :func:`validate` or :func:`discover` combines with others
    (the rendezvous, the node's files, TLS) or works out (the workers, the
    advertised address)."""

    name: str  # the flag without dashes; env and file keys derive from it
    parse: Callable[[str, Any], Any]
    default: Any
    help: str
    metavar: str | None = None
    is_flag: bool = False
    torchrun: tuple[str, ...] = ()
    short: str | None = None
    field: str | None = None

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return "ELASTIC_" + self.key.upper()


OPTIONS = [
    Option("etcd", _text, None, "etcd endpoints, comma-separated (http://host:2379,...)", "URLS",
           torchrun=("--rdzv-endpoint",)),
    Option("standalone", _flag, False,
           "start a private etcd on a Unix socket only this user can reach (default for a "
           "job of one node without an etcd; job id: a random one)", is_flag=True),
    Option("job-id", _text, None, "the job's id: every agent of a job uses the same", "ID",
           torchrun=("--rdzv-id",)),
    Option("nnodes", _text, None,
           "number of nodes, N or MIN:MAX (default 1 for --standalone and with "
           "--rdzv-backend, as torchrun)", "MIN[:MAX]"),
    Option("nproc-per-node", parse_nproc_per_node, 1,
           "workers per node: N, gpu (the CUDA GPUs visible here), cpu (the CPUs) or auto "
           "(gpu if there are any, else cpu)", "N|gpu|cpu|auto"),
    Option("node-id", _text, None, "this node's id (default: <hostname>-<pid>)", "ID"),
    Option("max-restarts", non_negative(int), DEFAULT_MAX_RESTARTS,
           "failures allowed within --restart-window before the job fails (torchrun: "
           "restarts over the whole job, default 0)", "N", field="max_restarts"),
    Option("restart-window", positive(float), DEFAULT_RESTART_WINDOW_S,
           "the window of the restart budget", "SECONDS", field="restart_window_s"),
    Option("checkpoint-dir", _absolute_path, None, "where workers save and find checkpoints",
           "DIR", field="checkpoint_dir"),
    Option("hang-timeout", non_negative(float), 300.0,
           "a worker without heartbeat or progress this long after its first progress (an "
           "optimizer step or elastic.step) is hung (0: hang detection off); under NCCL's "
           "default 10-minute collective timeout, so the hang is seen and attributed before "
           "NCCL's watchdog ends the processes", "SECONDS", field="hang_timeout_s"),
    Option("hang-timeout-first", positive(float), DEFAULT_HANG_TIMEOUT_FIRST_S,
           "the same until a worker's first progress: compilation, data loading and a "
           "restore come first", "SECONDS", field="hang_timeout_first_s"),
    Option("lease-ttl", positive(float), DEFAULT_LEASE_TTL_S,
           "a node silent this long is considered gone", "SECONDS", field="lease_ttl_s"),
    Option("freeze-timeout", non_negative(float), None,
           "a round member whose agent answers none of its peer's probes this long is frozen: "
           "the leader revokes its lease and the others go on without it (0: only its lease "
           f"expiring decides; else from 0.5 s to below --lease-ttl; default "
           f"{DEFAULT_FREEZE_TIMEOUT_S:g} s, or half --lease-ttl if that is shorter)",
           "SECONDS"),
    Option("settle", non_negative(float), DEFAULT_SETTLE_S,
           "wait this long without new arrivals before closing a round below max", "SECONDS",
           field="settle_s"),
    Option("join-timeout", positive(float), DEFAULT_JOIN_TIMEOUT_S,
           "give up when no round includes this node for this long", "SECONDS",
           field="join_timeout_s"),
    Option("start-timeout", positive(float), DEFAULT_START_TIMEOUT_S,
           "a round member that has not started its workers this long after the round "
           "formed is left out and the round formed again without it", "SECONDS",
           field="start_timeout_s"),
    Option("exit-barrier-timeout", positive(float), DEFAULT_EXIT_BARRIER_TIMEOUT_S,
           "once one node's workers all exited 0, how long the others may go on before "
           "the job fails naming them", "SECONDS", field="exit_barrier_timeout_s"),
    Option("scale-up-wait", non_negative(float), 0.0,
           "0: grow a running round as soon as a node joins; above 0: a joining node waits "
           "for the next committed checkpoint (so growing redoes no work), at most this long",
           "SECONDS", field="scale_up_wait_s"),
    Option("listen", _host_port, None,
           "address of the agent's gRPC server (default: the advertised address, a free port; "
           ":PORT: the advertised address, that port; 0.0.0.0:PORT for every interface)",
           "HOST:PORT"),
    Option("advertise-addr", _text, None,
           "address peers and workers reach this node at (default: the host name if it "
           "resolves to an address that is not loopback, else this host's source address on "
           "the route to etcd; 127.0.0.1 with --standalone or an etcd on loopback)", "HOST",
           torchrun=("--local-addr",)),
    Option("state-dir", _text, None,
           "the agent's own files: rank logs and error files under <dir>/<job>/<node>/ "
           "(default: $STATE_DIRECTORY under systemd, /var/lib/elasticd for root, else "
           "~/.local/state/elasticd)", "DIR"),
    Option("log-dir", _text, None,
           "per-round worker logs (default: <state-dir>/<job>/<node>/logs)", "DIR"),
    Option("log-format", _choice("text", "json"), "text",
           "the agent's log lines: text, or json (one object per line with job, node, round)",
           "text|json", field="log_format"),
    Option("metrics-port", _port, 0,
           "serve Prometheus metrics over HTTP on this port, on the --listen host (0: off)",
           "PORT", field="metrics_port"),
    Option("goodput-window", positive(float), DEFAULT_GOODPUT_WINDOW_S,
           "the window of the effective training time ratio (elasticd_ettr, elasticctl "
           "status): productive over accounted time in the last this many seconds",
           "SECONDS", field="goodput_window_s"),
    Option("stop-grace", non_negative(float), 5.0,
           "after SIGTERM, wait this long before SIGKILL of a worker (torchrun: 30): for a "
           "drain, a signal, the job's end, a scale-up; time for a final checkpoint", "SECONDS",
           torchrun=("--shutdown-timeout",), field="stop_grace_s"),
    Option("failure-stop-grace", non_negative(float), 3.0,
           "the same after a failure (a worker died or hung, a node was lost, a restart): "
           "survivors stuck in a collective never act on SIGTERM; at most --stop-grace",
           "SECONDS", field="failure_stop_grace_s"),
    Option("prestart", _flag, True,
           "keep warm workers (torch imported) ready for fast restarts; --no-prestart to turn off",
           is_flag=True),
    Option("warm-sets", positive(int), 2,
           "sets of nproc warm workers kept ready: with 2, a failure soon after a restart "
           "(before the set that replaces the used one has imported torch) restarts warm too",
           "N", field="warm_sets"),
    Option("drain-exit-code", non_negative(int), 0,
           "exit code after a SIGTERM drain: 0 is a clean stop (systemd); Kubernetes sets "
           "143 so that a Job replaces a pod it terminated instead of counting it complete",
           "N", field="drain_exit_code"),
    Option("connect-timeout", positive(float), DEFAULT_CONNECT_TIMEOUT_S,
           "give up reaching etcd after this long", "SECONDS", field="connect_timeout_s"),
    Option("etcd-cacert", _readable_file, None,
           "PEM bundle of the CAs that sign etcd's server certificates, for https:// "
           "endpoints (default: the system's CA roots)", "FILE"),
    Option("etcd-cert", _readable_file, None,
           "PEM client certificate for etcd (with --etcd-key), for etcd's --client-cert-auth",
           "FILE"),
    Option("etcd-key", _readable_file, None, "PEM private key of --etcd-cert", "FILE"),
    Option("etcd-user", _text, None,
           f"etcd user to authenticate as; its password from {PASSWORD_ENV} or "
           "--etcd-password-file (never a flag). Its role needs readwrite on the prefix "
           "/elastic/v1/<job-id>/", "NAME"),
    Option("etcd-password-file", _readable_file, None,
           "file holding the password of --etcd-user (a trailing newline is ignored)", "FILE"),
    Option("tls-cert", _readable_file, None,
           "PEM certificate of this agent (with --tls-key and --tls-ca: mutual TLS on --listen, "
           "and towards its peers); it must name the advertised address, or "
           "--tls-server-name", "FILE"),
    Option("tls-key", _readable_file, None, "PEM private key of --tls-cert", "FILE"),
    Option("tls-ca", _readable_file, None,
           "PEM bundle of the CA(s) that sign the agents' and the operators' certificates: "
           "--listen takes only clients with such a certificate, and only they may drain "
           "or restart", "FILE"),
    Option("tls-allowed-cn", _names, (),
           "only client certificates with one of these common names (CN), comma-separated, "
           "may drain or restart (others of --tls-ca: PERMISSION_DENIED naming their CN); "
           "default: any certificate --tls-ca signed", "CN[,CN...]"),
    Option("tls-server-name", _text, None,
           "the name checked in the peers' certificates instead of their address (one name "
           "every agent's certificate carries)", "NAME"),
    Option("probe-listen", _host_port, None,
           "also serve health and status, read-only and in plain text, on this address (for "
           "Kubernetes gRPC probes, which cannot use TLS); drain and restart are refused "
           "there (:PORT: the advertised address)", "HOST:PORT"),
    Option("operator-restart-interval", non_negative(float), DEFAULT_OPERATOR_RESTART_INTERVAL_S,
           "at most one operator restart (elasticctl restart, RequestRestart over gRPC) of the "
           "job per this many seconds (0: no limit)", "SECONDS",
           field="operator_restart_interval_s"),
    Option("role", _text, "default", "the workers' ROLE_NAME", "NAME", field="role"),
    Option("gpu-check", _choice(*GPU_CHECK_MODES), "warn",
           "before a round's workers start, check this node's GPUs through NVML: all expected "
           "present, no uncorrectable ECC error, no page retirement or row remap pending, no "
           "process of the last round holding memory (waited for up to 10 s). warn: log and "
           "record a failed check, start anyway; enforce: this node leaves the job (exit 6); "
           "off: no check", "off|warn|enforce", field="gpu_check"),
    Option("redirects", parse_streams, Streams(),
           "keep worker output off the console (it still goes to the rank logs): 0 none, "
           "1 stdout, 2 stderr, 3 both, or per local rank, e.g. 0:3,1:2", "SPEC", short="-r"),
    Option("memory-tier", _flag, False,
           "stage each worker's snapshots in host memory this agent owns (--memory-root), "
           "replicate them to a buddy node and free them when the job or the agent ends "
           "(docs/operations.md)", is_flag=True, field="memory_tier"),
    Option("memory-root", _absolute_path, DEFAULT_MEMORY_ROOT,
           "the tmpfs (or ramfs) the memory tier lives on: <root>/elastic-<uid>/<job>/<node>/",
           "DIR", field="memory_root"),
    Option("memory-min-free", _size, 1 << 30,
           "with --memory-tier, warn at start when the memory root or this agent's memory "
           "cgroup has less room than this (K, M, G, T: binary units)", "SIZE",
           field="memory_min_free_bytes"),
    Option("rack", _rack, "",
           "where this node sits (a rack, a switch, a zone): the memory tier replicates "
           "each node's snapshots to a node of another rack when it can", "NAME",
           field="rack"),
    Option("straggler-threshold", _straggler_threshold, DEFAULT_THRESHOLD,
           "the leader names a rank a straggler when its step time (the median of its recent "
           "heartbeats') is this many times its peers' median for a whole --straggler-window "
           "(1.2: 20%% slower; 0: straggler detection off)", "RATIO"),
    Option("straggler-window", positive(float), DEFAULT_WINDOW_S,
           "how long a rank must be that slow before it is named", "SECONDS"),
    Option("straggler-action", _choice(*STRAGGLER_ACTIONS), "report",
           "what the leader does about a straggler: report (an event, a metric, a line in "
           "elasticctl status, a warning in its log), or replace (the same, and it drains "
           "the straggler's node when a standby waits to take its place)", "report|replace"),
    Option("local-ranks-filter", parse_local_ranks, None,
           "copy only these local ranks' output to the console, e.g. 0 or 0,1 (every rank's "
           "output still goes to its log)", "RANKS"),
]
# The file's keys: the options' and the script's.
FILE_KEYS = frozenset({o.key for o in OPTIONS} | {"script", "module", "script_args", "no_python"})


@dataclass(frozen=True)
class AgentConfig:
    """Everything elasticd needs, validated. Build it with :func:`load`."""

    job_id: str
    etcd: str | None
    standalone: bool
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    node_id: str
    max_restarts: int
    restart_window_s: float
    checkpoint_dir: str | None
    hang_timeout_s: float
    lease_ttl_s: float
    settle_s: float
    join_timeout_s: float
    start_timeout_s: float
    exit_barrier_timeout_s: float
    scale_up_wait_s: float
    listen: str
    advertise_addr: str
    state_dir: str
    log_dir: str
    log_format: str
    metrics_port: int
    stop_grace_s: float
    drain_exit_code: int
    prestart: bool
    warm_sets: int
    connect_timeout_s: float
    script: str | None
    module: str | None
    script_args: tuple[str, ...]
    # TLS files and the etcd user (password included, left out of repr):
    # hand it to open_store(..., security=config.etcd_security).
    etcd_security: EtcdSecurity = EtcdSecurity()
    # Mutual TLS on --listen and towards the peers (None: plain text, control
    # open to whoever reaches --listen); the plain-text read-only endpoint.
    tls: AgentTLS | None = None
    probe_listen: str | None = None
    operator_restart_interval_s: float = DEFAULT_OPERATOR_RESTART_INTERVAL_S
    # torchrun's --no-python: ``script`` is a program executed as it is.
    no_python: bool = False
    role: str = "default"
    console: ConsoleFilter = ConsoleFilter()
    # --failure-stop-grace, capped by stop_grace_s where it is used.
    failure_stop_grace_s: float = 3.0
    # --gpu-check, and the GPUs it expects here (agent.gpu_health). "off" here,
    # "warn" from load(): agents built in-process (tests, the simulator) check
    # nothing unless they ask.
    gpu_check: str = "off"
    gpu_expectation: GpuExpectation = GpuExpectation()
    # The memory tier (agent.memory_tier): on, where, the room warned below.
    memory_tier: bool = False
    memory_root: str = DEFAULT_MEMORY_ROOT
    memory_min_free_bytes: int = 1 << 30
    rack: str = ""
    # --freeze-timeout: 0 here (the lease alone decides), the option's default from load().
    freeze_timeout_s: float = 0.0
    hang_timeout_first_s: float = DEFAULT_HANG_TIMEOUT_FIRST_S
    goodput_window_s: float = DEFAULT_GOODPUT_WINDOW_S
    # --straggler-*: None (off) here, the options' policy from load(): agents
    # built in-process (tests, the simulator) judge no stragglers unless they ask.
    stragglers: StragglerPolicy | None = None

    def rendezvous(self) -> RendezvousConfig:
        """The rendezvous' settings (:class:`elastic.rendezvous.config.RendezvousConfig`)."""
        return RendezvousConfig(
            job_id=self.job_id, min_nodes=self.min_nodes, max_nodes=self.max_nodes,
            settle_s=self.settle_s, lease_ttl_s=self.lease_ttl_s,
            join_timeout_s=self.join_timeout_s, max_restarts=self.max_restarts,
            restart_window_s=self.restart_window_s, start_timeout_s=self.start_timeout_s,
            exit_barrier_timeout_s=self.exit_barrier_timeout_s,
            scale_up_wait_s=self.scale_up_wait_s, freeze_timeout_s=self.freeze_timeout_s)

    def reactor_settings(self) -> Settings:
        """What the agent's decisions (:func:`agent.reactor.react`) need of this configuration."""
        return Settings(node_id=self.node_id, nproc=self.nproc_per_node,
                        lease_ttl_s=self.lease_ttl_s, join_timeout_s=self.join_timeout_s,
                        job_id=self.job_id, drain_exit_code=self.drain_exit_code,
                        gpu_check=self.gpu_check, freeze_timeout_s=self.freeze_timeout_s)

    def hang_timeouts(self) -> HangTimeouts:
        """--hang-timeout and --hang-timeout-first, as the hang verdict takes them."""
        return HangTimeouts(after_s=self.hang_timeout_s, first_s=self.hang_timeout_first_s)

    def entrypoint(self) -> Entrypoint:
        """What every worker runs: the script or module, its arguments, --no-python."""
        return Entrypoint(script=self.script, module=self.module, args=self.script_args,
                          no_python=self.no_python)

    def supervisor_options(self) -> dict[str, Any]:
        """:class:`agent.supervisor.WorkerSupervisor`'s keyword arguments that this
        configuration sets: the job, the node, the workers, what they run, how
        they are stopped, the warm pool and the console. The caller adds the
        node's log directory, the exit callback and the workers' environment."""
        return {"job_id": self.job_id, "node_id": self.node_id, "nproc": self.nproc_per_node,
                "entrypoint": self.entrypoint(), "stop_grace_s": self.stop_grace_s,
                "prestart": self.prestart, "warm_sets": self.warm_sets, "console": self.console}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elasticd", usage="%(prog)s [OPTIONS] SCRIPT [ARGS...]",
        # An abbreviation of a flag could take a script's own --flag (after SCRIPT) for ours.
        allow_abbrev=False,
        description="Per-node agent of an elastic, fault-tolerant PyTorch training job.",
        epilog="\n\n".join(textwrap.fill(paragraph, 79) for paragraph in (
            "Every option also reads ELASTIC_<OPTION> (e.g. ELASTIC_HANG_TIMEOUT) and the "
            "--config YAML file (e.g. hang_timeout: 60); flags win over the environment, "
            "which wins over the file.",
            "The script may come from ELASTIC_SCRIPT (with ELASTIC_SCRIPT_ARGS, split like a "
            "shell, ELASTIC_MODULE=1 for -m and ELASTIC_NO_PYTHON=1 for --no-python) or the "
            "file's script, script_args, module and no_python.",
            "A torchrun command line works as it is: replace torchrun by elasticd "
            "(docs/migrating-from-torchrun.md says what changes).",
            EXIT_CODES_HELP + " After SIGTERM or SIGINT the node drains and leaves the job, "
            "then exits with --drain-exit-code (default 0) for SIGTERM, 130 for SIGINT.")),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"elasticd {__version__}")
    p.add_argument("--config", default=None, metavar="FILE", help="YAML file of options")
    for o in OPTIONS:
        names = ([o.short] if o.short else []) + [f"--{o.name}"]
        if o.is_flag:
            p.add_argument(*names, dest=o.key, action=argparse.BooleanOptionalAction,
                           default=None, help=o.help)
        else:
            p.add_argument(*names, dest=o.key, default=None, metavar=o.metavar, help=o.help)
    p.add_argument("-m", "--module", dest="as_module", action="store_true", default=None,
                   help="run SCRIPT as a module, like python -m")
    p.add_argument("--no-python", dest="no_python", action="store_true", default=None,
                   help="SCRIPT is a program (looked up on PATH): execute it directly, not "
                        "with python (no warm workers then)")
    p.add_argument("--no_python", dest="no_python", action="store_true", default=None,
                   help=argparse.SUPPRESS)  # torchrun's other spelling
    torchrun_cli.add_arguments(p, OPTIONS)
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    return p


def _script(args: argparse.Namespace, environ: Mapping[str, str],
            file_values: Mapping[str, Any]) -> tuple[str | None, bool, bool, tuple[str, ...]]:
    """The training script, whether it is a module, whether it is executed without
    python, and its arguments: from the command line, else the environment, else
    the file."""
    script, as_module, no_python = args.script, bool(args.as_module), bool(args.no_python)
    script_args = tuple(args.script_args)
    if script is None and environ.get(SCRIPT_ENV[0]):
        script = environ[SCRIPT_ENV[0]]
        as_module = _flag("module", environ.get(SCRIPT_ENV[2], as_module))
        no_python = _flag("no-python", environ.get(SCRIPT_ENV[3], no_python))
        try:
            script_args = tuple(shlex.split(environ.get(SCRIPT_ENV[1], "")))
        except ValueError as exc:
            raise ConfigError(f"{SCRIPT_ENV[1]}: cannot split into arguments ({exc})") from None
    elif script is None:
        script = _text("script", file_values["script"]) if "script" in file_values else None
        as_module = _flag("module", file_values.get("module", as_module))
        no_python = _flag("no-python", file_values.get("no_python", no_python))
        file_args = file_values.get("script_args", [])
        if not isinstance(file_args, list) or not all(isinstance(a, str) for a in file_args):
            raise ConfigError(f"script_args {file_args!r}: expected a list of arguments")
        script_args = tuple(file_args)
    return script, as_module, no_python, script_args


def _first_given(o: Option, line: torchrun_cli.CommandLine, environ: Mapping[str, str],
                 file_values: Mapping[str, Any]) -> Any:
    """``o``'s value from its first source: a flag (any of its names), ``o.env``,
    the file, else its default; parsed, or ConfigError naming the flag."""
    if o.key in line.flags:
        spelling, given = line.flags[o.key]
        return o.parse(spelling, given)
    if o.env in environ:
        return o.parse(o.name, environ[o.env])
    if o.key in file_values:
        return o.parse(o.name, file_values[o.key])
    return o.default


def _warn_about_environment(environ: Mapping[str, str]) -> None:
    """A warning for each ``ELASTIC_*`` variable that is no option, and for
    torchrun's variables elasticd does not read (ConfigError for one it cannot
    run with: :func:`agent.torchrun_cli.check_environment`)."""
    # The etcd password comes from the environment only: no flag, no file key.
    known_env = ({o.env for o in OPTIONS} | {"ELASTIC_CONFIG", "ELASTIC_LOG_LEVEL"}
                 | {PASSWORD_ENV} | set(SCRIPT_ENV) | WORKER_ENV)
    for name in sorted(environ):
        if name.startswith("ELASTIC_") and name not in known_env:
            log.warning("Ignoring unknown environment variable %s (not an elasticd option)", name)
    for warning in torchrun_cli.check_environment(environ):
        log.warning("%s", warning)


def _fields_of(part: Any) -> dict[str, Any]:
    """A dataclass's fields by name (``asdict`` would turn nested ones into dicts)."""
    return {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}


@dataclass(frozen=True)
class Given:
    """What :func:`resolve` read: each option's value from its first source,
    by :attr:`Option.key`; the rendezvous torchrun's flags choose; and where
    the script is read from (``args``, ``file_values``, torchrun's ``line``)."""

    values: Mapping[str, Any]
    rendezvous: torchrun_cli.Rendezvous
    line: torchrun_cli.CommandLine
    args: argparse.Namespace
    file_values: Mapping[str, Any]

    def fields(self) -> dict[str, Any]:
        """The :class:`AgentConfig` fields the options set as they are (:attr:`Option.field`)."""
        return {o.field: self.values[o.key] for o in OPTIONS if o.field}


def resolve(argv: list[str] | None, environ: Mapping[str, str]) -> Given:
    """Flags (torchrun's names included), ``environ`` and the ``--config`` file
    (from ``--config`` or ``ELASTIC_CONFIG``), each option taken from its first
    source as the module docstring says, and torchrun's rendezvous flags read
    (:func:`agent.torchrun_cli.choose_rendezvous`, its notes logged).

    Warns about unknown ``ELASTIC_*`` variables. Raises ConfigError for a file
    :func:`agent.config_file.read_file` refuses, an option given under two
    names, a value its option cannot parse, a torchrun flag or variable
    elasticd cannot honour, a rendezvous it cannot run; argparse exits 2 for a
    malformed command line.
    """
    args = parser().parse_args(argv)
    config_path = args.config or environ.get("ELASTIC_CONFIG")
    file_values = read_file(config_path, FILE_KEYS) if config_path else {}
    line = torchrun_cli.read_command_line(args, OPTIONS)
    _warn_about_environment(environ)
    values = {o.key: _first_given(o, line, environ, file_values) for o in OPTIONS}
    rdzv = torchrun_cli.choose_rendezvous(line, etcd=values["etcd"],
                                          standalone=values["standalone"],
                                          nnodes=values["nnodes"], job_id=values["job_id"])
    for level, note in rdzv.notes:
        log.log(logging.getLevelName(level), "%s", note)
    return Given(values=values, rendezvous=rdzv, line=line, args=args, file_values=file_values)


@dataclass(frozen=True)
class Validated:
    """The :class:`AgentConfig` fields :func:`validate` checks: the job, its
    nodes and this node, and the credentials towards etcd and the peers."""

    job_id: str
    etcd: str | None
    standalone: bool
    min_nodes: int
    max_nodes: int
    node_id: str
    etcd_security: EtcdSecurity
    tls: AgentTLS | None


def validate(given: Given, environ: Mapping[str, str]) -> Validated:
    """The job id (required), the node count (required: N or MIN:MAX), the node
    id (default ``<hostname>-<pid>``), etcd's credentials (the password from
    ``environ``) and the agent's TLS files, checked together.

    Raises ConfigError naming the option that is missing or wrong, or the
    options that exclude each other (etcd credentials with --standalone).
    """
    v, rdzv = given.values, given.rendezvous
    if not rdzv.job_id:
        raise ConfigError("--job-id (torchrun: --rdzv-id) is required: every agent of a job "
                          "uses the same (or ELASTIC_JOB_ID, or job_id in --config)")
    validate_id("job id", rdzv.job_id)
    if not rdzv.nnodes:
        raise ConfigError("--nnodes is required: N or MIN:MAX")
    min_nodes, max_nodes = parse_nnodes(rdzv.nnodes)
    etcd_security = security_from_options(
        cacert=v["etcd_cacert"], cert=v["etcd_cert"], key=v["etcd_key"], user=v["etcd_user"],
        password_file=v["etcd_password_file"], environ=environ)
    if rdzv.standalone and etcd_security != EtcdSecurity():
        raise ConfigError("--etcd-cacert, --etcd-cert, --etcd-key, --etcd-user and "
                          f"{PASSWORD_ENV} are for --etcd; --standalone starts a private "
                          "plain-text etcd")
    tls = agent_tls_from_options(cert=v["tls_cert"], key=v["tls_key"], ca=v["tls_ca"],
                                 server_name=v["tls_server_name"], serving=True,
                                 allowed_cns=v["tls_allowed_cn"])
    node_id = v["node_id"] or f"{socket.gethostname()}-{os.getpid()}"
    validate_id("node id", node_id)
    return Validated(job_id=rdzv.job_id, etcd=rdzv.etcd, standalone=rdzv.standalone,
                     min_nodes=min_nodes, max_nodes=max_nodes, node_id=node_id,
                     etcd_security=etcd_security, tls=tls)


@dataclass(frozen=True)
class Found:
    """The :class:`AgentConfig` fields :func:`discover` works out on this host:
    the workers (how many, the GPUs they expect, what they run) and the
    addresses (advertised, and --listen and --probe-listen with it)."""

    nproc_per_node: int
    gpu_expectation: GpuExpectation
    script: str | None
    module: str | None
    script_args: tuple[str, ...]
    no_python: bool
    advertise_addr: str
    listen: str
    probe_listen: str | None


def discover(given: Given, valid: Validated, environ: Mapping[str, str], *,
             net: HostNetwork = SYSTEM_NETWORK, devices: HostDevices = SYSTEM_DEVICES) -> Found:
    """Count the workers (``--nproc-per-node gpu|cpu|auto`` with ``devices``), find
    the training script (on disk, or on PATH with --no-python) and choose the
    advertised address (:func:`agent.netaddr.choose_advertise_addr`, asking
    ``net``); each choice is logged with its reason.

    Raises ConfigError naming the option or the script that cannot be used, or
    telling to pass --advertise-addr when no address is usable.
    """
    say = JobLogger(log, valid.job_id, valid.node_id)
    nproc, gpus = _count_workers(given.values, environ, devices, say)
    script, module, script_args, no_python = _find_script(given, environ)
    advertise = choose_advertise_addr(given.values["advertise_addr"],
                                      standalone=valid.standalone, etcd=valid.etcd, net=net)
    if not valid_host(advertise.addr):
        # Peers would refuse this node's registration as a malformed record.
        raise ConfigError(f"--advertise-addr {cap_text(repr(advertise.addr), 80)}: expected "
                          "a host name or an IP address")
    say.info("advertising %s to the other nodes and the workers: %s.", advertise.addr,
             advertise.reason)
    return Found(nproc_per_node=nproc, gpu_expectation=gpus, script=script, module=module,
                 script_args=script_args, no_python=no_python, advertise_addr=advertise.addr,
                 listen=_on_advertised(given.values["listen"] or ":0", advertise.addr),
                 probe_listen=_on_advertised(given.values["probe_listen"], advertise.addr))


def _count_workers(v: Mapping[str, Any], environ: Mapping[str, str], devices: HostDevices,
                   say: JobLogger) -> tuple[int, GpuExpectation]:
    """Workers per node and the GPUs the GPU check expects; both logged when counted."""
    # Counted once: both the workers (auto) and the GPU check's expectation ask.
    physical_gpus = functools.cache(devices.physical_gpus)
    nproc, why = resolve_nproc(v["nproc_per_node"], environ,
                               HostDevices(physical_gpus, devices.cpu_count))
    if isinstance(v["nproc_per_node"], str):
        say.info("%d workers per node (--nproc-per-node %s).", nproc, why)
    gpus = expected_gpus(v["nproc_per_node"], nproc, environ, physical_gpus)
    if v["gpu_check"] != "off":
        say.info("GPU check (--gpu-check %s): %s.", v["gpu_check"], gpus.why)
    return nproc, gpus


def _find_script(given: Given, environ: Mapping[str, str]
                 ) -> tuple[str | None, str | None, tuple[str, ...], bool]:
    """(script as an absolute path, or None; module, or None; its arguments;
    executed without python). ConfigError when none is given, -m and
    --no-python are both asked, or the script or program is not there."""
    script, as_module, no_python, script_args = _script(given.args, environ, given.file_values)
    if given.line.given("--run-path"):
        no_python = False  # torchrun: --run-path takes precedence over --no-python
    if not script:
        raise ConfigError("no training script given: elasticd [options] SCRIPT [ARGS...] "
                          f"(or {SCRIPT_ENV[0]} with {SCRIPT_ENV[1]})")
    if as_module and no_python:
        raise ConfigError("--no-python and -m/--module exclude each other: a module is run by "
                          "python")
    if no_python:
        program = shutil.which(script)
        if program is None:
            raise ConfigError(f"training program {script!r} not found on PATH or not "
                              "executable (--no-python executes it directly)")
        script = program
    elif not as_module and not os.path.isfile(script):
        raise ConfigError(f"training script {script!r} not found (working directory "
                          f"{os.getcwd()})")
    if as_module:
        return None, script, script_args, no_python
    return os.path.abspath(script), None, script_args, no_python


def load(argv: list[str] | None = None, environ: Mapping[str, str] | None = None, *,
         net: HostNetwork = SYSTEM_NETWORK, devices: HostDevices = SYSTEM_DEVICES
         ) -> AgentConfig:
    """Parse flags, environment and config file into a validated AgentConfig:
    :func:`resolve`, then :func:`validate`, then :func:`discover`.

    torchrun's command line is read as :mod:`agent.torchrun_cli` describes:
    its names for our options count as flags, its rendezvous flags choose
    between an etcd and a private one, and a flag elasticd cannot honour is
    refused. ``--nproc-per-node gpu|cpu|auto`` is counted with ``devices``
    (:mod:`agent.devices`). Without --advertise-addr, the address is chosen by
    :func:`agent.netaddr.choose_advertise_addr` (asking ``net``). Both choices
    are logged with their reasons. Raises ConfigError naming the offending
    option and value, or telling to pass --advertise-addr when no address is
    usable.
    """
    environ = os.environ if environ is None else environ
    given = resolve(argv, environ)
    valid = validate(given, environ)
    found = discover(given, valid, environ, net=net, devices=devices)
    v = given.values
    node_dir = os.path.join(os.path.abspath(v["state_dir"] or default_state_dir(environ)),
                            valid.job_id, valid.node_id)
    config = AgentConfig(
        **given.fields(), **_fields_of(valid), **_fields_of(found),
        state_dir=node_dir, log_dir=v["log_dir"] or os.path.join(node_dir, "logs"),
        # Warm workers keep an interpreter ready; a program executed directly has no use for one.
        prestart=v["prestart"] and not found.no_python,
        console=ConsoleFilter(redirected=v["redirects"], local_ranks=v["local_ranks_filter"]),
        freeze_timeout_s=(default_freeze_timeout_s(v["lease_ttl"])
                          if v["freeze_timeout"] is None else v["freeze_timeout"]),
        stragglers=StragglerPolicy(v["straggler_threshold"], v["straggler_window"],
                                   v["straggler_action"]) if v["straggler_threshold"] else None)
    config.rendezvous()  # its checks across options (--freeze-timeout below --lease-ttl) now
    return config
