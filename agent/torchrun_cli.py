"""torchrun's command line, read by elasticd: its spellings, its flags, its rendezvous choice.

elasticd takes torch 2.13's ``torchrun`` command line as it is (see
``docs/migrating-from-torchrun.md``). This module owns what only torchrun's
command line has; the options themselves stay defined once, in
:data:`agent.config.OPTIONS`:

- every long flag also accepts its underscore spelling (``--nproc_per_node``),
  as torchrun's do; ``Option.torchrun`` names torchrun's other flag for an
  option (``--rdzv-id`` for ``--job-id``), and :data:`OPTION_OF_SETTING` the
  option each ``--rdzv-conf`` setting sets (``join_timeout`` sets
  ``--join-timeout``; the keys and what they mean are
  :mod:`elastic.torchrun.conf`'s, shared with the ``etcd3`` handler). Given
  two ways at once (``--job-id a --rdzv-id b``) is an error, never a silent
  choice;
- :data:`TORCHRUN_FLAGS`: torchrun's flags that are no elasticd option, each
  with what elasticd does with it; one it cannot honour is refused with one
  line that says what to use instead;
- :func:`choose_rendezvous`: torchrun's ``--rdzv-backend``, ``--standalone``
  and static-rendezvous flags turned into elasticd's etcd, standalone, node
  count and job id, or refused;
- :func:`check_environment`: torchrun's environment variables elasticd does
  not read.
"""

from __future__ import annotations

import argparse
import textwrap
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from agent.console import parse_streams
from elastic.errors import ConfigError
from elastic.options import positive
from elastic.records import cap_text
from elastic.rendezvous.config import parse_nnodes
from elastic.torchrun.conf import (
    C10D_KEYS,
    CONF_KEYS,
    Given,
    Setting,
    c10d_refusal,
    read_rdzv_conf,
    with_protocol,
)

ETCD_BACKENDS = ("etcd", "etcd-v2", "etcd3")
# torchrun's rendezvous without etcd: served by a private etcd when the job has one node.
STORELESS_BACKENDS = ("static", "c10d")
_STATIC_ONLY = ("--node-rank", "--master-addr", "--master-port")
# The elasticd option (its name) each --rdzv-conf setting sets. The protocol is the etcd
# endpoints' scheme (choose_rendezvous); a setting not here has nothing to set: the
# close timeout bounds one rendezvous write, and elasticd's etcd calls carry their own
# short deadlines.
OPTION_OF_SETTING = {
    Setting.JOIN_TIMEOUT: "join-timeout",
    Setting.LAST_CALL: "settle",
    Setting.LEASE_TTL: "lease-ttl",
    Setting.CONNECT_TIMEOUT: "connect-timeout",
    Setting.CACERT: "etcd-cacert",
    Setting.CERT: "etcd-cert",
    Setting.KEY: "etcd-key",
    Setting.USER: "etcd-user",
    Setting.PASSWORD_FILE: "etcd-password-file",
}
_SIGNALS_ELASTICD_ENDS_ON = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_MAX_RDZV_CONF_CHARS = 4096


def underscored(flag: str) -> str | None:
    """torchrun's second spelling of a long flag (``--nproc_per_node``), or None."""
    if not flag.startswith("--") or "-" not in flag[2:]:
        return None
    return "--" + flag[2:].replace("-", "_")


def alias_dest(flag: str) -> str:
    """The argparse destination of one of torchrun's names for an elasticd option."""
    return "torchrun_" + flag.lstrip("-").replace("-", "_")


# ------------------------------------------------------------------ torchrun's own flags

def _refuse(hint: str) -> Callable[[str, Any], None]:
    def judge(flag: str, value: Any) -> None:
        raise ConfigError(f"{flag} {value!r}: {hint}" if value is not True else f"{flag}: {hint}")
    return judge


def _accept(flag: str, value: Any) -> None:
    return None


def _positive_number(flag: str, value: Any) -> None:
    positive(float)(flag.lstrip("-"), value)


def _whole_number(flag: str, value: Any) -> None:
    if not (str(value).isascii() and str(value).isdigit() and len(str(value)) <= 9):
        raise ConfigError(f"{flag} {value!r}: expected a whole number 0 or more")


