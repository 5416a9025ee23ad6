"""elasticctl's pure parts and loops, against the in-memory store: watch
frames, NDJSON, ``status --watch`` through an etcd blip, ``events --follow``
exactly once across the read-to-watch gap and a compaction, ``--version`` and
the exit codes in ``--help``; and the demo's rank -> node mapping."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import threading
import time
import uuid

import pytest

from agent import config as agent_config
from agent import ctl
from agent import status as status_view
from elastic import __version__
from elastic.errors import EXIT_CODES_HELP, StoreUnavailableError
from elastic.events import event_op
from elastic.keyspace import JobKeys
from examples.demo import node_of_worker, warm_nodes
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore

WALL = 1_700_000_000.0
STAMP = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(WALL))


def fresh_keys() -> JobKeys:
    # Event ring slots are kept per (job, node) for the whole process.
    return JobKeys("ctl-" + uuid.uuid4().hex[:8])


def write_event(store, keys, clock, node_id, message):
    store.txn([], [event_op(keys, clock, node_id, 1, "state", message)])
    clock.advance(1.0)


# -- frames ---------------------------------------------------------------------------


def test_piped_frames_are_headed_by_their_time_and_separated_by_one_blank_line():
    first = status_view.watch_frame("BODY1", "j", WALL, 2.0, clear=False, first=True)
    second = status_view.watch_frame("BODY2", "j", WALL + 2, 2.0, clear=False, first=False)

    assert first == f"Every 2 s: elasticctl status of job j, {STAMP}\nBODY1\n"
    assert second.startswith("\nEvery 2 s: elasticctl status of job j, ")
    assert (first + second).count("\n\n") == 1
    assert status_view.CLEAR_SCREEN not in first + second


def test_terminal_frames_clear_the_screen_first():
    frame = status_view.watch_frame("BODY", "j", WALL, 0.5, clear=True, first=False)

    assert frame.startswith(status_view.CLEAR_SCREEN + "Every 0.5 s: elasticctl status of job j")
    assert frame.endswith("\n\nBODY\n")


def test_json_line_is_one_line_whatever_the_strings_hold():
    data = {"reason": "line one\nline two", "n": [1, 2]}

    line = status_view.json_line(data)

    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line) == data


# -- status --watch -------------------------------------------------------------------


class StopAfter:
    """A sleep that raises KeyboardInterrupt (Ctrl-C) on its ``n``-th call."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, seconds: float) -> None:
        self.calls += 1
        if self.calls >= self.n:
            raise KeyboardInterrupt


def watch_args(job_id: str, as_json: bool) -> argparse.Namespace:
    return argparse.Namespace(job_id=job_id, json=as_json, interval=2.0)


def test_watch_writes_a_frame_per_interval_and_warns_once_for_a_store_blip(capsys):
    store, keys = MemoryStore(clock=FakeClock()), fresh_keys()
    out = io.StringIO()
    # The second frame's read fails; the watch must go on to the third.
    store.fail_next("get_prefix", StoreUnavailableError("etcd at 127.0.0.1:2379 is down"))

    with pytest.raises(KeyboardInterrupt):
        ctl.watch_status(store, watch_args(keys.job_id, False), out, sleep=StopAfter(3),
                         wall=lambda: WALL)

    text = out.getvalue()
    assert text.count(f"elasticctl status of job {keys.job_id}") == 2
    assert text.count("no round yet") == 2
    assert status_view.CLEAR_SCREEN not in text  # a StringIO is no terminal
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [f"elasticctl: warning: job {keys.job_id}: no status this time "
                        "(etcd at 127.0.0.1:2379 is down); trying again in 2 s"]


def test_watch_json_is_one_status_object_per_line():
    store, keys = MemoryStore(clock=FakeClock()), fresh_keys()
    out = io.StringIO()

    with pytest.raises(KeyboardInterrupt):
        ctl.watch_status(store, watch_args(keys.job_id, True), out, sleep=StopAfter(2))

    frames = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(frames) == 2
    assert all(f["job_id"] == keys.job_id and f["round"] is None for f in frames)


# -- events --follow ------------------------------------------------------------------


