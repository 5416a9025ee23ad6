"""The checkpoint commit log kept in the store: one set of bodies, the fake and real etcd.

:class:`CommitLogContract` holds the bodies; each backend's class supplies
the ``store`` fixture. Every test runs under its own job id, so tests sharing
one etcd never see each other's keys.

The round is what fences a commit: the job's round number is the version of
its ``round`` key, so a test moves the job to its next round by writing that
key once more (what the rendezvous does when it commits a round).
"""

from __future__ import annotations

import json

import pytest

from elastic.checkpoint.api import CommitEntry
from elastic.checkpoint.etcd_log import EtcdCommitLog
from elastic.errors import FencedError, MalformedRecordError, StoreUnavailableError
from elastic.events import read_events
from elastic.keyspace import JobKeys
from elastic.store.api import Store
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore

WRITER = "node-a"


def entry(step: int, round_: int) -> CommitEntry:
    return CommitEntry(step=step, round=round_, world_size=4, path=f"step-{step:012d}",
                       time=1_700_000_000.0 + step)


def start_round(store: Store, keys: JobKeys) -> int:
    """Commit the job's next round, as the rendezvous does; its number."""
    store.put(keys.round, b'{"round": "record"}')
    return store.get(keys.round).version


def checkpoint_events(store: Store, keys: JobKeys) -> list[tuple[str, int, str]]:
    return [(e.node_id, e.round, e.message) for e in read_events(store, keys)
            if e.kind == "checkpoint"]


class CommitLogContract:
    """Bodies shared by every store backend; a subclass supplies ``store``."""

    @pytest.fixture
    def keys(self, job_id) -> JobKeys:
        return JobKeys(job_id)

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def commit_log(self, store, keys, clock) -> EtcdCommitLog:
        return EtcdCommitLog(store, keys, clock, writer=WRITER)

    def test_a_commit_in_the_current_round_becomes_the_latest(self, store, keys, commit_log):
        assert commit_log.latest() is None
        assert start_round(store, keys) == 1

        commit_log.commit(entry(10, round_=1))

        assert commit_log.latest() == entry(10, round_=1)
        # the record is the entry's own codec, with sorted keys (stable bytes for a diff)
        record = store.get(keys.checkpoint_latest).value
        assert record == json.dumps(entry(10, 1).to_dict(), sort_keys=True).encode()
        assert checkpoint_events(store, keys) == [
            (WRITER, 1, "checkpoint of step 10 committed (step-000000000010)")]

    def test_a_later_commit_of_the_same_round_replaces_the_latest(self, store, keys, commit_log,
                                                                   clock):
        start_round(store, keys)
        commit_log.commit(entry(10, round_=1))
        clock.advance(1)
        commit_log.commit(entry(20, round_=1))
        assert commit_log.latest() == entry(20, round_=1)
        assert len(checkpoint_events(store, keys)) == 2

    def test_a_commit_of_an_older_round_is_fenced_and_changes_nothing(self, store, keys,
                                                                      commit_log, clock):
        start_round(store, keys)
        commit_log.commit(entry(10, round_=1))
        assert start_round(store, keys) == 2  # the job moved on; a round-1 worker lingers
        clock.advance(1)

        with pytest.raises(FencedError, match=r"in round 1 was refused: the current round is 2"):
            commit_log.commit(entry(20, round_=1))

        assert commit_log.latest() == entry(10, round_=1)
        assert [round_ for _, round_, _ in checkpoint_events(store, keys)] == [1]

    def test_a_commit_of_a_round_newer_than_the_current_is_fenced(self, store, keys,
                                                                   commit_log):
        start_round(store, keys)
        start_round(store, keys)

        with pytest.raises(FencedError, match=r"in round 3 was refused: the current round is 2"):
            commit_log.commit(entry(10, round_=3))

        assert commit_log.latest() is None
        assert checkpoint_events(store, keys) == []

    def test_a_commit_before_any_round_is_refused(self, store, keys, commit_log):
        with pytest.raises(FencedError, match=r"the current round is 0"):
            commit_log.commit(entry(10, round_=1))
        assert commit_log.latest() is None
        assert checkpoint_events(store, keys) == []

    def test_a_newer_round_may_go_back_to_an_older_step(self, store, keys, commit_log, clock):
        # after a restore that fell back past a damaged latest, the new round commits
        # an older step than the recorded one: the round decides, not the step
        start_round(store, keys)
        commit_log.commit(entry(20, round_=1))
        start_round(store, keys)
        clock.advance(1)
        commit_log.commit(entry(15, round_=2))
        assert commit_log.latest() == entry(15, round_=2)

    @pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"[]",
                                     b'{"step": 1, "round": 1}',
                                     b'{"path": "../x", "round": 1, "step": 1, "time": 0, '
                                     b'"world_size": 1}'])
    def test_a_malformed_latest_raises_naming_the_key(self, store, keys, commit_log, raw):
        store.put(keys.checkpoint_latest, raw)
        with pytest.raises(MalformedRecordError) as info:
            commit_log.latest()
        assert info.value.key == keys.checkpoint_latest

    def test_a_failed_save_is_an_event_of_its_round_naming_the_latest(self, store, keys,
                                                                       commit_log, clock):
        start_round(store, keys)
        commit_log.commit(entry(10, round_=1))
        start_round(store, keys)  # not fenced: a failure happened whatever the round is now
        clock.advance(1)

        commit_log.report_failure(20, 1, 0, "[Errno 28 ENOSPC] No space left on device")

        assert checkpoint_events(store, keys)[-1] == (
            WRITER, 1, "checkpoint of step 20 failed (reported by rank 0): [Errno 28 ENOSPC] "
                       "No space left on device; the latest committed checkpoint stays step 10")
        assert commit_log.latest() == entry(10, round_=1)

    def test_logs_of_two_jobs_do_not_see_each_other(self, store, keys, clock, job_id):
        other_keys = JobKeys(job_id + "-other")
        start_round(store, keys)
        start_round(store, other_keys)
        EtcdCommitLog(store, keys, clock, WRITER).commit(entry(10, round_=1))
        assert EtcdCommitLog(store, other_keys, clock, WRITER).latest() is None


class TestMemoryStore(CommitLogContract):
    """Against the in-memory fake."""

    @pytest.fixture
    def store(self, clock):
        store = MemoryStore(clock=clock)
        yield store
        store.close()

    def test_a_failure_report_that_etcd_refuses_is_only_logged(self, store, keys, commit_log,
                                                               caplog):
        start_round(store, keys)
        store.fail_next("txn", StoreUnavailableError("etcd did not answer (injected)"))
        commit_log.report_failure(20, 1, 0, "disk gone")  # does not raise
        assert checkpoint_events(store, keys) == []
        assert "could not be recorded in the job's events" in caplog.text


class TestEtcdStore(CommitLogContract):
    """Against the session's real etcd server."""

    @pytest.fixture
    def store(self, etcd_store):
        return etcd_store
