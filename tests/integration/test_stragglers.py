"""Stragglers: a rank slowed on purpose is named, with its node, within its window.

Real agents, a real etcd, real workers running plain torch scripts. In
tests/integration/scripts/slow_rank.py the ranks train on their own, one rank
or one node sleeping longer per step: it is named by its wall time. In
tests/integration/scripts/lockstep_rank.py they train in lockstep (DDP on
gloo) and one rank spins longer per step while its peers wait for it in the
allreduce: every rank's wall time is the same, and it is named by its busy
time. The workers' heartbeats carry both; the leader names the slow rank in
its log, in a ``straggler`` event and in ``elasticctl status``; a healthy run
as long as naming one takes names nobody, nor does the lockstep job before its
rank slows; with ``--straggler-action replace`` and a standby waiting, the slow
node is drained and the standby takes its place.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time

import pytest

from elastic.events import KIND_STRAGGLER, parse_events
from elastic.keyspace import JobKeys
from elastic.rendezvous.round_record import read_round
from tests.integration.procs import PLAIN_TORCH_ENV, REPO, AgentProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SCRIPT = "tests/integration/scripts/slow_rank.py"
# Lockstep steps of 30 ms asleep; the slowed rank spins 40 ms more, its peers
# wait for it: steps of about 70 ms for all, busy about 40 ms more for it.
LOCKSTEP = "tests/integration/scripts/lockstep_rank.py"
WINDOW_S = 3.0
STRAGGLERS = ("--straggler-window", str(WINDOW_S))
# Steps of 50 ms; the slowed rank sleeps 50 ms more: twice its peers' time. A run
# that a test ends itself (--over-when) once it has seen what it waits for is at most
# RUN_S long; a healthy run lasts HEALTHY_RUN_S, about as long as a slowed rank
# takes to be named.
RUN_S = 25.0
HEALTHY_RUN_S = 12.0
# For a job whose workers are never restarted: no warm workers (their template's `import
# torch` would only compete with the training whose step times the test judges). Every
# worker runs the same bootstrap, warm or not, which times its steps.
NO_RESTART = ("--no-prestart",)
SECONDS, RATIO = r"\d\.\d{3} s", r"\d+\.\d\dx"


@pytest.fixture
def agents():
    started: list[AgentProcess] = []
    yield started
    for a in started:
        a.stop()
        print(f"--- agent {a.node_id}: last lines of its output ---\n" + "".join(a.output[-30:]))


def start(agents: list, etcd_endpoint: str, job_id: str, node: str, script_args: list[str],
          extra: tuple[str, ...] = (), nnodes: str = "2", script: str = SCRIPT) -> AgentProcess:
    agent = AgentProcess(etcd_endpoint, job_id, node, nnodes, script_args, nproc=2,
                         extra=STRAGGLERS + extra, script=script,
                         env=PLAIN_TORCH_ENV if script == SCRIPT else None)
    agents.append(agent)
    return agent


def straggler_events(store, job_id: str) -> list[str]:
    keys = JobKeys(job_id)
    events, _ = parse_events(keys, store.get_prefix(keys.events)[0])
    return [e.message for _, e in events if e.kind == KIND_STRAGGLER]


def busy_published_slow(store, job_id: str, rank: int) -> float | None:
    """When (monotonic) ``rank``'s published busy time is over twice its peers'
    median (none yet: None)."""
    busy: dict[str, float] = {}
    for kv in store.get_prefix(JobKeys(job_id).step_times)[0]:
        busy.update(json.loads(kv.value).get("busy_s", {}))
    mine, peers = busy.pop(str(rank), 0.0), list(busy.values())
    return time.monotonic() if peers and mine > 2 * statistics.median(peers) else None


def node_running(store, job_id: str, rank: int) -> str:
    """The node that runs global ``rank`` in the current round (two workers per node)."""
    current = read_round(store, JobKeys(job_id))
    return next(m.node_id for m in current.members if m.node_rank == rank // 2)


def first_published(store, job_id: str, rank: int, timeout_s: float,
                    measure: str = "step_s") -> float:
    """When (monotonic) a step time of ``rank`` (``measure``: its record's
    field, ``step_s`` or ``busy_s``) first appeared in etcd."""
    prefix = JobKeys(job_id).step_times
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for kv in store.get_prefix(prefix)[0]:
            if str(rank) in json.loads(kv.value).get(measure, {}):
                return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"no {measure} of rank {rank} published within {timeout_s} s")


def published_by(store, job_id: str, node: str, after_round: int) -> bool:
    """Whether ``node`` published step times of a round after ``after_round``."""
    kv = store.get(JobKeys(job_id).step_times_of(node))
    record = json.loads(kv.value) if kv is not None else {}
    return record.get("round", 0) > after_round and bool(record.get("step_s"))


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{what} not seen within {timeout_s} s")


def named_a_window_after(slow_at: float, store, job_id: str, started: tuple, rank: int):
    """Waits until one of the ``started`` agents names ``rank`` a straggler and
    asserts that it did so within its window: no sooner than a whole window
    after ``slow_at`` (monotonic: when its slow time first reached etcd), no
    later than a few of the leader's passes after that. Returns that agent,
    the rank's node and the sentence that names it."""
    node = node_running(store, job_id, rank=rank)
    named = f"rank {rank} (node {node}) is a straggler"
    leader = wait_for(lambda: next((x for x in started if named in x.text), None),
                      WINDOW_S + 10, "the straggler named")
    delay_s = time.monotonic() - slow_at
    assert WINDOW_S - 0.5 <= delay_s <= WINDOW_S + 5.0, delay_s
    return leader, node, named