class Follower:
    """``follow_events`` on a thread, its output collected."""

    def __init__(self, store, keys, limit=50, as_json=True):
        self.out = io.StringIO()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.as_json = as_json
        self.thread = threading.Thread(target=self._run, args=(store, keys, limit, as_json),
                                       daemon=True)
        self.thread.start()

    def _run(self, store, keys, limit, as_json):
        try:
            ctl.follow_events(store, keys.job_id, limit, as_json, self.out, stop=self.stop,
                              poll_s=0.02)
        except BaseException as exc:  # re-raised by finish()
            self.error = exc

    def messages(self) -> list[str]:
        return [json.loads(line)["message"] for line in self.out.getvalue().splitlines()]

    def wait_for(self, count: int, timeout_s: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(self.messages()) < count and time.monotonic() < deadline:
            assert self.error is None, self.error
            time.sleep(0.01)
        return self.messages()

    def finish(self) -> list[str] | None:
        time.sleep(0.1)  # room for a duplicate to show up
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.messages() if self.as_json else None


def test_follow_prints_the_newest_history_then_each_new_event_once_in_order():
    clock, keys = FakeClock(), fresh_keys()
    store = MemoryStore(clock=clock)
    for i in range(5):
        write_event(store, keys, clock, "a", f"old {i}")

    follower = Follower(store, keys, limit=2)
    assert follower.wait_for(2) == ["old 3", "old 4"]
    for i in range(3):
        write_event(store, keys, clock, "b" if i % 2 else "a", f"new {i}")

    assert follower.wait_for(5) == ["old 3", "old 4", "new 0", "new 1", "new 2"]
    assert follower.finish() == ["old 3", "old 4", "new 0", "new 1", "new 2"]


def test_follow_with_limit_zero_prints_only_new_events():
    clock, keys = FakeClock(), fresh_keys()
    store = MemoryStore(clock=clock)
    write_event(store, keys, clock, "a", "old")

    follower = Follower(store, keys, limit=0)
    time.sleep(0.05)
    write_event(store, keys, clock, "a", "new")

    assert follower.wait_for(1) == ["new"]
    assert follower.finish() == ["new"]


class WriteAfterRead(MemoryStore):
    """A store where an event is written right after each read of the events
    (before any watch can start), and, with ``compact``, history compacted."""

    def __init__(self, clock, keys, compact: bool):
        super().__init__(clock=clock)
        self.keys, self.do_compact, self.reads = keys, compact, 0

    def get_prefix(self, prefix, *, timeout_s=None):
        result = super().get_prefix(prefix, timeout_s=timeout_s)
        if prefix == self.keys.events and self.reads == 0:
            self.reads += 1
            write_event(self, self.keys, self.clock, "a", "in the gap")
            if self.do_compact:
                write_event(self, self.keys, self.clock, "b", "compacted away")
                self.compact(self.revision)
        return result


@pytest.mark.parametrize("compact", [False, True])
def test_an_event_written_between_the_read_and_the_watch_is_printed_once(compact):
    clock, keys = FakeClock(), fresh_keys()
    store = WriteAfterRead(clock, keys, compact)
    write_event(store, keys, clock, "a", "history")

    follower = Follower(store, keys)
    expected = ["history", "in the gap"] + (["compacted away"] if compact else [])
    assert follower.wait_for(len(expected)) == expected
    write_event(store, keys, clock, "b", "after")

    assert follower.finish() == expected + ["after"]


def test_follow_as_a_table_keeps_the_history_columns():
    clock, keys = FakeClock(), fresh_keys()
    store = MemoryStore(clock=clock)
    write_event(store, keys, clock, "node-1", "old")

    follower = Follower(store, keys, as_json=False)
    time.sleep(0.05)
    write_event(store, keys, clock, "node-1", "new")
    deadline = time.monotonic() + 5
    while "new" not in follower.out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    follower.finish()

    header, old, new = follower.out.getvalue().splitlines()
    assert header.split() == ["TIME", "NODE", "ROUND", "KIND", "MESSAGE"]
    assert old.index("old") == new.index("new") == header.index("MESSAGE")


# -- flags and help -------------------------------------------------------------------


def test_elasticctl_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        ctl.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"elasticctl {__version__}\n"


def test_elasticd_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        agent_config.parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"elasticd {__version__}\n"


@pytest.mark.parametrize("argv", [["--help"], ["events", "--help"], ["status", "--help"]])
def test_help_lists_the_exit_codes(capsys, argv):
    with pytest.raises(SystemExit):
        ctl.main(argv)
    out = capsys.readouterr().out
    assert " ".join(EXIT_CODES_HELP.split()) in " ".join(out.split())
    assert "130" in out and "141" in out
    assert max(len(line) for line in out.splitlines()) <= 90


@pytest.mark.parametrize("argv,needle", [
    (["events", "--limit", "-1"], "--limit must be 0 or more"),
    (["status", "--watch", "--interval", "0"], "--interval must be more than 0 seconds"),
    (["status", "--watch", "--job-id", "../x"], "invalid job id"),
])
def test_bad_flags_fail_at_once_with_exit_2(capsys, argv, needle):
    job = [] if "--job-id" in argv else ["--job-id", "j"]
    assert ctl.main([*argv, *job, "--etcd", "http://127.0.0.1:1"]) == 2
    assert needle in capsys.readouterr().err


# -- the demo's victim ----------------------------------------------------------------


def node(node_id, node_rank, nproc=2, workers=None):
    return {"node_id": node_id, "node_rank": node_rank, "nproc": nproc,
            "agent": None if workers is None else {"workers": workers}}


def test_the_demo_names_the_node_that_runs_the_rank_not_the_one_named_second():
    # "b" joined first and got node rank 0: rank 3 runs on "a".
    status = {"nodes": [node("b", 0), node("a", 1)]}

    assert node_of_worker(status, 3) == "a"
    assert node_of_worker(status, 1) == "b"
    assert node_of_worker(status, 4) is None


def test_the_demo_counts_ranks_over_unequal_nodes_and_skips_standbys():
    status = {"nodes": [node("x", 0, nproc=3), node("s", None, nproc=8), node("y", 1, nproc=1)]}

    assert [node_of_worker(status, r) for r in range(4)] == ["x", "x", "x", "y"]


def test_the_agent_that_reports_the_pid_wins_over_the_round_arithmetic():
    status = {"nodes": [node("a", 0, workers=[{"rank": 0, "pid": 10}, {"rank": 1, "pid": 11}]),
                        node("b", 1, workers=[{"rank": 3, "pid": 42}])]}

    assert node_of_worker(status, 3, pid=42) == "b"
    # A worker of another round with the same rank is not taken for it.
    assert node_of_worker({"nodes": [node("a", 0, workers=[{"rank": 3, "pid": 7}]),
                                     node("b", 1)]}, 3, pid=42) == "b"


def test_the_demo_waits_for_a_whole_warm_set_on_every_node():
    line = "2026-11-23 09:23:21,925 elasticd INFO: job demo node {n}: warm worker pid {p} is " \
           "ready ({k} of 4 warm).\n"
    output = [f"a: {line.format(n='a', p=1, k=1)}", f"b: {line.format(n='b', p=2, k=2)}",
              "a: [rank 2]: step 10 loss 0.5 (2 of 4 warm)\n"]

    assert warm_nodes(output, 2) == {"b"}
    assert warm_nodes(output + [f"a: {line.format(n='a', p=3, k=2)}"], 2) == {"a", "b"}


# -- checkpoints ----------------------------------------------------------------------


def checkpoints(store, keys, *argv):
    args = ctl.parser().parse_args(["checkpoints", "--etcd", "mem", "--job-id", keys.job_id,
                                     *argv])
    return ctl.COMMANDS["checkpoints"](store, args)


@pytest.mark.parametrize("garbage", [b"\xff\xfe", b'{"step": "nine"}', b"[]"])
def test_a_malformed_latest_checkpoint_is_a_problem_shown_with_the_history(garbage):
    # Not "rendezvous failed" (exit 4): the command reads the job and says
    # what it found, as status does.
    clock = FakeClock(wall_s=WALL)
    store, keys = MemoryStore(clock=clock), fresh_keys()
    store.txn([], [event_op(keys, clock, "a", 1, "checkpoint",
                            "checkpoint of step 8 committed (step-000000000008)")])
    store.put(keys.checkpoint_latest, garbage)
    text = checkpoints(store, keys)
    assert text.splitlines()[0] == (f"job {keys.job_id}: the record of the latest checkpoint "
                                    "is unreadable")
    assert "checkpoint of step 8 committed" in text
    assert text.splitlines()[-1].startswith(
        f"problem: malformed record at key '{keys.checkpoint_latest}'")
    assert text.endswith("the job's next checkpoint commit replaces it")
    data = json.loads(checkpoints(store, keys, "--json"))
    assert data["latest"] is None and len(data["history"]) == 1
    (problem,) = data["problems"]
    assert problem.startswith(f"malformed record at key '{keys.checkpoint_latest}'")


def test_checkpoints_without_a_commit_and_with_one():
    clock = FakeClock(wall_s=WALL)
    store, keys = MemoryStore(clock=clock), fresh_keys()
    assert checkpoints(store, keys) == f"job {keys.job_id}: no checkpoint committed yet"
    assert json.loads(checkpoints(store, keys, "--json")) == {"latest": None, "history": [],
                                                             "problems": []}
    store.put(keys.checkpoint_latest, json.dumps({
        "step": 9, "round": 1, "world_size": 2, "path": "step-000000000009",
        "time": WALL}).encode())
    assert checkpoints(store, keys) == (
        f"job {keys.job_id}: latest checkpoint step 9 (step-000000000009), round 1, world "
        f"size 2, committed {STAMP}")


def test_elasticctl_checkpoints_exits_0_on_a_malformed_record(monkeypatch, capsys):
    store, keys = MemoryStore(clock=FakeClock(wall_s=WALL)), fresh_keys()
    store.put(keys.checkpoint_latest, b"garbage")
    monkeypatch.setattr(ctl, "open_store", lambda *a, **kw: contextlib.nullcontext(store))
    code = ctl.main(["checkpoints", "--etcd", "mem", "--job-id", keys.job_id])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "problem: malformed record" in out and err == ""
