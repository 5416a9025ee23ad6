"""elasticctl: the operator's view of a job, straight from etcd.

    elasticctl status   --etcd URL --job-id ID [--json] [--watch [--interval S]]
    elasticctl events   --etcd URL --job-id ID [--json] [--limit N] [--follow]
    elasticctl checkpoints --etcd URL --job-id ID [--json]
    elasticctl report   --etcd URL --job-id ID [--json] [--html FILE]
    elasticctl restart  --etcd URL --job-id ID [--reason TEXT]
    elasticctl drain    --etcd URL --job-id ID NODE_ID
    elasticctl --version

``--etcd`` and ``--job-id`` may come from ELASTIC_ETCD and ELASTIC_JOB_ID.
Errors are one line on stderr; exit codes are those of :mod:`elastic.errors`,
plus the two below.
``drain`` refuses a node id that is not registered in the job (exit 2): a
drain request waits for its node, so a typo would eject whoever takes that id
later. A ``--reason`` longer than 1024 characters is cut to that length.
``report`` prints the job's timeline from its events (agent/report.py):
rounds, faults with their cause, rank and lost time, checkpoints,
stragglers, goodput, and whether the history is complete; ``--html FILE``
also writes it as one self-contained page with an SVG timeline (a FILE that
cannot be written: exit 2).
``restart`` is refused (exit 2, saying from when the next is allowed) less
than ``--operator-restart-interval`` seconds (default 60, env
ELASTIC_OPERATOR_RESTART_INTERVAL) after the job's last operator restart,
whether asked here or over an agent's gRPC.
``status`` asks each agent for its live state over gRPC; with agents that run
mutual TLS it needs ``--tls-ca``, ``--tls-cert`` and ``--tls-key`` (env
ELASTIC_TLS_CA, ELASTIC_TLS_CERT, ELASTIC_TLS_KEY; ``--tls-server-name``,
ELASTIC_TLS_SERVER_NAME, when the agents' certificates carry one shared
name). An agent that refuses the handshake is named under "problem:" with
the reason, and its status is the one it last published in etcd. Drain and
restart go through etcd: etcd's credentials authorise them. ``status`` and
``checkpoints`` name a record they cannot read under "problem:" (in
``--json``, ``problems``) and show the rest: exit 0, not a failed command.

``status --watch`` shows the status again every ``--interval`` seconds: on a
terminal it redraws the screen, like watch(1); on a pipe it prints frame after
frame, each headed by its time, a blank line between them; with ``--json`` one
JSON object per frame and line (NDJSON). An etcd error in one frame is a
one-line warning on stderr and the next frame tries again.
``events --follow`` prints the history (the newest ``--limit``), then every new
event once, as etcd commits it (``--json``: one JSON object per line).
Both run until stopped: Ctrl-C (SIGINT) or SIGTERM ends them quietly with exit
0, as watch(1) does, since that is how they are meant to end (and a script
that ends one with ``kill`` sees success). Ctrl-C in any other command exits
130 (128 + SIGINT): that command did not finish.
When whoever reads the output goes away (``elasticctl events | head -1``) a
command ends quietly with exit 141 (128 + SIGPIPE), which is what the shell
reports for cat or grep killed by SIGPIPE in that place, so ``set -o pipefail``
scripts see the same as for them. (Python's own recipe exits 1, which is this
project's "the job failed".)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import signal
import sys
import textwrap
import threading
import time
from dataclasses import asdict
from typing import Callable, TextIO

from agent import report_html, report_text
from agent import status as status_view
from agent.report_source import read_report
from agent.tls import ENV as TLS_ENV
from agent.tls import agent_tls_from_options
from elastic import __version__, events
from elastic.checkpoint.etcd_log import decode_latest
from elastic.errors import (
    EXIT_CODES_HELP,
    EXIT_OK,
    ConfigError,
    ElasticError,
    MalformedRecordError,
    StoreError,
    WatchCompactedError,
    exit_code_for,
)
from elastic.events import Event
from elastic.records import cap_text, validate_id
from elastic.rendezvous.api import RestartRequest
from elastic.rendezvous.operator import (
    DEFAULT_OPERATOR_RESTART_INTERVAL_S,
    request_operator_restart,
)
from elastic.rendezvous.round_record import read_round
from elastic.keyspace import JobKeys
from elastic.store import PASSWORD_ENV, open_store, security_from_options
from elastic.store.api import (
    DEFAULT_CONNECT_TIMEOUT_S,
    Compare,
    EventType,
    Get,
    KeyValue,
    Put,
    Store,
)

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130  # 128 + SIGINT: a one-shot command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for cat | head

EPILOG = textwrap.fill(EXIT_CODES_HELP, 79) + "\n" + textwrap.fill(
    "elasticctl also exits 130 when Ctrl-C interrupts a command, and 141 (as a command "
    "killed by SIGPIPE) when the reader of its output goes away (elasticctl events | "
    "head -1). status --watch and events --follow run until stopped: Ctrl-C or SIGTERM "
    "ends them with 0.", 79)


def _common_options() -> argparse.ArgumentParser:
    """The parent parser of every command: etcd and its credentials, the job,
    --json, and the agents' TLS; each flag also read from its variable."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--etcd", default=os.environ.get("ELASTIC_ETCD", "http://127.0.0.1:2379"),
                        help="etcd endpoint(s), comma-separated (env ELASTIC_ETCD)")
    common.add_argument("--job-id", default=os.environ.get("ELASTIC_JOB_ID"),
                        help="the job to look at (env ELASTIC_JOB_ID)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    common.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                        metavar="SECONDS", help="give up reaching etcd after this long "
                                                f"(default {DEFAULT_CONNECT_TIMEOUT_S:g})")
    # etcdctl's --cacert, --cert, --key and --user; the password never as a flag.
    for flag, metavar, what in (
            ("cacert", "FILE", "PEM bundle of the CAs that sign etcd's certificates "
                               "(https://; default: the system's roots)"),
            ("cert", "FILE", "PEM client certificate for etcd (with --etcd-key)"),
            ("key", "FILE", "PEM private key of --etcd-cert"),
            ("user", "NAME", f"etcd user; its password from {PASSWORD_ENV} or "
                             "--etcd-password-file"),
            ("password-file", "FILE", "file holding the password of --etcd-user")):
        env = "ELASTIC_ETCD_" + flag.replace("-", "_").upper()
        common.add_argument(f"--etcd-{flag}", default=os.environ.get(env), metavar=metavar,
                            help=f"{what} (env {env})")
    # The agents' gRPC, as elasticd's --tls-* (a client certificate is needed
    # wherever the agents run mutual TLS).
    for flag, metavar, what in (
            ("ca", "FILE", "PEM bundle of the CAs that sign the agents' certificates"),
            ("cert", "FILE", "PEM client certificate for the agents (with --tls-key)"),
            ("key", "FILE", "PEM private key of --tls-cert"),
            ("server-name", "NAME", "the name checked in the agents' certificates instead "
                                    "of their address")):
        env = TLS_ENV[flag.replace("-", "_")]
        common.add_argument(f"--tls-{flag}", default=os.environ.get(env), metavar=metavar,
                            help=f"{what} (env {env})")
    return common


