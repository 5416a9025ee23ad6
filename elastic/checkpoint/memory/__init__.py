"""The memory tier: every step's (or every k steps') state in host memory owned by
the node's agent, replicated to a buddy node, restored (and resharded) from memory.

:mod:`~elastic.checkpoint.memory.layout` (no torch) is the files' contract between
the workers that write and restore snapshots and the agent that owns, replicates
and frees them. The worker side, each module one job:

* :mod:`~elastic.checkpoint.memory.tier`: a snapshot at ``elastic.step(n)`` when
  :mod:`~elastic.checkpoint.memory.cadence` says so (every k steps, k from the
  measured cost), after :mod:`~elastic.checkpoint.memory.capacity` checked that
  the node has room; written by :mod:`~elastic.checkpoint.memory.writer` into
  the rank's two alternating slots, laid out by :mod:`~elastic.checkpoint.memory.items`;
* :mod:`~elastic.checkpoint.memory.recovery`: restore from memory, the snapshot
  chosen by the pure rules of :mod:`~elastic.checkpoint.memory.choice`, slots
  mapped in place or sent by peers (:mod:`~elastic.checkpoint.memory.fetch`),
  resharded through :mod:`~elastic.checkpoint.memory.reader`'s DCP storage reader.

The Checkpointer wires them in (``memory_dir=``/``$ELASTIC_MEMORY_DIR``, ``data=``,
``memory_every=``).
"""
