"""agent.hardening: the agent marks itself non-dumpable while it holds the etcd
password; what it executes (the workers) is not."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

CHECK = textwrap.dedent("""
    import subprocess, sys
    from agent import hardening
    assert hardening.is_dumpable()
    assert hardening.make_non_dumpable()
    assert not hardening.is_dumpable()
    child = subprocess.run([sys.executable, "-c",
                            "from agent import hardening; print(hardening.is_dumpable())"],
                           capture_output=True, text=True, check=True)
    print(child.stdout.strip())
""")


def test_non_dumpable_here_and_not_in_what_it_executes():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"  # the worker, executed, is an ordinary process
