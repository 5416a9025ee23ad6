"""torchrun's ``etcd3`` rendezvous backend: torch's ``RendezvousHandler`` on our etcd v3 rendezvous.

With this package installed, torch finds the backend through the
``torchrun.handlers`` entry point group (``pyproject.toml``)::

    torchrun --rdzv-backend etcd3 --rdzv-endpoint HOST:2379[,HOST:2379...] \\
        --rdzv-id JOB --nnodes 1:4 --nproc-per-node 8 \\
        [--rdzv-conf last_call_timeout=1,keep_alive_interval=1,cacert=ca.pem] \\
        train.py

torch's own etcd backends speak etcd's v2 API (off by default since etcd 3.4,
removed in 3.6); this one speaks v3 only, through :mod:`elastic.store`.
``--rdzv-conf`` keys: :data:`elastic.torchrun.conf.CONF_KEYS`, the same table
elasticd reads a torchrun command line with.

How torch's handler contract maps onto :class:`~elastic.rendezvous.node.RendezvousNode`
(the protocol elasticd uses; nothing here forms rounds itself):

* Each torchrun agent is one node of the job ``--rdzv-id``, with its own etcd
  lease (TTL ``keep_alive_interval`` x ``keep_alive_max_attempt``). Its first
  ``next_rendezvous`` registers it; the elected leader commits fenced rounds:
  at MAX nodes at once, at MIN or more once no node arrived for
  ``last_call_timeout``. The round's node ranks are
  the agents' group ranks, consecutive, survivors first in their old order.
* A later ``next_rendezvous`` (torch's agent calls it when its workers failed,
  or to admit waiting nodes) takes a newer round that includes this node if
  one was committed; otherwise it asks the leader for a new round of the same
  members (never counted as a failure: ``--max-restarts`` is torchrun's) and
  waits for it. Either way it tells the leader it started the round, as
  elasticd does (the leader leaves out members that never start).
* ``num_nodes_waiting`` is above 0 once a round newer than this agent's was
  committed: a node joined, a member's lease expired (a dead or frozen
  node), or another member asked for a new round. torch's agent then restarts
  its workers and calls ``next_rendezvous``, which returns that round. It
  answers from what the node's watches delivered: no etcd request per call.
* Closing: ``set_closed`` writes ``torchrun/closed``; from then on
  ``next_rendezvous`` raises ``RendezvousClosedError`` everywhere, also in
  nodes already waiting (they watch the key). ``shutdown`` closes, as torch's
  own handlers do, then leaves (revoking the lease, so peers see it at once).

The store: ``use_agent_store`` is False. The agents get an
:class:`~elastic.torchrun.store.EtcdTorchStore` of the round (rank assignment,
exit barrier), and the workers ``MASTER_ADDR`` = rank 0's host
(``--local-addr``, else its FQDN) and ``MASTER_PORT`` = a port that was free
there, advertised afresh by rank 0 for every round; the workers' rank 0 opens
its own TCPStore on it, as with torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
Why not a TCPStore in rank 0's agent, as torch's c10d backend does: the agent
store in etcd outlives any agent (rank 0's agent dying takes nothing with
it), needs no port of its own, and is namespaced per round, so a late write
of an old round can never confuse a new one; and the workers' own
``init_process_group`` traffic (many small requests per start) stays off etcd.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
from typing import Callable, Iterator

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic import errors
from elastic.keyspace import JobKeys
from elastic.net import free_port
from elastic.rendezvous.api import NodeInfo, ReportKind, Round
from elastic.rendezvous.node import RendezvousNode
from elastic.store import EventType, Get, Store, Watch, open_store
from elastic.torchrun.settings import BACKEND, HandlerSettings, settings_from_conf
from elastic.torchrun.store import EtcdTorchStore

log = logging.getLogger(__name__)

# How often a waiting next_rendezvous looks whether the rendezvous was closed.
_WAIT_SLICE_S = 0.25
# The most rounds whose agent stores rank 0 of a new round deletes.
_MAX_STORES_DROPPED = 16
_NODE_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def create_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point.

    torch calls it with no argument when ``torch.distributed.elastic.rendezvous``
    is imported, and registers what it returns as the creator of the
    ``etcd3`` backend (torch 2.13's ``_register_out_of_tree_handlers``).
    """
    return handler_from_params