def parser() -> argparse.ArgumentParser:
    """elasticctl's command line: one subcommand per entry of :data:`COMMANDS`."""
    common = _common_options()
    # Raw: the epilog is laid out here (one paragraph of exit codes, one of
    # elasticctl's own), and the description is the synopsis block.
    layout = {"epilog": EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}

    cli = argparse.ArgumentParser(prog="elasticctl",
                                  description=__doc__.split("\n\n")[0] + "\n\n"
                                  + __doc__.split("\n\n")[1], **layout)
    cli.add_argument("--version", action="version", version=f"elasticctl {__version__}")
    sub = cli.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", parents=[common], help="round, members and nodes of a job",
                        **layout)
    st.add_argument("--watch", action="store_true",
                    help="show it again every --interval seconds until Ctrl-C")
    st.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                    help="seconds between two frames of --watch (default 2)")
    ev = sub.add_parser("events", parents=[common], help="the job's event history", **layout)
    ev.add_argument("--limit", type=int, default=50, metavar="N",
                    help="show the newest N (default 50)")
    ev.add_argument("--follow", "-f", action="store_true",
                    help="then print new events as they happen, until Ctrl-C")
    sub.add_parser("checkpoints", parents=[common],
                   help="the latest committed checkpoint and the commit history", **layout)
    rp = sub.add_parser("report", parents=[common], help="the job's timeline: rounds, faults "
                        "and their causes, checkpoints, stragglers, goodput", **layout)
    rp.add_argument("--html", metavar="FILE",
                    help="also write the timeline as one HTML page (inline SVG) to FILE")
    rs = sub.add_parser("restart", parents=[common],
                        help="ask for a new round with the same members", **layout)
    rs.add_argument("--reason", default="requested by an operator")
    rs.add_argument("--operator-restart-interval", metavar="SECONDS",
                    default=os.environ.get("ELASTIC_OPERATOR_RESTART_INTERVAL",
                                           str(DEFAULT_OPERATOR_RESTART_INTERVAL_S)),
                    help="refuse when the job's last operator restart was less than this "
                         "long ago (env ELASTIC_OPERATOR_RESTART_INTERVAL; 0: no limit)")
    dr = sub.add_parser("drain", parents=[common], help="take a node out at the next round",
                        **layout)
    dr.add_argument("node_id")
    return cli