def elasticctl_status(etcd_endpoint: str, job_id: str) -> str:
    return subprocess.run([sys.executable, "-m", "agent.ctl", "status", "--etcd", etcd_endpoint,
                           "--job-id", job_id], cwd=REPO, capture_output=True, text=True,
                          timeout=30).stdout


@pytest.mark.names_stragglers
def test_a_rank_slowed_on_purpose_is_named_with_its_node_within_its_window(
        agents, etcd_endpoint, etcd_store, job_id, tmp_path):
    over = tmp_path / "over"
    args = ["--run-s", str(RUN_S), "--slow-rank", "3", "--over-when", str(over)]
    a = start(agents, etcd_endpoint, job_id, "a", args, NO_RESTART)
    b = start(agents, etcd_endpoint, job_id, "b", args, NO_RESTART)

    published_at = first_published(etcd_store, job_id, rank=3, timeout_s=60)
    leader, node, named = named_a_window_after(published_at, etcd_store, job_id, (a, b), rank=3)

    status = elasticctl_status(etcd_endpoint, job_id)
    assert re.search(rf"straggler: rank 3 \(node {node}\), steps of {SECONDS}, {RATIO} its "
                     rf"peers' median of {SECONDS}, for \d+ s; reported", status), status
    [event] = straggler_events(etcd_store, job_id)
    assert re.fullmatch(rf"{re.escape(named)}: its steps take {SECONDS}, {RATIO} its peers' "
                        rf"median of {SECONDS}, for \d+ s; reported", event), event

    time.sleep(WINDOW_S)  # still slow for another window: not named again
    over.touch()
    assert a.wait_exit(60) == 0 and b.wait_exit(30) == 0
    assert leader.text.count("is a straggler") == 1, "named once for the whole episode"
    assert straggler_events(etcd_store, job_id) == [event]


def test_a_healthy_run_as_long_as_naming_takes_names_nobody(agents, etcd_endpoint, etcd_store,
                                                       job_id):
    args = ["--run-s", str(HEALTHY_RUN_S)]
    a = start(agents, etcd_endpoint, job_id, "a", args, NO_RESTART)
    b = start(agents, etcd_endpoint, job_id, "b", args, NO_RESTART)

    first_published(etcd_store, job_id, rank=3, timeout_s=60)  # judged, not idle

    assert a.wait_exit(90) == 0 and b.wait_exit(30) == 0
    assert "straggler" not in a.text + b.text
    assert straggler_events(etcd_store, job_id) == []


