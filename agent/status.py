"""A job's status as read from etcd and the agents, and its rendering for humans.

``collect`` returns plain data (what ``elasticctl status --json`` prints);
``render`` turns it into the table an operator reads. Each agent's state comes
from the agent itself over gRPC when it answers (live), else from the
``status/<node>`` record it last published in etcd; an agent that refused
the TLS handshake is named under ``problems`` with what to change. The last
GPU check of each node (``--gpu-check``) comes from its events: ``render``
shows those that did not pass, including a node's that left the job for it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from agent.gpu_health import EVENT_KINDS as GPU_EVENT_KINDS
from agent.gpu_health import GpuAction
from agent.status_record import GoodputRow, MemoryTierRow, StatusRecord, StragglerRow
from elastic.checkpoint.etcd_log import decode_latest
from elastic.errors import MalformedRecordError
from elastic.events import Event
from elastic.keyspace import JobKeys
from elastic.records import cap_text, id_in_key
from elastic.rendezvous import round_record
from elastic.rendezvous.api import Member, NodeInfo, Round
from elastic.store.api import KeyValue, Store

if TYPE_CHECKING:
    from agent.tls import AgentTLS


def _agent_from_grpc(addr: str, timeout_s: float,
                     tls: AgentTLS | None = None) -> tuple[dict | None, str | None]:
    """(the agent's live status, None when it did not answer; the TLS problem, if any)."""
    from agent import peers  # grpc is loaded only when agents are queried
    from elastic.errors import AgentAuthError, ElasticError

    try:
        resp = peers.query_status(addr, timeout_s=timeout_s, tls=tls)
    except AgentAuthError as exc:
        return None, str(exc)
    except ElasticError:
        return None, None
    if resp is None:
        return None, None
    return StatusRecord.from_pb(resp).summary("agent"), None


# What each GPU check event kind says, in status.
_GPU_RESULTS = {GPU_EVENT_KINDS[GpuAction.PASS]: "passed",
                GPU_EVENT_KINDS[GpuAction.WARN]: "warned",
                GPU_EVENT_KINDS[GpuAction.LEAVE]: "failed"}


def _gpu_checks(keys: JobKeys, kvs: list, current: Round | None,
                shown: set[str]) -> list[dict]:
    """The last GPU check of each node, from its events: the nodes in
    ``shown`` (registered or members), and a node gone after a failed check
    in the current round or the one before (it left the job for it).
    Unreadable events are skipped (``elasticctl events`` names them)."""
    latest: dict[str, Event] = {}
    for kv in kvs:
        if not kv.key.startswith(keys.events):
            continue
        try:
            event = Event.from_json(kv.key, kv.value)
        except MalformedRecordError:
            continue
        if event.kind in _GPU_RESULTS and (event.node_id not in latest
                                           or event.time >= latest[event.node_id].time):
            latest[event.node_id] = event
    recent = current.number - 1 if current else 0
    return [{"node_id": e.node_id, "round": e.round, "time": e.time,
             "result": _GPU_RESULTS[e.kind], "message": e.message}
            for node_id, e in sorted(latest.items())
            if node_id in shown or (_GPU_RESULTS[e.kind] == "failed" and e.round >= recent)]


def collect(store: Store, job_id: str, query_agents: bool = True,
            agent_timeout_s: float = 1.0, *, tls: AgentTLS | None = None) -> dict:
    """Read the job's keys once (one consistent revision) and summarise them,
    asking each registered agent for its live status when ``query_agents``
    (with mutual TLS when ``tls`` is given).

    Malformed records are reported under ``problems`` with their key rather
    than failing the whole command.
    """
    keys = JobKeys(job_id)
    kvs, revision = store.get_prefix(keys.prefix)
    by_key = {kv.key: kv for kv in kvs}
    problems: list[str] = []
    current = _parsed(by_key.get(keys.round), problems,
                      lambda kv: round_record.from_reads(keys, [kv], kvs))
    registered = {info.node_id: info for info in _parsed_under(
        kvs, keys.nodes, problems, lambda kv: NodeInfo.from_json(kv.key, kv.value))}
    published = {node_id: record.summary("etcd") for node_id, record in _parsed_under(
        kvs, keys.status, problems, lambda kv: (id_in_key(kv.key, keys.status),
                                                StatusRecord.from_json(kv.key, kv.value)))}
    live = _live(registered, agent_timeout_s, tls, problems) if query_agents else {}
    checkpoint = _parsed(by_key.get(keys.checkpoint_latest), problems,
                         lambda kv: decode_latest(kv.key, kv.value).to_dict())
    leader_kv = by_key.get(keys.leader)
    members = {m.node_id: m for m in current.members} if current else {}
    return {
        "job_id": job_id,
        "revision": revision,
        "leader": (cap_text(leader_kv.value.decode(errors="replace"), 128) if leader_kv
                   else None),
        "round": None if current is None else _round_summary(current),
        "nodes": [_node_summary(node_id, registered.get(node_id), members.get(node_id),
                                live.get(node_id) or published.get(node_id))
                  for node_id in sorted(set(registered) | set(members), key=lambda n: (
                      members[n].node_rank if n in members else 1 << 30, n))],
        "gpu_checks": _gpu_checks(keys, kvs, current, set(registered) | set(members)),
        "checkpoint": checkpoint,
        "goodput": job_goodput(published),
        "problems": problems,
    }


def job_goodput(published: dict[str, dict]) -> dict | None:
    """The goodput of the node that has accounted the longest (its agent has
    seen the most of the job), from the records in etcd (at most
    agent.publishing.STATUS_PROGRESS_S old); None when no record has one."""
    rows = [(GoodputRow(**s["goodput"]), node_id) for node_id, s in published.items()
            if s.get("goodput")]
    if not rows:
        return None
    _, node_id = max(rows, key=lambda r: (r[0].accounted_s, r[1]))
    return {"node_id": node_id, **published[node_id]["goodput"]}


def _parsed(kv: KeyValue | None, problems: list[str], parse):
    """``parse(kv)``; None when there is no ``kv``, or when it is malformed
    (then the problem is added to ``problems``)."""
    if kv is None:
        return None
    try:
        return parse(kv)
    except MalformedRecordError as exc:
        problems.append(str(exc))
        return None


def _parsed_under(kvs: list[KeyValue], prefix: str, problems: list[str], parse) -> list:
    """:func:`_parsed` for each record under ``prefix``, the malformed left out."""
    parsed = (_parsed(kv, problems, parse) for kv in kvs if kv.key.startswith(prefix))
    return [record for record in parsed if record is not None]


def _live(registered: dict[str, NodeInfo], timeout_s: float, tls: AgentTLS | None,
          problems: list[str]) -> dict[str, dict | None]:
    """Each registered agent's live status (None: it did not answer), asked in parallel."""
    addrs = {n: i.addr for n, i in registered.items() if i.addr}
    if not addrs:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(addrs))) as pool:
        answers = list(pool.map(lambda a: _agent_from_grpc(a, timeout_s, tls), addrs.values()))
    problems.extend(f"node {node}: {problem}" for node, (_, problem) in zip(addrs, answers)
                    if problem)
    return {node: answer for node, (answer, _) in zip(addrs, answers)}


