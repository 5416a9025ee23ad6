"""The security suite: attacks of issue 24 replayed against real processes.

Each test plays what an attacker did (another local user, simulated with
``setpriv`` as uid/gid 65534; a client of an open etcd) against a real
``elasticd`` and a real etcd, and checks that it now fails with a clear
message. They run as root (the CI and the dev machines do): giving a file to
another user, and becoming one, needs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from tests.integration.procs import REPO, AgentProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="becoming another user needs root and setpriv")]

OTHER = 65534  # nobody
SCRIPT = os.path.join(REPO, "tests", "integration", "scripts", "progress_worker.py")


def as_other_user(*cmd: str, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` as uid/gid 65534 with no supplementary groups."""
    return subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}",
                           "--clear-groups", *cmd], capture_output=True, text=True,
                          timeout=60, **kw)


@pytest.fixture
def shared_dir():
    """A directory every user may write in, as /tmp (pytest's tmp_path is root's, 0700)."""
    path = tempfile.mkdtemp(prefix="elastic-attack-")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _agent(etcd_endpoint, tmp_path, job: str, *extra: str) -> AgentProcess:
    (tmp_path / "progress").mkdir(exist_ok=True)
    return AgentProcess(etcd_endpoint, job, "n1", "1", [
        "--progress-dir", str(tmp_path / "progress"), "--work-s", "30"],
        nproc=1, script=SCRIPT, extra=("--no-prestart", *extra))


def test_a_log_dir_made_in_advance_by_another_user_is_refused(etcd_endpoint, tmp_path,
                                                               shared_dir):
    # The attack: that user plants round-N there and the agent fails at each start.
    logs = os.path.join(shared_dir, "logs")
    made = as_other_user("mkdir", "-m", "0755", logs)
    assert made.returncode == 0, made.stderr
    agent = _agent(etcd_endpoint, tmp_path, "attack-logdir", "--log-dir", logs)
    assert agent.wait_exit(30) == 2, agent.text  # a configuration error
    assert f"belongs to uid {OTHER}" in agent.text and "another --log-dir" in agent.text


def test_a_state_dir_others_may_write_in_is_refused(etcd_endpoint, tmp_path, shared_dir):
    state = os.path.join(shared_dir, "state")
    os.mkdir(state)
    os.chmod(state, 0o1777)  # as /tmp: sticky does not stop a planted <job>
    agent = _agent(etcd_endpoint, tmp_path, "attack-statedir", "--state-dir", state)
    assert agent.wait_exit(30) == 2, agent.text
    assert "(--state-dir) is writable by its group and others" in agent.text
    assert "choose another --state-dir" in agent.text
