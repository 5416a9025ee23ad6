"""The worker supervisor with real worker processes: environment, output, exits, stop, warm pool.

Worker scripts are written into tmp_path by each test. Most tests preload nothing
(or only ``json``) so they run in well under a second; only the warm-versus-cold
test pays for real ``import torch``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agent import supervisor
from agent.spawn import signal_worker
from agent.supervisor import Entrypoint, WorkerSupervisor
from elastic.clock import SystemClock
from elastic import worker_env
from elastic.worker import priority
from tests.integration.supervising import REPO, Exits, check_exits_reported, kill, round_envs
from tests.waiting import wait_until
from tests.proctable import alive, parent, state

pytestmark = pytest.mark.integration

def test_env_argv_and_output_reach_the_agent_and_the_round_log(supervise, tmp_path, capfd,
                                                                monkeypatch):
    monkeypatch.setenv("AGENT_WIDE", "inherited")
    sup, exits = supervise("""
        import os, sys
        print("RANK=%s LOCAL_RANK=%s WORLD_SIZE=%s AGENT_WIDE=%s" % (os.environ["RANK"],
              os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["AGENT_WIDE"]))
        print("argv=%s stdin=%r name=%s" % (sys.argv[1:], sys.stdin.read(), __name__))
        print("to stderr", file=sys.stderr)
        """, nproc=2, args=("--lr", "0.1"))
    sup.start_round(7, round_envs(2))
    got = exits.wait(2)
    assert [(e.round, e.rank, e.exit_code, e.signal, e.stopped) for e in got] == \
        [(7, 10, 0, None, False), (7, 11, 0, None, False)]
    out = capfd.readouterr().out
    for rank, local in ((10, 0), (11, 1)):
        assert f"[rank {rank}]: RANK={rank} LOCAL_RANK={local} WORLD_SIZE=2 " \
               f"AGENT_WIDE=inherited\n" in out
        assert f"[rank {rank}]: argv=['--lr', '0.1'] stdin='' name=__main__\n" in out
        log_text = (tmp_path / "logs" / "round-7" / f"rank-{rank}.log").read_text()
        assert f"stdout: RANK={rank} LOCAL_RANK={local}" in log_text
        assert "stderr: to stderr\n" in log_text
        assert "[rank" not in log_text
    assert [(w.local_rank, w.rank, w.alive) for w in sup.workers()] == \
        [(0, 10, False), (1, 11, False)]


def test_module_entrypoint_runs_like_python_dash_m(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trainmod.py").write_text(
        "import sys\nprint('argv0=' + sys.argv[0], 'path0=' + sys.path[0], flush=True)\n"
        "sys.exit(5)\n")
    exits = Exits()
    sup = WorkerSupervisor(job_id="job-t", node_id="node-a", nproc=1,
                           entrypoint=Entrypoint(module="trainmod"), log_dir=str(tmp_path / "l"),
                           prestart=False, on_exit=exits)
    try:
        sup.start_round(1, round_envs(1))
        assert exits.wait(1)[0].exit_code == 5
        log_text = (tmp_path / "l" / "round-1" / "rank-10.log").read_text()
        assert f"argv0={tmp_path / 'trainmod.py'} path0={tmp_path}" in log_text
    finally:
        sup.shutdown()


def test_exit_codes_and_signals_are_reported_within_half_a_second(supervise, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    sup, exits = supervise(f"""
        import os, sys, time
        mode = ["ok", "three", "raise", "hang"][int(os.environ["LOCAL_RANK"])]
        with open(os.path.join({str(marks)!r}, mode), "w") as f:
            f.write(repr(time.monotonic()))
        if mode == "three":
            sys.exit(3)
        if mode == "raise":
            raise RuntimeError("a bug in the training script")
        if mode == "hang":
            time.sleep(1000)
        """, nproc=4)
    sup.start_round(1, round_envs(4))
    wait_until(lambda: (marks / "hang").exists(), 10, "the hanging rank started")
    hang_pid = sup.workers()[3].pid
    killed_at = kill(hang_pid)
    check_exits_reported(exits.wait(4), marks, ["ok", "three", "raise"], hang_pid, killed_at)
    log_text = (tmp_path / "logs" / "round-1" / "rank-12.log").read_text()
    assert "stderr: RuntimeError: a bug in the training script" in log_text
    assert "bootstrap" not in log_text  # the traceback is the script's, as under plain python


class _ShiftedClock(SystemClock):
    """The system's clocks, a day ahead: shows whose clock a timestamp came from."""

    def monotonic(self) -> float:
        return super().monotonic() + 86400.0


