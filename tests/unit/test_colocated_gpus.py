"""GPUs for several agents on one host (make demo, bench/): each its own, or the CPU."""

from __future__ import annotations

import pytest

from agent.devices import colocated_node_gpus, visible_gpus
from elastic.errors import ConfigError


@pytest.mark.parametrize("physical,cvd,expected", [
    (4, None, ["0", "1", "2", "3"]),
    (4, "3,1", ["3", "1"]),
    (4, "1,7,2", ["1"]),  # CUDA stops at the first GPU that does not exist
    (4, "GPU-a,GPU-b", ["GPU-a", "GPU-b"]),
    (4, "", []),
    (0, None, []),
])
def test_visible_gpus_name_what_cuda_sees(physical, cvd, expected):
    assert visible_gpus(physical, cvd) == expected


def test_each_agent_gets_its_own_gpus():
    visible = visible_gpus(8, None)
    assert [colocated_node_gpus(n, 2, visible) for n in (0, 1)] == ["0,1", "2,3"]
    assert [colocated_node_gpus(n, 1, ["5", "6"]) for n in (0, 1)] == ["5", "6"]


def test_no_gpu_means_the_cpu():
    assert colocated_node_gpus(1, 2, []) is None
    assert colocated_node_gpus(0, 2, visible_gpus(8, "")) is None


def test_too_few_gpus_say_how_many_are_needed():
    with pytest.raises(ConfigError, match=r"agent 2 .* GPUs 2-3 .* 3 are visible .* at least 4"):
        colocated_node_gpus(1, 2, ["0", "1", "2"])
