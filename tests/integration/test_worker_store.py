"""Rank 0's rendezvous store is up before any script runs, so no rank's first
connection is refused (torch waits 0.4 to 0.7 s before it tries again).

Real warm and cold workers through the supervisor. Each script first knocks on
``MASTER_PORT`` with a plain socket, before it imports anything, and writes
what it found; rank 0's then joins the ``env://`` rendezvous that
``init_process_group`` uses.
"""

from __future__ import annotations

import socket
import textwrap
import time

import pytest

from agent.supervisor import Entrypoint, WorkerSupervisor
from elastic.net import free_port

pytestmark = pytest.mark.integration

SCRIPT = """
    import os, socket, time
    try:
        socket.create_connection(("127.0.0.1", int(os.environ["MASTER_PORT"])), 2).close()
        seen = "listening"
    except ConnectionRefusedError:
        seen = "refused"
    if os.environ["RANK"] == "0" and os.environ["JOIN"] == "1":
        from torch.distributed.rendezvous import rendezvous
        store, _, _ = next(rendezvous("env://", rank=0, world_size=1))
        store.set("joined", "yes")
        seen += ", joined " + store.get("joined").decode()
    with open(os.path.join(os.environ["OUT"], os.environ["RANK"]), "w") as f:
        f.write(seen)
    # Rank 0 (and the store it hosts) stays until every rank has knocked, as
    # init_process_group would keep it.
    while len(os.listdir(os.environ["OUT"])) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)
    """


LISTENERS_SCRIPT = """
    import os
    from torch.distributed.rendezvous import rendezvous
    store, _, _ = next(rendezvous("env://", rank=0, world_size=1))
    port = int(os.environ["MASTER_PORT"])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(local.rsplit(":", 1)[0])
    with open(os.path.join(os.environ["OUT"], os.environ["RANK"]), "w") as f:
        f.write(",".join(found))
    """


def _first_round(tmp_path, *, nproc: int, warm: bool, join: bool,
                 script: str = SCRIPT) -> tuple[dict[str, str], int]:
    """Run ``script`` as round 1 on ``nproc`` workers (global ranks 0..nproc-1) with a fresh
    MASTER_PORT; returns what each rank wrote, and the port."""
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    out = tmp_path / f"out-{warm}"
    out.mkdir()
    port = free_port()
    sup = WorkerSupervisor(job_id="job-t", node_id="node-a", nproc=nproc,
                           entrypoint=Entrypoint(script=str(tmp_path / "script.py")),
                           log_dir=str(tmp_path / "logs"), prestart=warm, stop_grace_s=1.0,
                           worker_env={"ELASTIC_PRELOAD": "torch.distributed"})
    try:
        if warm:
            sup.warm_up()
            deadline = time.monotonic() + 60
            while not all(w.ready for w in sup.warm_workers()):
                assert time.monotonic() < deadline, "the warm workers never got ready"
                time.sleep(0.05)
        sup.start_round(1, [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                             "OUT": str(out), "JOIN": "1" if join else "0"}
                            for r in range(nproc)])
        deadline = time.monotonic() + 60
        while len([p for p in out.iterdir() if p.read_text()]) < nproc:
            assert time.monotonic() < deadline, "the scripts did not all finish"
            time.sleep(0.02)
        return {p.name: p.read_text() for p in out.iterdir()}, port
    finally:
        sup.shutdown()


def test_warm_rank_0_hosts_the_store_before_any_script_starts_and_its_script_shares_it(
        tmp_path):
    seen, port = _first_round(tmp_path, nproc=1, warm=True, join=True)
    # The script found the port listening before it did anything; its env://
    # rendezvous (a multi-tenant master store on that port) shared the early store
    # instead of failing to bind it. (Other ranks wait for it only up to
    # RENDEZVOUS_STORE_WAIT_S: a race on a loaded machine, so not asserted here.)
    assert seen == {"0": "listening, joined yes"}
    with pytest.raises(ConnectionRefusedError):  # and the store ended with its worker
        socket.create_connection(("127.0.0.1", port), 1).close()


def test_cold_workers_leave_master_port_to_the_script(tmp_path):
    # No torch preloaded to host it with, and importing it would only delay a script
    # that may not need it.
    seen, _ = _first_round(tmp_path, nproc=1, warm=False, join=False)
    assert seen == {"0": "refused"}


def test_warm_rank_0_store_listens_on_master_addr_only(tmp_path):
    # The store has no authentication: torch's own server would listen on every
    # interface (*:MASTER_PORT) while the ranks are told MASTER_ADDR.
    seen, _ = _first_round(tmp_path, nproc=1, warm=True, join=True, script=LISTENERS_SCRIPT)
    assert seen == {"0": "0100007F"}  # 127.0.0.1 (little-endian hex), nothing else


def test_cold_rank_0_store_listens_on_master_addr_only_once_the_script_imports_torch(
        tmp_path):
    # A cold script's own env:// rendezvous would host the store on every interface.
    seen, _ = _first_round(tmp_path, nproc=1, warm=False, join=True, script=LISTENERS_SCRIPT)
    assert seen == {"0": "0100007F"}
