"""The agent's end of the template protocol, against a test playing the template
over a real socketpair (the real template is in tests/integration/test_warm_template.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading

import pytest

from agent.template_link import (MalformedMessage, RetiredAndIdle, TemplateLink, TemplateReady,
                                 TemplateUnsafe)
from elastic.errors import WorkerSpawnError
from elastic.worker.template import MAX_MESSAGE_BYTES


class PlayedTemplate:
    """The template's end: reads fork requests, sends what the test says."""

    def __init__(self):
        ours, self.sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.link = TemplateLink(ours)
        self.events: list = []
        self.orphans: list = []
        self._serving = threading.Thread(target=self._serve, daemon=True)
        self._serving.start()

    def _serve(self):
        self.orphans = self.link.serve(self.events.append)

    def request(self) -> tuple[int, list[int]]:
        """The next fork request: (its id, the fds passed with it)."""
        data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 3)
        return json.loads(data)["fork"], fds

    def forked(self, pid: int):
        """A fork the link asks for and this template grants as ``pid``."""
        thread, result = fork_in_background(self.link)
        request, _ = self.request()
        self.send({"forked": request, "pid": pid})
        thread.join(5)
        return result["proc"]

    def send(self, message) -> None:
        self.sock.send(message if isinstance(message, bytes) else json.dumps(message).encode())

    def die(self) -> None:
        self.sock.close()
        self._serving.join(5)
        assert not self._serving.is_alive()


def fork_in_background(link: TemplateLink, timeout_s: float = 5.0):
    result: dict = {}

    def run():
        try:
            result["proc"] = link.fork(timeout_s)
        except WorkerSpawnError as exc:
            result["error"] = exc
    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_a_fork_gets_its_pid_and_streams_and_its_exit_status_from_the_template():
    t = PlayedTemplate()
    thread, result = fork_in_background(t.link)
    request, (stdin, stdout, stderr) = t.request()
    t.send({"forked": request, "pid": 4242})
    thread.join(5)
    proc = result["proc"]
    assert proc.pid == 4242 and proc.poll() is None

    proc.stdin.write(b"assignment\n")
    proc.stdin.flush()
    assert os.read(stdin, 100) == b"assignment\n"
    os.write(stdout, b"out\n")
    os.write(stderr, b"err\n")
    assert proc.stdout.readline() == b"out\n" and proc.stderr.readline() == b"err\n"

    t.send({"exit": 4242, "status": 3 << 8})  # a raw waitpid status: exit code 3
    assert proc.wait(5) == 3
    t.die()
    assert t.orphans == []  # it had ended before the template


def test_a_child_killed_by_a_signal_reads_as_popen_does():
    t = PlayedTemplate()
    proc = t.forked(77)
    t.send({"exit": 77, "status": signal.SIGKILL})
    assert proc.wait(5) == -signal.SIGKILL
    t.die()


def test_a_refusal_fails_the_fork_and_says_forking_is_unsafe():
    t = PlayedTemplate()
    thread, result = fork_in_background(t.link)
    request, _ = t.request()
    t.send({"refused": request, "reason": "thread 'pool' is running"})
    thread.join(5)
    assert "refused to fork: thread 'pool' is running" in str(result["error"])
    t.die()
    assert t.events == [TemplateUnsafe("thread 'pool' is running")]


def test_a_template_that_does_not_answer_fails_the_fork_in_time():
    t = PlayedTemplate()
    with pytest.raises(WorkerSpawnError, match="did not fork within 0.2 s"):
        t.link.fork(0.2)
    t.die()


def test_a_template_that_dies_fails_the_fork_asked_for_and_leaves_its_children_as_orphans():
    t = PlayedTemplate()
    first = t.forked(501)
    thread, second = fork_in_background(t.link)
    t.request()
    t.die()  # before it answered the second request
    thread.join(5)
    assert "died before it forked" in str(second["error"])
    assert t.orphans == [first] and first.poll() is None
    assert t.link.dead
    with pytest.raises(WorkerSpawnError, match="is gone"):
        t.link.fork(1.0)


def test_a_retired_template_is_idle_once_its_last_child_ended():
    t = PlayedTemplate()
    assert t.link.retire() is True  # no child: may be killed at once
    t.die()

    t = PlayedTemplate()
    proc = t.forked(900)
    assert t.link.retire() is False
    t.send({"exit": 900, "status": 0})
    proc.wait(5)
    t.die()
    assert t.events == [RetiredAndIdle()]


def test_readiness_and_nonsense_reach_the_handler_and_serving_goes_on():
    t = PlayedTemplate()
    t.send(b"not json")
    t.send({"what": 1})
    t.send({"ready": True, "pid": 1})
    assert t.forked(12).pid == 12
    t.die()
    assert t.events == [MalformedMessage(b"not json"), MalformedMessage(b'{"what": 1}'),
                        TemplateReady()]
