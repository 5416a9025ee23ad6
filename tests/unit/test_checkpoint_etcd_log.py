"""EtcdCommitLog's log lines go through the one JobLogger: ``job J node N round R:``
with R the entry's round (the field set on the record too), the commit said once
in the words of its event."""

from __future__ import annotations

import logging

from elastic.checkpoint.api import CommitEntry
from elastic.checkpoint.etcd_log import EtcdCommitLog
from elastic.errors import StoreUnavailableError
from elastic.keyspace import JobKeys
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore

LOGGER = "elastic.checkpoint.etcd_log"


def commit_log() -> tuple[EtcdCommitLog, MemoryStore, JobKeys]:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    keys = JobKeys("j1")
    store.put(keys.round, b'{"round": "record"}')  # round 1
    return EtcdCommitLog(store, keys, clock, writer="node-a"), store, keys


def test_a_commit_is_logged_once_with_the_job_node_and_the_entrys_round(caplog):
    log, store, _ = commit_log()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log.commit(CommitEntry(step=9, round=1, world_size=2, path="step-000000000009",
                               time=1.0))
    store.close()
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert [r.getMessage() for r in lines] == [
        "job j1 node node-a round 1: checkpoint of step 9 committed (step-000000000009)"]
    assert (lines[0].job, lines[0].node, lines[0].round) == ("j1", "node-a", 1)


def test_a_failure_report_is_logged_in_the_round_it_names(caplog):
    log, store, _ = commit_log()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log.report_failure(20, 1, 0, "disk gone")
        store.fail_next("txn", StoreUnavailableError("etcd did not answer (injected)"))
        log.report_failure(21, 1, 0, "disk gone")
    store.close()
    reported, lost = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert reported.startswith("job j1 node node-a round 1: checkpoint of step 20 failed "
                               "(reported by rank 0): disk gone; ")
    assert lost.startswith("job j1 node node-a round 1: the failed save of checkpoint step 21 "
                           "(disk gone) could not be recorded in the job's events: ")