def _round_summary(current: Round) -> dict:
    return {
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
    }


def _node_summary(node_id: str, info: NodeInfo | None, member: Member | None,
                  agent: dict | None) -> dict:
    return {
        "node_id": node_id,
        "node_rank": member.node_rank if member else None,
        "host": info.host if info else (member.host if member else ""),
        "nproc": info.nproc if info else (member.nproc if member else 0),
        "addr": info.addr if info else "",
        "role": ("member" if info else "gone") if member else "standby",
        "agent": agent,
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
                f"{sum(bool(w.get('judged')) for w in workers)}/{len(workers)}"
                if workers else "-",
                str(a.get("last_step", "-")) if a.get("last_step", -1) >= 0 else "-",
                f"{a['step_rate']:.2f}/s" if a.get("step_rate") else "-",
                str(a.get("restarts", "-")), a.get("last_failure") or "-"])
        out.append("")
        # JUDGED: the workers whose hang detection judges progress (agent.health).
        out.append(table(["NODE", "RANK", "ROLE", "STATE", "HOST", "WORKERS", "JUDGED", "STEP",
                          "RATE", "RESTARTS", "LAST FAILURE"], rows))
        out.extend(MemoryTierRow(**n["agent"]["memory_tier"]).line(n["node_id"])
                   for n in status["nodes"] if (n["agent"] or {}).get("memory_tier"))
        out.extend(StragglerRow(**row).line() for n in status["nodes"]
                   for row in (n["agent"] or {}).get("stragglers", ()))
    else:
        out.append("no nodes registered")
    g = status.get("goodput")
    if g:
        fields = {k: v for k, v in g.items() if k != "node_id"}
        out.append(GoodputRow(**fields).line(g["node_id"]))
    for g in status.get("gpu_checks", []):
        if g["result"] != "passed":
            out.append(f"GPU check: node {g['node_id']} {g['result']} in round {g['round']}, "
                       f"{_ago(g['time'], now)}: {g['message']}")
    for p in status["problems"]:
        out.append(f"problem: {p}")
    return "\n".join(out)