def _status(store: Store, args) -> str:
    data = status_view.collect(store, args.job_id, tls=getattr(args, "tls", None))
    return json.dumps(data, indent=2) if args.json else status_view.render(data)


EVENT_HEADERS = ["TIME", "NODE", "ROUND", "KIND", "MESSAGE"]


def _when(wall_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_s))


def _event_row(e: Event) -> list[str]:
    return [_when(e.time), e.node_id, str(e.round), e.kind, e.message]


def _newest(history: list[Event], limit: int) -> list[Event]:
    return history[max(0, len(history) - limit):]


def _events(store: Store, args) -> str:
    history = _newest(events.read_events(store, JobKeys(args.job_id)), args.limit)
    if args.json:
        return json.dumps([asdict(e) for e in history], indent=2)
    return status_view.table(EVENT_HEADERS, [_event_row(e) for e in history])


def _events_of(keys: JobKeys, kvs: list[KeyValue]) -> list[Event]:
    """The events in ``kvs``, in their order; unreadable ones are logged and skipped."""
    return [event for _, event in events.parse_events(keys, kvs)[0]]


def _event_writer(out: TextIO, as_json: bool,
                  history: list[Event]) -> Callable[[list[Event]], None]:
    """Write ``history`` to ``out`` (NDJSON, or a table) and return the
    function that writes later events the same way (the table's columns stay
    those of the history)."""
    widths = status_view.column_widths(EVENT_HEADERS, [_event_row(e) for e in history])

    def write(batch: list[Event]) -> None:
        for e in batch:
            out.write(status_view.json_line(asdict(e)) if as_json else
                      status_view.table_row(_event_row(e), widths) + "\n")
        out.flush()

    if not as_json:
        out.write(status_view.table_row(EVENT_HEADERS, widths) + "\n")
    write(history)
    return write


def _write_watched(store: Store, keys: JobKeys, after: int, write: Callable[[list[Event]], None],
                   stop: threading.Event, poll_s: float) -> int | None:
    """Watch the events from revision ``after + 1`` and write each new one.
    Returns None once ``stop`` is set, or the last revision written when etcd
    compacted the history the watch needed."""
    arrivals: queue.Queue = queue.Queue()  # one per watch: nothing of an ended one mixes in
    watch = store.watch(keys.events, arrivals.put, prefix=True, start_revision=after + 1,
                        on_error=arrivals.put)
    try:
        while True:
            try:
                item = arrivals.get(timeout=poll_s)
            except queue.Empty:
                if stop.is_set():
                    return None
                continue
            if isinstance(item, WatchCompactedError):
                return after
            if isinstance(item, BaseException):
                raise item
            write(_events_of(keys, [c.kv for c in item if c.type is EventType.PUT]))
            after = max([after, *(c.revision for c in item)])
    finally:
        watch.cancel()


