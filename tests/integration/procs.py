"""Real node processes for integration tests: start, signal, and read what they report."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from elastic import worker_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The environment of an agent whose script imports torch and nothing of ours (tests/
# integration/scripts/slow_rank.py, stuck_rank.py): its warm workers and template preload
# what the script uses, not the default (torch._dynamo, DCP and our worker runtime too),
# which costs each of them twice the CPU on the suite's 2 cores.
PLAIN_TORCH_ENV = {worker_env.PRELOAD: "torch,torch.distributed"}



def end_process(proc: subprocess.Popen, grace_s: float) -> None:
    """End ``proc`` if it still runs, even when stopped (SIGSTOP): SIGCONT, then
    SIGTERM and up to ``grace_s`` to exit, then SIGKILL; reaped on return."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    if grace_s > 0:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()


class MemberProcess:
    """``python -m agent.member`` as a child process; its JSON lines are collected."""

    def __init__(self, endpoint: str, job_id: str, node_id: str, nnodes: str,
                 lease_ttl: float = 2.0, settle: float = 0.3, extra: tuple[str, ...] = ()):
        self.node_id = node_id
        cmd = [sys.executable, "-m", "agent.member", "--etcd", endpoint, "--job-id", job_id,
               "--node-id", node_id, "--nnodes", nnodes, "--lease-ttl", str(lease_ttl),
               "--settle", str(settle), *extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                self.lines.put({"event": "garbage", "line": line})

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_for(self, predicate, timeout_s: float = 15.0) -> dict:
        """The first reported line (old or new) matching ``predicate``."""
        for obj in self.seen:
            if predicate(obj):
                return obj
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{self.node_id}: nothing matched within {timeout_s} s; saw {self.seen}; "
                    f"stderr tail: {''.join(self.stderr[-15:])}")
            try:
                obj = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(obj)
            if predicate(obj):
                return obj

    def wait_round(self, members: list[str], timeout_s: float = 15.0, after: int = 0) -> dict:
        """The first round with exactly these members (in rank order) numbered above ``after``."""
        return self.wait_for(lambda o: o.get("event") == "round" and o["members"] == members
                             and o["number"] > after, timeout_s)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        end_process(self.proc, grace_s=5.0)


class AgentProcess:
    """``elasticd`` (``python -m agent.daemon``) as a child process, output collected."""

    def __init__(self, endpoint: str | None, job_id: str, node_id: str, nnodes: str,
                 script_args: list[str], *, nproc: int = 2, lease_ttl: float = 2.0,
                 hang_timeout: float = 5.0, extra: tuple[str, ...] = (),
                 script: str = "examples/ddp.py", env: dict[str, str] | None = None,
                 listen: str | None = "127.0.0.1:0"):
        """``listen`` None: no --listen (the agent binds its advertised address)."""
        self.node_id = node_id
        store = ["--etcd", endpoint] if endpoint else ["--standalone"]
        cmd = [sys.executable, "-m", "agent.daemon", *store, "--job-id", job_id,
               "--node-id", node_id, "--nnodes", nnodes, "--nproc-per-node", str(nproc),
               "--lease-ttl", str(lease_ttl), "--hang-timeout", str(hang_timeout),
               "--settle", "0.3", "--stop-grace", "2", "--advertise-addr", "127.0.0.1",
               *(["--listen", listen] if listen else []), *extra, script, *script_args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def text(self) -> str:
        return "".join(self.output)

    def wait_output(self, needle: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.text:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.node_id}: {needle!r} not seen within {timeout_s} s; "
                                     f"output tail:\n{''.join(self.output[-40:])}")
            time.sleep(0.05)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.node_id} did not exit within {timeout_s} s; output "
                                 f"tail:\n{''.join(self.output[-40:])}") from None
        self._reader.join(timeout=5)
        return code

    def stop(self) -> None:
        end_process(self.proc, grace_s=0.0)


def read_progress(path) -> list[dict]:
    """The JSON lines examples/ddp.py appends per step (missing file: none yet)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


# A job's first steps wait for its workers' `import torch`, which shares two cores with
# every other job `make test` runs at the same time (the chaos campaign's agents among them):
# a minute is within reason, so the bound is twice that.
PROGRESS_TIMEOUT_S = 120.0


def wait_progress(path, predicate, timeout_s: float = PROGRESS_TIMEOUT_S) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_progress(path)
        if predicate(records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"progress never matched within {timeout_s} s; last records: "
                                 f"{records[-5:]}")
        time.sleep(0.05)


