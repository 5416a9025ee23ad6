"""Replication between agents under mutual TLS: a slot goes through the agent's real
gRPC server to its buddy's receiver with the agents' certificates; the plain-text probe
endpoint and callers without a certificate of the job's CA are refused."""

from __future__ import annotations

import os
import threading

import pytest

from agent.grpc_server import AgentServer
from agent.memory_client import ReplicaClient
from agent.memory_receiver import ReplicaReceiver
from agent.tls import AgentTLS
from elastic.checkpoint.memory import layout
from elastic.errors import AgentUnreachableError, ElasticError
from elastic.rendezvous.api import Member, Round

CHUNKS = 3  # the slot's data spans several Replicate calls


class Receiving:
    """The receiving agent's control: only Replicate is used here."""

    def __init__(self, memory_dir: str):
        members = (Member("a", 0, "127.0.0.1", 1), Member("b", 1, "127.0.0.1", 1))
        round_ = Round(number=2, members=members, master_addr="127.0.0.1", master_port=1,
                       reason="", leader="a", created_at=0.0)
        self.receiver = ReplicaReceiver(memory_dir, "job", "b", lambda: round_,
                                        lambda: 1 << 40, threading.Lock())

    def replicate(self, request):
        return self.receiver.receive(request)


@pytest.fixture
def buddy(certs, sock_dir, tmp_path):
    tls = AgentTLS(cert=certs.agent.cert, key=certs.agent.key, ca=certs.ca)
    server = AgentServer("127.0.0.1:0", os.path.join(sock_dir, "b.sock"),
                         Receiving(str(tmp_path / "b")), None, max_workers=4, tls=tls,
                         probe_listen="127.0.0.1:0")
    server.start()
    yield server
    server.stop(grace_s=0.1)


@pytest.fixture
def slot(tmp_path):
    slot_dir = os.path.join(layout.own_dir(str(tmp_path / "a")), layout.SlotKey(2, 0, 1).name)
    layout.begin_write(slot_dir)
    data = os.urandom(CHUNKS << 20)
    with open(os.path.join(slot_dir, layout.DATA), "wb") as f:
        f.write(data)
    layout.finish_write(slot_dir, layout.Manifest(
        job_id="job", node_id="a", round=2, step=5, rank=0, world_size=2,
        files={layout.DATA: len(data)}))
    return layout.read_slot(slot_dir), data


def test_a_slot_reaches_the_buddy_under_mutual_tls(certs, buddy, slot, tmp_path):
    info, data = slot
    client = ReplicaClient("job", "a", AgentTLS(cert=certs.operator.cert,
                                                key=certs.operator.key, ca=certs.ca))
    try:
        assert client.send_slot(buddy.address, 2, info) == info.manifest.nbytes + len(
            open(os.path.join(info.path, layout.MANIFEST), "rb").read())
    finally:
        client.close()
    replica = layout.read_slot(str(tmp_path / "b" / "replicas" / "a" / info.key.name), "a")
    assert replica is not None and replica.manifest == info.manifest
    assert open(os.path.join(replica.path, layout.DATA), "rb").read() == data


def test_the_probe_endpoint_and_callers_without_a_certificate_are_refused(certs, buddy,
                                                                           slot, tmp_path):
    info, _ = slot
    plain = ReplicaClient("job", "a", None)
    no_cert = ReplicaClient("job", "a", AgentTLS(ca=certs.ca))
    try:
        with pytest.raises(ElasticError, match="PERMISSION_DENIED.*read-only probe"):
            plain.send_slot(buddy.probe_address, 2, info)
        with pytest.raises(AgentUnreachableError):
            no_cert.send_slot(buddy.address, 2, info)
    finally:
        plain.close()
        no_cert.close()
    assert not os.path.exists(tmp_path / "b" / "replicas")


def test_a_slot_that_changes_during_the_copy_is_abandoned_and_never_complete(
        certs, buddy, slot, tmp_path):
    info, _ = slot
    # The worker starts the slot over after the copy began: its manifest goes first.
    os.unlink(os.path.join(info.path, layout.MANIFEST))
    client = ReplicaClient("job", "a", AgentTLS(cert=certs.agent.cert, key=certs.agent.key,
                                                ca=certs.ca))
    try:
        with pytest.raises(FileNotFoundError):
            client.send_slot(buddy.address, 2, info)
        layout.finish_write(info.path, info.manifest)  # a new manifest: another stamp
        assert client.send_slot(buddy.address, 2, info) is None
    finally:
        client.close()
    replica_dir = tmp_path / "b" / "replicas" / "a" / info.key.name
    assert layout.read_slot(str(replica_dir), "a") is None


def test_a_send_stops_at_the_next_chunk_when_the_tier_stops(certs, buddy, slot, tmp_path):
    info, _ = slot
    stop = threading.Event()
    stop.set()
    client = ReplicaClient("job", "a", AgentTLS(cert=certs.agent.cert, key=certs.agent.key,
                                                ca=certs.ca))
    try:
        assert client.send_slot(buddy.address, 2, info, stop) is None
    finally:
        client.close()
    replica_dir = tmp_path / "b" / "replicas" / "a" / info.key.name
    assert os.listdir(replica_dir) == []  # begun, never written, never complete
