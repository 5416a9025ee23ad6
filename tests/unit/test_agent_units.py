"""The agent's pure parts: configuration precedence, the lifecycle table, hang
verdicts and worker environments. No processes, no sleeping."""

from __future__ import annotations

import pytest

from agent import config as agent_config
from agent.assign import startup_env, worker_envs
from agent.health import WorkerHealth, hung_workers
from agent.lifecycle import AgentState, IllegalTransition, Lifecycle
from elastic.errors import ConfigError
from elastic.rendezvous.api import Member, Round
from tests.fakes.clock import FakeClock


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


class TestConfig:
    def test_precedence_flag_over_env_over_file_over_default(self, tmp_path, script):
        cfg_file = tmp_path / "elastic.yaml"
        cfg_file.write_text("hang_timeout: 11\nlease_ttl: 7\nsettle: 0.5\nnproc_per_node: 3\n")
        env = {"ELASTIC_HANG_TIMEOUT": "22", "ELASTIC_LEASE_TTL": "8"}
        c = agent_config.load(["--config", str(cfg_file), "--standalone", "--job-id", "j",
                               "--nnodes", "1:2", "--hang-timeout", "33", script], env)
        assert c.hang_timeout_s == 33  # flag
        assert c.lease_ttl_s == 8  # env beats file
        assert c.settle_s == 0.5  # file beats default
        assert c.nproc_per_node == 3
        assert c.max_restarts == 3  # default
        assert (c.min_nodes, c.max_nodes) == (1, 2)
        assert c.script == script and c.module is None

    def test_everything_from_the_environment(self, script):
        env = {"ELASTIC_ETCD": "http://127.0.0.1:2379", "ELASTIC_JOB_ID": "job1",
               "ELASTIC_NNODES": "2", "ELASTIC_PRESTART": "false"}
        c = agent_config.load([script, "--lr", "0.1"], env)
        assert c.etcd == "http://127.0.0.1:2379" and c.job_id == "job1"
        assert c.prestart is False
        assert c.script_args == ("--lr", "0.1")

    def test_module_mode_keeps_the_module_name(self):
        c = agent_config.load(["--standalone", "--job-id", "j", "--nnodes", "1", "-m",
                               "pkg.train", "x"], {})
        assert c.module == "pkg.train" and c.script is None and c.script_args == ("x",)

    @pytest.mark.parametrize("argv,needle", [
        (["--job-id", "j", "--nnodes", "2"], "no etcd given"),  # one node: standalone
        (["--standalone", "--etcd", "http://x:1", "--job-id", "j", "--nnodes", "1"],
         "either --etcd or --standalone"),
        (["--etcd", "http://x:1", "--nnodes", "1"], "--job-id (torchrun: --rdzv-id) is required"),
        (["--standalone", "--job-id", "j", "--nnodes", "3:2"], "MIN (3) must not be greater"),
        (["--standalone", "--job-id", "j", "--nnodes", "1", "--nproc-per-node", "0"],
         "--nproc-per-node '0': must be greater than 0"),
        (["--standalone", "--job-id", "j", "--nnodes", "1", "--hang-timeout", "soon"],
         "--hang-timeout 'soon': expected a float"),
        (["--standalone", "--job-id", "j", "--nnodes", "1", "--listen", "nohost"],
         "expected HOST:PORT"),
    ])
    def test_bad_values_are_refused_by_name(self, argv, needle, script):
        with pytest.raises(ConfigError) as info:
            agent_config.load(argv + [script], {})
        assert needle in str(info.value)

    def test_missing_script_is_named(self):
        with pytest.raises(ConfigError, match="training script 'nope.py' not found"):
            agent_config.load(["--standalone", "--job-id", "j", "--nnodes", "1", "nope.py"], {})

    def test_unknown_file_key_is_an_error_not_ignored(self, tmp_path, script):
        f = tmp_path / "c.yaml"
        f.write_text("hang_timout: 5\n")
        with pytest.raises(ConfigError, match="unknown option.*hang_timout"):
            agent_config.load(["--config", str(f), "--standalone", "--job-id", "j",
                               "--nnodes", "1", script], {})

    def test_unknown_environment_variable_is_warned_about(self, script, caplog):
        agent_config.load(["--standalone", "--job-id", "j", "--nnodes", "1", script],
                          {"ELASTIC_HANG_TIMOUT": "5", "ELASTIC_ROUND": "3"})
        assert "ELASTIC_HANG_TIMOUT" in caplog.text
        assert "ELASTIC_ROUND" not in caplog.text  # set by the agent for workers


