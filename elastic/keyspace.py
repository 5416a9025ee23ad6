"""The etcd keyspace of a job, in one place (DESIGN.md, "The etcd keyspace").

It sits below the rendezvous, the event history, the checkpoint commit and the
agent: every one of them names keys through :class:`JobKeys` only.
"""

from __future__ import annotations

ROOT = "/elastic/v1/"


class JobKeys:
    """Key names under ``/elastic/v1/<job_id>/``.

    ``standbys`` lists the agent addresses of the registered nodes outside
    the round, kept by the leader: a member cut off from etcd asks them (and
    the other members) whether etcd is still there.

    ``requests/`` holds what nodes and operators tell the leader (the leader
    alone watches it): restart and drain requests, and per-node reports that a
    node started the workers of a round (``started/``), that its workers all
    exited 0 (``done/``), that a peer's agent does not answer
    (``suspect/``), or that it answered no probe for the freeze timeout
    (``frozen/``). Reports live under their writer's lease.

    ``rosters/<digest>/<chunk>`` holds the member list of the round whose
    ``round`` record names that digest, when it is too large to sit in the
    record itself (:mod:`elastic.rendezvous.round_record`): written before or
    with that record, deleted with the record that replaces it.

    ``roster-buckets/<digest>/<bucket>`` holds the same roster again in
    small buckets by node id (:mod:`elastic.rendezvous.buckets`), when it is
    too large to sit in the record: a node that lacks it reads its own bucket
    alone. Written before or with that record, deleted with it.

    ``torchrun/`` belongs to torchrun's ``etcd3`` rendezvous backend
    (:mod:`elastic.torchrun`), whose job id is torchrun's ``--rdzv-id``:
    ``torchrun/closed`` marks the rendezvous closed (torch's ``set_closed``),
    and ``torchrun/store/<round>/`` holds the key-value store the torchrun
    agents of that round share (their rank assignment, their exit barrier).
    """

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.prefix = f"{ROOT}{job_id}/"
        self.nodes = self.prefix + "nodes/"
        self.leader = self.prefix + "leader"
        self.round = self.prefix + "round"
        self.rosters = self.prefix + "rosters/"
        self.roster_buckets = self.prefix + "roster-buckets/"
        self.standbys = self.prefix + "standbys"
        self.config = self.prefix + "config"
        self.requests = self.prefix + "requests/"
        self.restart_requests = self.requests + "restart/"
        self.drain_requests = self.requests + "drain/"
        self.started_reports = self.requests + "started/"
        self.done_reports = self.requests + "done/"
        self.suspect_reports = self.requests + "suspect/"
        self.frozen_reports = self.requests + "frozen/"
        self.status = self.prefix + "status/"
        # Each node's windowed step time per rank, for the leader's straggler
        # rule (agent.step_times); under the writer's lease.
        self.step_times = self.prefix + "step-times/"
        self.events = self.prefix + "events/"
        self.checkpoint_latest = self.prefix + "checkpoint/latest"
        # The last operator restart taken (not under requests/: the leader
        # reads every key there as a request); see elastic.rendezvous.operator.
        self.operator_restart = self.prefix + "operator-restart"
        self.torchrun_closed = self.prefix + "torchrun/closed"
        self.torchrun_stores = self.prefix + "torchrun/store/"

    def roster(self, digest: str) -> str:
        """The prefix of the chunks of the roster named ``digest``."""
        return f"{self.rosters}{digest}/"

    def roster_chunk(self, digest: str, index: int) -> str:
        return f"{self.roster(digest)}{index:04d}"

    def buckets_of(self, digest: str) -> str:
        """The prefix of the buckets of the roster named ``digest``."""
        return f"{self.roster_buckets}{digest}/"

    def roster_bucket(self, digest: str, index: int) -> str:
        return f"{self.buckets_of(digest)}{index:05d}"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def node_id_of(self, key: str) -> str:
        """The node id in a ``nodes/<id>``, ``status/<id>`` or report key."""
        return key.rsplit("/", 1)[-1]

    def restart_request(self, round_number: int, by: str) -> str:
        """Where ``by`` (a node id, or "elasticctl") asks for a round to replace
        round ``round_number``."""
        return f"{self.restart_requests}{round_number:012d}-{by}"

    def drain_request(self, node_id: str) -> str:
        return self.drain_requests + node_id

    def started_report(self, node_id: str) -> str:
        return self.started_reports + node_id

    def done_report(self, node_id: str) -> str:
        return self.done_reports + node_id

    def suspect_report(self, node_id: str) -> str:
        """Where a node reports that ``node_id``'s agent does not answer."""
        return self.suspect_reports + node_id

    def frozen_report(self, node_id: str) -> str:
        """Where a node reports that ``node_id``'s agent answered no probe."""
        return self.frozen_reports + node_id

    def status_of(self, node_id: str) -> str:
        return self.status + node_id

    def step_times_of(self, node_id: str) -> str:
        return self.step_times + node_id

    def torchrun_store(self, round_number: int) -> str:
        """The prefix of round ``round_number``'s torchrun agent store."""
        return f"{self.torchrun_stores}{round_number:012d}/"
