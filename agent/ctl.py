"""elasticctl: the operator's view of a job, straight from etcd.

    elasticctl status   --etcd URL --job-id ID [--json]
    elasticctl events   --etcd URL --job-id ID [--json] [--limit N]
    elasticctl checkpoints --etcd URL --job-id ID [--json]
    elasticctl restart  --etcd URL --job-id ID [--reason TEXT]
    elasticctl drain    --etcd URL --job-id ID NODE_ID

``--etcd`` and ``--job-id`` may come from ELASTIC_ETCD and ELASTIC_JOB_ID.
Errors are one line on stderr; exit codes are those of :mod:`elastic.errors`.
``drain`` refuses a node id that is not registered in the job (exit 2): a
drain request waits for its node, so a typo would eject whoever takes that id
later. A ``--reason`` longer than 1024 characters is cut to that length.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from agent import status as status_view
from elastic import events
from elastic.checkpoint.etcd_log import decode_latest
from elastic.errors import ConfigError, ElasticError, exit_code_for
from elastic.rendezvous.api import RestartRequest, Round, cap_text, validate_id
from elastic.keyspace import JobKeys
from elastic.store import open_store
from elastic.store.api import Compare, Get, Put, Store


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--etcd", default=os.environ.get("ELASTIC_ETCD", "http://127.0.0.1:2379"),
                        help="etcd endpoint(s), comma-separated (env ELASTIC_ETCD)")
    common.add_argument("--job-id", default=os.environ.get("ELASTIC_JOB_ID"),
                        help="the job to look at (env ELASTIC_JOB_ID)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    common.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="give up reaching etcd after this long (default 5)")

    parser = argparse.ArgumentParser(prog="elasticctl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", parents=[common], help="round, members and nodes of a job")
    ev = sub.add_parser("events", parents=[common], help="the job's event history")
    ev.add_argument("--limit", type=int, default=50, help="show the newest N (default 50)")
    sub.add_parser("checkpoints", parents=[common],
                   help="the latest committed checkpoint and the commit history")
    rs = sub.add_parser("restart", parents=[common],
                        help="ask for a new round with the same members")
    rs.add_argument("--reason", default="requested by an operator")
    dr = sub.add_parser("drain", parents=[common], help="take a node out at the next round")
    dr.add_argument("node_id")
    return parser


def _current_round(store: Store, keys: JobKeys) -> Round | None:
    kv = store.get(keys.round)
    return Round.from_json(kv.key, kv.value, kv.version) if kv else None


def _status(store: Store, args) -> str:
    data = status_view.collect(store, args.job_id)
    return json.dumps(data, indent=2) if args.json else status_view.render(data)


def _events(store: Store, args) -> str:
    history = events.read_events(store, JobKeys(args.job_id))[-args.limit:]
    if args.json:
        return json.dumps([e.__dict__ for e in history], indent=2)
    rows = [[time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time)), e.node_id,
             str(e.round), e.kind, e.message] for e in history]
    return status_view.table(["TIME", "NODE", "ROUND", "KIND", "MESSAGE"], rows)


def _checkpoints(store: Store, args) -> str:
    keys = JobKeys(args.job_id)
    kv = store.get(keys.checkpoint_latest)
    latest = decode_latest(kv.key, kv.value).to_dict() if kv else None
    history = [e for e in events.read_events(store, keys) if e.kind == "checkpoint"]
    if args.json:
        return json.dumps({"latest": latest, "history": [e.__dict__ for e in history]}, indent=2)
    if latest is None:
        return f"job {args.job_id}: no checkpoint committed yet"
    head = (f"job {args.job_id}: latest checkpoint step {latest['step']} ({latest['path']}), "
            f"round {latest['round']}, world size {latest['world_size']}, committed "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(latest['time']))}")
    rows = [[time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time)), e.node_id,
             str(e.round), e.message] for e in history]
    return head + ("\n\n" + status_view.table(["TIME", "NODE", "ROUND", "COMMIT"], rows)
                   if rows else "")


def _restart(store: Store, args) -> str:
    keys = JobKeys(args.job_id)
    current = _current_round(store, keys)
    number = current.number if current else 0
    req = RestartRequest(node_id="elasticctl", round=number, reason=cap_text(args.reason))
    store.put(f"{keys.restart_requests}{number:012d}-elasticctl", req.to_json())
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
        known = [keys.node_id_of(kv.key) for kv in result.results[0]]
        listed = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if known[20:] else "")
        raise ConfigError(f"node {args.node_id!r} is not registered in job {args.job_id} "
                          f"(registered: {listed or 'none'}); nothing to drain")
    return json.dumps({"requested": "drain", "node_id": args.node_id}) if args.json else (
        f"node {args.node_id} of job {args.job_id} will leave at the next round")


COMMANDS = {"status": _status, "events": _events, "checkpoints": _checkpoints,
            "restart": _restart, "drain": _drain}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if not args.job_id:
            raise ConfigError("--job-id is required (or set ELASTIC_JOB_ID)")
        validate_id("job id", args.job_id)
        with open_store(args.etcd, connect_timeout_s=args.connect_timeout) as store:
            print(COMMANDS[args.command](store, args))
        return 0
    except ElasticError as exc:
        print(f"elasticctl: error: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
