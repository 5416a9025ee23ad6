"""Warm workers forked from one template process (elastic.worker.template), with real processes.

The preload is a small module written by each test (milliseconds to import) that
records every import by pid, so a test can tell which processes imported it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import textwrap
import time

import pytest

from elastic import worker_env
from tests.integration.supervising import REPO, check_exits_reported, kill, round_envs
from tests.waiting import wait_until
from tests.proctable import alive, parent

pytestmark = pytest.mark.integration

PRELOAD = """
import os
with open(os.path.join({dir!r}, "imports"), "a") as f:
    f.write("%d\\n" % os.getpid())
"""


def _imports(tmp_path) -> list[int]:
    return [int(line) for line in (tmp_path / "imports").read_text().split()]


@pytest.fixture
def counted_preload(tmp_path, monkeypatch):
    """ELASTIC_PRELOAD is `countpre`, which appends the importing pid to tmp_path/imports."""
    (tmp_path / "countpre.py").write_text(PRELOAD.format(dir=str(tmp_path)))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    monkeypatch.setenv(worker_env.PRELOAD, "countpre")


def _forked_pool(sup, nproc: int):
    """Wait for the template, let round 0 take the first forked set, and return
    (template pid, the warm set forked to replace it)."""
    sup.warm_up()
    template = wait_until(lambda: (t := sup.warm_template()) and t.ready and t, 20, "template ready")
    sup.start_round(0, round_envs(nproc, ROUND="0"))
    sup.stop()
    warm = wait_until(lambda: len(sup.warm_workers()) == nproc and sup.warm_workers(), 10,
                 "the forked set")
    assert [parent(w.pid) for w in warm] == [template.pid] * nproc
    assert all(w.ready for w in warm)  # ready at once: nothing left to import
    return template.pid, warm


def test_warm_workers_are_forks_of_one_template_that_alone_imported_the_preload(
        supervise, tmp_path, counted_preload):
    sup, exits = supervise("""
        import os, time
        if os.environ["ROUND"] != "0":
            print("parent", os.getppid())
        """, nproc=2, prestart=True)
    template, warm = _forked_pool(sup, 2)
    for number in (1, 2):
        sup.start_round(number, round_envs(2, ROUND=str(number)))
        assert [w.pid for w in sup.workers()] == [w.pid for w in warm]
        exits.wait(2 * (number + 1))
        sup.stop()
        warm = wait_until(lambda: len(sup.warm_workers()) == 2 and sup.warm_workers(), 10,
                     "the next forked set")
        assert [parent(w.pid) for w in warm] == [template] * 2
    log_text = (tmp_path / "logs" / "round-2" / "rank-10.log").read_text()
    assert f"stdout: parent {template}\n" in log_text
    # The template alone imported the preload; none of the eight forks did.
    assert _imports(tmp_path) == [template]
    assert len(sup.pids()) == 1 + 4 * 2


def test_a_forked_worker_keeps_the_bootstrap_promises_and_its_exit_is_reported_at_once(
        supervise, tmp_path, counted_preload):
    marks = tmp_path / "marks"
    marks.mkdir()
    sup, exits = supervise(f"""
        import json, os, sys, time
        from elastic.worker import priority
        if os.environ["ROUND"] == "0":
            sys.exit(0)
        mode = ["info", "three", "raise", "hang"][int(os.environ["LOCAL_RANK"])]
        with open(os.path.join({str(marks)!r}, mode), "w") as f:
            f.write(repr(time.monotonic()))
        if mode == "info":
            tids = [int(t) for t in os.listdir("/proc/self/task")]
            print("INFO " + json.dumps({{
                "argv": sys.argv, "path0": sys.path[0], "name": __name__,
                "stdin": sys.stdin.read(), "sid": os.getsid(0), "pgid": os.getpgid(0),
                "pid": os.getpid(), "main_idle": priority.is_idle(os.getpid()),
                "idle_threads": [t for t in tids if priority.is_idle(t)],
                "rank": os.environ["RANK"]}}))
            print("to stderr", file=sys.stderr)
        if mode == "three":
            sys.exit(3)
        if mode == "raise":
            raise RuntimeError("a bug in the training script")
        if mode == "hang":
            time.sleep(1000)
        """, nproc=4, prestart=True, args=("--lr", "0.1"))
    template, warm = _forked_pool(sup, 4)
    sup.start_round(1, round_envs(4, ROUND="1"))
    assert [w.pid for w in sup.workers()] == [w.pid for w in warm]
    wait_until(lambda: (marks / "hang").exists(), 10, "the hanging rank started")
    hang_pid = sup.workers()[3].pid
    killed_at = kill(hang_pid)
    got = [e for e in exits.wait(8) if e.round == 1]
    check_exits_reported(got, marks, ["info", "three", "raise"], hang_pid, killed_at)

    logs = tmp_path / "logs" / "round-1"
    info_log = (logs / "rank-10.log").read_text()
    info = json.loads(info_log.split("stdout: INFO ", 1)[1].splitlines()[0])
    script = str(tmp_path / "worker0.py")
    assert info["argv"] == [script, "--lr", "0.1"]
    assert info["path0"] == str(tmp_path) and info["name"] == "__main__"
    assert info["stdin"] == "" and info["rank"] == "10"
    assert info["sid"] == info["pgid"] == info["pid"]  # its own session and process group
    assert not info["main_idle"] and info["idle_threads"] == []
    assert "stderr: to stderr\n" in info_log
    raised = (logs / "rank-12.log").read_text()
    assert "stderr: RuntimeError: a bug in the training script" in raised
    assert "bootstrap" not in raised and "template" not in raised
    error = json.loads((logs / "rank-12.error.json").read_text())
    assert "a bug in the training script" in json.dumps(error)


def test_a_killed_template_takes_its_workers_along_and_the_pool_is_rebuilt(
        supervise, tmp_path, counted_preload):
    sup, exits = supervise("""
        import os, sys, time
        if os.environ["ROUND"] == "0":
            sys.exit(0)
        while True:
            time.sleep(0.05)
        """, nproc=2, prestart=True)
    template, _ = _forked_pool(sup, 2)
    sup.start_round(1, round_envs(2, ROUND="1"))  # on forks of the template
    running = [w.pid for w in sup.workers()]
    assert [parent(p) for p in running] == [template] * 2
    forks_warm = [w.pid for w in wait_until(lambda: len(sup.warm_workers()) == 2 and
                                       sup.warm_workers(), 10, "refilled")]
    seen_before = len(exits.seen)

    killed_at = time.monotonic()
    os.kill(template, signal.SIGKILL)
    got = [e for e in exits.wait(seen_before + 2) if e.round == 1]
    assert [(e.pid, e.signal, e.stopped) for e in got] == [
        (running[0], signal.SIGKILL, False), (running[1], signal.SIGKILL, False)]
    assert max(e.at for e in got) - killed_at < 1.0
    wait_until(lambda: not any(alive(p) for p in forks_warm + running), 2, "its forks died")
    assert len(exits.seen) == seen_before + 2  # the warm ones are not reported

    sup.stop()
    rebuilt = wait_until(lambda: (t := sup.warm_template()) and t.ready and t.pid != template and t,
                    20, "a new template")
    pool = wait_until(lambda: len(sup.warm_workers()) == 2 and all(
        w.ready for w in sup.warm_workers()) and sup.warm_workers(), 20, "the pool rebuilt")
    assert not {w.pid for w in pool} & set(forks_warm)
    assert sup.warm_enabled and rebuilt.pid in sup.pids()


def test_a_template_whose_preload_starts_a_thread_falls_back_to_spawning(
        supervise, tmp_path, monkeypatch, caplog):
    (tmp_path / "threadpre.py").write_text(textwrap.dedent("""
        import threading, time
        threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
        """))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    monkeypatch.setenv(worker_env.PRELOAD, "threadpre")
    caplog.set_level(logging.INFO, logger="agent.supervisor")
    sup, exits = supervise("print('ran')", nproc=2, prestart=True)
    sup.warm_up()
    wait_until(lambda: "is unsafe here" in caplog.text, 20, "the template's verdict")
    assert sup.warm_template() is None
    _two_rounds_on_spawned_warm_sets(sup, exits)
    assert caplog.text.count("is unsafe here") == 1
    assert sup.warm_enabled and sup.warm_template() is None


# torch's CUDA fork guard, as torch/csrc/cuda/Module.cpp has it, in a stand-in
# that needs no GPU: asking the driver for its devices (_cuda_getDeviceCount,
# which torch.cuda.is_available() calls unless PYTORCH_NVML_BASED_CUDA_CHECK=1)
# registers an at-fork handler that marks every later child "in bad fork",
# where torch refuses CUDA. Neither sets torch.cuda.is_initialized().
FAKE_TORCH = """
import os, sys, types
_bad_fork = [False]
_poisoned = []
def _poison_fork():
    if not _poisoned:
        _poisoned.append(True)
        os.register_at_fork(after_in_child=lambda: _bad_fork.__setitem__(0, True))
