"""The etcd v3 rendezvous: nodes register under leases, a leader composes
fenced rounds, everyone follows them through watches."""

from elastic.rendezvous.api import (
    Decision,
    Member,
    NodeInfo,
    Observed,
    RendezvousConfig,
    RestartRequest,
    Round,
    parse_nnodes,
)
from elastic.keyspace import JobKeys

__all__ = [
    "Decision", "JobKeys", "Member", "NodeInfo", "Observed", "RendezvousConfig",
    "RestartRequest", "Round", "parse_nnodes",
]