def _one_of(*allowed: str, hint: str) -> Callable[[str, Any], None]:
    def judge(flag: str, value: Any) -> None:
        if str(value).strip().lower() not in allowed:
            raise ConfigError(f"{flag} {value!r}: {hint}")
    return judge


def _empty_or(hint: str) -> Callable[[str, Any], None]:
    def judge(flag: str, value: Any) -> None:
        if str(value).strip():
            raise ConfigError(f"{flag} {value!r}: {hint}")
    return judge


def _signals(flag: str, value: Any) -> None:
    names = [s.strip().upper() for s in str(value).split(",") if s.strip()]
    others = [n for n in names if n not in _SIGNALS_ELASTICD_ENDS_ON]
    if others:
        raise ConfigError(f"{flag} {value!r}: elasticd drains the node on SIGTERM and SIGINT "
                          f"(and ends with its workers on SIGHUP and SIGQUIT) but forwards no "
                          f"{', '.join(others)} to workers; drop those, and stop a node with "
                          "SIGTERM")


def _tee(flag: str, value: Any) -> None:
    parse_streams(flag.lstrip("-"), value)  # elasticd always tees: a valid value asks nothing more


def _rdzv_conf_help() -> str:
    """What each ``--rdzv-conf`` key sets, from the one table of them."""
    names: dict[Setting | None, list[str]] = {}
    for k in CONF_KEYS:
        names.setdefault(k.setting, []).append(k.name)
    sets = [("*" if s is Setting.LEASE_TTL else "/").join(names[s]) + f" = --{o}"
            for s, o in OPTION_OF_SETTING.items()]
    idle = [n for s, keys in names.items() if s not in OPTION_OF_SETTING
            and s is not Setting.PROTOCOL for n in keys]
    return (f"KEY=VALUE,... with torch's keys: {', '.join(sets)}; protocol=http|https for "
            f"the endpoints; {', '.join(idle)} accepted, nothing to set; "
            f"{', '.join(C10D_KEYS)} only when one node runs standalone; others refused")


@dataclass(frozen=True)
class TorchrunFlag:
    """One of torchrun's flags that is no elasticd option.

    ``metavar`` None: a switch. ``judge(flag, value)`` returns when elasticd
    honours the flag with that value, else raises ConfigError with one line
    that says what to use instead. Flags :func:`choose_rendezvous` interprets
    only have their format checked here.
    """

    flag: str
    help: str
    judge: Callable[[str, Any], None]
    metavar: str | None = None
    short: str | None = None

    @property
    def dest(self) -> str:
        return alias_dest(self.flag)


