"""Leadership of a job's rendezvous: who composes the rounds.

The smallest election etcd's ``concurrency`` package would recognise: the
``leader`` key, created only if absent and held under the candidate's lease,
so a dead leader's key vanishes with its lease and a new campaign can win.
Only public store calls; no state but the names.
"""

from __future__ import annotations

import logging
from typing import Callable

from elastic.errors import ConfigError
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.records import cap_text, validate_id
from elastic.store.api import Compare, Delete, Get, KeyValue, Put, Store

log = logging.getLogger(__name__)


class Election:
    """Campaign for, hold and give up a job's leadership as ``node_id``."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, *,
                 round_of: Callable[[], int] = lambda: 0):
        """``round_of``: the round this node knows, for its log lines."""
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.log = JobLogger(log, keys.job_id, node_id, round_of)

    def campaign(self, lease_id: int) -> str | None:
        """Become leader if nobody is; return who leads now (this node's id
        when it won, None when the key vanished meanwhile). Raises the
        store's errors; the caller retries."""
        result = self.store.txn(
            [Compare.absent(self.keys.leader)],
            [Put(self.keys.leader, self.node_id.encode(), lease=lease_id)],
            [Get(self.keys.leader)],
        )
        if result.succeeded:
            return self.node_id
        kvs = result.results[0] if result.results else []
        if not kvs:
            return None
        holder = leader_in(kvs[0])
        if holder is not None:
            return holder
        # Not a leader's record (garbage, or written without a lease, so no
        # death would ever free it): replace exactly what was read.
        self.log.warning("the leader key holds %s, which no leader wrote; taking its place.",
                         cap_text(repr(kvs[0].value), 64) if kvs[0].lease
                         else "a key without a lease")
        taken = self.store.txn(
            [Compare.mod_revision(self.keys.leader, "==", kvs[0].mod_revision)],
            [Put(self.keys.leader, self.node_id.encode(), lease=lease_id)],
            [Get(self.keys.leader)],
        )
        if taken.succeeded:
            return self.node_id
        kvs = taken.results[0] if taken.results else []
        return leader_in(kvs[0]) if kvs else None

    def holds(self) -> Compare:
        """A compare that holds while this node leads: part of every leader write."""
        return Compare.value(self.keys.leader, "==", self.node_id.encode())

    def resign(self) -> bool:
        """Give up leadership (delete the key if this node holds it), so
        another node can win at once. Returns whether this node held it."""
        return self.store.txn([self.holds()], [Delete(self.keys.leader)]).succeeded


def leader_in(kv: KeyValue) -> str | None:
    """The node id the ``leader`` key names, or None when it is not a leader's
    record: a leader writes its node id under its lease, so a value that is
    not a valid id (garbage, a huge value) or a key without a lease (which no
    lease expiry would ever delete) is treated as no leader at all, and the
    next campaign replaces it."""
    if kv.lease == 0:
        return None
    try:
        return validate_id("node id", kv.value.decode("utf-8"))
    except (UnicodeDecodeError, ConfigError):
        return None
