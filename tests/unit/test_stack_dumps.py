"""The agent reads a real worker's stacks: signalled only when its file names it, read once.

Each test starts a real Python process that does what the worker bootstrap does
(:func:`elastic.worker.stacks.dump_on_signal`) and then blocks where a test
names it, and asks :class:`agent.stack_dumps.StackCollector` for its stack.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agent.health import WorkerHealth
from agent.stack_dumps import LocalWorker, StackCollector
from agent.worker_output import stacks_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = """
import sys, time
from elastic.worker import stacks
if sys.argv[1] != "-":
    stacks.dump_on_signal(sys.argv[1])

def stuck_here():
    print("ready", flush=True)  # from here: a dump any time after it shows this frame
    time.sleep(600)

stuck_here()
"""


@pytest.fixture
def spawn(tmp_path):
    started: list[subprocess.Popen] = []

    def start(path: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", WORKER, path], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": REPO})
        started.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_worker_s_stack_is_read_with_its_step_and_kept_and_read_once(tmp_path, spawn):
    os.makedirs(tmp_path / "round-4")
    path = stacks_file(str(tmp_path), 4, 7)
    proc = spawn(path)
    collector = StackCollector(str(tmp_path), "node-a")
    health = WorkerHealth(local_rank=0, rank=7, started_at=0.0, last_progress_at=10.0, step=41)
    [stack] = collector.collect(4, [LocalWorker(7, proc.pid)], [health], 12.5, timeout_s=5.0)
    assert stack.dumped and stack.node_id == "node-a" and stack.rank == 7
    assert stack.place.endswith("in stuck_here") and stack.collective == ""
    assert (stack.step, stack.progress_age_s) == (41, 2.5)
    size = os.path.getsize(path)
    assert "in stuck_here" in open(path).read(), "the full dump stays beside the rank log"
    [again] = collector.collect(4, [LocalWorker(7, proc.pid)], [health], 13.0, timeout_s=5.0)
    assert again.place == stack.place and os.path.getsize(path) == size, "dumped once"
    assert proc.poll() is None


def test_a_worker_whose_file_does_not_name_it_is_not_signalled(tmp_path, spawn):
    os.makedirs(tmp_path / "round-4")
    without = spawn("-")  # no handler: the signal would end it
    other = spawn(stacks_file(str(tmp_path), 4, 1))  # rank 1's file names another pid
    collector = StackCollector(str(tmp_path), "node-a")
    started = time.monotonic()
    stacks = collector.collect(4, [LocalWorker(0, without.pid), LocalWorker(1, without.pid)],
                               [], 0.0, timeout_s=5.0)
    assert [s.dumped for s in stacks] == [False, False]
    assert time.monotonic() - started < 1.0, "nothing asked, nothing waited for"
    time.sleep(0.2)
    assert without.poll() is None and other.poll() is None
