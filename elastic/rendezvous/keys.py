"""The etcd keyspace of a job, in one place (DESIGN.md, "The etcd keyspace")."""

from __future__ import annotations

ROOT = "/elastic/v1/"


class JobKeys:
    """Key names under ``/elastic/v1/<job_id>/``."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.prefix = f"{ROOT}{job_id}/"
        self.nodes = self.prefix + "nodes/"
        self.leader = self.prefix + "leader"
        self.round = self.prefix + "round"
        self.config = self.prefix + "config"
        self.requests = self.prefix + "requests/"
        self.restart_requests = self.requests + "restart/"
        self.drain_requests = self.requests + "drain/"
        self.status = self.prefix + "status/"
        self.events = self.prefix + "events/"
        self.checkpoint_latest = self.prefix + "checkpoint/latest"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def node_id_of(self, key: str) -> str:
        """The node id in a ``nodes/<id>`` or ``status/<id>`` key."""
        return key.rsplit("/", 1)[-1]

    def drain_request(self, node_id: str) -> str:
        return self.drain_requests + node_id

    def status_of(self, node_id: str) -> str:
        return self.status + node_id