class TestLifecycle:
    def test_transitions_are_published_and_kept(self):
        seen = []
        lc = Lifecycle("j", "n", publish=seen.append, clock=FakeClock())
        lc.to(AgentState.JOINING, "registered")
        lc.to(AgentState.STARTING, "rank 0", 1)
        lc.to(AgentState.RUNNING, "2 workers", 1)
        assert [t.after for t in seen] == [AgentState.JOINING, AgentState.STARTING,
                                           AgentState.RUNNING]
        assert seen[-1].reason == "2 workers" and seen[-1].round == 1

    def test_illegal_transition_is_refused(self):
        lc = Lifecycle("j", "n")
        with pytest.raises(IllegalTransition, match="INIT -> RUNNING"):
            lc.to(AgentState.RUNNING, "skipping ahead")
        assert lc.state is AgentState.INIT

    def test_final_states_have_no_way_out(self):
        lc = Lifecycle("j", "n")
        lc.to(AgentState.FAILED, "bad")
        for s in AgentState:
            with pytest.raises(IllegalTransition):
                lc.to(s, "again")


class TestHang:
    def test_silent_script_is_never_judged(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        assert hung_workers([w], now=10_000.0, hang_timeout_s=5) == []

    def test_no_heartbeat_past_the_timeout_is_a_hang(self):
        w = WorkerHealth(local_rank=0, rank=3, started_at=0.0)
        w.on_heartbeat(10.0, -1, 0.0)
        assert hung_workers([w], 14.9, 5) == []
        [(hung, reason)] = hung_workers([w], 15.5, 5)
        assert hung is w and "rank 3 sent no heartbeat for 5.5 s" in reason

    def test_heartbeats_without_progress_are_a_hang_after_the_first_step(self):
        w = WorkerHealth(local_rank=0, rank=1, started_at=0.0)
        for t in range(10, 30):
            w.on_heartbeat(float(t), 7, 0.0)
        [(_, reason)] = hung_workers([w], 29.0, 5)
        assert "made no progress for 19.0 s after step 7" in reason

    def test_announced_save_suspends_the_progress_check(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        w.on_heartbeat(10.0, 5, 0.0)
        w.on_heartbeat(14.0, 5, 60.0)  # saving for up to a minute
        w.on_heartbeat(30.0, 5, 60.0)
        assert hung_workers([w], 31.0, 5) == []

    def test_an_exiting_worker_is_not_judged(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        w.on_heartbeat(10.0, 5, 0.0)
        w.on_heartbeat(11.0, 5, 0.0, exiting=True)
        assert hung_workers([w], 100.0, 5) == []

    def test_zero_timeout_turns_detection_off(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        w.on_heartbeat(0.0, 1, 0.0)
        assert hung_workers([w], 1e6, 0) == []

    def test_step_rate(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        for i in range(5):
            w.on_heartbeat(float(i), i * 10, 0.0)
        assert w.step_rate() == pytest.approx(10.0)


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


def test_startup_env_limits_threads_only_for_several_workers_unless_set():
    # TORCH_NCCL_ASYNC_ERROR_HANDLING: torch's default (3), or the agent's own (inherited).
    assert startup_env(2, {}) == {"OMP_NUM_THREADS": "1"}
    assert startup_env(1, {}) == {}
    assert startup_env(4, {"OMP_NUM_THREADS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) == {}
