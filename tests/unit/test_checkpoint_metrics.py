"""Checkpoint save and restore metrics end to end in one process: a real
checkpointer (torch, DCP) commits and restores through the worker channel (a
real gRPC server on a Unix socket) of a real agent (over the in-memory store),
whose metrics count the save's time and bytes, and the restore's."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from agent.metrics import AgentMetrics
from elastic import worker_env
from elastic.checkpoint import layout
from elastic.checkpoint.agent_log import AgentCommitLog
from elastic.checkpoint.api import CommitEntry
from elastic.errors import CheckpointError
from tests.unit.test_agent_loop import OneNode

pytestmark = pytest.mark.timeout(90)

IDS = {"job_id": "j", "node_id": "a"}


@pytest.fixture
def node():
    node = OneNode(metrics=AgentMetrics("j", "a"))
    node.run(3)
    return node


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_commit_record_keeps_how_the_save_went_and_older_records_still_read():
    entry = CommitEntry(step=4, round=1, world_size=2, path="step-000000000004", time=1.0,
                        save_s=2.5, size_bytes=1000)
    assert CommitEntry.from_dict(json.loads(json.dumps(entry.to_dict()))) == entry
    old = {"step": 4, "round": 1, "world_size": 2, "path": "step-000000000004", "time": 1.0}
    assert CommitEntry.from_dict(old) == dataclasses.replace(entry, save_s=0.0, size_bytes=0)
    for bad in ({"save_s": -1.0}, {"save_s": float("nan")}, {"size_bytes": -5},
                {"size_bytes": 1.5}, {"save_s": "slow"}):
        with pytest.raises(CheckpointError):
            CommitEntry.from_dict({**old, **bad})


def test_a_save_and_a_restore_are_counted_by_the_agent(node, socket_path, monkeypatch,
                                                       tmp_path):
    from torch import nn

    from elastic.checkpoint.checkpointer import Checkpointer

    monkeypatch.setenv(worker_env.ROUND, str(node.round().number))
    root = str(tmp_path / "ckpt")
    get = node.agent.metrics.registry.get_sample_value
    ckpt = Checkpointer(root, model=nn.Linear(64, 64), commit_log=AgentCommitLog(socket_path),
                        on_saving=lambda seconds: None)
    try:
        ckpt.save(4, async_=True)
        ckpt.wait()
    finally:
        ckpt.close()
    manifests, problems = layout.read_manifests(os.path.join(root, "step-000000000004"))
    assert not problems
    size = layout.manifest_bytes(manifests)
    assert size > 64 * 64 * 4  # the weights at least
    latest = node.agent.commit_log.latest()  # the record in etcd says so too
    assert latest.size_bytes == size and latest.save_s > 0
    assert get("elasticd_checkpoint_save_bytes_total", IDS) == size
    assert get("elasticd_checkpoint_save_seconds_count", IDS) == 1
    assert get("elasticd_checkpoint_save_seconds_sum", IDS) == latest.save_s
    assert get("elasticd_checkpoint_step", IDS) == 4

    restored = Checkpointer(root, model=nn.Linear(64, 64),
                            commit_log=AgentCommitLog(socket_path), on_saving=lambda s: None)
    try:
        assert restored.restore() == 5
    finally:
        restored.close()
    # Reported from a thread of its own: it may land a little later.
    wait_for(lambda: get("elasticd_checkpoint_restore_seconds_count", IDS) == 1)
    assert get("elasticd_checkpoint_restore_seconds_sum", IDS) > 0
    assert get("elasticd_checkpoint_restore_bytes_total", IDS) == size
