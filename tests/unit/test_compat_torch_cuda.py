"""elastic._compat.torch_cuda: torch's CUDA fork guard, read in a forked child.

The logic runs everywhere on stand-ins; the last test asks the installed
torch itself, where it is a CUDA build (the matrix's PyPI wheels are, even on
a host without a GPU: torch poisons fork before it knows whether a driver
answers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from elastic._compat import torch_cuda
from elastic.worker import template


def fake_torch(**c_attrs):
    module = types.ModuleType("torch")
    module._C = types.SimpleNamespace(**c_attrs)
    return module


def test_no_torch_or_a_cpu_build_is_never_in_a_bad_fork():
    assert torch_cuda.in_bad_fork(None) is False
    assert torch_cuda.in_bad_fork(fake_torch()) is False  # no _cuda_getDeviceCount


@pytest.mark.parametrize("flag", [True, False])
def test_a_cuda_build_answers_with_its_own_flag(flag):
    module = fake_torch(_cuda_getDeviceCount=lambda: 1, _cuda_isInBadFork=lambda: flag)
    assert torch_cuda.in_bad_fork(module) is flag


def test_a_cuda_build_that_cannot_say_gives_none():
    assert torch_cuda.in_bad_fork(fake_torch(_cuda_getDeviceCount=lambda: 1)) is None

    def broken():
        raise RuntimeError("changed")
    module = fake_torch(_cuda_getDeviceCount=lambda: 1, _cuda_isInBadFork=broken)
    assert torch_cuda.in_bad_fork(module) is None


def test_the_template_calls_a_poisoned_fork_unsafe_and_says_what_to_do():
    reason = template.unsafe_reason(fake_torch(), fork_poisoned=True)
    assert "used the CUDA driver" in reason and "elastic.init()" in reason
    assert template.TEMPLATE_ENV == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def test_the_installed_torch_poisons_fork_as_the_shim_reads_it():
    if not torch_cuda.cuda_build(torch):
        assert torch_cuda.in_bad_fork(torch) is False
        pytest.skip(f"torch {torch.__version__} has no CUDA: nothing to poison")
    # In a fresh interpreter: the test process itself must stay unpoisoned.
    script = textwrap.dedent("""
        import os, sys
        import torch
        from elastic._compat import torch_cuda

        def child_says():
            pid = os.fork()
            if pid == 0:
                os._exit(int(bool(torch_cuda.in_bad_fork(torch))))
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

        before = child_says()
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        torch.cuda.is_available()
        with_nvml = child_says()  # 1 where NVML fails (no driver): torch asked the driver
        del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        torch.cuda.is_available()
        print(before, with_nvml, child_says(), torch.cuda.is_initialized())
        """)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True, cwd=repo).stdout.split()
    before, _with_nvml, after, initialized = out[-4:]
    assert (before, after, initialized) == ("0", "1", "False")
