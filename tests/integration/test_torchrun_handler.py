"""torchrun's etcd3 rendezvous handler against a real etcd, in one process.

Handlers are made the way torchrun makes them (torch's registry, which finds
the backend through the ``torchrun.handlers`` entry point), and driven through
torch's ``RendezvousHandler`` interface alone, covering what torch's own
handler tests expect: consecutive ranks, MIN/MAX and the last call, late nodes
counted by ``num_nodes_waiting`` and admitted by the next round, a member that
asks again starting a new round for everyone, a dead node (its lease runs out)
leading to a round without it, closing, and etcd over TLS as a user.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic.errors import ConfigError
from elastic.rendezvous import round_record
from elastic.store.server import EtcdServer, ServerTLS
from tests.integration.tcp_proxy import TcpProxy
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

WAIT_S = 15.0


@pytest.fixture
def make(etcd_endpoint, job_id):
    """``make(nnodes=(2, 2), endpoint=..., **rdzv_conf)``: a handler of the
    test's job, shut down after the test."""
    made = []

    def make_handler(nnodes=(2, 2), endpoint=etcd_endpoint, **conf):
        conf = {"last_call_timeout": "0.2", "keep_alive_interval": "1",
                "keep_alive_max_attempt": "1", "join_timeout": str(WAIT_S),
                **conf}
        params = RendezvousParameters("etcd3", endpoint, job_id, *nnodes,
                                      local_addr="127.0.0.1", **conf)
        handler = get_rendezvous_handler(params)
        made.append(handler)
        return handler

    yield make_handler
    for handler in made:
        handler.shutdown()


def rendezvous_all(*handlers):
    """next_rendezvous of every handler at once; their RendezvousInfos, in order."""
    with concurrent.futures.ThreadPoolExecutor(len(handlers)) as pool:
        return [f.result(WAIT_S) for f in [pool.submit(h.next_rendezvous) for h in handlers]]


def test_two_agents_form_a_round_with_consecutive_ranks_and_share_its_store(make, job_id):
    a, b = make(), make()
    info_a, info_b = rendezvous_all(a, b)
    assert sorted([info_a.rank, info_b.rank]) == [0, 1]
    assert info_a.world_size == info_b.world_size == 2
    assert info_a.bootstrap_store_info == info_b.bootstrap_store_info
    assert info_a.bootstrap_store_info.master_addr == "127.0.0.1"
    assert info_a.bootstrap_store_info.master_port > 0
    info_a.store.set("torchelastic/role_info/0", "x")
    assert info_b.store.get("torchelastic/role_info/0") == b"x"
    assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
    assert (a.get_backend(), a.get_run_id(), a.use_agent_store) == ("etcd3", job_id, False)


def test_below_min_no_round_forms_and_at_max_it_closes_without_the_last_call(make):
    lone = make(nnodes=(2, 3), last_call_timeout="30", join_timeout="1")
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="not included in a round after round 0 "
                                                     "within 1 s"):
        lone.next_rendezvous()
    assert time.monotonic() - started >= 1.0
    # Two more arrive: MAX (3) is there, so the 30 s last call is not waited out.
    others = [make(nnodes=(2, 3), last_call_timeout="30") for _ in range(2)]
    started = time.monotonic()
    infos = rendezvous_all(lone, *others)
    assert time.monotonic() - started < 10
    assert sorted(i.rank for i in infos) == [0, 1, 2]


def test_with_min_present_the_round_closes_after_the_last_call(make):
    a, b = make(nnodes=(2, 3), last_call_timeout="1.5"), make(nnodes=(2, 3),
                                                              last_call_timeout="1.5")
    started = time.monotonic()
    infos = rendezvous_all(a, b)
    assert time.monotonic() - started >= 1.4  # the last call, from the second arrival
    assert [i.world_size for i in infos] == [2, 2]


@pytest.mark.parametrize("roster", ["in the record", "in buckets, as a large job's"])
def test_a_late_node_is_counted_as_waiting_and_the_next_round_admits_it(make, roster,
                                                                         monkeypatch):
    if roster != "in the record":  # a follower holds its own bucket of each roster alone
        monkeypatch.setattr(round_record, "INLINE_BYTES", 0)
    a, b = make(nnodes=(2, 3)), make(nnodes=(2, 3))
    first_a, first_b = rendezvous_all(a, b)
    late = make(nnodes=(2, 3))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joining = pool.submit(late.next_rendezvous)
        wait_until(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, WAIT_S,
                   "both members count the late node as waiting", poll_s=0.05)
        # As torch's agent does on seeing it: restart, rendezvous again.
        again_a, again_b = rendezvous_all(a, b)
        admitted = joining.result(WAIT_S)
    assert (admitted.rank, admitted.world_size) == (2, 3)
    # The members keep their ranks: survivors first, in their old order.
    assert (again_a.rank, again_b.rank) == (first_a.rank, first_b.rank)
    assert again_a.world_size == again_b.world_size == 3
    assert (a.num_nodes_waiting(), b.num_nodes_waiting(), late.num_nodes_waiting()) == (0, 0, 0)


