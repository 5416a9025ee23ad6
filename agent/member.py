"""A rendezvous-only node: joins a job's rendezvous and reports the rounds it sees.

    python -m agent.member --etcd URL --job-id ID --nnodes MIN[:MAX] --node-id ID
                           [--nproc N] [--lease-ttl S] [--settle S] [--host H]

It runs no workers: it is the control plane of an agent alone, used by the
demo, the integration tests and the benchmarks to put real node processes
through rounds. Each round it sees is one JSON line on stdout:
``{"event": "round", "number": 2, "members": [...], "node_rank": 1}``
(``node_rank`` null when standing by). Logs go to stderr. SIGTERM or SIGINT
leaves the rendezvous (the lease is revoked, peers see the node go at once).
SIGUSR1 tries a fenced write for the first round this process took part in and
prints ``{"event": "fenced_write", "round": N, "ok": bool, "error": ...}``:
the integration tests use it to show that a node of an older round cannot
commit anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Callable

from elastic.errors import ElasticError, FencedError, exit_code_for
from elastic.records import validate_id
from elastic.rendezvous.api import NodeInfo, Round
from elastic.rendezvous.config import (
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_SETTLE_S,
    RendezvousConfig,
    parse_nnodes,
)
from elastic.rendezvous.node import RendezvousNode
from elastic.store import open_store

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agent.member", description=__doc__.split("\n")[0])
    p.add_argument("--etcd", required=True, help="etcd endpoint(s), comma-separated")
    p.add_argument("--job-id", required=True)
    p.add_argument("--nnodes", required=True, help="N or MIN:MAX, as torchrun")
    p.add_argument("--node-id", default=None, help="default: <hostname>-<pid>")
    p.add_argument("--nproc", type=int, default=1, help="workers this node would run")
    p.add_argument("--host", default="127.0.0.1", help="address peers reach this node at")
    p.add_argument("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL_S, metavar="SECONDS")
    p.add_argument("--settle", type=float, default=DEFAULT_SETTLE_S, metavar="SECONDS")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS")
    p.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT_S,
                   metavar="SECONDS", help="how long to wait for a node id still held by "
                   "another agent")
    return p


def _members(r: Round, latest: Callable[[], Round | None]) -> list[str] | None:
    """The ids of ``r``'s members; when this node took ``r`` from its bucket
    of a large roster, read whole through ``latest`` (None: that failed,
    said on stderr)."""
    if r.holds_members:
        return list(r.node_ids)
    try:
        whole = latest()
    except ElasticError as exc:
        log.warning("round %d's members not read whole: %s", r.number, exc)
        return None
    return list(whole.node_ids) if whole is not None else None


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    fence_check = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: fence_check.set())
    try:
        low, high = parse_nnodes(args.nnodes)
        node_id = validate_id("node id", args.node_id or f"{os.uname().nodename}-{os.getpid()}")
        config = RendezvousConfig(job_id=args.job_id, min_nodes=low, max_nodes=high,
                                  settle_s=args.settle, lease_ttl_s=args.lease_ttl)
        first_round: list[int] = []

        def on_round(r: Round) -> None:
            me = r.member(node_id)
            if me is not None and not first_round:
                first_round.append(r.number)
            _emit({"event": "round", "node_id": node_id, "number": r.number,
                   "members": _members(r, lambda: node.latest_round),
                   "world_size": r.world_size,
                   "node_rank": me.node_rank if me else None, "reason": r.reason})

        with open_store(args.etcd, connect_timeout_s=args.connect_timeout) as store:
            info = NodeInfo(node_id=node_id, host=args.host, nproc=args.nproc)
            node = RendezvousNode(store, config, info, on_round=on_round).start()
            try:
                node.wait_registered(args.join_timeout)
            except ElasticError:
                node.stop()
                raise
            _emit({"event": "registered", "node_id": node_id})
            try:
                while not stop.wait(0.1):
                    if fence_check.is_set():
                        fence_check.clear()
                        _try_fenced_write(node, first_round[0] if first_round else 0)
            finally:
                node.stop()
        return 0
    except ElasticError as exc:
        print(f"member: error: {exc}", file=sys.stderr)
        return exit_code_for(exc)


def _try_fenced_write(node: RendezvousNode, round_number: int) -> None:
    key = f"{node.keys.prefix}fence-test/{node.node_id}"
    try:
        node.fenced_put(key, b"written", round_number)
        _emit({"event": "fenced_write", "round": round_number, "ok": True, "error": None})
    except FencedError as exc:
        _emit({"event": "fenced_write", "round": round_number, "ok": False, "error": str(exc)})


if __name__ == "__main__":
    sys.exit(main())
