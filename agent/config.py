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

The file's scalars are read as the text they were written as, whatever they
look like, and each option parses its own, exactly as it parses a flag: YAML
1.1 would otherwise read ``nnodes: 2:4`` as the base-60 integer 124,
``job_id: 0123`` as 83 and ``node_id: 1e3`` as 1000.0.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shlex
import shutil
import socket
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import yaml

from agent import torchrun_cli
from agent.console import ConsoleFilter, Streams, parse_local_ranks, parse_streams
from agent.devices import SYSTEM_DEVICES, HostDevices, parse_nproc_per_node, resolve_nproc
from agent.gpu_health import GPU_CHECK_MODES, GpuExpectation, expected_gpus
from agent.netaddr import SYSTEM_NETWORK, HostNetwork, choose_advertise_addr
from elastic import __version__
from elastic.errors import EXIT_CODES_HELP, ConfigError
from elastic.failpoints import ENV_VAR as FAILPOINT_ENV
from elastic.joblog import JobLogger
from elastic.options import non_negative, positive
from elastic.rendezvous.api import (
    DEFAULT_EXIT_BARRIER_TIMEOUT_S,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_WINDOW_S,
    DEFAULT_SETTLE_S,
    DEFAULT_START_TIMEOUT_S,
    RendezvousConfig,
    cap_text,
    parse_nnodes,
    valid_host,
    validate_id,
)
from agent.tls import AgentTLS, agent_tls_from_options
from elastic.rendezvous.operator import DEFAULT_OPERATOR_RESTART_INTERVAL_S
from elastic.store.api import DEFAULT_CONNECT_TIMEOUT_S
from elastic.store.security import PASSWORD_ENV, EtcdSecurity, security_from_options
from elastic.worker.channel import HEARTBEAT_SOCKET_ENV

log = logging.getLogger(__name__)

# The training script from the environment (systemd's EnvironmentFile, a pod's
# env): the script, its arguments split like a shell, "run it with -m", and
# "execute it directly, not with python" (torchrun's --no-python).
SCRIPT_ENV = ("ELASTIC_SCRIPT", "ELASTIC_SCRIPT_ARGS", "ELASTIC_MODULE", "ELASTIC_NO_PYTHON")
# Variables the agent sets for its workers: not options, never warned about.
WORKER_ENV = {"ELASTIC_ROUND", "ELASTIC_AGENT_SOCKET", HEARTBEAT_SOCKET_ENV,
              "ELASTIC_CHECKPOINT_DIR",
              "ELASTIC_JOB_ID", "ELASTIC_NODE_ID", "ELASTIC_PRELOAD", "ELASTIC_HANG_TIMEOUT_S",
              "ELASTIC_LEASE_TTL_S", FAILPOINT_ENV,
              # Read by the workers' Checkpointer, which inherit the agent's environment.
              "ELASTIC_CHECKPOINT_TRUST", "ELASTIC_CHECKPOINT_MODE"}


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
    """``HOST:PORT``, or ``:PORT`` for the advertised address (filled in by :func:`load`)."""
    text = str(raw)
    host, sep, port = text.rpartition(":")
    if (not sep or not (port.isascii() and port.isdigit()) or len(port) > 5
            or int(port) > 65535):
        raise ConfigError(f"--{name} {raw!r}: expected HOST:PORT, e.g. 10.0.0.11:29401, or "
                          ":PORT for the advertised address")
    return text


def _on_advertised(listen: str | None, advertised: str) -> str | None:
    """``:PORT`` becomes the advertised address with that port."""
    if listen is not None and listen.startswith(":"):
        return _join_host_port(advertised, int(listen[1:]))
    return listen