def test_exit_times_come_from_the_injected_clock(supervise):
    sup, exits = supervise("import sys; sys.exit(4)", clock=_ShiftedClock())
    before = time.monotonic()
    sup.start_round(1, round_envs(1))
    got = exits.wait(1)[0]
    assert got.exit_code == 4
    assert before + 86400.0 <= got.at <= time.monotonic() + 86400.0


def test_stop_kills_term_ignoring_and_sigstopped_workers_and_their_children(supervise,
                                                                           tmp_path):
    sup, exits = supervise(f"""
        import os, signal, subprocess, time
        local = os.environ["LOCAL_RANK"]
        if local == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # A child in the worker's process group that ignores SIGTERM as well.
        child = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 1000"])
        with open(os.path.join({str(tmp_path)!r}, "child-" + local), "w") as f:
            f.write(str(child.pid))
        while True:
            time.sleep(0.05)
        """, nproc=2, stop_grace_s=0.5)
    sup.start_round(3, round_envs(2))
    children = [int(wait_until(lambda i=i: (tmp_path / f"child-{i}").exists() and
                          (tmp_path / f"child-{i}").read_text(), 10, f"child of rank {i}"))
                for i in range(2)]
    pids = [w.pid for w in sup.workers()]
    os.kill(pids[1], signal.SIGSTOP)
    wait_until(lambda: state(pids[1]) == "T", 5, "worker 1 stopped")
    started = time.monotonic()
    got = sup.stop()
    took = time.monotonic() - started
    assert 0.4 < took < 0.5 + 3.0, took  # waited out the grace, then no longer than needed
    assert [(e.local_rank, e.signal, e.stopped) for e in got] == [
        (0, signal.SIGKILL, True), (1, signal.SIGTERM, True)]
    assert not [p for p in pids + children if alive(p)]
    assert sorted(e.local_rank for e in exits.wait(2)) == [0, 1]  # delivered before stop returned
    assert all(e.stopped for e in exits.seen)
    assert sup.stop() == []  # idempotent


def test_a_warm_restart_starts_the_script_faster_than_a_cold_one(supervise, tmp_path):
    script = f"""
        import torch  # the cost a warm worker has already paid
        import os, time
        with open(os.path.join({str(tmp_path)!r}, "mark-" + os.environ["ROUND"]), "w") as f:
            f.write(repr(time.monotonic()))
        """

    def time_to_script(sup, exits, number: int) -> float:
        t0 = time.monotonic()
        sup.start_round(number, round_envs(1, ROUND=str(number)))
        mark = tmp_path / f"mark-{number}"
        wait_until(lambda: mark.exists() and mark.read_text(), 30, f"round {number} ran")
        exits.wait(number if sup.prestart else 1, timeout_s=30)
        sup.stop()
        return float(mark.read_text()) - t0

    cold_sup, cold_exits = supervise(script, prestart=False)
    cold = time_to_script(cold_sup, cold_exits, 1)
    cold_sup.shutdown()

    warm_sup, warm_exits = supervise(script, prestart=True)
    warm_sup.warm_up()
    time_to_script(warm_sup, warm_exits, 1)  # the first round takes the first warm set
    wait_until(lambda: [w for w in warm_sup.warm_workers() if w.ready], 30, "next set warm")
    warm_pid = warm_sup.warm_workers()[0].pid
    warm = time_to_script(warm_sup, warm_exits, 2)
    assert warm_sup.workers()[0].pid == warm_pid
    print(f"\nstart_round -> first line of the script: cold {cold:.3f} s, warm {warm:.3f} s")
    assert warm < 0.6 * cold, (warm, cold)


