"""The warm workers' default preload covers what a script's restart imports of ours.

One fresh interpreter (a real import, as the template does it): the default
preload's own modules are imported, then what a script that uses the library
imports on its critical path (``elastic.init()``'s runtime, the
``Checkpointer``); nothing of ours may be left to import then, and the preload
may start no thread (the template forks only while single-threaded).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.integration.supervising import REPO

pytestmark = pytest.mark.integration

PROBE = textwrap.dedent("""
    import importlib, json, os, sys
    from elastic.worker.bootstrap import DEFAULT_PRELOAD
    ours = [m for m in DEFAULT_PRELOAD.split(",") if m.split(".")[0] == "elastic"]
    import torch  # the rest of the default preload: what the template imported first
    threads = len(os.listdir("/proc/self/task"))
    for name in ours:
        importlib.import_module(name)
    after_preload = len(os.listdir("/proc/self/task"))
    before = set(sys.modules)
    import elastic
    from elastic.checkpoint import Checkpointer
    from elastic.worker import runtime  # what elastic.init() imports on its first call
    late = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("elastic", "grpc"))
    print(json.dumps({"ours": ours, "late": late, "threads": [threads, after_preload]}))
""")


def test_a_restart_imports_nothing_of_ours_that_the_default_preload_did_not():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["ours"] == ["elastic.worker.runtime", "elastic.checkpoint.checkpointer"]
    assert seen["late"] == []
    assert seen["threads"][1] == seen["threads"][0]