def _get_device_count():
    _poison_fork()
    return 8
C = types.SimpleNamespace(_cuda_getDeviceCount=_get_device_count,
                          _cuda_isInBadFork=lambda: _bad_fork[0])
def is_available():
    if os.getenv("PYTORCH_NVML_BASED_CUDA_CHECK") == "1":
        return True  # NVML counted the GPUs; the CUDA driver was not asked
    return C._cuda_getDeviceCount() > 0
torch = types.ModuleType("torch")
torch._C = C
torch.cuda = types.SimpleNamespace(is_available=is_available, is_initialized=lambda: False)
sys.modules["torch"] = torch
"""

# What a worker's first CUDA call finds: torch refuses CUDA in a bad fork.
CUDA_WORKER = """
    import os, sys
    torch = sys.modules.get("torch")  # the preloaded stand-in, in a warm worker
    if torch is not None and torch._C._cuda_isInBadFork():
        print("RuntimeError: Cannot re-initialize CUDA in forked subprocess")
        sys.exit(3)
    print("ran", os.getppid())
    """


@pytest.fixture
def cuda_preload(tmp_path, monkeypatch):
    """ELASTIC_PRELOAD is the torch stand-in, then ``cudapre``, a module the test writes."""
    (tmp_path / "faketorch.py").write_text(FAKE_TORCH)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    monkeypatch.setenv(worker_env.PRELOAD, "faketorch,cudapre")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    return tmp_path / "cudapre.py"


def test_a_preload_that_asks_is_available_does_not_poison_the_forks(
        supervise, cuda_preload):
    # torch.cuda.is_available() at import is common (libraries pick a device):
    # the template asks NVML, so its forks can still use CUDA.
    cuda_preload.write_text("import torch\nassert torch.cuda.is_available()\n")
    sup, exits = supervise(CUDA_WORKER, nproc=2, prestart=True)
    template, warm = _forked_pool(sup, 2)
    sup.start_round(1, round_envs(2))
    assert [w.pid for w in sup.workers()] == [w.pid for w in warm]
    got = [e for e in exits.wait(4) if e.round == 1]
    assert [e.exit_code for e in got] == [0, 0], [e.log_path for e in got]


def test_a_preload_that_uses_the_cuda_driver_makes_the_template_fall_back_to_spawning(
        supervise, cuda_preload, caplog):
    # What torch.cuda.device_count() does where NVML fails, and any CUDA call:
    # the driver was asked, every fork would fail at its first CUDA call.
    cuda_preload.write_text("import torch\nassert torch._C._cuda_getDeviceCount() == 8\n")
    caplog.set_level(logging.INFO, logger="agent.supervisor")
    sup, exits = supervise(CUDA_WORKER, nproc=2, prestart=True)
    sup.warm_up()
    wait_until(lambda: "is unsafe here" in caplog.text, 20, "the template's verdict")
    assert "used the CUDA driver" in caplog.text
    assert sup.warm_template() is None
    _two_rounds_on_spawned_warm_sets(sup, exits)


def _two_rounds_on_spawned_warm_sets(sup, exits) -> None:
    """Without a template, each of two rounds of 2 workers takes a warm set the
    agent spawned itself, and both end well."""
    for number in (1, 2):
        wait_until(lambda: len(sup.warm_workers()) == 2, 10, "a spawned warm set")
        warm = [w.pid for w in sup.warm_workers()]
        assert [parent(p) for p in warm] == [os.getpid()] * 2  # spawned by the agent
        sup.start_round(number, round_envs(2))
        assert sorted(w.pid for w in sup.workers()) == sorted(warm)
        exits.wait(2 * number)
        sup.stop()
    assert [e.exit_code for e in exits.seen] == [0] * 4
