"""A ``torch.distributed.Store`` kept in etcd: the torchrun agents' store of one round.

torchrun's agent uses the store its rendezvous hands it for two things: to
assign global ranks (each agent ``set``s its role info, node rank 0
``multi_get``s them all and ``multi_set``s the assignments, every agent
``get``s its own) and for the exit barrier (``add`` to a counter, ``set`` a
flag, ``wait`` for it). :class:`EtcdTorchStore` serves those calls from keys
under one prefix of our etcd store (``JobKeys.torchrun_store(round)``), so the
agents need no TCP store server of their own: nothing to lose when rank 0's
agent dies, nothing to bind, and every round starts from an empty namespace.

Semantics are TCPStore's, which torch's code relies on:

* ``get`` and ``multi_get`` wait for missing keys, up to the store's
  ``timeout`` (torch's ``Store.timeout``; ``set_timeout`` changes it);
  ``wait`` waits for every key; ``check`` does not wait.
* ``add`` treats an absent key as 0 and stores the sum as decimal text, so a
  ``get`` of it reads ``b"3"``.
* ``compare_set(key, expected, desired)`` writes ``desired`` when the key
  holds ``expected``, or when it is absent and ``expected`` is empty; it
  returns the value the key then holds (``expected`` itself for an absent key
  that was not written, as TCPStore does).

Errors: a wait that runs out raises ``torch.distributed.DistStoreError``
naming the missing keys (what TCPStore raises); etcd that cannot be reached
in time raises ``DistNetworkError``, any other store failure ``DistStoreError``,
each with our :class:`~elastic.errors.StoreError` chained. Waiting uses one
watch per call, and looks again at least every second, so a watch ended by a
compaction degrades to polling instead of hanging.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Iterator, Sequence

import torch.distributed as dist

from elastic.errors import StoreError, StoreTimeoutError, StoreUnavailableError
from elastic.store.api import Compare, EventType, Get, KeyValue, Put, Store

# The longest a waiter sleeps between looks when no watch event wakes it.
_RECHECK_S = 1.0


@contextlib.contextmanager
def _as_dist_errors(what: str) -> Iterator[None]:
    try:
        yield
    except (StoreUnavailableError, StoreTimeoutError) as exc:
        raise dist.DistNetworkError(f"etcd store: {what}: {exc}") from exc
    except StoreError as exc:
        raise dist.DistStoreError(f"etcd store: {what}: {exc}") from exc


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdTorchStore(dist.Store):
    """A torch Store over ``store``, every key under ``prefix``.

    Thread-safe (the etcd store is). ``timeout`` is the default wait of
    ``get``, ``multi_get`` and ``wait``; ``timeout_s`` of the etcd requests
    themselves stays the etcd store's request timeout.
    """

    def __init__(self, store: Store, prefix: str, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self._store = store
        self._prefix = prefix
        self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _key(self, key: str) -> str:
        return self._prefix + key

    # ---------------------------------------------------------------- writes

    def set(self, key: str, value) -> None:
        with _as_dist_errors(f"set {key!r}"):
            self._store.put(self._key(key), _bytes(value))

    def multi_set(self, keys: list[str], values: list) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        with _as_dist_errors(f"multi_set of {len(keys)} keys"):
            self._store.txn([], [Put(self._key(k), _bytes(v)) for k, v in zip(keys, values)])

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (absent: 0) atomically; the sum."""
        full = self._key(key)
        with _as_dist_errors(f"add to {key!r}"):
            kv = self._store.get(full)
            while True:
                current = self._integer(key, kv)
                total = current + int(amount)
                # Fenced on the key's last write: a concurrent add makes this
                # one fail and retry on the value it read back.
                result = self._store.txn(
                    [Compare.mod_revision(full, "==", kv.mod_revision if kv else 0)],
                    [Put(full, str(total).encode())], [Get(full)])
                if result.succeeded:
                    return total
                kvs = result.results[0]
                kv = kvs[0] if kvs else None

    @staticmethod
    def _integer(key: str, kv: KeyValue | None) -> int:
        if kv is None:
            return 0
        try:
            return int(kv.value.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"add: key {key!r} holds {kv.value[:32]!r}, not an integer "
                             "written by add") from None

    def compare_set(self, key: str, expected, desired) -> bytes:
        full, expected, desired = self._key(key), _bytes(expected), _bytes(desired)
        condition = Compare.absent(full) if not expected else Compare.value(full, "==", expected)
        with _as_dist_errors(f"compare_set {key!r}"):
            result = self._store.txn([condition], [Put(full, desired)], [Get(full)])
        if result.succeeded:
            return desired
        kvs = result.results[0]
        return kvs[0].value if kvs else expected

    def delete_key(self, key: str) -> bool:
        with _as_dist_errors(f"delete {key!r}"):
            return self._store.delete(self._key(key)) > 0

    # ----------------------------------------------------------------- reads

    def check(self, keys: list[str]) -> bool:
        with _as_dist_errors(f"check {len(keys)} keys"):
            values, _ = self._read([self._key(k) for k in keys])
        return all(v is not None for v in values)

    def num_keys(self) -> int:
        with _as_dist_errors("num_keys"):
            kvs, _ = self._store.get_prefix(self._prefix)
        return len(kvs)

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout`` for missing ones."""
        full = [self._key(k) for k in keys]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            with _as_dist_errors(f"get {len(keys)} keys"):
                values, revision = self._read(full)
            if all(v is not None for v in values):
                return values
            # Read again after the wait: a key may be deleted in between.
            self._wait_from(full, values, revision, deadline)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; DistStoreError after ``timeout``
        (default: the store's)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout.total_seconds()
        full = [self._key(k) for k in keys]
        with _as_dist_errors(f"wait for {len(keys)} keys"):
            values, revision = self._read(full)
        self._wait_from(full, values, revision, deadline)

    def _read(self, full: list[str]) -> tuple[list[bytes | None], int]:
        """The values (None: absent) of ``full`` keys at one revision, and that revision."""
        result = self._store.txn([], [Get(k) for k in full])
        return [kvs[0].value if kvs else None for kvs in result.results], result.revision

    def _wait_from(self, full: list[str], values: list[bytes | None], revision: int,
                   deadline: float) -> None:
        """Wait until every key in ``full`` exists, given their ``values`` as
        read at ``revision``: changes after it wake the waiter."""
        wanted = set(full)
        changed = threading.Event()

        def on_events(events) -> None:
            if any(ev.type is EventType.PUT and ev.kv.key in wanted for ev in events):
                changed.set()

        watch = None
        try:
            while any(v is None for v in values):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k[len(self._prefix):] for k, v in zip(full, values) if v is None]
                    raise dist.DistStoreError(
                        f"etcd store: timed out waiting for keys {missing[:8]}"
                        f"{' and more' if len(missing) > 8 else ''} under {self._prefix!r}")
                with _as_dist_errors(f"wait for {len(full)} keys"):
                    if watch is None:
                        watch = self._store.watch(self._prefix, on_events, prefix=True,
                                                  start_revision=revision + 1,
                                                  on_error=lambda _exc: changed.set())
                    changed.wait(min(left, _RECHECK_S))
                    changed.clear()
                    values, _ = self._read(full)
        finally:
            if watch is not None:
                watch.cancel()