def test_warm_worker_deaths_are_not_failures_and_a_broken_pool_goes_cold(supervise, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv(worker_env.PRELOAD, "json")  # warm in milliseconds
    sup, exits = supervise("import os; print('ran', os.environ['RANK'])", nproc=2,
                           prestart=True)
    assert not sup.ready_for_a_round()  # a round now would start its workers cold
    sup.warm_up()
    first = wait_until(lambda: len(sup.warm_workers()) == 2 and all(
        w.ready for w in sup.warm_workers()) and sup.warm_workers(), 10, "pool warm")
    assert sup.ready_for_a_round()
    # A template becoming ready resets the count of failures in a row: let it first.
    wait_until(lambda: (t := sup.warm_template()) and t.ready, 10, "template ready")
    os.kill(first[0].pid, signal.SIGKILL)
    wait_until(lambda: first[0].pid not in [w.pid for w in sup.warm_workers()] and
          len(sup.warm_workers()) == 2, 10, "the dead warm worker replaced")
    assert sup.warm_enabled
    assert exits.seen == []

    # Preloading fails from now on: three deaths in a row, then rounds start cold.
    monkeypatch.setenv(worker_env.PRELOAD, "no_such_module_for_elastic_tests")
    for w in sup.warm_workers():
        os.kill(w.pid, signal.SIGKILL)
    wait_until(lambda: not sup.warm_enabled, 15, "warm workers given up")
    assert sup.ready_for_a_round()  # nothing left to wait for
    assert exits.seen == []
    sup.start_round(1, round_envs(2))
    assert [e.exit_code for e in exits.wait(2)] == [0, 0]
    assert sup.warm_workers() == []


def test_giving_up_the_warm_pool_ends_the_warm_workers_still_importing(supervise, tmp_path,
                                                                      monkeypatch):
    # `badpre` starts a thread, so the template finds forking unsafe and warm workers
    # are spawned, each importing on its own. Once the marker exists, the first import
    # fails and every later one hangs: the verdict "go cold" comes while a replacement
    # is still importing.
    marker, claimed = tmp_path / "broken", tmp_path / "claimed"
    (tmp_path / "badpre.py").write_text(textwrap.dedent(f"""
        import os, threading, time
        threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
        if os.path.exists({str(marker)!r}):
            try:
                os.close(os.open({str(claimed)!r}, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                time.sleep(60)
            else:
                raise SystemExit("broken preload")
        """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(worker_env.PRELOAD, "badpre")
    sup, exits = supervise("print('ran')", nproc=2, prestart=True)
    sup.warm_up()
    warm = wait_until(lambda: len(sup.warm_workers()) == 2 and all(
        w.ready for w in sup.warm_workers()) and sup.warm_template() is None
        and sup.warm_workers(), 20, "two spawned warm workers ready")
    marker.touch()

    # Three deaths in a row: the two warm workers, then the replacement that claims
    # the marker; the other replacement hangs in `badpre` when the verdict comes.
    first = set(sup.pids())
    for w in warm:
        os.kill(w.pid, signal.SIGKILL)
    wait_until(lambda: not sup.warm_enabled, 15, "warm workers given up")

    assert sup.warm_workers() == []
    assert sup.warm_template() is None
    hanging = [pid for pid in sup.pids() if pid not in first]
    assert len(hanging) == 2, "the replacements were not started"
    wait_until(lambda: not any(alive(pid) for pid in hanging), 5, "the hanging replacement ended")
    assert exits.seen == []


def _slow_preload(tmp_path, monkeypatch, release) -> None:
    """ELASTIC_PRELOAD is `slowpre`, which waits for ``release`` to exist."""
    (tmp_path / "slowpre.py").write_text(
        f"import os, time\n"
        f"while not os.path.exists({str(release)!r}):\n"
        f"    time.sleep(0.05)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    monkeypatch.setenv(worker_env.PRELOAD, "slowpre")


def test_a_round_short_of_warm_workers_waits_for_the_importing_template_and_takes_its_forks(
        supervise, tmp_path, monkeypatch, caplog):
    release = tmp_path / "release"
    _slow_preload(tmp_path, monkeypatch, release)
    caplog.set_level(logging.INFO, logger="agent.supervisor")
    sup, exits = supervise("import time\nwhile True: time.sleep(0.05)", nproc=2, prestart=True)
    sup.warm_up()
    template = wait_until(lambda: sup.warm_template(), 10, "the template started")

    starting = threading.Thread(target=sup.start_round, args=(1, round_envs(2)))
    starting.start()
    time.sleep(1.0)
    # Nothing imports beside the template, and the round waits for it.
    assert starting.is_alive() and sup.workers() == []
    assert sup.pids() == [template.pid]
    release.touch()
    starting.join(10)
    assert not starting.is_alive()
    assert [parent(w.pid) for w in sup.workers()] == [template.pid] * 2
    assert "the round waited" in caplog.text
    refilled = wait_until(lambda: len(sup.warm_workers()) == 2 and sup.warm_workers(), 10,
                          "the next set forked")
    assert [parent(w.pid) for w in refilled] == [template.pid] * 2


def test_a_template_that_is_not_ready_in_time_leaves_the_round_to_start_cold(
        supervise, tmp_path, monkeypatch, caplog):
    _slow_preload(tmp_path, monkeypatch, tmp_path / "never")
    monkeypatch.setattr(supervisor, "TEMPLATE_WAIT_S", 1.0)
    sup, exits = supervise("print('ran')", prestart=True)
    sup.warm_up()
    template = wait_until(lambda: sup.warm_template(), 10, "the template started")
    t0 = time.monotonic()
    sup.start_round(1, round_envs(1))
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert parent(sup.workers()[0].pid) != template.pid
    assert exits.wait(1)[0].exit_code == 0  # a cold worker: it never imported `slowpre`
    assert "which is not ready to fork; its workers start cold" in caplog.text


def test_the_template_imports_at_idle_priority_until_a_round_waits_for_it(
        supervise, tmp_path, monkeypatch):
    # The preload records the priority of the thread importing it, then waits for the
    # marker: the round that waits for the template raises that thread (as root).
    marker = tmp_path / "go"
    (tmp_path / "idlepre.py").write_text(textwrap.dedent(f"""
        import json, os, threading, time
        from elastic.worker import priority
        tid = threading.get_native_id()
        with open(os.path.join({str(tmp_path)!r}, "preload-%d.json" % os.getpid()), "w") as f:
            json.dump({{"tid": tid, "idle": priority.is_idle(tid),
                        "io_class": priority.io_class(tid),
                        "main_idle": priority.is_idle(os.getpid())}}, f)
        while not os.path.exists({str(marker)!r}):
            time.sleep(0.01)
    """))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    monkeypatch.setenv(worker_env.PRELOAD, "idlepre")
    sup, exits = supervise("""
        import json, os
        from elastic.worker import priority
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        print("RUN " + json.dumps({"main_idle": priority.is_idle(os.getpid()),
                                   "idle_threads": [t for t in tids if priority.is_idle(t)]}))
    """, prestart=True)
    sup.warm_up()
    seen = wait_until(lambda: list(tmp_path.glob("preload-*.json")), 20,
                      "the template to start importing")
    at_import = json.loads(seen[0].read_text())
    assert at_import["idle"] and not at_import["main_idle"]
    assert at_import["io_class"] in (3, None)  # idle I/O, where this machine has the syscall

    starting = threading.Thread(target=sup.start_round, args=(1, round_envs(1)))
    starting.start()
    if os.geteuid() == 0:  # unprivileged, a lowered thread cannot be raised
        wait_until(lambda: not priority.is_idle(at_import["tid"]), 5,
                   "the waiting round to raise the template's import")
    marker.touch()
    starting.join(10)
    assert exits.wait(1)[0].exit_code == 0
    log = (tmp_path / "logs" / "round-1" / "rank-10.log").read_text()
    ran = json.loads(log.split("RUN ", 1)[1].splitlines()[0])
    assert not ran["main_idle"] and ran["idle_threads"] == []


def test_a_round_sets_startup_variables_so_it_starts_cold_and_the_next_set_learns_them(
        supervise, tmp_path, monkeypatch):
    monkeypatch.setenv(worker_env.PRELOAD, "json")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    sup, exits = supervise("import os; print('omp', os.environ['OMP_NUM_THREADS'])",
                           prestart=True)
    sup.warm_up()
    before = wait_until(lambda: sup.warm_workers(), 10, "a warm worker")[0].pid
    sup.start_round(1, round_envs(1, OMP_NUM_THREADS="1"))
    assert sup.workers()[0].pid != before  # its interpreter started without OMP_NUM_THREADS
    exits.wait(1)
    sup.stop()
    again = wait_until(lambda: sup.warm_workers(), 10, "the next warm worker")[0].pid
    sup.start_round(2, round_envs(1, OMP_NUM_THREADS="1"))
    assert sup.workers()[0].pid == again
    exits.wait(2)
    assert "stdout: omp 1" in (tmp_path / "logs" / "round-2" / "rank-10.log").read_text()


def test_shutdown_leaves_no_process_and_is_idempotent(supervise, tmp_path, monkeypatch):
    monkeypatch.setenv(worker_env.PRELOAD, "json")
    sup, exits = supervise("import time\nwhile True: time.sleep(0.05)", nproc=2, prestart=True)
    sup.warm_up()
    sup.start_round(1, round_envs(2))
    wait_until(lambda: len(sup.warm_workers()) == 2, 10, "the next warm set")
    sup.shutdown()
    sup.shutdown()
    assert len(sup.pids()) >= 4
    for pid in sup.pids():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert all(e.stopped for e in exits.wait(2))
    with pytest.raises(RuntimeError):
        sup.start_round(2, round_envs(2))


def test_a_worker_forked_a_moment_ago_is_signalled_before_it_has_a_group_of_its_own():
    # A template answers a fork before the child's setsid(): until then the
    # worker's pid names no process group, so the pid itself is signalled too;
    # signalling only the group would leave a worker forked just before a
    # shutdown alive until its template dies (a zombie where PID 1 does not reap).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # our group
    try:
        signal_worker(proc.pid, signal.SIGKILL)
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_workers_started_from_a_short_lived_thread_outlive_it(supervise):
    # PDEATHSIG follows the spawning *thread*; the supervisor spawns from its own.
    sup, _ = supervise("import time\nwhile True: time.sleep(0.05)")
    t = threading.Thread(target=sup.start_round, args=(1, round_envs(1)))
    t.start()
    t.join()
    time.sleep(0.3)
    assert alive(sup.workers()[0].pid)


def test_round_misuse_is_refused(supervise):
    sup, _ = supervise("import time\nwhile True: time.sleep(0.05)", nproc=2)
    with pytest.raises(ValueError):
        sup.start_round(1, round_envs(1))
    sup.start_round(1, round_envs(2))
    with pytest.raises(RuntimeError):
        sup.start_round(2, round_envs(2))
    with pytest.raises(ValueError):
        Entrypoint(script="a.py", module="a")


DRIVER = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from agent.supervisor import Entrypoint, WorkerSupervisor
sup = WorkerSupervisor(job_id="job-t", node_id="node-a", nproc=2,
                       entrypoint=Entrypoint(script={script!r}), log_dir={logs!r}, prestart=True)
sup.warm_up()
while not (sup.warm_template() and sup.warm_template().ready):
    time.sleep(0.01)
sup.start_round(1, [{{"RANK": "0"}}, {{"RANK": "1"}}])  # takes the spawned set; forks the next
while len(sup.warm_workers()) < 2:
    time.sleep(0.01)
print(json.dumps({{"pids": sup.pids(), "template": sup.warm_template().pid,
                  "warm": [w.pid for w in sup.warm_workers()]}}), flush=True)
time.sleep(1000)
"""


def test_a_killed_agent_takes_its_workers_along(tmp_path):
    # The chain: agent (its spawner thread) -> template and spawned workers -> forked workers.
    script = tmp_path / "forever.py"
    script.write_text("import time\nwhile True: time.sleep(0.05)\n")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=REPO, script=str(script), logs=str(tmp_path / "logs")))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE,
                            env={**os.environ, worker_env.PRELOAD: "json"}, text=True)
    try:
        seen = json.loads(proc.stdout.readline())
        pids = seen["pids"]
        # Two spawned warm workers (round 1's), the template, two forks of it.
        assert len(pids) == 5 and all(alive(p) for p in pids)
        assert seen["template"] in pids
        assert [parent(p) for p in seen["warm"]] == [seen["template"]] * 2
        proc.kill()
        proc.wait()
        wait_until(lambda: not [p for p in pids if alive(p)], 2.0, f"workers {pids} died")
    finally:
        proc.kill()
        proc.wait()
