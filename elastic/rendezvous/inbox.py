"""What wakes a rendezvous node's loop: typed messages, taken in arrival order.

Watch callbacks and the session's loss run on other threads; they only post
here. The loop thread blocks in :meth:`Inbox.wait` and then applies
everything with :meth:`Inbox.take` (a simulator calls ``take`` alone).
"""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass
from typing import Iterator, Union

from elastic.rendezvous.api import FrozenReport
from elastic.store.api import WatchEvent


class PartName(str, enum.Enum):
    """A part of the job's state a node reads and then watches (see
    :mod:`elastic.rendezvous.follower`). Ordered by name: parts pending
    together are read in that order."""

    CHECKPOINT = "checkpoint"
    LEADER = "leader"
    NODES = "nodes"
    REQUESTS = "requests"
    ROUND = "round"
    STANDBYS = "standbys"


@dataclass(frozen=True)
class Changed:
    """Watch events on ``part``, as one batch."""

    part: PartName
    events: tuple[WatchEvent, ...]


@dataclass(frozen=True)
class WatchEnded:
    """The watch on ``part`` ended with ``error``: the part must be read again."""

    part: PartName
    error: Exception


@dataclass(frozen=True)
class SessionLost:
    """The node's session was lost: the next pass renews it."""


@dataclass(frozen=True)
class LeaderFrozen:
    """This node reported the leader ``node_id`` frozen (``report``): the
    next pass applies the freeze rule to it, as the leader would to a member."""

    node_id: str
    report: FrozenReport


@dataclass(frozen=True)
class Stop:
    """The node is stopping: the loop thread returns."""


Message = Union[Changed, WatchEnded, SessionLost, LeaderFrozen, Stop]


class Inbox:
    """Messages for one node's loop. Thread-safe to post; one thread takes."""

    def __init__(self, messages: "queue.Queue[Message] | None" = None):
        self._queue: queue.Queue = messages if messages is not None else queue.Queue()
        self._first: Message | None = None  # taken from the queue by wait(): it came first

    def post(self, message: Message) -> None:
        self._queue.put(message)

    def has_news(self) -> bool:
        """Whether a message waits to be taken."""
        return self._first is not None or not self._queue.empty()

    def wait(self, timeout_s: float) -> Message | None:
        """Block until a message arrives or ``timeout_s`` passes; return it
        (None on timeout). It stays first for :meth:`take`: a message put back
        in the queue would go behind those that arrived meanwhile, and a key
        written twice in quick succession would be applied out of order."""
        try:
            message = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        self._first = message
        return message

    def take(self) -> Iterator[Message]:
        """Yield every message that arrived, in the order they arrived."""
        while True:
            if self._first is not None:
                message, self._first = self._first, None
            else:
                try:
                    message = self._queue.get_nowait()
                except queue.Empty:
                    return
            yield message
