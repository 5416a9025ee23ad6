"""Worker environments: torchrun's variables follow the round's node ranks, and the
start-up environment limits threads only where several workers share a node."""

from __future__ import annotations

import pytest

from agent.assign import startup_env, worker_envs
from elastic.rendezvous.api import Member, Round
from tests.unit.test_roster_buckets import bucket_view


def test_worker_envs_follow_node_ranks_with_uneven_nproc():
    r = Round(number=4, members=(Member("a", 0, "h0", 2), Member("b", 1, "h1", 3)),
              master_addr="h0", master_port=2345, reason="", leader="a", created_at=0)
    envs = worker_envs(r, "b", job_id="j", restart_count=2, max_restarts=5, agent_socket="/s",
                       checkpoint_dir="/ck", hang_timeout_s=60)
    assert [e["RANK"] for e in envs] == ["2", "3", "4"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    e = envs[0]
    assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("5", "3", "1")
    assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("h0", "2345")
    assert e["TORCHELASTIC_RESTART_COUNT"] == "2" and e["TORCHELASTIC_MAX_RESTARTS"] == "5"
    assert e["TORCHELASTIC_RUN_ID"] == "j" and e["ELASTIC_ROUND"] == "4"
    assert e["ELASTIC_CHECKPOINT_DIR"] == "/ck" and e["ELASTIC_AGENT_SOCKET"] == "/s"
    with pytest.raises(ValueError):
        worker_envs(r, "zzz", job_id="j", restart_count=0, max_restarts=0, agent_socket="",
                    checkpoint_dir=None, hang_timeout_s=0)


def test_a_large_jobs_node_is_told_from_its_bucket_what_the_whole_list_would_tell_it():
    ms = tuple(Member(f"n{i:04d}", i, f"h{i}", 1 + i % 3) for i in range(300))
    whole = Round(number=4, members=ms, master_addr="h0", master_port=2345, reason="",
                  leader="n0000", created_at=0)
    me = "n0217"
    from_bucket = bucket_view(whole, me)
    envs = worker_envs(from_bucket, me, job_id="j", restart_count=0, max_restarts=0,
                       agent_socket="", checkpoint_dir=None, hang_timeout_s=0)
    assert envs == worker_envs(whole, me, job_id="j", restart_count=0, max_restarts=0,
                               agent_socket="", checkpoint_dir=None, hang_timeout_s=0)
    assert envs[0]["RANK"] == str(sum(m.nproc for m in ms[:217]))


def test_startup_env_limits_threads_only_for_several_workers_unless_set():
    # TORCH_NCCL_ASYNC_ERROR_HANDLING: torch's default (3), or the agent's own (inherited).
    assert startup_env(2, {}) == {"OMP_NUM_THREADS": "1"}
    assert startup_env(1, {}) == {}
    assert startup_env(4, {"OMP_NUM_THREADS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) == {}
