"""Real ``torchrun --rdzv-backend etcd3`` launchers on one etcd, running a DDP job on gloo.

Nothing but the installed package makes torchrun find the backend (its
``torchrun.handlers`` entry point). Two scenarios, each ending with every
launcher exiting 0 and every rank holding the same weights (the script checks):

* a worker is killed once (SIGKILL): with ``--max-restarts 1`` both launchers restart into
  a new round, and the job finishes;
* a third launcher arrives while two train (``--nnodes 2:3``): the running
  group restarts to admit it, and the job finishes in a world of 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from elastic.keyspace import JobKeys
from elastic.rendezvous.round_record import read_round

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "integration", "scripts", "torchrun_ddp.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
JOB_S = 100.0  # a bound, not an expectation: ~15 s each on 2 idle cores


class Launcher:
    """One ``torchrun`` process; its output goes to a file read on failure."""

    def __init__(self, endpoint: str, job_id: str, nnodes: str, out_dir, name: str,
                 extra: tuple[str, ...] = (), script_args: tuple[str, ...] = ()):
        self.log_path = out_dir / f"{name}.log"
        cmd = [TORCHRUN, "--rdzv-backend", "etcd3", "--rdzv-endpoint", endpoint,
               "--rdzv-id", job_id, "--nnodes", nnodes, "--nproc-per-node", "1",
               "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
               "--rdzv-conf", "last_call_timeout=0.3,keep_alive_interval=1,"
               "keep_alive_max_attempt=2,join_timeout=60", *extra,
               SCRIPT, "--out", str(out_dir), *script_args]
        # INFO: the agent's log says where it was if the test fails.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env=env)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9

    def tail(self) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-40:])


@pytest.fixture
def launchers():
    started: list[Launcher] = []
    yield started
    for launcher in started:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
            launcher.proc.wait()


def finish(launchers: list[Launcher]) -> None:
    deadline = time.monotonic() + JOB_S
    codes = [launcher.wait(max(deadline - time.monotonic(), 1)) for launcher in launchers]
    assert codes == [0] * len(launchers), "\n\n".join(
        f"launcher {i} exited {c}:\n{launcher.tail()}"
        for i, (c, launcher) in enumerate(zip(codes, launchers)))


def records(out_dir) -> list[dict]:
    return [json.loads((out_dir / name).read_text())
            for name in sorted(os.listdir(out_dir)) if name.endswith(".json")]


def test_a_killed_worker_restarts_both_launchers_in_a_new_round(etcd_endpoint, etcd_store,
                                                                 job_id, tmp_path, launchers):
    marker = tmp_path / "killed-once"
    for name in ("a", "b"):
        launchers.append(Launcher(etcd_endpoint, job_id, "2", tmp_path, name,
                                  extra=("--max-restarts", "1"),
                                  script_args=("--crash-once", str(marker))))
    finish(launchers)
    assert marker.exists()  # rank 1 was killed, and its launcher saw it
    assert any("exitcode: -9" in (tmp_path / f"{name}.log").read_text() for name in "ab")
    done = records(tmp_path)
    assert sorted((r["rank"], r["world"]) for r in done) == [(0, 2), (1, 2)]
    assert max(r["restart"] for r in done) == 1  # the killed rank's launcher used its one restart
    keys = JobKeys(job_id)
    assert read_round(etcd_store, keys).number >= 2


def test_a_late_launcher_is_admitted_by_restarting_the_running_group(etcd_endpoint, job_id,
                                                                     tmp_path, launchers):
    args = ("--until-world", "3")
    for name in ("a", "b"):
        launchers.append(Launcher(etcd_endpoint, job_id, "2:3", tmp_path, name,
                                  script_args=args))
    deadline = time.monotonic() + JOB_S
    while not all((tmp_path / f"running-2-{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, "\n".join(x.tail() for x in launchers)
        assert all(x.proc.poll() is None for x in launchers), "\n".join(
            x.tail() for x in launchers)
        time.sleep(0.1)
    launchers.append(Launcher(etcd_endpoint, job_id, "2:3", tmp_path, "c", script_args=args))
    finish(launchers)
    done = records(tmp_path)
    assert sorted((r["rank"], r["world"], r["group_rank"]) for r in done) == [
        (0, 3, 0), (1, 3, 1), (2, 3, 2)]
    assert all(r["restart"] == 0 for r in done)  # a membership change is no failure
