"""The store interface: the small slice of etcd v3 the rest of the project uses.

Nothing outside ``elastic/store`` talks to an etcd client library. Every call
has a deadline; errors are the :mod:`elastic.errors` store errors, with the
client library's error chained as the cause.

Semantics follow etcd v3 exactly, so the in-memory fake used by unit tests and
the etcd backend pass one contract suite (``tests/contract``):

* Every successful write advances one global revision; a transaction is one
  revision however many keys it touches.
* A key's ``create_revision`` is the revision that created it, ``mod_revision``
  the revision of its last write, ``version`` the number of writes since it was
  created (0 means absent).
* A lease removes every key attached to it when it expires or is revoked.
* A watch started at revision R delivers every change with revision >= R, in
  order, once, even across reconnects; if R has been compacted away the watch
  ends with :class:`~elastic.errors.WatchCompactedError`.
"""

from __future__ import annotations

import abc
import collections
import enum
import operator
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "Compare",
    "CompareTarget",
    "Delete",
    "ErrorCallback",
    "EventsCallback",
    "EventType",
    "Get",
    "KeyValue",
    "Op",
    "OpCounter",
    "Put",
    "Session",
    "Store",
    "TxnResult",
    "Watch",
    "WatchEvent",
]

DEFAULT_REQUEST_TIMEOUT_S = 5.0
# How long reaching etcd may take before a client gives up (elasticd's --connect-timeout).
DEFAULT_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class KeyValue:
    """One key as stored, with its revisions. ``lease`` is 0 when none is attached."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


class EventType(enum.Enum):
    """What a watch event did to its key."""

    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch. For DELETE, ``kv.value`` is empty and
    ``kv.mod_revision`` is the revision of the delete."""

    type: EventType
    kv: KeyValue

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


class CompareTarget(enum.Enum):
    VERSION = "version"
    CREATE_REVISION = "create_revision"
    MOD_REVISION = "mod_revision"
    VALUE = "value"