TORCHRUN_FLAGS = (
    TorchrunFlag("--rdzv-backend", "etcd, etcd-v2 or etcd3: elasticd's etcd v3 rendezvous at "
                 "--rdzv-endpoint; static or c10d: a job of one node runs standalone, more are "
                 "refused (they need an etcd)", _accept, "NAME"),
    TorchrunFlag("--rdzv-conf", _rdzv_conf_help(), _accept, "CONF"),
    TorchrunFlag("--node-rank", "static rendezvous only, as in torchrun: ignored (with a "
                 "warning) with an etcd; 0 on one node", _whole_number, "N"),
    TorchrunFlag("--master-addr", "static rendezvous only: ignored with an etcd; on one node "
                 "MASTER_ADDR is 127.0.0.1", _accept, "HOST"),
    TorchrunFlag("--master-port", "static rendezvous only: ignored with an etcd; on one node "
                 "MASTER_PORT is a free port picked each round", _whole_number, "PORT"),
    TorchrunFlag("--monitor-interval", "accepted: the agent sees a worker's exit the moment it "
                 "happens", _positive_number, "SECONDS"),
    TorchrunFlag("--start-method", "spawn, fork or forkserver, accepted: every worker is a fresh "
                 "interpreter, as torchrun runs a script",
                 _one_of("spawn", "fork", "forkserver", hint="expected spawn, fork or forkserver"),
                 "METHOD"),
    TorchrunFlag("--run-path", "accepted: the script runs as `python SCRIPT` would run it",
                 _accept),
    TorchrunFlag("--tee", "accepted: every line already goes to the rank logs and, unless "
                 "--redirects or --local-ranks-filter leave it out, to the console", _tee, "SPEC",
                 short="-t"),
    TorchrunFlag("--event-log-handler", "null or console: elasticd logs and records its events "
                 "in etcd (elasticctl events)",
                 _one_of("null", "console", hint="elasticd records its events in etcd (read "
                         "them with elasticctl events) and loads no event handler: drop "
                         "--event-log-handler"), "NAME"),
    TorchrunFlag("--duplicate-stdout-filters", "refused unless empty: grep the rank logs",
                 _empty_or("elasticd copies no matching lines to another file; every line is "
                           "in the rank logs under --log-dir: grep them"), "FILTERS"),
    TorchrunFlag("--duplicate-stderr-filters", "refused unless empty: grep the rank logs",
                 _empty_or("elasticd copies no matching lines to another file; every line is "
                           "in the rank logs under --log-dir: grep them"), "FILTERS"),
    TorchrunFlag("--signals-to-handle", "SIGTERM, SIGINT, SIGHUP, SIGQUIT accepted (the agent "
                 "drains on the first two); others refused", _signals, "SIGNALS"),
    TorchrunFlag("--logs-specs", "refused: elasticd writes the rank logs itself",
                 _refuse("elasticd writes the rank logs itself (--log-dir, --redirects, "
                         "--local-ranks-filter) and loads no torchrun.logs_specs plugin: drop "
                         "--logs-specs"), "NAME"),
    TorchrunFlag("--numa-binding", "refused: bind with numactl or in the script",
                 _refuse("elasticd does not bind workers to NUMA nodes: run elasticd under "
                         "numactl, or set the affinity in the script (os.sched_setaffinity)"),
                 "MODE"),
    TorchrunFlag("--virtual-local-rank", "refused: select the GPU with LOCAL_RANK",
                 _refuse("elasticd gives each worker its own LOCAL_RANK and the node's "
                         "CUDA_VISIBLE_DEVICES: drop the flag and pick the device with "
                         "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))")),
)


def _add(parser: argparse.ArgumentParser, group: Any, names: list[str], **kwargs: Any) -> None:
    """``names`` shown in ``group``'s help; their underscore spellings accepted, unshown."""
    group.add_argument(*names, **kwargs)
    hidden = [u for n in names if (u := underscored(n))]
    if hidden:
        parser.add_argument(*hidden, **{**kwargs, "help": argparse.SUPPRESS})


def add_arguments(parser: argparse.ArgumentParser, options: Sequence[Any]) -> None:
    """Add torchrun's names to ``parser``: the underscore spelling of every
    option's flag (unshown), and one help group of torchrun's other names for
    the options and of torchrun's own flags."""
    group = parser.add_argument_group(
        "torchrun's flags", textwrap.fill(
            "elasticd takes torchrun's command line: every flag also in its underscore "
            "spelling (--nproc_per_node). These are torchrun's names for elasticd's "
            "options, and torchrun's own flags with what elasticd does with them.", 79))
    for o in options:
        hidden = underscored(f"--{o.name}")
        if hidden:
            action = argparse.BooleanOptionalAction if o.is_flag else "store"
            parser.add_argument(hidden, dest=o.key, action=action, default=None,
                                help=argparse.SUPPRESS)
        for other in o.torchrun:
            _add(parser, group, [other], dest=alias_dest(other), default=None,
                 metavar=o.metavar, help=f"= --{o.name}")
    for t in TORCHRUN_FLAGS:
        names = ([t.short] if t.short else []) + [t.flag]
        if t.metavar is None:
            _add(parser, group, names, dest=t.dest, action="store_true", default=None,
                 help=t.help)
        else:
            _add(parser, group, names, dest=t.dest, default=None, metavar=t.metavar,
                 help=t.help)


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """torchrun's ``--rdzv-conf KEY=VALUE,...`` -> its keys and values (text).
    Raises ConfigError for an empty key or value, or a key given twice."""
    if len(text) > _MAX_RDZV_CONF_CHARS:
        raise ConfigError(f"--rdzv-conf is longer than {_MAX_RDZV_CONF_CHARS} characters")
    conf: dict[str, str] = {}
    for item in (i for i in text.split(",") if text.strip()):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not key or not sep or not value:
            raise ConfigError(f"--rdzv-conf {cap_text(repr(text), 200)}: expected "
                              f"KEY=VALUE,... (got {cap_text(repr(item), 80)})")
        if key in conf:
            raise ConfigError(f"--rdzv-conf: {key} is given twice")
        conf[key] = value
    return conf


