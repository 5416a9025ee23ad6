"""The GPU check in the agent: the reactor's rules with explicit times, then a
real Agent over the in-memory store and fake workers, with a scripted GPU
reader (tests/fakes/gpus.py) and a fake clock."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from agent import status as job_status
from agent.gpu_health import RELEASE_WAIT_S, GpuAction, GpuDecision, GpuExpectation, GpuProcess
from agent.lifecycle import AgentState as S
from agent.metrics import AgentMetrics
from agent.reactor import (
    AgentView,
    AnnounceDrain,
    CheckGpus,
    GpuChecked,
    Leave,
    Note,
    Report,
    RoundCommitted,
    Settings,
    StartWorkers,
    StopWorkers,
    Tick,
    Transition,
    react,
)
from agent.supervisor import WorkerStatus
from elastic.errors import EXIT_NODE_UNFIT, GpuUnavailableError, NodeUnfitError, exit_code_for
from elastic.events import read_events
from elastic.rendezvous.api import Member, ReportKind, Round
from tests.fakes.agent_config import one_node_config
from tests.fakes.gpus import MIB, FakeGpuReader, node
from tests.sim.one_node import OneNode
from tests.sim.world import FakeSupervisor

ENFORCE = Settings(node_id="a", nproc=2, lease_ttl_s=4.0, join_timeout_s=60.0, job_id="j",
                   gpu_check="enforce")


def round_of(number, *ids):
    return Round(number=number,
                 members=tuple(Member(i, r, "127.0.0.1", 2, addr=f"{i}:1")
                               for r, i in enumerate(ids)),
                 master_addr="127.0.0.1", master_port=1, reason="", leader=ids[0],
                 created_at=0.0)


def verdict(action, reason="r", problems=(), wake_at=None):
    return GpuDecision(action, reason, problems, wake_at=wake_at)


def kinds(commands):
    return [type(c).__name__ for c in commands]


class TestReactor:
    def checking(self, now=10.0, settings=ENFORCE):
        return react(AgentView(), RoundCommitted(round_of(1, "a", "b")), now, settings)

    def test_a_round_that_includes_this_node_checks_its_gpus_before_any_worker_starts(self):
        view, commands = self.checking()
        assert view.state is S.STARTING
        assert commands == [Transition(S.STARTING, "node rank 0 of 2, world size 4; checking "
                                                   "the GPUs first", 1), CheckGpus(1, 10.0)]

    def test_off_starts_at_once_as_before(self):
        view, commands = self.checking(settings=Settings(node_id="a", nproc=2, lease_ttl_s=4.0,
                                                         join_timeout_s=60.0))
        assert view.state is S.RUNNING
        assert "CheckGpus" not in kinds(commands) and StartWorkers(round_of(1, "a", "b"), 0) \
            in commands

    def test_pass_starts_the_workers_and_reports_started(self):
        view, _ = self.checking()
        view, commands = react(view, GpuChecked(1, verdict(GpuAction.PASS)), 10.1, ENFORCE)
        assert view.state is S.RUNNING
        assert kinds(commands) == ["StartWorkers", "Report", "WatchPeer", "Transition"]
        assert commands[0] == StartWorkers(round_of(1, "a", "b"), 0)
        assert commands[1] == Report(ReportKind.STARTED, 1)

    def test_warn_notes_the_reason_and_starts(self):
        view, _ = self.checking()
        view, commands = react(view, GpuChecked(1, verdict(GpuAction.WARN, "GPU 1: 2 ECC")),
                               10.1, ENFORCE)
        assert view.state is S.RUNNING
        assert commands[0] == Note("GPU check failed (--gpu-check warn, starting the workers "
                                   "anyway): GPU 1: 2 ECC")
        assert "StartWorkers" in kinds(commands)

    def test_wait_reads_again_at_its_time_and_notes_only_once(self):
        view, _ = self.checking(now=10.0)
        view, commands = react(view, GpuChecked(1, verdict(GpuAction.WAIT, "held", wake_at=10.5)),
                               10.0, ENFORCE)
        assert commands == [Note("GPU check: held")] and view.state is S.STARTING
        assert react(view, Tick(), 10.4, ENFORCE)[1] == []
        view, commands = react(view, Tick(), 10.5, ENFORCE)
        assert commands == [CheckGpus(1, 10.0)]  # judged from the round's start, not the read
        assert react(view, Tick(), 10.6, ENFORCE)[1] == []  # asked once
        view, commands = react(view, GpuChecked(1, verdict(GpuAction.WAIT, "held", wake_at=11.0)),
                               10.5, ENFORCE)
        assert commands == []

    def test_leave_announces_a_drain_leaves_and_ends_failed_with_exit_code_6(self):
        view, _ = self.checking()
        view, commands = react(view, GpuChecked(1, verdict(GpuAction.LEAVE, "GPU 1: 2 ECC")),
                               11.0, ENFORCE)
        why = "GPU check failed: GPU 1: 2 ECC"
        assert commands == [Transition(S.DRAINING, why, 1), AnnounceDrain(why),
                            commands[2], Leave(why),
                            Transition(S.FAILED, "left the job: this node is not fit for round 1",
                                       1)]
        assert "StartWorkers" not in kinds(commands) and "Report" not in kinds(commands)
        assert view.state is S.FAILED and view.exit_code == EXIT_NODE_UNFIT
        assert view.last_failure == why
        assert view.outcome_reason == f"node a left the job: {why}"

    def test_an_answer_for_another_round_is_ignored(self):
        view, _ = self.checking()
        assert react(view, GpuChecked(7, verdict(GpuAction.PASS)), 10.1, ENFORCE) == (view, [])

    def test_a_newer_round_while_checking_is_checked_afresh(self):
        view, _ = self.checking()
        view, commands = react(view, RoundCommitted(round_of(2, "a", "b")), 12.0, ENFORCE)
        assert commands[-1] == CheckGpus(2, 12.0)
        assert any(isinstance(c, StopWorkers) for c in commands)  # nothing runs: a no-op
        assert react(view, GpuChecked(1, verdict(GpuAction.PASS)), 12.1, ENFORCE)[1] == []
        view, commands = react(view, GpuChecked(2, verdict(GpuAction.PASS)), 12.1, ENFORCE)
        assert commands[0] == StartWorkers(round_of(2, "a", "b"), 1)  # restart count 1


# ---------------------------------------------------------------- the agent

class SurvivingSupervisor(FakeSupervisor):
    """Fake workers; ``survivors`` pids still alive after their stop (stuck in
    the kernel): how the real supervisor reports a worker that outlived SIGKILL."""

    survivors: frozenset = frozenset()

    def workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(w.local_rank, w.rank, w.pid, w.alive or w.pid in self.survivors)
                for w in self.current]


class GpuNode(OneNode):
    """One agent with two fake workers, a scripted GPU reader and a fake clock."""

    def __init__(self, reader, mode="enforce",
                 expected=GpuExpectation(("0", "1"), True, "2 GPUs expected")):
        self.metrics = AgentMetrics("j", "a", registry=CollectorRegistry())
        self.reader = reader
        self.sleeps: list[float] = []
        super().__init__(one_node_config(gpu_check=mode, gpu_expectation=expected),
                         supervisor=SurvivingSupervisor, metrics=self.metrics, gpus=reader,
                         sleep=self.sleeps.append)
        self.agent.start(threaded=False)

    def run(self, seconds, dt=0.25):
        super().run(seconds, dt, until_final=True)

    def running(self):
        return [w for w in self.supervisor.current if w.alive]

    def gpu_events(self):
        return [(e.kind, e.message) for e in read_events(self.store, self.rdzv.keys)
                if e.kind.startswith("gpu_")]

    def metric(self, name, **labels):
        return self.metrics.registry.get_sample_value(
            name, {"job_id": "j", "node_id": "a", **labels})


def held_by(pid, mib=20_000):
    return {"processes": (GpuProcess(pid, mib * MIB),)}


class TestAgent:
    def test_fit_gpus_start_the_workers_and_record_the_check(self):
        n = GpuNode(FakeGpuReader([node(2)]))
        n.run(3)
        assert n.agent.state is S.RUNNING and len(n.running()) == 2
        [(kind, message)] = n.gpu_events()
        assert kind == "gpu_ok" and message.startswith("2 GPUs fit (2 GPUs expected)")
        assert n.metric("elasticd_gpu_checks_total", result="pass") == 1

    def test_a_replacement_waits_until_the_dead_workers_memory_is_released(self):
        dead = {"pid": 0, "reads_held": 0}

        def reading(_i):
            if dead["reads_held"] == 0:
                return node(2)
            dead["reads_held"] -= 1  # the driver frees it after a few reads
            return node(2, g0=held_by(dead["pid"]))

        n = GpuNode(FakeGpuReader(reading))
        n.run(3)
        first = {w.pid for w in n.running()}
        crashed = n.running()[0]
        dead.update(pid=crashed.pid, reads_held=3)
        n.workers.end(crashed, -9, n.clock.monotonic())
        n.run(0.75)
        assert n.agent.state is S.STARTING, "a replacement started on a held GPU"
        assert not n.running()
        n.run(3)
        assert n.agent.state is S.RUNNING
        assert not first & {w.pid for w in n.running()}
        kind, message = n.gpu_events()[-1]
        assert kind == "gpu_ok" and "let go after" in message
        assert n.metric("elasticd_gpu_check_seconds_count") == 2

    @pytest.mark.parametrize("mode, state, kind", [("enforce", S.FAILED, "gpu_failed"),
                                                   ("warn", S.RUNNING, "gpu_warning")])
    def test_uncorrectable_ecc_errors_found_before_a_round(self, mode, state, kind):
        # enforce reads once before joining (fit then), warn only before the round
        bad = node(2, g1={"ecc_uncorrected_volatile": 3})
        n = GpuNode(FakeGpuReader([node(2), bad] if mode == "enforce" else [bad]), mode=mode)
        n.run(3)
        assert n.agent.state is state
        [(recorded, message)] = n.gpu_events()
        assert recorded == kind and "3 uncorrectable ECC errors" in message
        assert n.metric("elasticd_gpu_check_problems_total", problem="ecc") == 1

    def test_enforce_leaves_the_job_with_its_reason_visible_in_status_and_events(self):
        n = GpuNode(FakeGpuReader([node(2), node(1)]))  # a GPU lost after joining
        n.run(3)
        assert n.agent.state is S.FAILED
        assert n.agent.exit_code == EXIT_NODE_UNFIT
        assert n.rdzv.lease_id is None, "still registered"
        states = [e.message for e in read_events(n.store, n.rdzv.keys) if e.kind == "state"]
        assert any("-> DRAINING: GPU check failed: 2 GPUs expected, but NVML sees 1" in m
                   for m in states)
        status = job_status.collect(n.store, "j", query_agents=False)
        [check] = status["gpu_checks"]
        assert check["node_id"] == "a" and check["result"] == "failed"
        text = job_status.render(status, now=n.clock.wall())
        assert "GPU check: node a failed in round 1" in text
        assert "2 GPUs expected, but NVML sees 1: 1 missing" in text
        assert n.metric("elasticd_gpu_checks_total", result="leave") == 1

    def test_no_nvml_with_gpus_expected_keeps_the_node_out(self):
        n = GpuNode(FakeGpuReader([GpuUnavailableError("pynvml is not installed")]), mode="warn")
        n.run(3)
        assert n.agent.state is S.RUNNING
        [(kind, message)] = n.gpu_events()
        assert kind == "gpu_warning"
        assert message.endswith("NVML cannot be read: pynvml is not installed")

    def test_enforce_does_not_join_with_unfit_gpus(self):
        with pytest.raises(NodeUnfitError) as refused:
            GpuNode(FakeGpuReader([GpuUnavailableError("pynvml is not installed")]))
        assert str(refused.value) == (
            "job j: node a does not join: GPU check failed (--gpu-check enforce): 2 GPUs "
            "expected, but NVML cannot be read: pynvml is not installed")
        assert exit_code_for(refused.value) == EXIT_NODE_UNFIT

    def test_enforce_joins_once_the_previous_agents_workers_let_go_of_the_gpus(self):
        reader = FakeGpuReader([node(2, g0=held_by(4242))] * 3 + [node(2)])
        n = GpuNode(reader)
        assert n.sleeps == [0.5, 0.5, 0.5]  # read four times, 0.5 s apart
        n.run(3)
        assert n.agent.state is S.RUNNING

    def test_enforce_does_not_join_while_the_gpus_stay_held(self):
        reader = FakeGpuReader([node(2, g0=held_by(4242))])
        with pytest.raises(NodeUnfitError,
                           match=r"pid 4242 holds 20000 MiB \(still after waiting 10.0 s\)$"):
            GpuNode(reader)
        assert reader.reads == int(RELEASE_WAIT_S / 0.5) + 1

    def test_no_gpus_expected_reads_no_nvml_and_records_nothing(self):
        reader = FakeGpuReader([GpuUnavailableError("no NVML")])
        n = GpuNode(reader, expected=GpuExpectation((), False, "no GPUs expected"))
        n.run(3)
        assert n.agent.state is S.RUNNING and reader.reads == 0
        assert n.gpu_events() == []

    def test_a_worker_that_survives_sigkill_makes_the_node_leave_not_crash(self):
        n = GpuNode(FakeGpuReader([node(2)]), mode="warn")
        n.run(3)
        stuck, other = n.running()
        n.supervisor.survivors = frozenset({stuck.pid})
        n.workers.end(other, 1, n.clock.monotonic())  # a failure: the node restarts its round
        n.run(RELEASE_WAIT_S - 1)
        assert n.agent.state is S.STARTING  # waiting for it to go
        n.run(3)
        assert n.agent.state is S.FAILED
        assert n.agent.exit_code == EXIT_NODE_UNFIT
        assert f"(pid {stuck.pid}) are still alive after SIGKILL" in n.agent.view.last_failure
        assert not n.running()

    def test_shutdown_closes_the_reader(self):
        n = GpuNode(FakeGpuReader([node(2)]))
        n.run(1)
        n.agent.shutdown()
        assert n.reader.closed