def follow_events(store: Store, job_id: str, limit: int, as_json: bool, out: TextIO, *,
                  stop: threading.Event | None = None, poll_s: float = 0.5) -> None:
    """Write the newest ``limit`` events of the job, then every event written
    after them as it is committed, until interrupted (KeyboardInterrupt) or
    until ``stop`` is set (checked every ``poll_s`` seconds).

    The watch starts right after the revision the history was read at, so no
    event is written twice or missed in between. New events come in the order
    etcd committed them. If etcd compacts the watched history away, the events
    are read again and those changed after the last revision seen are written
    before watching on. Raises the store's errors.
    """
    keys = JobKeys(job_id)
    kvs, seen = store.get_prefix(keys.events)
    history = sorted(_events_of(keys, kvs), key=lambda e: (e.time, e.node_id))
    write = _event_writer(out, as_json, _newest(history, limit))
    stop = stop or threading.Event()
    while True:
        last = _write_watched(store, keys, seen, write, stop, poll_s)
        if last is None:
            return
        log.warning("Job %s: etcd compacted the events the watch was reading; reading them "
                    "again from revision %d on.", job_id, last + 1)
        kvs, seen = store.get_prefix(keys.events)
        write(_events_of(keys, sorted((kv for kv in kvs if kv.mod_revision > last),
                                      key=lambda kv: kv.mod_revision)))


def watch_status(store: Store, args, out: TextIO, *,
                 sleep: Callable[[float], None] = time.sleep,
                 wall: Callable[[], float] = time.time) -> None:
    """Write a frame of the job's status every ``args.interval`` seconds until
    interrupted (KeyboardInterrupt): redrawn on a terminal, one after another
    on a pipe, NDJSON with ``args.json``. A store error in one frame is a
    one-line warning on stderr and the next frame tries again."""
    clear = out.isatty() and not args.json
    first = True
    while True:
        try:
            data = status_view.collect(store, args.job_id, tls=getattr(args, "tls", None))
        except StoreError as exc:
            reason = " ".join(str(exc).split())
            print(f"elasticctl: warning: job {args.job_id}: no status this time ({reason}); "
                  f"trying again in {args.interval:g} s", file=sys.stderr, flush=True)
        else:
            now = wall()
            out.write(status_view.json_line(data) if args.json else status_view.watch_frame(
                status_view.render(data, now), args.job_id, now, args.interval,
                clear=clear, first=first))
            out.flush()
            first = False
        sleep(args.interval)


def _checkpoints(store: Store, args) -> str:
    """The latest committed checkpoint and the checkpoint history. A latest
    record that cannot be read is named under ``problems`` ("problem:" lines),
    as ``status`` does, with the history still shown: it is a finding about
    the job, not a failure of the command (exit 0)."""
    keys = JobKeys(args.job_id)
    kv = store.get(keys.checkpoint_latest)
    latest, problems = None, []
    if kv is not None:
        try:
            latest = decode_latest(kv.key, kv.value).to_dict()
        except MalformedRecordError as exc:
            problems.append(f"{exc}; the job's next checkpoint commit replaces it")
    history = [e for e in events.read_events(store, keys) if e.kind == "checkpoint"]
    if args.json:
        return json.dumps({"latest": latest, "history": [asdict(e) for e in history],
                           "problems": problems}, indent=2)
    if latest is not None:
        head = (f"job {args.job_id}: latest checkpoint step {latest['step']} "
                f"({latest['path']}), round {latest['round']}, world size "
                f"{latest['world_size']}, committed {_when(latest['time'])}")
    elif problems:
        head = f"job {args.job_id}: the record of the latest checkpoint is unreadable"
    else:
        head = f"job {args.job_id}: no checkpoint committed yet"
    rows = [[_when(e.time), e.node_id, str(e.round), e.message] for e in history]
    out = [head]
    if rows and (latest is not None or problems):
        out += ["", status_view.table(["TIME", "NODE", "ROUND", "COMMIT"], rows)]
    out += [f"problem: {p}" for p in problems]
    return "\n".join(out)


def _report(store: Store, args) -> str:
    """The job's report as text or JSON; with ``--html``, also written as a
    page (ConfigError naming the file when it cannot be)."""
    report = read_report(store, args.job_id, time.time())
    if args.html:
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(report_html.render(report))
        except OSError as exc:
            raise ConfigError(f"--html {args.html}: cannot write the report there "
                              f"({exc.strerror or exc})") from exc
    if args.json:
        return json.dumps(report.to_dict(), indent=2)
    return report_text.render(report) + (f"\n\ntimeline: {args.html}" if args.html else "")


