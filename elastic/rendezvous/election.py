"""Leadership of a job's rendezvous: who composes the rounds.

The smallest election etcd's ``concurrency`` package would recognise: the
``leader`` key, created only if absent and held under the candidate's lease,
so a dead leader's key vanishes with its lease and a new campaign can win.
Only public store calls; no state but the names.
"""

from __future__ import annotations

from elastic.keyspace import JobKeys
from elastic.store.api import Compare, Delete, Get, Put, Store


class Election:
    """Campaign for, hold and give up a job's leadership as ``node_id``."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str):
        self.store = store
        self.keys = keys
        self.node_id = node_id

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
        return kvs[0].value.decode(errors="replace") if kvs else None

    def holds(self) -> Compare:
        """A compare that holds while this node leads: part of every leader write."""
        return Compare.value(self.keys.leader, "==", self.node_id.encode())

    def resign(self) -> bool:
        """Give up leadership (delete the key if this node holds it), so
        another node can win at once. Returns whether this node held it."""
        return self.store.txn([self.holds()], [Delete(self.keys.leader)]).succeeded
