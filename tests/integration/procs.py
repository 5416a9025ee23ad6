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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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

    def wait_round(self, members: list[str], timeout_s: float = 15.0) -> dict:
        return self.wait_for(lambda o: o.get("event") == "round" and o["members"] == members,
                             timeout_s)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