@dataclass(frozen=True)
class CommandLine:
    """What torchrun's spellings gave on the command line.

    ``flags``: option key -> (the flag as written without its dashes, raw
    value), for every option given as a flag under any of its names or
    through ``--rdzv-conf``. ``torchrun``: torchrun-only flag dest -> value,
    for those given. ``rdzv_conf``: the parsed ``--rdzv-conf``; ``rdzv``:
    what it sets (:func:`elastic.torchrun.conf.read_rdzv_conf`).
    """

    flags: dict[str, tuple[str, Any]] = field(default_factory=dict)
    torchrun: dict[str, Any] = field(default_factory=dict)
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    rdzv: dict[Setting, Given] = field(default_factory=dict)

    def given(self, flag: str) -> bool:
        return alias_dest(flag) in self.torchrun

    def value(self, flag: str) -> Any:
        return self.torchrun.get(alias_dest(flag))


def read_command_line(args: argparse.Namespace, options: Sequence[Any]) -> CommandLine:
    """Collect every option given as a flag, under whichever name, and judge
    torchrun's own flags (:data:`TORCHRUN_FLAGS`).

    Raises ConfigError when an option is given under two names (a flag and
    a ``--rdzv-conf`` key count as two), for what
    :func:`~elastic.torchrun.conf.read_rdzv_conf` refuses, and for a
    torchrun flag elasticd cannot honour.
    """
    torchrun = {t.dest: getattr(args, t.dest) for t in TORCHRUN_FLAGS
                if getattr(args, t.dest, None) is not None}
    for t in TORCHRUN_FLAGS:
        if t.dest in torchrun:
            t.judge(t.flag, torchrun[t.dest])
    conf = parse_rdzv_conf(torchrun.get(alias_dest("--rdzv-conf"), ""))
    rdzv = read_rdzv_conf(conf)

    flags: dict[str, tuple[str, Any]] = {}

    def give(key: str, spelling: str, raw: Any) -> None:
        if key in flags:
            raise ConfigError(f"--{flags[key][0]} and --{spelling} set the same option: "
                              "give one")
        flags[key] = (spelling, raw)

    for o in options:
        if getattr(args, o.key, None) is not None:
            give(o.key, o.name, getattr(args, o.key))
        for other in o.torchrun:
            if getattr(args, alias_dest(other), None) is not None:
                give(o.key, other.lstrip("-"), getattr(args, alias_dest(other)))
    by_name = {o.name: o for o in options}
    for setting, given in rdzv.items():
        if setting in OPTION_OF_SETTING:
            give(by_name[OPTION_OF_SETTING[setting]].key, f"rdzv-conf {given.spelling}",
                 given.value)
    return CommandLine(flags=flags, torchrun=torchrun, rdzv_conf=conf, rdzv=rdzv)


# ------------------------------------------------------------------ the rendezvous

@dataclass(frozen=True)
class Rendezvous:
    """Where the job meets: a private etcd (``standalone``) or ``etcd``; the
    node count and job id, with torchrun's defaults filled in; and the log
    lines (level name, text) that say what was decided and what is ignored."""

    standalone: bool
    etcd: str | None
    nnodes: str | None
    job_id: str | None
    notes: tuple[tuple[str, str], ...] = ()


