"""elasticctl as an operator runs it, a process against a real etcd:
``events --follow`` sees each new event once and in order, ``status --watch``
draws frames until Ctrl-C and outlives an etcd blip, and every command ends
quietly (exit 141, no traceback) when the reader of its output goes away."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from agent.ctl import EXIT_BROKEN_PIPE
from elastic.checkpoint.api import CommitEntry
from elastic.checkpoint.etcd_log import encode_latest
from elastic.clock import SYSTEM_CLOCK
from elastic.events import event_op
from elastic.keyspace import JobKeys
from tests.integration.procs import REPO
from tests.integration.tcp_proxy import TcpProxy


def _sigint_as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Ctl:
    """``python -m agent.ctl ARGS`` with its stdout read line by line on a thread."""

    def __init__(self, *args: str):
        # Ctrl-C as at a terminal: a suite started in the background (`make test &`) runs
        # with SIGINT ignored, which Python would keep, so the child gets it back.
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.ctl", *args], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=_sigint_as_at_a_terminal)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append),
                         daemon=True).start()

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)
        sink(None)

    def read(self, n: int, timeout_s: float = 8.0) -> list[str]:
        """The next ``n`` lines of stdout (without their newlines)."""
        deadline, got = time.monotonic() + timeout_s, []
        while len(got) < n:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"only {got} within {timeout_s} s; stderr: "
                                     f"{''.join(filter(None, self.stderr))}") from None
            assert line is not None, f"stdout ended after {got}; stderr: {self.stderr}"
            got.append(line.rstrip("\n"))
        return got

    def read_until(self, predicate, timeout_s: float = 8.0) -> list[str]:
        got = []
        while not got or not predicate(got[-1]):
            got += self.read(1, timeout_s)
        return got

    def stop(self, sig: int) -> tuple[int, list[str], str]:
        """Send ``sig``; the exit code, the lines left on stdout and all of stderr."""
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=30)  # generous: the full suite loads both cores
        rest = []
        while (line := self.lines.get(timeout=2)) is not None:
            rest.append(line)
        deadline = time.monotonic() + 2
        while (not self.stderr or self.stderr[-1] is not None) and time.monotonic() < deadline:
            time.sleep(0.01)
        return code, rest, "".join(filter(None, self.stderr))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def write_events(store, keys: JobKeys, messages: list[str], nodes=("a", "b")) -> None:
    for i, message in enumerate(messages):
        store.txn([], [event_op(keys, SYSTEM_CLOCK, nodes[i % len(nodes)], 1, "state", message)])


def test_events_follow_prints_history_then_each_new_event_once_in_order(
        etcd_endpoint, etcd_store, job_id):
    keys = JobKeys(job_id)
    write_events(etcd_store, keys, [f"old {i}" for i in range(3)])
    ctl = Ctl("events", "--follow", "--json", "--limit", "2", "--etcd", etcd_endpoint,
              "--job-id", job_id)
    try:
        assert [json.loads(x)["message"] for x in ctl.read(2)] == ["old 1", "old 2"]
        # Written at once: the watch may not be running yet, and must still see them.
        new = [f"new {i}" for i in range(5)]
        write_events(etcd_store, keys, new)

        got = [json.loads(x) for x in ctl.read(5)]
        assert [e["message"] for e in got] == new
        assert [e["node_id"] for e in got] == ["a", "b", "a", "b", "a"]
        time.sleep(0.5)  # room for a duplicate to show up

        code, rest, stderr = ctl.stop(signal.SIGTERM)
    finally:
        ctl.kill()
    assert (code, rest, stderr) == (0, [], "")


def test_events_follow_as_a_table_ends_quietly_on_ctrl_c(etcd_endpoint, etcd_store, job_id):
    keys = JobKeys(job_id)
    write_events(etcd_store, keys, ["before"])
    ctl = Ctl("events", "-f", "--etcd", etcd_endpoint, "--job-id", job_id)
    try:
        header, before = ctl.read(2)
        write_events(etcd_store, keys, ["after"])
        (after,) = ctl.read(1)
        code, rest, stderr = ctl.stop(signal.SIGINT)
    finally:
        ctl.kill()
    assert header.split() == ["TIME", "NODE", "ROUND", "KIND", "MESSAGE"]
    assert before.endswith("before") and after.endswith("after")
    assert (code, rest, stderr) == (0, [], "")


def frame_header(job_id: str):
    return lambda line: line.startswith("Every 0.3 s: elasticctl status of job " + job_id)


def test_status_watch_prints_frames_until_ctrl_c(etcd_endpoint, job_id):
    ctl = Ctl("status", "--watch", "--interval", "0.3", "--etcd", etcd_endpoint,
              "--job-id", job_id)
    try:
        first = ctl.read_until(frame_header(job_id))
        second = ctl.read_until(frame_header(job_id))
        code, _, stderr = ctl.stop(signal.SIGINT)
    finally:
        ctl.kill()
    assert len(first) == 1  # the first frame starts with its header, nothing before
    *body, blank, _ = second
    assert body == [f"job {job_id}: no round yet (leader: none)", "no nodes registered"]
    assert blank == ""  # one blank line between two frames
    assert (code, stderr) == (0, "")


def test_status_watch_json_is_one_object_per_line(etcd_endpoint, job_id):
    ctl = Ctl("status", "--watch", "--json", "--interval", "0.2", "--etcd", etcd_endpoint,
              "--job-id", job_id)
    try:
        frames = [json.loads(line) for line in ctl.read(2)]
        code, _, stderr = ctl.stop(signal.SIGINT)
    finally:
        ctl.kill()
    assert [f["job_id"] for f in frames] == [job_id, job_id]
    assert (code, stderr) == (0, "")


def test_status_watch_warns_through_an_etcd_blip_and_goes_on(etcd_endpoint, job_id):
    with TcpProxy.for_url(etcd_endpoint) as proxy:
        ctl = Ctl("status", "--watch", "--interval", "0.3", "--etcd", proxy.endpoint,
                  "--job-id", job_id)
        try:
            ctl.read_until(frame_header(job_id))
            proxy.cut()  # frames time out (5 s) and warn
            deadline = time.monotonic() + 9
            while not any(s and "warning" in s for s in ctl.stderr):
                assert time.monotonic() < deadline, "no warning during the blip"
                time.sleep(0.05)
            proxy.restore()
            while not ctl.lines.empty():
                ctl.lines.get()
            ctl.read_until(frame_header(job_id), timeout_s=8)
            code, _, stderr = ctl.stop(signal.SIGINT)
        finally:
            ctl.kill()
    warnings = stderr.splitlines()
    assert warnings and all(w.startswith(f"elasticctl: warning: job {job_id}: no status this "
                                         "time (") for w in warnings), stderr
    assert code == 0


def big_history(store, keys: JobKeys) -> None:
    """More than a pipe holds (64 KiB): the writer must block, then meet the closed pipe."""
    for node in ("a", "b", "c"):
        write_events(store, keys, [f"checkpoint {i} " + "x" * 900 for i in range(60)], (node,))


@pytest.mark.parametrize("command", [["events", "--limit", "1000"], ["checkpoints"],
                                     ["status", "--watch", "--interval", "0.2"]])
def test_a_reader_gone_away_ends_the_command_quietly_with_141(
        etcd_endpoint, etcd_store, job_id, command):
    keys = JobKeys(job_id)
    if command[0] == "checkpoints":
        etcd_store.put(keys.checkpoint_latest, encode_latest(CommitEntry(
            step=9, round=1, world_size=2, path="step-000000000009", time=time.time())))
        for node in ("a", "b", "c"):
            etcd_store.txn([], [event_op(keys, SYSTEM_CLOCK, node, 1, "checkpoint",
                                         f"checkpoint {i} " + "x" * 900) for i in range(60)])
    else:
        big_history(etcd_store, keys)
    proc = subprocess.Popen([sys.executable, "-m", "agent.ctl", *command, "--etcd",
                             etcd_endpoint, "--job-id", job_id], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline()  # what `head -1` reads before it exits
        proc.stdout.close()
        code = proc.wait(timeout=10)
        stderr = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert (code, stderr) == (EXIT_BROKEN_PIPE, "")
