"""RendezvousNode against the in-memory store: behaviour that needs no real etcd."""

from __future__ import annotations

import logging

from elastic.rendezvous.api import NodeInfo, RendezvousConfig
from elastic.rendezvous.node import RendezvousNode
from tests.fakes.memory_store import MemoryStore


def test_a_node_joining_after_compaction_watches_from_the_present(caplog):
    # etcd compacts old history; a node whose job keys were never written must
    # not ask for revisions that are gone (it used to watch from revision 1).
    store = MemoryStore()
    for i in range(20):
        store.put(f"/other/{i}", b"x")
    store.compact(store.revision)
    node = RendezvousNode(store, RendezvousConfig(job_id="j", min_nodes=1, max_nodes=1,
                                                  settle_s=0.0),
                          NodeInfo(node_id="a", host="127.0.0.1"))
    with caplog.at_level(logging.WARNING):
        node.start()
        try:
            r = node.wait_for_round(timeout_s=5)
        finally:
            node.stop()
    assert r.node_ids == ("a",)
    assert "compacted" not in caplog.text
