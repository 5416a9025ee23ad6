"""A 3-member etcd cluster, one member per host of the topology, for the chaos campaign.

Each member is the etcd 3.5 binary the project finds with
:func:`elastic.store.server.find_etcd_binary`, started in its host's namespace
(``ip netns exec``; on loopback, on ports of its own) with a data directory
that survives :meth:`EtcdMember.kill`, so :meth:`EtcdMember.start` brings the
same member back, as a crashed machine would come back. Every member carries
the run's ``CHAOS_TAG`` and dies with the harness (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time

import grpc

from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic.store.server import find_etcd_binary
from tests.chaos.topology import TAG_ENV, Host
from tests.proctable import killed_with_this_process

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdMember:
    def __init__(self, index: int, host: Host, workdir: str, tag: str, cluster_token: str):
        self.name = f"m{index}"
        self.host = host
        self.tag = tag
        self.token = cluster_token
        isolated = host.netns is not None
        self.client_port = 2379 if isolated else _free_port()
        self.peer_port = 2380 if isolated else _free_port()
        self.data_dir = os.path.join(workdir, f"etcd-{self.name}")
        self.log_path = os.path.join(workdir, f"etcd-{self.name}.log")
        self.proc: subprocess.Popen | None = None
        self.initial_cluster = ""

    @property
    def client_url(self) -> str:
        return f"http://{self.host.addr}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host.addr}:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start (or start again) this member; returns at once
        (:meth:`EtcdCluster.wait_ready` waits for the cluster)."""
        if self.running:
            return
        state = "existing" if os.path.isdir(os.path.join(self.data_dir, "member")) else "new"
        cmd = [find_etcd_binary(), "--name", self.name, "--data-dir", self.data_dir,
               "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
               "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
               "--initial-cluster", self.initial_cluster, "--initial-cluster-state", state,
               "--initial-cluster-token", self.token,
               "--heartbeat-interval", "100", "--election-timeout", "1000",
               "--unsafe-no-fsync", "--log-level", "warn"]
        with open(self.log_path, "ab") as logf:
            logf.write(f"--- {time.strftime('%H:%M:%S')} starting {self.name}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                self.host.wrap(cmd), stdin=subprocess.DEVNULL, stdout=logf,
                stderr=subprocess.STDOUT, env={**os.environ, TAG_ENV: self.tag},
                start_new_session=True, preexec_fn=killed_with_this_process())

    def kill(self) -> None:
        """SIGKILL: a crash. The data directory stays for :meth:`start`."""
        if self.running:
            self.proc.kill()
            self.proc.wait()

    def status(self, timeout_s: float = 1.0) -> rpc_pb2.StatusResponse | None:
        """This member's Maintenance.Status, or None when it does not answer."""
        if not self.running:
            return None
        try:
            with grpc.insecure_channel(f"{self.host.addr}:{self.client_port}") as ch:
                return rpc_pb2_grpc.MaintenanceStub(ch).Status(rpc_pb2.StatusRequest(),
                                                               timeout=timeout_s)
        except grpc.RpcError:
            return None


class EtcdCluster:
    def __init__(self, hosts: list[Host], workdir: str, tag: str):
        self.members = [EtcdMember(i, h, workdir, tag, f"{tag}-etcd")
                        for i, h in enumerate(hosts)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        return ",".join(m.client_url for m in self.members)

    def start(self, timeout_s: float = 30.0) -> None:
        for m in self.members:
            m.start()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until every running member answers and they agree on a leader."""
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = [m.status() for m in self.members if m.running]
            leaders = {s.leader for s in statuses if s is not None}
            if statuses and None not in statuses and len(leaders) == 1 and 0 not in leaders:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"{m.name}: {_tail(m.log_path)}" for m in self.members)
                raise RuntimeError(f"etcd cluster not ready within {timeout_s} s:\n{tails}")
            time.sleep(0.2)

    def leader(self) -> EtcdMember | None:
        for m in self.members:
            s = m.status()
            if s is not None and s.leader and s.leader == s.header.member_id:
                return m
        return None

    def stop(self) -> None:
        for m in self.members:
            m.kill()


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"