_COMPARE_OPS: dict[str, Callable[[object, object], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
}


@dataclass(frozen=True)
class Compare:
    """A condition of a transaction: ``<target of key> <op> <operand>``.

    Use the constructors below rather than building one by hand. An absent key
    has version, create_revision and mod_revision 0 and never equals a value.
    """

    key: str
    target: CompareTarget
    op: str  # one of "==", "!=", "<", ">"
    operand: Union[int, bytes]

    def __post_init__(self) -> None:
        if self.op not in _COMPARE_OPS:
            raise ValueError(f"unknown compare operator {self.op!r}")

    def check_operand(self) -> None:
        """Raises TypeError: the operand's type does not fit the target
        (bytes for VALUE, an int otherwise)."""
        if self.target is CompareTarget.VALUE:
            if not isinstance(self.operand, (bytes, bytearray)):
                raise TypeError(f"a value compare needs bytes, got {type(self.operand).__name__}")
        elif isinstance(self.operand, bool) or not isinstance(self.operand, int):
            raise TypeError(f"a {self.target.value} compare needs an int, got {self.operand!r}")

    def holds(self, kv: KeyValue | None) -> bool:
        """Whether the compare holds for ``kv`` (None: the key is absent), as
        etcd decides it. Raises TypeError as :meth:`check_operand`."""
        self.check_operand()
        if self.target is CompareTarget.VALUE:
            if kv is None:
                return False  # etcd: a value compare on an absent key fails whatever the op
            actual: object = kv.value
        else:
            actual = 0 if kv is None else getattr(kv, self.target.value)
        return _COMPARE_OPS[self.op](actual, self.operand)

    @staticmethod
    def absent(key: str) -> "Compare":
        return Compare(key, CompareTarget.VERSION, "==", 0)

    @staticmethod
    def version(key: str, op: str, version: int) -> "Compare":
        """On the number of writes to the key since it was created (0: absent)."""
        return Compare(key, CompareTarget.VERSION, op, version)

    @staticmethod
    def mod_revision(key: str, op: str, revision: int) -> "Compare":
        """On the revision of the key's last write; a fencing token: it
        changes with every write, so ``==`` says nobody wrote since it was read."""
        return Compare(key, CompareTarget.MOD_REVISION, op, revision)

    @staticmethod
    def create_revision(key: str, op: str, revision: int) -> "Compare":
        """On the revision that created the key; it stays while the key lives,
        so ``==`` says the key is still the one that was read (not deleted and
        written again)."""
        return Compare(key, CompareTarget.CREATE_REVISION, op, revision)

    @staticmethod
    def value(key: str, op: str, value: bytes) -> "Compare":
        return Compare(key, CompareTarget.VALUE, op, value)


@dataclass(frozen=True)
class Put:
    """Write ``value`` at ``key``, attached to ``lease`` when it is not 0."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    """Delete ``key``, or every key starting with it when ``prefix`` is true."""

    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    """Read ``key``, or every key starting with it when ``prefix`` is true."""

    key: str
    prefix: bool = False


Op = Union[Put, Delete, Get]


@dataclass(frozen=True)
class TxnResult:
    """Outcome of a transaction.

    ``results`` has one entry per executed op: a list of KeyValue for Get, the
    number of deleted keys for Delete, None for Put.
    """

    succeeded: bool
    revision: int
    results: tuple = ()


class LostFlag(threading.Event):
    """``Session.lost``: an Event that can also call back when set, so that an
    owner learns of the loss without polling. The callbacks run before the
    waiters wake."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()
        self._fired = False

    def when_set(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once this is set: now if it already is, else on
        the thread that sets it, which may hold the store's locks (so the
        callback must not block or call the store)."""
        with self._callbacks_lock:
            if not self._fired:
                self._callbacks.append(callback)
                return
        callback()

    def set(self) -> None:
        with self._callbacks_lock:
            self._fired = True
            callbacks, self._callbacks = self._callbacks, []
        try:
            for callback in callbacks:
                callback()
        finally:
            super().set()


class Session(abc.ABC):
    """A lease kept alive in the background: the liveness of its owner.

    Keys written with ``lease=session.lease_id`` vanish when the session dies.
    ``lost`` is set once the lease is known to be gone (expired, revoked, or
    keep-alive impossible for longer than the TTL); it is never cleared: a
    node that lost its session opens a new one.
    """

    def __init__(self, lease_id: int, ttl_s: float):
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.lost = LostFlag()

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (best effort); sets ``lost``."""

    @property
    @abc.abstractmethod
    def confirmed_at(self) -> float:
        """Monotonic time when etcd last confirmed the lease (its grant or a
        keep-alive answer): the lease lives at least until ``ttl_s`` after it."""


KEEPALIVE_TTL_FRACTION = 1 / 3
"""A lease's keep-alive is sent every this fraction of its TTL, so a healthy
holder's ``confirmed_at`` is at most about that old."""


class Watch(abc.ABC):
    """A running watch. Cancel it when done; cancelling twice is harmless."""

    @abc.abstractmethod
    def cancel(self) -> None: ...


EventsCallback = Callable[[Sequence[WatchEvent]], None]
ErrorCallback = Callable[[Exception], None]


@dataclass
class OpCounter:
    """Counts store operations by kind, for benchmarks and tests (thread-safe)."""

    counts: collections.Counter = field(default_factory=collections.Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class Store(abc.ABC):
    """A consistent key-value store with revisions, leases and watches (etcd v3).

    All methods are thread-safe. ``timeout_s`` defaults to the store's request
    timeout. Requests that are safe to repeat (reads, puts, deletes, keep-alive,
    revoke) are retried while the store is unavailable, within the deadline;
    transactions and lease grants are not, since they may have taken effect.

    Raises (every method): StoreUnavailableError, StoreTimeoutError, StoreError.
    """

    def __init__(self) -> None:
        self.ops = OpCounter()

    @abc.abstractmethod
    def get(self, key: str, *, timeout_s: float | None = None) -> KeyValue | None:
        """The key, or None if it does not exist."""

    @abc.abstractmethod
    def get_prefix(
        self, prefix: str, *, timeout_s: float | None = None
    ) -> tuple[list[KeyValue], int]:
        """Every key starting with ``prefix``, sorted by key, and the store
        revision they were read at (watch from ``revision + 1`` to miss nothing)."""

    @abc.abstractmethod
    def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout_s: float | None = None
    ) -> int:
        """Write the key; returns the revision of the write."""

    @abc.abstractmethod
    def delete(
        self, key: str, *, prefix: bool = False, timeout_s: float | None = None
    ) -> int:
        """Delete the key (or prefix); returns how many keys were deleted."""

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout_s: float | None = None,
    ) -> TxnResult:
        """If every compare holds, run ``success``, otherwise ``failure``; atomically.

        Raises:
            TypeError: a compare's operand does not fit its target (checked
                for every compare before anything is sent), or an op is not
                a Put, Delete or Get.
        """
        for compare in compares:
            compare.check_operand()
        return self._run_txn(compares, success, failure, timeout_s)

    @abc.abstractmethod
    def _run_txn(self, compares: Sequence[Compare], success: Sequence[Op],
                 failure: Sequence[Op], timeout_s: float | None) -> TxnResult:
        """The backend's hook for :meth:`txn` (a backend implements it; callers
        call :meth:`txn`): run the transaction, its compares already checked.
        Raises the store's errors, and TypeError for an op that is not a Put,
        Delete or Get."""

    @abc.abstractmethod
    def session(self, ttl_s: float) -> Session:
        """Grant a lease of ``ttl_s`` seconds and keep it alive until closed or lost."""

    @abc.abstractmethod
    def lease_time_to_live(self, lease_id: int, *, timeout_s: float | None = None) -> float:
        """Seconds left on the lease; -1 if it has expired or never existed."""

    @abc.abstractmethod
    def resume_session(self, lease_id: int, ttl_s: float) -> Session | None:
        """Keep an existing lease alive again (a session whose keep-alives
        failed while etcd itself was down: etcd keeps leases through an outage
        and renews them when it is back). Returns None if etcd no longer has
        the lease. Raises the store's errors."""

    @abc.abstractmethod
    def revoke_lease(self, lease_id: int, *, timeout_s: float | None = None) -> None:
        """Revoke any lease (its keys are deleted at once); a lease that is
        already gone is not an error. Raises the store's errors."""

    def watch(
        self,
        key: str,
        on_events: EventsCallback,
        *,
        prefix: bool = False,
        start_revision: int | None = None,
        on_error: ErrorCallback | None = None,
    ) -> Watch:
        """Deliver changes of the key (or prefix) to ``on_events``, in revision
        order, from a background thread. ``start_revision`` None means "changes
        after now". ``on_error`` is called once if the watch ends for good
        (WatchCompactedError); transient disconnects are retried internally.

        Raises:
            ValueError: ``start_revision`` is not positive.
        """
        if start_revision is not None and start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        return self._start_watch(key, prefix, start_revision, on_events, on_error)

    @abc.abstractmethod
    def _start_watch(self, key: str, prefix: bool, start_revision: int | None,
                     on_events: EventsCallback, on_error: ErrorCallback | None) -> Watch:
        """The backend's hook for :meth:`watch` (a backend implements it;
        callers call :meth:`watch`): start the watch, its arguments already
        checked. Raises the store's errors."""

    @abc.abstractmethod
    def close(self) -> None:
        """Cancel watches, close sessions and release the connection."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
