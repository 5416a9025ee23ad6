"""The etcd v3 rendezvous: nodes register under leases, a leader composes
fenced rounds, everyone follows them through watches."""

from elastic.keyspace import JobKeys
from elastic.rendezvous.api import Member, NodeInfo, RestartRequest, Round
from elastic.rendezvous.config import RendezvousConfig, parse_nnodes
from elastic.rendezvous.decisions import Decision, Observed

__all__ = [
    "Decision", "JobKeys", "Member", "NodeInfo", "Observed", "RendezvousConfig",
    "RestartRequest", "Round", "parse_nnodes",
]