@pytest.mark.names_stragglers
def test_in_lockstep_nobody_is_named_until_a_rank_slows_and_then_it_is_by_its_busy_time(
        agents, etcd_endpoint, etcd_store, job_id, tmp_path):
    slow, over = tmp_path / "slow", tmp_path / "over"
    args = ["--slow-rank", "3", "--slow-when", str(slow), "--over-when", str(over)]
    a = start(agents, etcd_endpoint, job_id, "a", args, NO_RESTART, script=LOCKSTEP)
    b = start(agents, etcd_endpoint, job_id, "b", args, NO_RESTART, script=LOCKSTEP)

    # Healthy: every rank's busy time published, then judged for a whole window
    # and one of the leader's periods (window / 6) more.
    for rank in range(4):
        first_published(etcd_store, job_id, rank=rank, timeout_s=60, measure="busy_s")
    time.sleep(WINDOW_S * 7 / 6)
    assert "straggler" not in a.text + b.text
    assert straggler_events(etcd_store, job_id) == []

    slow.touch()  # rank 3 spins 40 ms a step from now on; the others wait for it
    slow_at = wait_for(lambda: busy_published_slow(etcd_store, job_id, rank=3), 30,
                       "rank 3's busy time published slow")
    leader, node, named = named_a_window_after(slow_at, etcd_store, job_id, (a, b), rank=3)

    status = elasticctl_status(etcd_endpoint, job_id)
    assert re.search(rf"straggler: rank 3 \(node {node}\), busy {SECONDS} per step, {RATIO} its "
                     rf"peers' median of {SECONDS}, for \d+ s; reported", status), status
    over.touch()
    assert a.wait_exit(60) == 0 and b.wait_exit(30) == 0
    [event] = straggler_events(etcd_store, job_id)
    assert re.fullmatch(rf"{re.escape(named)}: busy {SECONDS} per step, {RATIO} its peers' "
                        rf"median of {SECONDS}, for \d+ s; reported", event), event
    assert leader.text.count("is a straggler") == 1, "its peers, waiting for it, are not named"


@pytest.mark.names_stragglers
def test_replace_drains_the_slow_node_when_a_standby_waits(agents, etcd_endpoint, etcd_store,
                                                           job_id, tmp_path):
    over = tmp_path / "over"
    args = ["--run-s", str(RUN_S), "--slow-node", "b", "--over-when", str(over)]
    replace = ("--straggler-action", "replace")
    a = start(agents, etcd_endpoint, job_id, "a", args, replace)
    b = start(agents, etcd_endpoint, job_id, "b", args, replace)
    first_published(etcd_store, job_id, rank=0, timeout_s=60)
    slow_round = read_round(etcd_store, JobKeys(job_id)).number
    c = start(agents, etcd_endpoint, job_id, "c", args, replace)  # the standby
    c.wait_output("STANDBY", timeout_s=30)

    drained = wait_for(lambda: [e for e in straggler_events(etcd_store, job_id)
                                if "drained node b" in e], WINDOW_S + 15, "the drain")
    assert re.fullmatch(r"rank \d \(node b\) is a straggler: .*; drained node b: a standby "
                        r"waits to take its place", drained[0]), drained

    assert b.wait_exit(30) == 0, "b leaves as a drained node does"
    # c trains in b's place: once its step times are published, judged for a whole
    # window and one of the leader's periods more, the job names nobody else.
    wait_for(lambda: published_by(etcd_store, job_id, "c", after_round=slow_round), 60,
             "step times of c in a round without b")
    time.sleep(WINDOW_S * 7 / 6)
    over.touch()
    assert a.wait_exit(60) == 0 and c.wait_exit(30) == 0
    assert read_round(etcd_store, JobKeys(job_id)).node_ids in (("a", "c"), ("c", "a"))
    events = straggler_events(etcd_store, job_id)
    assert len([e for e in events if "drained node" in e]) == 1
    assert all("(node b)" in e for e in events), events