def _restart(store: Store, args) -> str:
    keys = JobKeys(args.job_id)
    current = read_round(store, keys)
    number = current.number if current else 0
    req = RestartRequest(node_id="elasticctl", round=number, reason=cap_text(args.reason))
    request_operator_restart(store, keys, req, interval_s=_interval(args), now=time.time())
    return json.dumps({"requested": "restart", "round": number}) if args.json else (
        f"restart of job {args.job_id} requested for round {number}")


def _drain(store: Store, args) -> str:
    """Write the drain request, only while the node is registered; raises
    ConfigError naming the node and the registered ones when it is not."""
    keys = JobKeys(args.job_id)
    validate_id("node id", args.node_id)
    # In one transaction with the check, so the node cannot leave in between
    # and leave a request behind for whoever registers under its id next.
    result = store.txn([Compare.version(keys.node(args.node_id), ">", 0)],
                       [Put(keys.drain_request(args.node_id), b'{"by": "elasticctl"}')],
                       [Get(keys.nodes, prefix=True)])
    if not result.succeeded:
        # Key names are anyone's writing: shown printable and short.
        known = [cap_text(keys.node_id_of(kv.key), 64) for kv in result.results[0]]
        listed = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if known[20:] else "")
        raise ConfigError(f"node {args.node_id!r} is not registered in job {args.job_id} "
                          f"(registered: {listed or 'none'}); nothing to drain")
    return json.dumps({"requested": "drain", "node_id": args.node_id}) if args.json else (
        f"node {args.node_id} of job {args.job_id} will leave at the next round")


COMMANDS = {"status": _status, "events": _events, "checkpoints": _checkpoints,
            "report": _report, "restart": _restart, "drain": _drain}


def _interval(args) -> float:
    """``--operator-restart-interval`` in seconds; ConfigError unless a finite number >= 0."""
    raw = getattr(args, "operator_restart_interval", DEFAULT_OPERATOR_RESTART_INTERVAL_S)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"--operator-restart-interval {raw!r}: expected seconds, 0 or more")
    return value


def _stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # ends --watch and --follow the way Ctrl-C does


def _run(args) -> None:
    """Validate, open the store and run the command, writing to stdout."""
    if not args.job_id:
        raise ConfigError("--job-id is required (or set ELASTIC_JOB_ID)")
    validate_id("job id", args.job_id)
    if getattr(args, "limit", 0) < 0:
        raise ConfigError(f"--limit must be 0 or more, got {args.limit}")
    if getattr(args, "watch", False) and not args.interval > 0:
        raise ConfigError(f"--interval must be more than 0 seconds, got {args.interval:g}")
    security = security_from_options(
        cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key, user=args.etcd_user,
        password_file=args.etcd_password_file)
    args.tls = agent_tls_from_options(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca,
                                      server_name=args.tls_server_name)
    if args.command == "restart":
        _interval(args)  # before anything is written
    with open_store(args.etcd, connect_timeout_s=args.connect_timeout,
                    security=security) as store:
        if args.command == "status" and args.watch:
            watch_status(store, args, sys.stdout)
        elif args.command == "events" and args.follow:
            follow_events(store, args.job_id, args.limit, args.json, sys.stdout)
        else:
            print(COMMANDS[args.command](store, args))
        # Inside the try of main: a reader gone away shows here, not at exit.
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Run elasticctl; returns the exit code (see the module docstring)."""
    try:
        args = parser().parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        until_stopped = getattr(args, "watch", False) or getattr(args, "follow", False)
        previous = None
        if until_stopped and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
        try:
            _run(args)
            return EXIT_OK
        except ElasticError as exc:
            print(f"elasticctl: error: {exc}", file=sys.stderr)
            return exit_code_for(exc)
        except KeyboardInterrupt:
            return EXIT_OK if until_stopped else EXIT_INTERRUPTED
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    except BrokenPipeError:
        # The recipe of Python's signal module docs: send the rest of stdout to
        # /dev/null, so the flush at exit cannot fail again and print a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
