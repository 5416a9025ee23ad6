"""bench/recovery.py and bench/goodput.py run two "nodes" on one host: on a GPU host
each launcher gets GPUs of its own, or the run stops saying how many it needs."""

from __future__ import annotations

import pytest

from bench.recovery import BenchError, launcher_env

ELASTICD = ["python", "-m", "agent.daemon", "--nnodes", "1:2", "--nproc-per-node", "2",
            "examples/ddp.py"]
TORCHRUN = ["torchrun", "--nproc_per_node", "1", "examples/ddp.py"]


def test_each_node_gets_its_own_gpus():
    gpus = ["0", "1", "2", "3"]
    assert [launcher_env("x", {"A": "1"}, ELASTICD, n, gpus) for n in (0, 1)] == [
        {"A": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, {"A": "1", "CUDA_VISIBLE_DEVICES": "2,3"}]
    assert [launcher_env("x", {}, TORCHRUN, n, gpus)["CUDA_VISIBLE_DEVICES"]
            for n in (0, 1)] == ["0", "1"]


def test_on_the_cpu_nothing_changes():
    assert launcher_env("x", {"A": "1"}, ELASTICD, 1, []) == {"A": "1"}


def test_too_few_gpus_stop_the_run_with_the_count():
    with pytest.raises(BenchError, match="b: agent 2 .* at least 4"):
        launcher_env("b", {}, ELASTICD, 1, ["0", "1"])