def _join_host_port(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


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
    ``short``: a one-letter flag (``-r``)."""

    name: str  # the flag without dashes; env and file keys derive from it
    parse: Callable[[str, Any], Any]
    default: Any
    help: str
    metavar: str | None = None
    is_flag: bool = False
    torchrun: tuple[str, ...] = ()
    short: str | None = None

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
           "restarts over the whole job, default 0)", "N"),
    Option("restart-window", positive(float), DEFAULT_RESTART_WINDOW_S,
           "the window of the restart budget", "SECONDS"),
    Option("checkpoint-dir", _text, None, "where workers save and find checkpoints", "DIR"),
    Option("hang-timeout", non_negative(float), 300.0,
           "a worker without heartbeat or progress this long is hung (0: never judged)",
           "SECONDS"),
    Option("lease-ttl", positive(float), DEFAULT_LEASE_TTL_S,
           "a node silent this long is considered gone", "SECONDS"),
    Option("settle", non_negative(float), DEFAULT_SETTLE_S,
           "wait this long without new arrivals before closing a round below max", "SECONDS"),
    Option("join-timeout", positive(float), DEFAULT_JOIN_TIMEOUT_S,
           "give up when no round includes this node for this long", "SECONDS"),
    Option("start-timeout", positive(float), DEFAULT_START_TIMEOUT_S,
           "a round member that has not started its workers this long after the round "
           "formed is left out and the round formed again without it", "SECONDS"),
    Option("exit-barrier-timeout", positive(float), DEFAULT_EXIT_BARRIER_TIMEOUT_S,
           "once one node's workers all exited 0, how long the others may go on before "
           "the job fails naming them", "SECONDS"),
    Option("scale-up-wait", non_negative(float), 0.0,
           "0: grow a running round as soon as a node joins; above 0: a joining node waits "
           "for the next committed checkpoint (so growing redoes no work), at most this long",
           "SECONDS"),
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
           "text|json"),
    Option("metrics-port", _port, 0,
           "serve Prometheus metrics over HTTP on this port, on the --listen host (0: off)",
           "PORT"),
    Option("stop-grace", non_negative(float), 5.0,
           "after SIGTERM, wait this long before SIGKILL of a worker (torchrun: 30): for a "
           "drain, a signal, the job's end, a scale-up; time for a final checkpoint", "SECONDS",
           torchrun=("--shutdown-timeout",)),
    Option("failure-stop-grace", non_negative(float), 3.0,
           "the same after a failure (a worker died or hung, a node was lost, a restart): "
           "survivors stuck in a collective never act on SIGTERM; at most --stop-grace",
           "SECONDS"),
    Option("prestart", _flag, True,
           "keep warm workers (torch imported) ready for fast restarts; --no-prestart to turn off",
           is_flag=True),
    Option("warm-sets", positive(int), 2,
           "sets of nproc warm workers kept ready: with 2, a failure soon after a restart "
           "(before the set that replaces the used one has imported torch) restarts warm too",
           "N"),
    Option("drain-exit-code", non_negative(int), 0,
           "exit code after a SIGTERM drain: 0 is a clean stop (systemd); Kubernetes sets "
           "143 so that a Job replaces a pod it terminated instead of counting it complete",
           "N"),
    Option("connect-timeout", positive(float), DEFAULT_CONNECT_TIMEOUT_S, "give up reaching etcd after this long",
           "SECONDS"),
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
           "job per this many seconds (0: no limit)", "SECONDS"),
    Option("role", _text, "default", "the workers' ROLE_NAME", "NAME"),
    Option("gpu-check", _choice(*GPU_CHECK_MODES), "warn",
           "before a round's workers start, check this node's GPUs through NVML: all expected "
           "present, no uncorrectable ECC error, no page retirement or row remap pending, no "
           "process of the last round holding memory (waited for up to 10 s). warn: log and "
           "record a failed check, start anyway; enforce: this node leaves the job (exit 6); "
           "off: no check", "off|warn|enforce"),
    Option("redirects", parse_streams, Streams(),
           "keep worker output off the console (it still goes to the rank logs): 0 none, "
           "1 stdout, 2 stderr, 3 both, or per local rank, e.g. 0:3,1:2", "SPEC", short="-r"),
    Option("local-ranks-filter", parse_local_ranks, None,
           "copy only these local ranks' output to the console, e.g. 0 or 0,1 (every rank's "
           "output still goes to its log)", "RANKS"),
]
_BY_KEY = {o.key: o for o in OPTIONS}


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

    def rendezvous(self) -> RendezvousConfig:
        return RendezvousConfig(
            job_id=self.job_id, min_nodes=self.min_nodes, max_nodes=self.max_nodes,
            settle_s=self.settle_s, lease_ttl_s=self.lease_ttl_s,
            join_timeout_s=self.join_timeout_s, max_restarts=self.max_restarts,
            restart_window_s=self.restart_window_s, start_timeout_s=self.start_timeout_s,
            exit_barrier_timeout_s=self.exit_barrier_timeout_s,
            scale_up_wait_s=self.scale_up_wait_s)


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


# A file of options is a few hundred bytes; this much is already no such file.
MAX_CONFIG_FILE_BYTES = 1 << 20


class _TextLoader(yaml.SafeLoader):
    """A SafeLoader that reads every plain scalar as a string, except an empty
    one or ``null``/``~`` (None: the option is not given); see the module docstring."""


_TextLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag in ("tag:yaml.org,2002:null", "tag:yaml.org,2002:merge")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _read_file(path: str) -> dict[str, Any]:
    """The options in the YAML file at ``path``, keys in snake case, values as
    written (strings, lists of strings); keys left empty are dropped. Raises
    ConfigError when it cannot be read, is larger than MAX_CONFIG_FILE_BYTES,
    is not UTF-8 text, not YAML (or nested too deeply to parse), is not a
    mapping or has unknown keys."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc.strerror}") from exc
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from exc
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"config file {path!r} is larger than {MAX_CONFIG_FILE_BYTES} bytes; "
                          "a file of options is a few hundred")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_TextLoader) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: "
                          f"{cap_text(str(exc), 500)}") from exc
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"config file {path!r} is nested too deeply to be a file of "
                          "options") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r}: expected a mapping of options, got "
                          f"{type(data).__name__}")
    allowed = set(_BY_KEY) | {"script", "module", "script_args", "no_python"}
    unknown = sorted(cap_text(repr(str(k).replace("-", "_")), 64) for k in data
                     if str(k).replace("-", "_") not in allowed)
    if unknown:
        shown = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if unknown[10:]
                                           else "")
        raise ConfigError(f"config file {path!r}: unknown option(s) {shown}; "
                          f"known: {', '.join(sorted(allowed))}")
    return {str(k).replace("-", "_"): v for k, v in data.items() if v is not None}


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


