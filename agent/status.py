"""A job's status as read from etcd and the agents, and its rendering for humans.

``collect`` returns plain data (what ``elasticctl status --json`` prints);
``render`` turns it into the table an operator reads. Each agent's state comes
from the agent itself over gRPC when it answers (live), else from the
``status/<node>`` record it last published in etcd.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from elastic.checkpoint.etcd_log import decode_latest
from elastic.errors import MalformedRecordError
from elastic.rendezvous.api import NodeInfo, Round
from elastic.keyspace import JobKeys
from elastic.store.api import Store


def _agent_from_grpc(addr: str, timeout_s: float) -> dict | None:
    from agent import peers  # grpc is loaded only when agents are queried
    from elastic.errors import ElasticError

    try:
        resp = peers.query_status(addr, timeout_s=timeout_s)
    except ElasticError:
        return None
    if resp is None:
        return None
    workers = [{"local_rank": w.local_rank, "rank": w.rank, "pid": w.pid, "state": w.state,
                "last_step": w.last_step, "step_rate": w.step_rate,
                "heartbeat_age_s": w.heartbeat_age_s, "exit_code": w.exit_code}
               for w in resp.workers]
    return {"source": "agent", "state": resp.state, "round": resp.round,
            "node_rank": resp.node_rank if resp.node_rank >= 0 else None,
            "workers": workers, "restarts": resp.restarts, "last_failure": resp.last_failure,
            "last_step": max((w["last_step"] for w in workers), default=-1),
            "step_rate": min((w["step_rate"] for w in workers), default=0.0)}


def collect(store: Store, job_id: str, query_agents: bool = True,
            agent_timeout_s: float = 1.0) -> dict:
    """Read the job's keys once (one consistent revision) and summarise them,
    asking each registered agent for its live status when ``query_agents``.

    Malformed records are reported under ``problems`` with their key rather
    than failing the whole command.
    """
    keys = JobKeys(job_id)
    kvs, revision = store.get_prefix(keys.prefix)
    by_key = {kv.key: kv for kv in kvs}
    problems: list[str] = []

    current = None
    round_kv = by_key.get(keys.round)
    if round_kv is not None:
        try:
            current = Round.from_json(round_kv.key, round_kv.value, round_kv.version)
        except MalformedRecordError as exc:
            problems.append(str(exc))

    registered: dict[str, NodeInfo] = {}
    for kv in kvs:
        if kv.key.startswith(keys.nodes):
            try:
                info = NodeInfo.from_json(kv.key, kv.value)
                registered[info.node_id] = info
            except MalformedRecordError as exc:
                problems.append(str(exc))

    published: dict[str, dict] = {}
    for kv in kvs:
        if kv.key.startswith(keys.status):
            try:
                record = json.loads(kv.value)
                if not isinstance(record, dict):
                    raise ValueError("not an object")
                published[keys.node_id_of(kv.key)] = {"source": "etcd", **record}
            except ValueError as exc:
                problems.append(f"malformed record at key {kv.key!r}: {exc}")
    live: dict[str, dict | None] = {}
    addrs = {n: i.addr for n, i in registered.items() if i.addr}
    if query_agents and addrs:
        with ThreadPoolExecutor(max_workers=min(16, len(addrs))) as pool:
            answers = pool.map(lambda a: _agent_from_grpc(a, agent_timeout_s), addrs.values())
            live = dict(zip(addrs, answers))

    checkpoint = None
    ckpt_kv = by_key.get(keys.checkpoint_latest)
    if ckpt_kv is not None:
        try:
            checkpoint = decode_latest(ckpt_kv.key, ckpt_kv.value).to_dict()
        except MalformedRecordError as exc:
            problems.append(str(exc))

    leader_kv = by_key.get(keys.leader)
    nodes = []
    members = {m.node_id: m for m in current.members} if current else {}
    for node_id in sorted(set(registered) | set(members),
                          key=lambda n: (members[n].node_rank if n in members else 1 << 30, n)):
        info, member = registered.get(node_id), members.get(node_id)
        nodes.append({
            "node_id": node_id,
            "node_rank": member.node_rank if member else None,
            "host": info.host if info else (member.host if member else ""),
            "nproc": info.nproc if info else (member.nproc if member else 0),
            "addr": info.addr if info else "",
            "role": ("member" if info else "gone") if member else "standby",
            "agent": live.get(node_id) or published.get(node_id),
        })
    return {
        "job_id": job_id,
        "revision": revision,
        "leader": leader_kv.value.decode(errors="replace") if leader_kv else None,
        "round": None if current is None else {
            "number": current.number,
            "world_size": current.world_size,
            "nnodes": len(current.members),
            "master_addr": current.master_addr,
            "master_port": current.master_port,
            "reason": current.reason,
            "created_at": current.created_at,
            "members": list(current.node_ids),
            "outcome": current.outcome,
            "failures": len(current.failures),
        },
        "nodes": nodes,
        "checkpoint": checkpoint,
        "problems": problems,
    }


def _ago(then: float, now: float) -> str:
    seconds = max(0, int(now - then))
    if seconds < 120:
        return f"{seconds} s ago"
    if seconds < 7200:
        return f"{seconds // 60} min ago"
    return f"{seconds // 3600} h ago"


def column_widths(headers: list[str], rows: list[list[str]]) -> list[int]:
    """The width of each column of a table of these headers and rows."""
    return [max(len(str(c)) for c in col) for col in zip(headers, *rows)]


def table_row(cells: list[str], widths: list[int]) -> str:
    """One line of a table; a cell wider than its column pushes the rest right."""
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain left-aligned text table."""
    widths = column_widths(headers, rows)
    return "\n".join(table_row(r, widths) for r in [headers, *rows])


CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen (what clear(1) sends)


def watch_frame(body: str, job_id: str, now: float, interval_s: float, *, clear: bool,
                first: bool) -> str:
    """One frame of ``elasticctl status --watch``, ready to write: a header
    with the time (like watch(1)'s), then ``body``. On a terminal (``clear``)
    each frame starts by clearing the screen; on a pipe frames follow each
    other, separated by one blank line (none before the ``first``)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    head = f"Every {interval_s:g} s: elasticctl status of job {job_id}, {stamp}"
    if clear:
        return f"{CLEAR_SCREEN}{head}\n\n{body}\n"
    return ("" if first else "\n") + f"{head}\n{body}\n"


def json_line(data: dict) -> str:
    """``data`` as one line of NDJSON (JSON escapes every newline inside strings)."""
    return json.dumps(data, separators=(",", ":")) + "\n"


def render(status: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    out = []
    r = status["round"]
    if r is None:
        out.append(f"job {status['job_id']}: no round yet (leader: {status['leader'] or 'none'})")
    elif r["outcome"]:
        out.append(f"job {status['job_id']}: {r['outcome'].upper()} in round {r['number']}, "
                   f"{_ago(r['created_at'], now)}")
        out.append(f"  why: {r['reason']}")
    else:
        out.append(
            f"job {status['job_id']}: round {r['number']}, {r['nnodes']} nodes, world size "
            f"{r['world_size']}, leader {status['leader'] or 'none'}"
        )
        out.append(f"  master {r['master_addr']}:{r['master_port']}, formed "
                   f"{_ago(r['created_at'], now)}")
        out.append(f"  why: {r['reason']}")
    c = status.get("checkpoint")
    if c:
        out.append(f"  last checkpoint: step {c.get('step')} ({c.get('path')}), round "
                   f"{c.get('round')}, committed {_ago(float(c.get('time', 0)), now)}")
    if status["nodes"]:
        rows = []
        for n in status["nodes"]:
            a = n["agent"] or {}
            workers = a.get("workers") or []
            rows.append([
                n["node_id"], "-" if n["node_rank"] is None else str(n["node_rank"]), n["role"],
                a.get("state", "?"), n["host"],
                f"{sum(w['state'] == 'running' for w in workers)}/{n['nproc']}",
                str(a.get("last_step", "-")) if a.get("last_step", -1) >= 0 else "-",
                f"{a['step_rate']:.2f}/s" if a.get("step_rate") else "-",
                str(a.get("restarts", "-")), a.get("last_failure") or "-"])
        out.append("")
        out.append(table(["NODE", "RANK", "ROLE", "STATE", "HOST", "WORKERS", "STEP", "RATE",
                          "RESTARTS", "LAST FAILURE"], rows))
    else:
        out.append("no nodes registered")
    for p in status["problems"]:
        out.append(f"problem: {p}")
    return "\n".join(out)