def test_a_member_that_rendezvous_again_starts_a_new_round_for_everyone(make):
    a, b = make(), make()
    old_a, old_b = rendezvous_all(a, b)
    old_a.store.set("step", "old round")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        failed = pool.submit(a.next_rendezvous)  # a's workers failed: torch's agent asks again
        wait_until(lambda: b.num_nodes_waiting() >= 1, WAIT_S, "b sees the new round", poll_s=0.05)
        new_b = b.next_rendezvous()
        new_a = failed.result(WAIT_S)
    assert (new_a.rank, new_b.rank) == (old_a.rank, old_b.rank)
    # A new round: a new store namespace, which the old round's keys do not reach.
    assert not new_b.store.check(["step"])
    new_a.store.set("step", "new round")
    assert new_b.store.get("step") == b"new round"


def test_a_dead_node_leads_to_a_new_round_without_it(make, etcd_endpoint):
    with TcpProxy.for_url(etcd_endpoint) as proxy:
        a, b = make(nnodes=(2, 3)), make(nnodes=(2, 3))
        doomed = make(nnodes=(2, 3), endpoint=proxy.endpoint)
        infos = rendezvous_all(a, b, doomed)
        assert sorted(i.rank for i in infos) == [0, 1, 2]
        proxy.cut()  # its keep-alives stop reaching etcd: the lease (1 s) runs out
        wait_until(lambda: a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1, WAIT_S,
                   "the survivors see a round without the dead node", poll_s=0.05)
        after_a, after_b = rendezvous_all(a, b)
        assert sorted([after_a.rank, after_b.rank]) == [0, 1]
        assert after_a.world_size == after_b.world_size == 2
        proxy.restore()
        doomed.shutdown()  # while its way to etcd is open: past the proxy it would wait


def test_closing_stops_waiting_nodes_and_refuses_later_ones(make):
    a, b = make(), make()
    rendezvous_all(a, b)
    standby = make()  # beyond MAX (2): waits for a place
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(standby.next_rendezvous)
        time.sleep(0.5)
        assert not waiting.done()
        a.set_closed()
        with pytest.raises(RendezvousGracefulExitError, match="closed while this node waited"):
            waiting.result(WAIT_S)
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()
    latecomer = make()
    assert latecomer.is_closed()
    with pytest.raises(RendezvousClosedError, match="the rendezvous is closed"):
        latecomer.next_rendezvous()
    assert (a.is_closed(), b.is_closed(), b.num_nodes_waiting()) == (True, True, 0)


def test_shutdown_closes_the_rendezvous_for_the_others(make):
    a, b = make(), make()
    rendezvous_all(a, b)
    assert a.shutdown() is True
    assert b.is_closed()
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_a_second_nnodes_for_the_same_job_is_refused(make):
    first = make(nnodes=(1, 2))
    first.next_rendezvous()
    with pytest.raises(ConfigError, match="already running with other settings: max_nodes 2 "
                                          "\\(this agent: 3\\); .* use another --rdzv-id$"):
        make(nnodes=(1, 3)).next_rendezvous()


def test_bad_rdzv_conf_is_refused_before_etcd_is_dialled():
    params = RendezvousParameters("etcd3", "127.0.0.1:1", "job", 1, 2, joint_timeout="5")
    with pytest.raises(ConfigError, match=r"--rdzv-conf: unknown key\(s\) 'joint_timeout'"):
        get_rendezvous_handler(params)


def test_over_tls_as_a_user_limited_to_the_jobs_prefix(tmp_path, job_id):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_cert, client_cert = ca.issue_cert("127.0.0.1"), ca.issue_cert("agent")
    paths = {}
    for name, blob in [("ca", ca.cert_pem), ("server", server_cert.cert_chain_pems[0]),
                       ("server-key", server_cert.private_key_pem),
                       ("client", client_cert.cert_chain_pems[0]),
                       ("client-key", client_cert.private_key_pem)]:
        paths[name] = str(tmp_path / f"{name}.pem")
        blob.write_to_path(paths[name])
    (tmp_path / "password").write_text("tr41ner\n")
    tls = ServerTLS(ca_file=paths["ca"], cert_file=paths["server"], key_file=paths["server-key"],
                    client_ca_file=paths["ca"])
    with EtcdServer(unsafe_no_fsync=True, tls=tls, extra_args=("--bcrypt-cost", "4")) as server:
        server.start()
        server.add_user("trainer", "tr41ner", prefixes=[f"/elastic/v1/{job_id}/"])
        server.enable_auth("r00t")
        params = RendezvousParameters(
            "etcd3", server.endpoint.removeprefix("https://"), job_id, 1, 1,
            local_addr="127.0.0.1", cacert=paths["ca"], cert=paths["client"],
            key=paths["client-key"], user="trainer", password_file=str(tmp_path / "password"))
        handler = get_rendezvous_handler(params)
        try:
            info = handler.next_rendezvous()
            info.store.set("k", "v")
            assert (info.rank, info.world_size, info.store.get("k")) == (0, 1, b"v")
        finally:
            assert handler.shutdown() is True