def load(argv: list[str] | None = None, environ: Mapping[str, str] | None = None, *,
         net: HostNetwork = SYSTEM_NETWORK, devices: HostDevices = SYSTEM_DEVICES
         ) -> AgentConfig:
    """Parse flags, environment and config file into a validated AgentConfig.

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
    args = parser().parse_args(argv)
    config_path = args.config or environ.get("ELASTIC_CONFIG")
    file_values = _read_file(config_path) if config_path else {}
    line = torchrun_cli.read_command_line(args, OPTIONS)

    # The etcd password comes from the environment only: no flag, no file key.
    known_env = ({o.env for o in OPTIONS} | {"ELASTIC_CONFIG", "ELASTIC_LOG_LEVEL"}
                 | {PASSWORD_ENV} | set(SCRIPT_ENV) | WORKER_ENV)
    for name in sorted(environ):
        if name.startswith("ELASTIC_") and name not in known_env:
            log.warning("Ignoring unknown environment variable %s (not an elasticd option)", name)
    for warning in torchrun_cli.check_environment(environ):
        log.warning("%s", warning)

    def value(o: Option) -> Any:
        if o.key in line.flags:
            spelling, given = line.flags[o.key]
            return o.parse(spelling, given)
        if o.env in environ:
            return o.parse(o.name, environ[o.env])
        if o.key in file_values:
            return o.parse(o.name, file_values[o.key])
        return o.default

    v = {o.key: value(o) for o in OPTIONS}

    rdzv = torchrun_cli.choose_rendezvous(line, etcd=v["etcd"], standalone=v["standalone"],
                                          nnodes=v["nnodes"], job_id=v["job_id"])
    for level, note in rdzv.notes:
        log.log(logging.getLevelName(level), "%s", note)
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
    # Counted once: both the workers (auto) and the GPU check's expectation ask.
    physical_gpus = functools.cache(devices.physical_gpus)
    nproc, why = resolve_nproc(v["nproc_per_node"], environ,
                               HostDevices(physical_gpus, devices.cpu_count))
    if isinstance(v["nproc_per_node"], str):
        JobLogger(log, rdzv.job_id, node_id).info("%d workers per node (--nproc-per-node %s).",
                                                  nproc, why)
    gpus = expected_gpus(v["nproc_per_node"], nproc, environ, physical_gpus)
    if v["gpu_check"] != "off":
        JobLogger(log, rdzv.job_id, node_id).info("GPU check (--gpu-check %s): %s.",
                                                  v["gpu_check"], gpus.why)

    script, as_module, no_python, script_args = _script(args, environ, file_values)
    if line.given("--run-path"):
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

    advertise = choose_advertise_addr(v["advertise_addr"], standalone=rdzv.standalone,
                                      etcd=rdzv.etcd, net=net)
    if not valid_host(advertise.addr):
        # Peers would refuse this node's registration as a malformed record.
        raise ConfigError(f"--advertise-addr {cap_text(repr(advertise.addr), 80)}: expected "
                          "a host name or an IP address")
    JobLogger(log, rdzv.job_id, node_id).info(
        "advertising %s to the other nodes and the workers: %s.", advertise.addr, advertise.reason)
    state_dir = os.path.abspath(v["state_dir"] or default_state_dir(environ))
    node_dir = os.path.join(state_dir, rdzv.job_id, node_id)
    log_dir = v["log_dir"] or os.path.join(node_dir, "logs")
    return AgentConfig(
        job_id=rdzv.job_id, etcd=rdzv.etcd, standalone=rdzv.standalone, min_nodes=min_nodes,
        max_nodes=max_nodes, nproc_per_node=nproc, node_id=node_id,
        max_restarts=v["max_restarts"], restart_window_s=v["restart_window"],
        checkpoint_dir=os.path.abspath(v["checkpoint_dir"]) if v["checkpoint_dir"] else None,
        hang_timeout_s=v["hang_timeout"], lease_ttl_s=v["lease_ttl"], settle_s=v["settle"],
        join_timeout_s=v["join_timeout"], start_timeout_s=v["start_timeout"],
        exit_barrier_timeout_s=v["exit_barrier_timeout"],
        scale_up_wait_s=v["scale_up_wait"],
        listen=_on_advertised(v["listen"] or ":0", advertise.addr),
        advertise_addr=advertise.addr,
        state_dir=node_dir, log_dir=log_dir, log_format=v["log_format"],
        metrics_port=v["metrics_port"], stop_grace_s=v["stop_grace"],
        failure_stop_grace_s=v["failure_stop_grace"],
        # Warm workers keep an interpreter ready; a program executed directly has no use for one.
        drain_exit_code=v["drain_exit_code"], prestart=v["prestart"] and not no_python,
        warm_sets=v["warm_sets"], connect_timeout_s=v["connect_timeout"],
        script=None if as_module else os.path.abspath(script),
        module=script if as_module else None, script_args=script_args,
        etcd_security=etcd_security, tls=tls,
        probe_listen=_on_advertised(v["probe_listen"], advertise.addr),
        operator_restart_interval_s=v["operator_restart_interval"], no_python=no_python,
        role=v["role"],
        console=ConsoleFilter(redirected=v["redirects"], local_ranks=v["local_ranks_filter"]),
        gpu_check=v["gpu_check"], gpu_expectation=gpus)