def choose_rendezvous(line: CommandLine, *, etcd: str | None, standalone: bool,
                      nnodes: str | None, job_id: str | None) -> Rendezvous:
    """torchrun's rendezvous flags -> elasticd's, as torchrun reads them.

    ``etcd``, ``standalone``, ``nnodes`` and ``job_id`` are the options'
    values from any source (None: not given). In order:

    - ``--standalone``: a private etcd; ``--rdzv-backend``,
      ``--rdzv-endpoint`` and the static flags are ignored with a warning, as
      torchrun ignores them; an ``--etcd`` is an error.
    - ``--rdzv-backend etcd|etcd-v2|etcd3``: the etcd at ``--rdzv-endpoint``
      (required), over https with ``protocol=https``.
    - an etcd without ``--rdzv-backend``: given as ``--etcd`` (or its variable,
      or the file), elasticd's own line; as ``--rdzv-endpoint``, refused:
      torchrun would read it as a static rendezvous.
    - otherwise torchrun's static or c10d rendezvous: a job of one node
      (``--nnodes`` absent, as torchrun's default 1:1, or at most 1) runs
      standalone; more nodes are refused: they need an etcd.

    torchrun's defaults fill in: ``--nnodes 1`` for a torchrun line or a
    standalone job, a random job id for a standalone one. Raises ConfigError,
    one line that says what to give instead.
    """
    given = _RendezvousFlags.read(line)
    if standalone:
        if etcd and not given.endpoint_flag:
            raise ConfigError("give either --etcd or --standalone, not both")
        ignored = ([f"--rdzv-backend {given.raw_backend}"] if given.raw_backend is not None
                   else []) + (["--rdzv-endpoint"] if given.endpoint_flag else []) + given.static
        if ignored:
            given.notes.append(("WARNING", f"--standalone: ignoring {', '.join(ignored)}, as "
                                           "torchrun does; the job runs on a private etcd on "
                                           "this machine"))
        return _standalone(nnodes, job_id, given.notes, c10d_keys=given.c10d_keys)
    backend = given.backend
    refusal = c10d_refusal(line.rdzv_conf)
    if etcd and refusal is not None and backend not in STORELESS_BACKENDS:
        raise refusal
    if backend in ETCD_BACKENDS and not etcd:
        raise ConfigError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT, the "
                          "address of an etcd")
    if etcd and backend is None and given.endpoint_flag:
        raise ConfigError("--rdzv-endpoint without --rdzv-backend is torchrun's static "
                          "rendezvous (a TCP store there); elasticd's endpoint is an etcd: "
                          "add --rdzv-backend etcd")
    if backend in ETCD_BACKENDS or (etcd and backend is None):
        if given.static:
            given.notes.append(("WARNING", f"ignoring {', '.join(given.static)}: torchrun uses "
                                           "them only with --rdzv-backend static; elasticd "
                                           "ranks the nodes in the order they join and picks "
                                           "MASTER_ADDR and MASTER_PORT each round"))
        # A torchrun line gets torchrun's node count; elasticd's own (--etcd) must say it.
        return Rendezvous(standalone=False, etcd=with_protocol(etcd, given.protocol),
                          nnodes=nnodes or ("1" if backend else None), job_id=job_id,
                          notes=tuple(given.notes))
    if etcd and not given.endpoint_flag:
        raise ConfigError(f"--rdzv-backend {backend} and --etcd: elasticd meets through the "
                          "etcd; drop --rdzv-backend or give --rdzv-backend etcd")
    return _one_node_without_etcd(line, given, nnodes, job_id)


@dataclass
class _RendezvousFlags:
    """torchrun's rendezvous flags as :func:`choose_rendezvous` weighs them;
    ``notes`` collects its log lines."""

    raw_backend: Any
    backend: str | None
    endpoint_flag: bool  # the etcd came as --rdzv-endpoint
    static: list[str]  # the static rendezvous' flags given
    c10d_keys: list[str]  # --rdzv-conf keys of torch's c10d store
    protocol: str | None
    notes: list[tuple[str, str]]

    @classmethod
    def read(cls, line: CommandLine) -> "_RendezvousFlags":
        """Raises ConfigError for a backend elasticd does not know."""
        raw_backend = line.value("--rdzv-backend")
        backend = None if raw_backend is None else str(raw_backend).strip().lower()
        if backend is not None and backend not in ETCD_BACKENDS + STORELESS_BACKENDS:
            raise ConfigError(f"--rdzv-backend {raw_backend!r}: elasticd meets through etcd: "
                              "use --rdzv-backend etcd with --rdzv-endpoint ETCD_HOST:2379 (or "
                              "--standalone on one node)")
        notes: list[tuple[str, str]] = []
        conf_noop = [k.name for k in CONF_KEYS if k.name in line.rdzv_conf
                     and k.setting not in OPTION_OF_SETTING
                     and k.setting is not Setting.PROTOCOL]
        if conf_noop:
            notes.append(("INFO", f"--rdzv-conf {', '.join(conf_noop)}: nothing to set, each "
                                  "etcd call of elasticd's rendezvous has its own short "
                                  "deadline"))
        return cls(raw_backend=raw_backend, backend=backend,
                   endpoint_flag=line.flags.get("etcd", ("",))[0] == "rdzv-endpoint",
                   static=[f for f in _STATIC_ONLY if line.given(f)],
                   c10d_keys=[k for k in C10D_KEYS if k in line.rdzv_conf],
                   protocol=(line.rdzv[Setting.PROTOCOL].value
                             if Setting.PROTOCOL in line.rdzv else None),
                   notes=notes)


