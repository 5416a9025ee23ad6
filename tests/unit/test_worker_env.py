"""The worker environment contract (elastic.worker_env): what the agent writes
is what the worker reads."""

from __future__ import annotations

import pytest

from agent.assign import worker_envs
from elastic import worker_env
from elastic.errors import ConfigError
from elastic.rendezvous.api import Member, Round
from elastic.worker_env import WorkerEnv


def a_round() -> Round:
    return Round(number=7, members=(Member("a", 0, "h", 2, "h:1"),), master_addr="h",
                 master_port=29500, reason="", leader="a", created_at=0.0)


def test_what_the_agent_writes_the_worker_reads():
    env = worker_envs(a_round(), "a", job_id="j", restart_count=0, max_restarts=3,
                      agent_socket="/run/a.sock", checkpoint_dir="/ckpt", hang_timeout_s=30,
                      lease_ttl_s=5, heartbeat_socket="/run/a.hb")[1]

    read = WorkerEnv(env)
    assert (read.round, read.job_id, read.node_id) == (7, "j", "a")
    assert (read.agent_socket, read.heartbeat_socket, read.checkpoint_dir) == (
        "/run/a.sock", "/run/a.hb", "/ckpt")
    assert (read.hang_timeout_s, read.lease_ttl_s) == (30.0, 5.0)


def test_what_the_agent_sets_is_no_option_it_warns_about():
    env = worker_envs(a_round(), "a", job_id="j", restart_count=0, max_restarts=3,
                      agent_socket="/s", checkpoint_dir="/c", hang_timeout_s=0,
                      heartbeat_socket="/h")[0]

    assert {name for name in env if name.startswith("ELASTIC_")} <= worker_env.NOT_OPTIONS


def test_unset_or_empty_reads_as_none_and_round_0():
    read = WorkerEnv({worker_env.CHECKPOINT_DIR: "", worker_env.ROUND: ""})

    assert read.round == 0
    assert (read.checkpoint_dir, read.agent_socket, read.hang_timeout_s) == (None, None, None)


@pytest.mark.parametrize("name, attribute", [(worker_env.ROUND, "round"),
                                              (worker_env.HANG_TIMEOUT_S, "hang_timeout_s"),
                                              (worker_env.LEASE_TTL_S, "lease_ttl_s")])
def test_a_value_that_does_not_parse_is_a_config_error_naming_it(name, attribute):
    with pytest.raises(ConfigError, match=name):
        getattr(WorkerEnv({name: "x1"}), attribute)
