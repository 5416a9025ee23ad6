"""A failed checkpoint save reaches the job's events: from the checkpointer of rank 0,
through the worker channel (a real gRPC server on a Unix socket), to a real agent
(over the in-memory store), which records a ``checkpoint`` event naming the error and
the checkpoint that stays. A report never breaks training: with no agent to take it,
it is a warning.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

import pytest

from elastic import worker_env
from elastic.checkpoint.agent_log import AgentCommitLog
from elastic.checkpoint.api import CommitEntry
from elastic.events import read_events
from tests.unit.test_agent_loop import OneNode

pytestmark = pytest.mark.timeout(60)

ENOSPC_TEXT = ("saving checkpoint step 20 into /ckpt/.tmp-step-20-round-1 failed on rank 1: "
               "[Errno 28 ENOSPC] No space left on device (/ckpt/__1_0.distcp)")


@pytest.fixture
def node():
    """One real agent training (fake workers) in the in-memory store."""
    node = OneNode()
    node.run(3)
    return node


def checkpoint_events(node) -> list[tuple[str, int, str]]:
    return [(e.node_id, e.round, e.message) for e in read_events(node.store, node.rdzv.keys)
            if e.kind == "checkpoint"]


def test_a_reported_failure_is_an_event_naming_the_error_and_the_checkpoint_that_stays(
        node, socket_path):
    round_ = node.round().number
    log = AgentCommitLog(socket_path)
    log.commit(CommitEntry(step=9, round=round_, world_size=2, path="step-000000000009",
                           time=time.time()))

    log.report_failure(20, round_, 0, ENOSPC_TEXT)

    failed = [e for e in checkpoint_events(node) if "failed" in e[2]]
    assert failed == [("a", round_, f"checkpoint of step 20 failed (reported by rank 0): "
                                     f"{ENOSPC_TEXT}; the latest committed checkpoint stays "
                                     f"step 9")]


def test_a_failure_before_any_commit_says_so(node, socket_path):
    AgentCommitLog(socket_path).report_failure(10, node.round().number, 0, "disk gone")
    (_, _, message), = checkpoint_events(node)
    assert message.endswith("disk gone; no checkpoint is committed yet")


def test_a_huge_message_is_capped_before_it_reaches_etcd(node, socket_path):
    AgentCommitLog(socket_path).report_failure(10, node.round().number, 0, "x" * 100_000)
    (_, _, message), = checkpoint_events(node)
    assert len(message) <= 1024


def test_a_report_with_no_agent_to_take_it_is_a_warning_not_an_error(caplog):
    directory = tempfile.mkdtemp(prefix="elastic-test-", dir="/tmp")
    try:
        log = AgentCommitLog(os.path.join(directory, "nobody.sock"))
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.agent_log"):
            log.report_failure(10, 1, 0, "disk gone")
        assert time.monotonic() - started < 3.0
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert "checkpoint of step 10 failed in round 1 (disk gone)" in caplog.text


@pytest.mark.parametrize("async_", [False, True])
def test_the_checkpointer_reports_its_failed_save_through_the_agent(node, socket_path,
                                                                    monkeypatch, tmp_path,
                                                                    async_):
    from torch import nn

    from elastic.checkpoint.checkpointer import Checkpointer
    from elastic.errors import CheckpointWriteError

    round_ = node.round().number
    monkeypatch.setenv(worker_env.ROUND, str(round_))
    model = nn.Linear(2, 2)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=model, commit_log=AgentCommitLog(socket_path),
                        on_saving=lambda seconds: None)
    try:
        ckpt.save(4, async_=async_)
        ckpt.wait()
        monkeypatch.setenv("ELASTIC_FAILPOINT", "ckpt.write=oserror:ENOSPC")
        with pytest.raises(CheckpointWriteError, match="ENOSPC"):
            ckpt.save(9, async_=async_)
            ckpt.wait()
        monkeypatch.delenv("ELASTIC_FAILPOINT")
        ckpt.save(14, async_=async_)  # training goes on, and saves again
    finally:
        ckpt.close()

    # The failure is reported from a thread of its own: it may land after step 14's commit.
    deadline = time.monotonic() + 10
    while len(messages := [m for _, _, m in checkpoint_events(node)]) < 3 \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    failed, = [m for m in messages if "failed" in m]
    # Sorted: the fake clock stands still, so all events share one time and come back
    # in the order of their ring slots, which wrap around (the ring is per process).
    assert sorted(m for m in messages if m != failed) == [
        "checkpoint of step 14 committed (step-000000000014)",
        "checkpoint of step 4 committed (step-000000000004)"]
    assert failed.startswith("checkpoint of step 9 failed (reported by rank 0): saving "
                             "checkpoint step 9 into ")
    assert "[Errno 28 ENOSPC]" in failed
    assert failed.endswith("the latest committed checkpoint stays step 4")


def test_a_save_replaces_a_malformed_latest_record_instead_of_failing(node, socket_path,
                                                                      monkeypatch, tmp_path,
                                                                      caplog):
    # Rank 0 reads the latest entry before its commit: garbage there is replaced by
    # the fenced commit, never a reason to fail every save until someone mends the key.
    from torch import nn

    from elastic.checkpoint.checkpointer import Checkpointer

    monkeypatch.setenv(worker_env.ROUND, str(node.round().number))
    node.store.put(node.rdzv.keys.checkpoint_latest, b"garbage")
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=nn.Linear(2, 2),
                        commit_log=AgentCommitLog(socket_path), on_saving=lambda seconds: None)
    try:
        with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.saving"):
            ckpt.save(4)
            ckpt.wait()
        assert AgentCommitLog(socket_path).latest().step == 4
        assert "cannot be read" in caplog.text and "malformed record" in caplog.text
        ckpt.save(8)  # and the next save finds a readable record
        ckpt.wait()
        assert AgentCommitLog(socket_path).latest().step == 8
    finally:
        ckpt.close()
