"""Which GPU ``elastic.init()`` binds each worker to, decided on CPU.

The CUDA facade (``is_available``, ``device_count``, ``set_device``) and
``init_process_group`` are passed in, so the decision runs without a GPU and
without touching torch's globals.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from elastic.errors import ConfigError
from elastic.worker import runtime


class FakeCuda:
    """``torch.cuda`` as far as elastic.init() uses it; records set_device."""

    def __init__(self, gpus: int):
        self.gpus = gpus
        self.current: list[int] = []

    def is_available(self) -> bool:
        return self.gpus > 0

    def device_count(self) -> int:
        return self.gpus

    def set_device(self, index: int) -> None:
        if not 0 <= index < self.gpus:
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.current.append(index)


class RecordingInit:
    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, **kwargs) -> None:
        self.calls.append(kwargs)


def join(backend, local_rank, gpus):
    cuda, init = FakeCuda(gpus), RecordingInit()
    runtime.join_process_group(backend, 30.0, local_rank, cuda, init)
    assert len(init.calls) == 1
    return cuda.current, init.calls[0]


@pytest.mark.parametrize("backend", ["nccl", "NCCL", "cuda:nccl", "cpu:gloo,cuda:nccl",
                                     "cuda:nccl,cpu:gloo", " cpu:gloo , cuda:nccl ", None])
def test_a_backend_with_nccl_binds_the_gpu_of_the_local_rank(backend):
    current, call = join(backend, 3, gpus=8)
    assert current == [3]
    assert call["device_id"] == torch.device("cuda", 3)
    assert call["init_method"] == "env://"
    assert call["timeout"] == datetime.timedelta(seconds=30)


@pytest.mark.parametrize("backend,expected", [(None, "gloo"), ("gloo", "gloo"),
                                              ("cpu:gloo", "cpu:gloo")])
def test_without_nccl_no_gpu_is_bound(backend, expected):
    current, call = join(backend, 1, gpus=0)
    assert current == [] and call["backend"] == expected
    assert call.get("device_id") is None


def test_gloo_on_a_gpu_host_binds_nothing_either():
    current, call = join("gloo", 1, gpus=8)
    assert current == [] and call.get("device_id") is None


def test_nccl_without_cuda_is_left_to_torch_to_refuse():
    # No device to bind: torch's own error ("NCCL requires CUDA") says it best.
    current, call = join("nccl", 0, gpus=0)
    assert current == [] and call["backend"] == "nccl" and call.get("device_id") is None


def test_a_local_rank_past_the_visible_gpus_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 2 .* 2 GPUs"):
        join("cpu:gloo,cuda:nccl", 2, gpus=2)


@pytest.mark.parametrize("backend,uses", [("nccl", True), ("cuda:nccl", True),
                                          ("cpu:gloo,cuda:nccl", True), ("gloo", False),
                                          ("cpu:gloo,cuda:gloo", False), ("ncclx", False),
                                          ("mpi", False), ("", False)])
def test_uses_nccl_reads_torch_s_backend_syntax(backend, uses):
    assert runtime.uses_nccl(backend) is uses


class CurrentCuda(FakeCuda):
    def current_device(self) -> int:
        return self.current[-1] if self.current else 0


@pytest.mark.parametrize("backend,gpus,expected", [
    ("nccl", 8, torch.device("cuda", 5)), ("cpu:gloo,cuda:nccl", 8, torch.device("cuda", 5)),
    ("gloo", 8, torch.device("cpu")), ("gloo", 0, torch.device("cpu")),
])
def test_the_device_of_a_rank_follows_its_group_s_backend(backend, gpus, expected):
    cuda = CurrentCuda(gpus)
    if gpus:
        cuda.set_device(5)
    assert runtime.device_for(backend, cuda) == expected


def test_join_returns_the_gpu_it_bound():
    cuda, init = FakeCuda(4), RecordingInit()
    assert runtime.join_process_group("nccl", 1.0, 2, cuda, init) == torch.device("cuda", 2)
    assert runtime.join_process_group("gloo", 1.0, 2, cuda, init) is None