def handler_from_params(params: RendezvousParameters) -> "EtcdRendezvousHandler":
    """An :class:`EtcdRendezvousHandler` for torchrun's arguments, connected to etcd.

    Raises:
        ConfigError: bad ``--rdzv-*`` arguments (one line naming the option).
        RendezvousConnectionError: etcd cannot be reached, or refused us.
    """
    return EtcdRendezvousHandler.from_params(params)


_local_ids = itertools.count()


def default_node_id(hostname: str | None = None, pid: int | None = None) -> str:
    """``<host>-<pid>-<n>``, ``n`` counting the handlers of this process (as
    torch's node descriptors do): unique per torchrun agent, readable in elasticctl."""
    host = _NODE_ID_UNSAFE.sub("-", hostname or socket.gethostname()).strip(".-_")[:96]
    return f"{host or 'node'}-{os.getpid() if pid is None else pid}-{next(_local_ids)}"


def _master_port(host: str) -> int:
    """A port free on every interface: the workers' rank 0 binds its TCPStore there."""
    return free_port("::" if ":" in host else "0.0.0.0")


@contextlib.contextmanager
def _torch_errors(what: str) -> Iterator[None]:
    """Our errors as the rendezvous errors torch's agent expects, cause chained.
    ConfigError (bad input) passes through: it already says what to change."""
    try:
        yield
    except errors.JobEndedError as exc:
        raise RendezvousClosedError(f"{what}: {exc}") from exc
    except errors.RendezvousTimeoutError as exc:
        raise RendezvousTimeoutError(f"{what}: {exc}") from exc
    except errors.MalformedRecordError as exc:
        raise RendezvousStateError(f"{what}: {exc}") from exc
    except errors.StoreError as exc:
        raise RendezvousConnectionError(f"{what}: etcd failed: {exc}") from exc
    except errors.RendezvousError as exc:
        raise RendezvousError(f"{what}: {exc}") from exc


