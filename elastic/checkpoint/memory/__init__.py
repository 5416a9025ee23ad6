"""The memory tier: every step's (or every k steps') state in host memory owned by
the node's agent, replicated to a buddy node, restored (and resharded) from memory.

:mod:`~elastic.checkpoint.memory.layout` (no torch) is the files' contract between
the workers that write and restore snapshots and the agent that owns, replicates
and frees them.
"""
