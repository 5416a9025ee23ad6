"""One real Agent and RendezvousNode over the synchronous in-memory store and the
simulator's fake workers, moved by a fake clock: the harness of the agent's in-process
tests (tests/unit/test_agent_loop.py, test_gpu_check_agent.py)."""

from __future__ import annotations

import queue
import random
from typing import Any

from agent.config import AgentConfig
from agent.daemon import Agent, RoundChanged
from elastic.rendezvous.api import NodeInfo
from elastic.rendezvous.node import RendezvousNode
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore
from tests.sim.world import FakeMesh, FakeServer, FakeSupervisor, Network, Workers


class OneNode:
    """Node "a" of job "j" with two fake workers, wired and not yet started
    (``self.agent.start(threaded=False)`` starts it); ``agent_options`` go to
    :class:`Agent` (metrics, gpus, sleep)."""

    def __init__(self, config: AgentConfig, *, total_steps: int = 1000,
                 supervisor: type[FakeSupervisor] = FakeSupervisor, **agent_options: Any):
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock, synchronous=True)
        network = Network()
        self.workers = Workers(network, step_s=0.5, total_steps=total_steps, ckpt_every=10,
                               init_timeout_s=30.0, crash_delay_s=0.5, form_s=0.5,
                               rng=random.Random(0), latest_step=lambda: (0, 0))
        inbox: queue.Queue = queue.Queue()
        server = FakeServer("a:1")
        network.servers["a:1"] = ("a", server)
        self.rdzv = RendezvousNode(self.store, config.rendezvous(),
                                   NodeInfo(node_id="a", host="h", nproc=2, addr="a:1"),
                                   clock=self.clock, on_round=lambda _r: inbox.put(RoundChanged()),
                                   port_picker=lambda _h: 1)
        self.supervisor = supervisor(self.workers, "a", self.clock.monotonic)
        self.agent = Agent(config, self.store, self.rdzv, self.supervisor, server,
                           FakeMesh(network, "a"), inbox=inbox, clock=self.clock,
                           **agent_options)
        server.agent = self.agent
        self.workers.agents["a"] = self.agent
        self.workers.on_exit["a"] = inbox.put

    def run(self, seconds: float, dt: float = 0.25, *, until_final: bool = False) -> None:
        """Move the store, the rendezvous, the agent, the workers and the clock
        forward for ``seconds`` in steps of ``dt`` (stopping early once the agent
        reaches a final state, if ``until_final``)."""
        for _ in range(int(seconds / dt)):
            if until_final and self.agent.state.final:
                return
            self.store.deliver_pending()
            self.rdzv.pump()
            self.store.deliver_pending()
            self.agent.step(0)
            self.workers.advance(self.clock.monotonic())
            self.clock.advance(dt)
