"""torchrun's documented command lines, run by elasticd unchanged but for the program's name.

The lines are those of PyTorch's torchrun documentation (``torch/distributed/
run.py``): single node, several nodes meeting at an etcd, and the underscore
spellings older scripts use. The script is a plain torchrun script
(``scripts/torchrun_env.py``): it checks the worker environment, forms a gloo
group and exits 0; every agent must exit 0.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import urllib.parse

import pytest

from tests.integration.procs import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = os.path.join(REPO, "tests", "integration", "scripts", "torchrun_env.py")
# Not on the command line, which stays as documented: without warm workers each agent imports
# torch once per worker instead of twice (the round's workers, then the next warm set), which
# on the suite's 2 cores halves these tests' time. Warm workers are tested elsewhere.
NO_WARM_WORKERS = {"ELASTIC_PRESTART": "false"}
# The console script pip installs beside the interpreter; `python -m agent.daemon` without it.
_INSTALLED = os.path.join(os.path.dirname(sys.executable), "elasticd")
ELASTICD = [_INSTALLED] if os.access(_INSTALLED, os.X_OK) else [sys.executable, "-m",
                                                                "agent.daemon"]


class Agent:
    """One ``elasticd`` started from a torchrun command line; output collected."""

    def __init__(self, torchrun_line: str, **replace: str):
        """``replace``: the line's placeholders and the shell text that fills them in."""
        for placeholder, text in replace.items():
            torchrun_line = torchrun_line.replace(placeholder, text)
        argv = shlex.split(torchrun_line)
        assert argv[0] == "torchrun"
        self.argv = ELASTICD + argv[1:]
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **NO_WARM_WORKERS})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.argv} still ran after {timeout_s} s:\n{self.text}")
        self._reader.join(5)
        return code

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def reports(self) -> list[dict]:
        """The environments the workers reported to the console."""
        return [json.loads(line.split("torchrun_env ok ", 1)[1]) for line in self.lines
                if "torchrun_env ok " in line]


def script_args(nproc: int, max_restarts: int, **more: str) -> str:
    """The script and its arguments, as shell text."""
    extra = "".join(f" --{k.replace('_', '-')} {shlex.quote(v)}" for k, v in more.items())
    return f"{shlex.quote(SCRIPT)} --nproc {nproc} --max-restarts {max_restarts}{extra}"


def test_the_single_node_line_runs_standalone_and_gives_torchrun_s_environment():
    # torch/distributed/run.py, "Single-node multi-worker".
    agent = Agent("torchrun --standalone --nnodes=1 --nproc-per-node=2 YOUR_TRAINING_SCRIPT.py",
                  **{"YOUR_TRAINING_SCRIPT.py": script_args(2, max_restarts=3)})

    assert agent.wait() == 0, agent.text
    reports = agent.reports()
    assert sorted(int(r["RANK"]) for r in reports) == [0, 1]
    assert {r["WORLD_SIZE"] for r in reports} == {"2"}
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in reports} == {"0"}
    assert len({r["TORCHELASTIC_RUN_ID"] for r in reports}) == 1  # a random id, the same for all


def test_the_multi_node_line_meets_at_etcd_and_the_job_ends_with_both_agents(etcd_endpoint,
                                                                           job_id):
    # torch/distributed/run.py, "Elastic (min=1, max=4, tolerates up to 3 membership changes
    # or failures)", with the etcd3 backend. A node that closes a round alone is restarted
    # into the round of both (--min-world 4).
    line = ("torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=3 --rdzv-id=JOB_ID "
            "--rdzv-backend=etcd3 --rdzv-endpoint=HOST_NODE_ADDR YOUR_TRAINING_SCRIPT.py")
    endpoint = urllib.parse.urlsplit(etcd_endpoint).netloc
    training = script_args(2, max_restarts=3, run_id=job_id, min_world="4")
    a, b = (Agent(line, JOB_ID=job_id, HOST_NODE_ADDR=endpoint,
                  **{"YOUR_TRAINING_SCRIPT.py": training}) for _ in range(2))

    assert a.wait() == 0, a.text
    assert b.wait() == 0, b.text
    last = {int(r["RANK"]): r for r in a.reports() + b.reports() if r["WORLD_SIZE"] == "4"}
    assert sorted(last) == [0, 1, 2, 3]
    assert {r["GROUP_WORLD_SIZE"] for r in last.values()} == {"2"}
    assert {r["TORCHELASTIC_RUN_ID"] for r in last.values()} == {job_id}


def test_underscore_spellings_and_console_and_role_flags(tmp_path):
    # The spellings of older torchrun and torch.distributed.launch lines; no rendezvous
    # flag at all is torchrun's one-node static rendezvous.
    line = ("torchrun --nnodes=1 --nproc_per_node=2 --max_restarts=0 --local_ranks_filter=0 "
            "--role=trainer --log_dir=LOGS YOUR_TRAINING_SCRIPT.py")
    agent = Agent(line, LOGS=shlex.quote(str(tmp_path / "logs")),
                  **{"YOUR_TRAINING_SCRIPT.py": script_args(2, max_restarts=0, role="trainer")})

    assert agent.wait() == 0, agent.text
    assert [int(r["RANK"]) for r in agent.reports()] == [0]  # rank 1 is off the console
    rank1_log = (tmp_path / "logs" / "round-1" / "rank-1.log").read_text()
    assert "torchrun_env ok " in rank1_log and '"ROLE_NAME": "trainer"' in rank1_log


def test_no_python_executes_the_program_with_the_worker_environment():
    check = ('test "$WORLD_SIZE" = 2 && test -n "$TORCHELASTIC_RUN_ID" && '
             'echo "no-python rank $RANK of $WORLD_SIZE"')
    agent = Agent("torchrun --standalone --nproc-per-node=2 --no-python sh -c CHECK",
                  CHECK=shlex.quote(check))

    assert agent.wait() == 0, agent.text
    assert "no-python rank 0 of 2" in agent.text and "no-python rank 1 of 2" in agent.text


def test_a_flag_elasticd_cannot_honour_is_one_line_with_what_to_use():
    agent = Agent("torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "
                  "--rdzv-endpoint=localhost:29400 --rdzv-id=J YOUR_TRAINING_SCRIPT.py",
                  **{"YOUR_TRAINING_SCRIPT.py": shlex.quote(SCRIPT)})

    assert agent.wait() == 2
    errors = [line for line in agent.lines if "error" in line.lower()]
    assert len(errors) == 1, agent.text
    assert "--rdzv-backend etcd --rdzv-endpoint ETCD_HOST:2379" in errors[0]