class EtcdRendezvousHandler(RendezvousHandler):
    """torch's rendezvous handler for one torchrun agent (see the module docstring).

    Built by :meth:`from_params`; ``store`` is closed by :meth:`shutdown`.
    """

    def __init__(self, settings: HandlerSettings, store: Store, info: NodeInfo):
        self._settings = settings
        self._store = store
        self._keys = JobKeys(settings.run_id)
        self._node = RendezvousNode(store, settings.rendezvous_config(), info,
                                    port_picker=_master_port, job_flag="--rdzv-id")
        self._lock = threading.Lock()  # one next_rendezvous at a time
        self._shutdown_lock = threading.Lock()  # never held while waiting
        self._joined = False
        self._round: Round | None = None  # the round next_rendezvous last returned
        self._closed = threading.Event()  # seen set (by anyone)
        self._closed_watch: Watch | None = None
        self._closed_watch_ended = threading.Event()
        self._shut_down = False

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> "EtcdRendezvousHandler":
        """See :func:`handler_from_params`."""
        settings = settings_from_conf(
            run_id=params.run_id, endpoint=params.endpoint, min_nodes=params.min_nodes,
            max_nodes=params.max_nodes, local_addr=params.local_addr, conf=params.config,
            default_host="" if params.local_addr else socket.getfqdn())
        info = NodeInfo(node_id=default_node_id(), host=settings.host,
                        master_port=_master_port(settings.host), version="torchrun-etcd3")
        with _torch_errors(f"--rdzv-endpoint {settings.endpoints}"):
            store = open_store(settings.endpoints, security=settings.security,
                               connect_timeout_s=settings.connect_timeout_s)
        return cls(settings, store, info)

    # ------------------------------------------------------ torch's interface

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def use_agent_store(self) -> bool:
        """False: the workers get their own TCPStore (see the module docstring)."""
        return False

    @property
    def node_id(self) -> str:
        return self._node.node_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Block until a round that includes this node is committed (see the
        module docstring); its store, group rank, group size and MASTER_ADDR/PORT.

        Raises:
            RendezvousClosedError: the rendezvous is closed (before or while waiting).
            RendezvousGracefulExitError: closed while this node waited beyond
                ``--nnodes`` MAX for a place.
            RendezvousTimeoutError: no round included this node within the
                join timeout (a node beyond MAX waits without one, as torch's do).
            RendezvousConnectionError: etcd failed.
            ConfigError: the job already runs with another ``--nnodes``.
        """
        with self._lock, _torch_errors(self._describe()):
            if self._shut_down:
                raise RendezvousClosedError(f"{self._describe()}: this handler was shut down")
            if not self._joined:
                self._join()
            elif self._round is not None:
                self._ask_for_new_round()
            previous, current = self._round, self._wait_for_round()
            self._round = current
            self._report_started(current)
            member = current.member(self.node_id)
            if member.node_rank == 0:
                self._drop_old_stores(previous.number if previous else 0, current.number)
        log.info("%s: joined round %d as node rank %d of %d; MASTER_ADDR %s, MASTER_PORT %d",
                 self._describe(), current.number, member.node_rank, len(current.members),
                 current.master_addr, current.master_port)
        return RendezvousInfo(
            EtcdTorchStore(self._store, self._keys.torchrun_store(current.number)),
            member.node_rank, len(current.members),
            RendezvousStoreInfo(current.master_addr, current.master_port))

    def num_nodes_waiting(self) -> int:
        """How many nodes the round newer than this agent's brings in (at
        least 1 if there is such a round, whatever it changed; 1 for a large
        job's, whose members this node holds only in part); 0 otherwise, and
        once the rendezvous is closed."""
        mine = self._round
        latest = self._node.placed_round
        if (mine is None or latest is None or latest.number <= mine.number or latest.outcome
                or self._closed.is_set()):
            return 0
        if not (latest.holds_members and mine.holds_members):
            return 1
        return max(1, sum(1 for n in latest.node_ids if mine.member(n) is None))

    def is_closed(self) -> bool:
        """Whether anyone closed the rendezvous (read from etcd).

        Raises RendezvousConnectionError when etcd fails."""
        if self._closed.is_set():
            return True
        with _torch_errors(self._describe()):
            closed = self._store.get(self._keys.torchrun_closed) is not None
        if closed:
            self._closed.set()
        return closed

    def set_closed(self) -> None:
        """Close the rendezvous for every node of the job, within ``close_timeout``.

        Raises RendezvousConnectionError when etcd fails."""
        record = json.dumps({"by": self.node_id, "at": time.time()}).encode()
        with _torch_errors(self._describe()):
            self._store.put(self._keys.torchrun_closed, record,
                            timeout_s=self._settings.close_timeout_s)
        self._closed.set()
        log.info("%s: closed the rendezvous", self._describe())

    def shutdown(self) -> bool:
        """Close the rendezvous, leave it and release etcd; idempotent.

        Returns False when the rendezvous could not be marked closed (etcd
        failed; logged), True otherwise."""
        with self._shutdown_lock:
            if self._shut_down:
                return True
            self._shut_down = True
        closed = True
        try:
            if not self._closed.is_set():
                self.set_closed()
        except RendezvousError as exc:
            log.warning("%s: could not mark the rendezvous closed: %s", self._describe(), exc)
            closed = False
        if self._closed_watch is not None:
            self._closed_watch.cancel()
        self._node.stop()
        self._store.close()
        return closed

    # ------------------------------------------------------------ the steps

    def _describe(self) -> str:
        return f"{BACKEND} rendezvous {self._settings.run_id!r} node {self.node_id}"

    def _join(self) -> None:
        """Refuse a closed rendezvous, watch for it closing, register."""
        self._watch_closed()
        if self._closed.is_set():
            raise RendezvousClosedError(f"{self._describe()}: the rendezvous is closed")
        self._node.start()
        self._joined = True

    def _watch_closed(self) -> None:
        """Read the closed mark and watch it from that revision on."""
        result = self._store.txn([], [Get(self._keys.torchrun_closed)])
        if result.results[0]:
            self._closed.set()
            return

        def on_events(events) -> None:
            if any(ev.type is EventType.PUT for ev in events):
                self._closed.set()

        if self._closed_watch is not None:
            self._closed_watch.cancel()
        self._closed_watch_ended.clear()
        self._closed_watch = self._store.watch(
            self._keys.torchrun_closed, on_events, start_revision=result.revision + 1,
            on_error=lambda _exc: self._closed_watch_ended.set())

    def _ask_for_new_round(self) -> None:
        """Unless a newer round that includes this node exists, ask for one."""
        mine = self._round
        latest = self._node.placed_round
        if (latest is not None and latest.number > mine.number
                and latest.member(self.node_id) is not None):
            return
        log.info("%s: asking for a new round to replace round %d", self._describe(),
                 mine.number)
        self._node.request_restart(
            f"torchrun agent {self.node_id} stopped its workers of round {mine.number} and "
            "asked for a new round", mine.number, failure=False)

    def _wait_for_round(self) -> Round:
        after = self._round.number if self._round is not None else 0
        join_s = self._settings.join_timeout_s
        deadline = time.monotonic() + join_s
        while True:
            if self._closed_watch_ended.is_set():
                self._watch_closed()  # compacted away: read again, watch again
            latest = self._node.placed_round
            beyond_max = (latest is not None and latest.member(self.node_id) is None
                          and len(latest.members) >= self._settings.max_nodes)
            if self._closed.is_set():
                error = RendezvousGracefulExitError if beyond_max else RendezvousClosedError
                raise error(f"{self._describe()}: the rendezvous was closed while this node "
                            f"waited for a round after round {after}")
            if beyond_max:
                deadline = time.monotonic() + join_s  # a standby waits for a place
            left = deadline - time.monotonic()
            if left <= 0:
                seen = (f"latest round {latest.number} has {_members_of(latest)}" if latest
                        else "no round has been committed yet")
                raise RendezvousTimeoutError(
                    f"{self._describe()}: not included in a round after round {after} within "
                    f"{join_s:g} s (join_timeout; {seen})")
            try:
                current = self._node.wait_for_round(after, timeout_s=min(left, _WAIT_SLICE_S))
            except errors.RendezvousTimeoutError:
                continue
            if current.outcome:
                raise RendezvousClosedError(f"{self._describe()}: the job has "
                                            f"{current.outcome} (round {current.number})")
            return current

    def _report_started(self, current: Round) -> None:
        """Tell the leader this node takes part in ``current``. A failure is
        logged, not raised: the node's lease is gone, and it registers again
        as a newcomer, which forms a new round by itself."""
        try:
            self._node.report(ReportKind.STARTED, current.number)
        except errors.StoreError as exc:
            log.warning("%s: could not report starting round %d: %s", self._describe(),
                        current.number, exc)

    def _drop_old_stores(self, previous: int, current: int) -> None:
        """Delete the agent stores of the rounds before ``current`` since
        ``previous`` (best effort: the next round's rank 0 tries again)."""
        for number in range(max(previous, current - _MAX_STORES_DROPPED, 1), current):
            try:
                self._store.delete(self._keys.torchrun_store(number), prefix=True)
            except errors.StoreError as exc:
                log.info("%s: could not delete round %d's agent store: %s", self._describe(),
                         number, exc)
                return


def _members_of(r: Round) -> str:
    """``r``'s members for an error: the list, or their count where this node
    holds its own bucket of a large job's roster alone."""
    return str(list(r.node_ids)) if r.holds_members else f"{len(r.members)} members"
