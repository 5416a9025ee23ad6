"""Hand-built job histories for the job report's tests: events written the way the
agents and the leader write them (the messages' wording is theirs: agent/reactor.py,
agent/health.py, elastic/rendezvous/leader.py and decisions.py,
elastic/checkpoint/etcd_log.py), at times relative to :data:`T0`."""

from __future__ import annotations

from agent.report import build_report
from agent.report_model import JobReport
from elastic.events import Event

T0 = 1_800_000_000.0


class Job:
    """A job's history, written event by event at times relative to T0."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def at(self, t: float, node: str, number: int, kind: str, message: str) -> "Job":
        self.events.append(Event(T0 + t, node, number, kind, message))
        return self

    def state(self, t: float, node: str, number: int, before: str, after: str,
              reason: str) -> "Job":
        return self.at(t, node, number, "state", f"{before} -> {after}: {reason}")

    def join(self, t: float, *nodes: str) -> "Job":
        for node in nodes:
            self.state(t, node, 0, "INIT", "JOINING", "registered with the rendezvous")
        return self

    def formed(self, t: float, number: int, members: list[str], why: str) -> "Job":
        return self.at(t, members[0], number, "round",
                       f"round {number} formed with {members}: {why}")

    def run(self, t: float, number: int, members: list[str], nproc: int = 2) -> "Job":
        """Every member starts its workers of round ``number`` at ``t`` (the last a bit later)."""
        for i, node in enumerate(members):
            self.state(t, node, number, "JOINING", "STARTING",
                       f"node rank {i} of {len(members)}, world size {nproc * len(members)}")
            self.state(t + 0.1 * i, node, number, "STARTING", "RUNNING",
                       f"{nproc} workers started")
        return self

    def commit(self, t: float, node: str, number: int, step: int) -> "Job":
        return self.at(t, node, number, "checkpoint",
                       f"checkpoint of step {step} committed (step-{step:012d})")

    def stop(self, t: float, node: str, number: int, reason: str) -> "Job":
        return self.state(t, node, number, "RUNNING", "STOPPING", reason)

    def report(self, now: float, **kw) -> JobReport:
        return build_report("j", self.events, T0 + now, **kw)


def first_round(job: Job, members=("a", "b")) -> Job:
    members = list(members)
    return (job.join(0.0, *members)
            .formed(1.0, 1, members, f"first round: {len(members)} nodes registered; closing "
                                     f"with {len(members)} nodes (max reached)")
            .run(2.0, 1, members))


CRASH = "worker rank 3 (pid 4242) exited with 13 (log: /var/lib/elasticd/j/b/rank-3.log)"


def crashed_job() -> Job:
    """Two nodes; rank 3 on b crashes at 20 s; a follows; round 2 runs from 23 s and succeeds."""
    job = first_round(Job())
    job.commit(10.0, "a", 1, 99).commit(15.0, "a", 1, 199)
    job.stop(20.0, "b", 1, CRASH).stop(20.5, "a", 1, "round 2 replaces round 1: ...")
    job.formed(21.0, 2, ["a", "b"], f"round 1: restart requested by b: {CRASH}; closing with "
                                    "2 nodes (max reached)")
    job.run(23.0, 2, ["a", "b"]).commit(30.0, "a", 2, 299)
    job.state(40.0, "a", 2, "RUNNING", "DONE", "all 2 workers exited 0; waiting for the other "
                                               "members (exit barrier)")
    job.state(40.2, "b", 2, "RUNNING", "DONE", "all 2 workers exited 0; waiting ...")
    job.at(40.5, "a", 3, "outcome", "job succeeded: round 2: the workers of all 2 members "
                                    "exited 0")
    return job
