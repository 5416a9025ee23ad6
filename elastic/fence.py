"""The one fenced transaction: writes that only happen while a round is current.

The round number is the version of the job's ``round`` key (see
:mod:`elastic.keyspace`). Every write that must never come from an older round
(a new round, the job's outcome, a checkpoint commit) goes through
:func:`fenced_txn`, so the fence is written, and tested, once.
"""

from __future__ import annotations

from typing import Sequence

from elastic.errors import FencedError
from elastic.keyspace import JobKeys
from elastic.store.api import Compare, Get, Op, Put, Store, TxnResult


def fenced_txn(store: Store, keys: JobKeys, round_number: int, ops: Sequence[Op], *,
               also: Sequence[Compare] = ()) -> TxnResult:
    """Apply ``ops`` in one transaction if ``round_number`` is still the job's
    round (and every compare in ``also`` holds).

    On success the result is the transaction's. On refusal nothing is written
    and the result's ``results[0]`` holds the round key as it is now (a list
    of zero or one KeyValue), so the caller can say what moved on. Raises the
    store's errors; never retries (a transaction is not idempotent).
    """
    return store.txn([Compare.version(keys.round, "==", round_number), *also], list(ops),
                     [Get(keys.round)])


def current_round_number(refused: TxnResult) -> int:
    """The round number a refused :func:`fenced_txn` saw (0: no round yet)."""
    kvs = refused.results[0] if refused.results else []
    return kvs[0].version if kvs else 0


def fenced_put(store: Store, keys: JobKeys, key: str, value: bytes, round_number: int) -> int:
    """Write ``key`` only while ``round_number`` is the job's current round.

    Returns the revision of the write; raises FencedError when the round has
    moved on.
    """
    result = fenced_txn(store, keys, round_number, [Put(key, value)])
    if not result.succeeded:
        raise FencedError(
            f"job {keys.job_id}: refused to write {key!r} for round {round_number}: "
            f"the current round is {current_round_number(result)}")
    return result.revision