def _one_node_without_etcd(line: CommandLine, given: _RendezvousFlags, nnodes: str | None,
                           job_id: str | None) -> Rendezvous:
    """torchrun's static or c10d rendezvous: standalone for one node, refused for more."""
    backend, static = given.backend, given.static
    _, max_nodes = parse_nnodes(nnodes or "1")
    if max_nodes > 1:
        if backend is None and not static:
            raise ConfigError("no etcd given: use --etcd URL[,URL...] (torchrun: "
                              "--rdzv-backend etcd --rdzv-endpoint HOST:PORT), or --standalone "
                              "for a job of one node")
        what = (f"--rdzv-backend {backend}" if backend
                else f"torchrun's static rendezvous ({', '.join(static)})")
        raise ConfigError(f"{what} with --nnodes {nnodes}: elasticd's nodes meet through an "
                          "etcd, not a TCP store: start one and give every node --rdzv-backend "
                          "etcd --rdzv-endpoint ETCD_HOST:2379 and the same --rdzv-id")
    node_rank = line.value("--node-rank")
    if node_rank is not None and int(node_rank) != 0:
        raise ConfigError(f"--node-rank {node_rank}: a job of one node has only node rank 0")
    told = [f for f in ("--master-addr", "--master-port") if line.given(f)]
    given.notes.append(("INFO", "one node and no etcd: running standalone on a private etcd, "
                                f"as torchrun runs a one-node {backend or 'static'} rendezvous "
                                "locally"
                                + (f"; instead of {' and '.join(told)}, MASTER_ADDR is "
                                   "127.0.0.1 and MASTER_PORT a free port picked each round"
                                   if told else "")))
    return _standalone(nnodes, job_id, given.notes, c10d_keys=given.c10d_keys)


def _standalone(nnodes: str | None, job_id: str | None, notes: list[tuple[str, str]], *,
                c10d_keys: Sequence[str]) -> Rendezvous:
    if c10d_keys:
        notes.append(("INFO", f"--rdzv-conf {', '.join(c10d_keys)}: settings of torch's c10d "
                              "store, which a private etcd replaces"))
    return Rendezvous(standalone=True, etcd=None, nnodes=nnodes or "1",
                      job_id=job_id or str(uuid.uuid4()), notes=tuple(notes))


# ------------------------------------------------------------------ the environment

# torchrun's variables with no counterpart elasticd reads: what to use instead.
_UNREAD_ENV = {
    "PYTHON_EXEC": "workers run under elasticd's own interpreter",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "use --stop-grace (or --shutdown-timeout)",
    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "worker lines are prefixed [rank R]",
}


def check_environment(environ: Mapping[str, str]) -> list[str]:
    """Warnings for torchrun's variables elasticd does not read (``PET_*``,
    torchrun's environment spelling of its flags, among them). Raises
    ConfigError for ``TORCHELASTIC_ENABLE_FILE_TIMER=1``: the workers would
    expect torch's file-timer server, which elasticd does not run."""
    if environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") == "1":
        raise ConfigError("TORCHELASTIC_ENABLE_FILE_TIMER=1: elasticd runs no torch file-timer "
                          "server; its hang detection (--hang-timeout) watches the workers "
                          "instead: unset the variable")
    warnings = [f"{name} is set but not read by elasticd: {why}"
                for name, why in _UNREAD_ENV.items() if name in environ]
    pet = sorted(n for n in environ if n.startswith("PET_"))
    if pet:
        warnings.append(f"{', '.join(pet[:8])}{' ...' if pet[8:] else ''}: torchrun's "
                        "environment spelling of its flags is not read by elasticd; pass the "
                        "flags, or ELASTIC_<OPTION> variables")
    return warnings
