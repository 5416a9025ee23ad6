"""torchrun's command line read by elasticd: spellings, rendezvous, refusals, devices, console.

Every test loads a real configuration from a command line (with a fake host
network and fake devices), as ``elasticd`` would at start; nothing is mocked
inside agent.config.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
import textwrap

import pytest

from agent import config
from agent.assign import startup_env, worker_envs
from agent.console import ConsoleFilter, Streams, parse_local_ranks, parse_streams
from agent.devices import HostDevices, physical_gpus, visible_cuda_devices
from agent.netaddr import HostNetwork
from agent.torchrun_cli import parse_rdzv_conf
from elastic.errors import ConfigError
from elastic.rendezvous.api import Member, Round
from tests.tls_certs import make_certs

# A host whose name resolves to a routable address, so any etcd endpoint will do.
NET = HostNetwork(fqdn=lambda: "node1", resolve=lambda h: ["10.0.0.5"] if h == "node1" else [],
                  route_source=lambda addr, port: "10.0.0.5", interface_of=lambda a: "eth0")
NO_GPU = HostDevices(physical_gpus=lambda: 0, cpu_count=lambda: 6)
FOUR_GPUS = HostDevices(physical_gpus=lambda: 4, cpu_count=lambda: 64)
ETCD_LINE = ("--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd1:2379", "--rdzv-id", "j")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


@pytest.fixture
def load(script):
    """``load(*flags, environ=..., devices=...)``: the config of ``elasticd FLAGS SCRIPT``."""
    def run(*flags: str, environ: dict | None = None, devices: HostDevices = NO_GPU,
            argv_tail: tuple[str, ...] | None = None) -> config.AgentConfig:
        tail = (script,) if argv_tail is None else argv_tail
        return config.load([*flags, *tail], environ or {}, net=NET, devices=devices)
    return run


def refusal(load, *flags: str, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load(*flags, **kw)
    message = str(info.value)
    assert "\n" not in message  # one line
    return message


class TestSpellings:
    def test_every_torchrun_flag_of_torch_2_13_is_known(self):
        run = pytest.importorskip("torch.distributed.run")
        theirs = {s for a in run.get_args_parser()._actions for s in a.option_strings}

        ours = set(config.parser()._option_string_actions)

        assert theirs - ours == set()

    @pytest.mark.parametrize("dashed, underscored, field, expected", [
        ("--nproc-per-node=3", "--nproc_per_node=3", "nproc_per_node", 3),
        ("--max-restarts=7", "--max_restarts=7", "max_restarts", 7),
        ("--log-dir=/l", "--log_dir=/l", "log_dir", "/l"),
        ("--local-addr=10.0.0.7", "--local_addr=10.0.0.7", "advertise_addr", "10.0.0.7"),
        ("--shutdown-timeout=30", "--shutdown_timeout=30", "stop_grace_s", 30.0),
        ("--hang-timeout=9", "--hang_timeout=9", "hang_timeout_s", 9.0),  # ours too
    ])
    def test_both_spellings_set_the_same_option(self, load, dashed, underscored, field,
                                                expected):
        assert getattr(load("--standalone", dashed), field) == expected
        assert getattr(load("--standalone", underscored), field) == expected

    def test_torchrun_names_set_our_options(self, load):
        cfg = load("--rdzv_backend=etcd", "--rdzv_endpoint=etcd1:2379", "--rdzv_id=job7",
                   "--nnodes=2")

        assert (cfg.etcd, cfg.job_id, cfg.standalone) == ("etcd1:2379", "job7", False)

    @pytest.mark.parametrize("ours, theirs", [
        (("--job-id", "a"), ("--rdzv-id", "b")),
        (("--stop-grace", "1"), ("--shutdown_timeout", "1")),
        (("--join-timeout", "9"), ("--rdzv-conf", "join_timeout=9")),
        (("--lease-ttl", "9"), ("--rdzv-conf", "keep_alive_interval=3")),
    ])
    def test_one_option_given_under_two_names_is_refused(self, load, ours, theirs):
        message = refusal(load, *ETCD_LINE[:4], *ours, *theirs)

        assert "set the same option: give one" in message

    def test_the_script_s_own_flags_are_never_read_as_the_agent_s(self, load, script):
        cfg = load("--standalone", argv_tail=(script, "--nproc", "2", "--role", "x", "-r", "3"))

        assert cfg.script_args == ("--nproc", "2", "--role", "x", "-r", "3")
        assert (cfg.nproc_per_node, cfg.role) == (1, "default")

    def test_help_lists_torchrun_flags_in_their_own_group_without_the_underscores(self):
        text = config.parser().format_help()

        ours, theirs = text.split("torchrun's flags:")
        assert "--rdzv-id ID" in theirs and "= --job-id" in theirs
        assert "--numa-binding" in theirs and "--numa-binding" not in ours
        assert "--nproc_per_node" not in ours and theirs.count("_per_node") == 1  # the intro


class TestNprocPerNode:
    def test_gpu_counts_the_gpus_cuda_will_see(self, load):
        cfg = load("--standalone", "--nproc-per-node", "gpu",
                   environ={"CUDA_VISIBLE_DEVICES": "1,3"}, devices=FOUR_GPUS)

        assert cfg.nproc_per_node == 2

    def test_gpu_without_a_visible_gpu_is_refused_naming_the_hiding_variable(self, load):
        none = refusal(load, "--standalone", "--nproc-per-node", "gpu")
        hidden = refusal(load, "--standalone", "--nproc-per-node", "gpu",
                         environ={"CUDA_VISIBLE_DEVICES": ""}, devices=FOUR_GPUS)

        assert "no visible CUDA GPU" in none and "give a number of workers, or cpu" in none
        assert "CUDA_VISIBLE_DEVICES='' hides all 4" in hidden

    @pytest.mark.parametrize("devices, expected", [(NO_GPU, 6), (FOUR_GPUS, 4)])
    def test_auto_is_the_gpus_if_any_else_the_cpus(self, load, devices, expected):
        assert load("--standalone", "--nproc-per-node", "auto",
                    devices=devices).nproc_per_node == expected

    def test_cpu_is_the_cpus_even_with_gpus(self, load):
        assert load("--standalone", "--nproc_per_node=cpu",
                    devices=FOUR_GPUS).nproc_per_node == 64

    @pytest.mark.parametrize("written, needle", [
        ("xpu", "give the number of xpu devices, e.g. --nproc-per-node 8"),
        ("0", "must be greater than 0"),
        ("-2", "must be greater than 0"),
        ("two", "expected a int (at most 9 digits) or one of gpu, cpu, auto"),
        ("1" * 12, "at most 9 digits"),
    ])
    def test_bad_values_are_refused_by_name(self, load, written, needle):
        message = refusal(load, "--standalone", f"--nproc-per-node={written}")

        assert message.startswith("--nproc-per-node") and needle in message

    @pytest.mark.parametrize("physical, visible, expected", [
        (4, None, 4),
        (4, "", 0),
        (4, "0,1", 2),
        (4, "2gpu,3", 2),  # read like strtoul
        (4, "1,7,2", 1),  # stops at an ordinal past the last GPU
        (4, "0,-1,2", 1),  # and at a negative one
        (4, "0,0", 0),  # a repeated ordinal hides every GPU
        (2, "GPU-aa,GPU-bb,1", 2),  # UUIDs: the leading ones
        (2, "MIG-aa,MIG-aa", 0),
        (0, "0,1", 0),
    ])
    def test_cuda_visible_devices_is_read_as_cuda_reads_it(self, physical, visible, expected):
        assert visible_cuda_devices(physical, visible) == expected

    def test_physical_gpus_are_nvidia_smi_s_gpu_lines_not_its_mig_lines(self, tmp_path,
                                                                       monkeypatch):
        fake = tmp_path / "nvidia-smi"
        fake.write_text(textwrap.dedent("""\
            #!/bin/sh
            echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a)"
            echo "  MIG 3g.40gb     Device  0: (UUID: MIG-1b)"
            echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-0c)"
            """))
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

        assert physical_gpus() == 2


class TestStandalone:
    def test_standalone_alone_is_enough(self, load):
        cfg = load("--standalone")

        assert cfg.standalone and cfg.etcd is None
        assert (cfg.min_nodes, cfg.max_nodes) == (1, 1)
        assert len(cfg.job_id) == 36 and cfg.job_id != load("--standalone").job_id  # a uuid

    def test_no_rendezvous_at_all_is_torchrun_s_one_node_job(self, load, caplog):
        caplog.set_level(logging.INFO, logger="agent.config")

        cfg = load("--nproc_per_node=2")

        assert cfg.standalone and cfg.nproc_per_node == 2 and cfg.max_nodes == 1
        assert any("running standalone" in r.getMessage() for r in caplog.records)

    def test_one_node_static_flags_run_standalone_and_say_what_replaces_them(self, load,
                                                                          caplog):
        caplog.set_level(logging.INFO, logger="agent.config")

        cfg = load("--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
                   "--master_port=29501")

        assert cfg.standalone
        note = next(r.getMessage() for r in caplog.records if "standalone" in r.getMessage())
        assert "instead of --master-addr and --master-port" in note

    @pytest.mark.parametrize("backend", ["c10d", "static"])
    def test_a_one_node_c10d_or_static_rendezvous_runs_standalone(self, load, backend):
        cfg = load(f"--rdzv-backend={backend}", "--rdzv-endpoint=localhost:0",
                   "--rdzv-conf=is_host=1")

        assert cfg.standalone and cfg.etcd is None

    def test_standalone_ignores_torchrun_s_rendezvous_flags_with_a_warning(self, load, caplog):
        cfg = load("--standalone", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400")

        assert cfg.standalone and cfg.etcd is None
        warning = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert "ignoring --rdzv-backend c10d, --rdzv-endpoint, as torchrun does" in warning

    def test_our_own_etcd_and_standalone_still_exclude_each_other(self, load):
        assert "either --etcd or --standalone" in refusal(load, "--standalone", "--etcd", "h:1")

    def test_node_rank_other_than_0_on_one_node_is_refused(self, load):
        assert "only node rank 0" in refusal(load, "--nnodes=1", "--node-rank=1")


class TestEtcdRendezvous:
    @pytest.mark.parametrize("backend", ["etcd", "etcd-v2", "etcd3", "ETCD3"])
    def test_etcd_backends_meet_at_the_endpoint_with_torchrun_s_defaults(self, load, backend):
        cfg = load("--rdzv-backend", backend, "--rdzv-endpoint", "etcd1:2379", "--rdzv-id", "j")

        assert (cfg.etcd, cfg.job_id, cfg.standalone) == ("etcd1:2379", "j", False)
        assert (cfg.min_nodes, cfg.max_nodes) == (1, 1)  # torchrun's --nnodes default

    def test_the_documented_elastic_line(self, load):
        cfg = load("--nnodes=1:4", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=JOB",
                   "--rdzv-backend=etcd3", "--rdzv-endpoint=etcd1:2379")

        assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (1, 4, 2)
        assert (cfg.max_restarts, cfg.job_id) == (3, "JOB")

    def test_static_flags_are_ignored_with_a_warning_as_torchrun_does(self, load, caplog):
        cfg = load(*ETCD_LINE, "--nnodes=2", "--node-rank=1", "--master-addr=h0")

        assert cfg.etcd == "etcd1:2379"
        warning = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert "ignoring --node-rank, --master-addr" in warning

    @pytest.mark.parametrize("flags, needle", [
        (("--rdzv-backend=etcd", "--rdzv-id=j"), "--rdzv-backend etcd needs --rdzv-endpoint"),
        (("--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--nnodes=2"),
         "--rdzv-backend c10d with --nnodes 2: elasticd's nodes meet through an etcd"),
        (("--nnodes=2", "--node_rank=0", "--master_addr=h0", "--master_port=29500"),
         "torchrun's static rendezvous (--node-rank, --master-addr, --master-port) with "
         "--nnodes 2"),
        (("--nnodes=2", "--job-id=j"), "no etcd given"),
        (("--rdzv-backend=zookeeper", "--rdzv-endpoint=h:1"), "use --rdzv-backend etcd"),
        (("--rdzv-endpoint=h:2379", "--rdzv-id=j"), "add --rdzv-backend etcd"),
        (("--rdzv-backend=c10d", "--etcd=h:2379", "--job-id=j"),
         "drop --rdzv-backend or give --rdzv-backend etcd"),
        (("--rdzv-backend=etcd", "--rdzv-endpoint=h:1"), "--job-id (torchrun: --rdzv-id) is "
         "required"),
    ])
    def test_what_cannot_meet_is_refused_with_what_to_give(self, load, flags, needle):
        assert needle in refusal(load, *flags)

    def test_our_own_etcd_line_still_needs_its_node_count(self, load):
        assert "--nnodes is required" in refusal(load, "--etcd", "etcd1:2379", "--job-id", "j")


class TestRdzvConf:
    def test_timeouts_map_onto_our_options(self, load):
        cfg = load(*ETCD_LINE, "--rdzv-conf", "join_timeout=120,last_call_timeout=3,"
                   "read_timeout=7,keep_alive_interval=2,keep_alive_max_attempt=4")

        assert (cfg.join_timeout_s, cfg.settle_s, cfg.connect_timeout_s) == (120.0, 3.0, 7.0)
        assert cfg.lease_ttl_s == 8.0  # torch's dead node: no keep-alive for interval * attempts

    def test_etcd_s_timeout_key_and_one_keep_alive_key_with_torch_s_other_default(self, load):
        cfg = load(*ETCD_LINE, "--rdzv-conf", "timeout=90,keep_alive_max_attempt=2")

        assert (cfg.join_timeout_s, cfg.lease_ttl_s) == (90.0, 10.0)

    def test_join_timeout_wins_over_torchrun_s_timeout(self, load):
        # torchrun passes timeout always; torch's dynamic rendezvous reads join_timeout.
        cfg = load(*ETCD_LINE, "--rdzv-conf", "timeout=900,join_timeout=30")

        assert cfg.join_timeout_s == 30.0

    def test_the_etcd_user_and_its_password_file(self, load, tmp_path):
        password = tmp_path / "password"
        password.write_text("s3cret\n")

        cfg = load(*ETCD_LINE, "--rdzv-conf", f"user=trainer,password_file={password}")

        assert (cfg.etcd_security.user, cfg.etcd_security.password) == ("trainer", "s3cret")

    def test_protocol_and_tls_files_reach_etcd(self, load, tmp_path):
        certs = make_certs(str(tmp_path))

        cfg = load(*ETCD_LINE, "--rdzv-conf", f"protocol=https,cacert={certs.ca},"
                   f"ssl_cert={certs.operator.cert},key={certs.operator.key}")

        assert cfg.etcd == "https://etcd1:2379"
        assert (cfg.etcd_security.cacert, cfg.etcd_security.cert, cfg.etcd_security.key) == (
            certs.ca, certs.operator.cert, certs.operator.key)

    def test_protocol_applies_to_our_own_etcd_spelling_too(self, load):
        cfg = load("--etcd", "etcd1:2379,etcd2", "--job-id", "j", "--nnodes", "2",
                   "--rdzv-conf", "protocol=https")

        assert cfg.etcd == "https://etcd1:2379,https://etcd2"

    def test_timeouts_with_no_counterpart_are_accepted_and_said_so(self, load, caplog):
        caplog.set_level(logging.INFO, logger="agent.config")

        load(*ETCD_LINE, "--rdzv-conf", "close_timeout=30,heartbeat_timeout=5")

        assert any("close_timeout, heartbeat_timeout: nothing to set" in r.getMessage()
                   for r in caplog.records)

    @pytest.mark.parametrize("conf, needle", [
        ("etcd_prefix=/x", "unknown key(s) 'etcd_prefix' (the rendezvous keeps its keys under"),
        ("heartbeat=6", "unknown key(s) 'heartbeat' (not read by torch: the lease TTL is "
                        "keep_alive_interval x keep_alive_max_attempt)"),
        ("join_timout=5", "unknown key(s) 'join_timout'; known: ca_cert, cacert"),
        ("join_timeout", "expected KEY=VALUE,..."),
        ("join_timeout=", "expected KEY=VALUE,..."),
        ("=5", "expected KEY=VALUE,..."),
        ("timeout=1,timeout=2", "timeout is given twice"),
        ("join_timeout=soon", "--rdzv-conf join_timeout 'soon': expected a float"),
        ("keep_alive_interval=0", "--rdzv-conf keep_alive_interval '0': must be greater than 0"),
        ("keep_alive_max_attempt=1.5", "keep_alive_max_attempt '1.5': expected a int"),
        ("keep_alive_interval=0.3", "keep_alive_interval*keep_alive_max_attempt 0.3*3: the lease "
                                    "TTL must be at least 1 s"),
        ("close_timeout=-1", "--rdzv-conf close_timeout '-1': must be greater than 0"),
        ("cacert=/a,ca_cert=/b", "--rdzv-conf cacert and ca_cert both set the etcd CA bundle: "
                                 "give one"),
        ("protocol=ftp", "--rdzv-conf protocol 'ftp': expected http or https"),
        ("protocol=http,cacert=/nope", "--rdzv-conf cacert /nope: no such file"),
        ("is_host=1", "--rdzv-conf is_host: settings of torch's c10d rendezvous, not of an "
                      "etcd one"),
    ])
    def test_bad_or_unknown_keys_are_refused(self, load, conf, needle):
        assert needle in refusal(load, *ETCD_LINE, "--rdzv-conf", conf)

    def test_protocol_conflicting_with_the_endpoint_s_scheme_is_refused(self, load):
        message = refusal(load, "--rdzv-backend=etcd", "--rdzv-endpoint=http://h:2379",
                          "--rdzv-id=j", "--rdzv-conf=protocol=https")

        assert "protocol=https but the endpoint 'http://h:2379'" in message

    def test_an_empty_conf_is_no_conf(self):
        assert parse_rdzv_conf("") == {} and parse_rdzv_conf(" a = 1 , b=x ") == {"a": "1",
                                                                                  "b": "x"}


class TestTorchrunOnlyFlags:
    @pytest.mark.parametrize("flags, needle", [
        (("--logs-specs", "custom"), "loads no torchrun.logs_specs plugin: drop --logs-specs"),
        (("--numa-binding", "node"), "run elasticd under numactl"),
        (("--virtual-local-rank",), "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))"),
        (("--duplicate-stdout-filters", "loss"), "grep them"),
        (("--duplicate_stderr_filters", "err"), "grep them"),
        (("--event-log-handler", "dynamic_rendezvous"), "elasticctl events"),
        (("--signals-to-handle", "SIGTERM,SIGUSR1"), "forwards no SIGUSR1 to workers"),
        (("--start-method", "thread"), "expected spawn, fork or forkserver"),
        (("--monitor-interval", "0"), "--monitor-interval '0': must be greater than 0"),
        (("--tee", "4"), "expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (("--node-rank", "first"), "expected a whole number"),
    ])
    def test_what_cannot_be_honoured_is_one_line_naming_the_flag_and_the_way_out(
            self, load, flags, needle):
        message = refusal(load, "--standalone", *flags)

        assert message.startswith(flags[0].replace("_", "-")) and needle in message

    @pytest.mark.parametrize("flags", [
        ("--monitor-interval", "0.5"), ("--start-method", "fork"), ("--run-path",),
        ("-t", "3"), ("--tee", "0:1,1:3"), ("--event-log-handler", "console"),
        ("--duplicate-stdout-filters", ""), ("--signals-to-handle", "SIGTERM,SIGINT,SIGHUP"),
    ])
    def test_what_elasticd_already_does_is_accepted(self, load, flags):
        assert load("--standalone", *flags).standalone


class TestScript:
    def test_no_python_executes_a_program_found_on_path_and_keeps_no_warm_workers(self, load):
        cfg = load("--standalone", "--no_python", argv_tail=("sh", "-c", "true"))

        assert cfg.no_python and os.path.isabs(cfg.script) and cfg.script.endswith("/sh")
        assert cfg.script_args == ("-c", "true") and cfg.prestart is False

    def test_no_python_with_a_missing_program_is_refused(self, load):
        message = refusal(load, "--standalone", "--no-python", argv_tail=("no-such-tool-x",))

        assert "'no-such-tool-x' not found on PATH or not executable" in message

    def test_module_and_no_python_exclude_each_other(self, load):
        assert "exclude each other" in refusal(load, "--standalone", "--no-python", "-m",
                                               argv_tail=("pkg",))

    def test_run_path_takes_precedence_over_no_python_as_in_torchrun(self, load, script):
        cfg = load("--standalone", "--no-python", "--run-path")

        assert not cfg.no_python and cfg.script == script


class TestConsole:
    def test_redirects_and_the_rank_filter_reach_the_supervisor_s_filter(self, load):
        cfg = load("--standalone", "-r", "0:1,1:3", "--local_ranks_filter=0,1")

        assert cfg.console == ConsoleFilter(
            redirected=Streams(by_rank=((0, frozenset({"stdout"})),
                                        (1, frozenset({"stdout", "stderr"})))),
            local_ranks=frozenset({0, 1}))

    def test_what_the_console_shows(self):
        keep_rank0_stderr = ConsoleFilter(redirected=parse_streams("redirects", "1"),
                                          local_ranks=parse_local_ranks("f", "0"))

        assert keep_rank0_stderr.shows(0, "stderr")
        assert not keep_rank0_stderr.shows(0, "stdout")  # redirected
        assert not keep_rank0_stderr.shows(1, "stderr")  # filtered out
        assert not keep_rank0_stderr.shows(None, "stderr")  # a warm worker, when filtering
        assert ConsoleFilter().shows(None, "stdout") and ConsoleFilter().shows(7, "stderr")

    @pytest.mark.parametrize("parse, written", [
        (parse_streams, "5"), (parse_streams, "0:1,0:2"), (parse_streams, "a:1"),
        (parse_local_ranks, "0,x"), (parse_local_ranks, "-1"),
        # longer than int() converts: still a ConfigError, not Python's ValueError
        (parse_streams, "9" * 5000), (parse_streams, "0:" + "1" * 5000),
        (parse_streams, "1" * 5000 + ":1"), (parse_local_ranks, "0," + "2" * 5000),
        (parse_local_ranks, "65537"),
    ])
    def test_bad_specs_are_refused(self, parse, written):
        with pytest.raises(ConfigError, match="--opt"):
            parse("opt", written)


class TestEnvironment:
    def test_torch_s_file_timer_is_refused_since_no_server_would_read_it(self, load):
        message = refusal(load, "--standalone", environ={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})

        assert message.startswith("TORCHELASTIC_ENABLE_FILE_TIMER=1")
        assert "--hang-timeout" in message

    def test_torchrun_variables_elasticd_does_not_read_are_named(self, load, caplog):
        load("--standalone", environ={"PET_NNODES": "2", "PYTHON_EXEC": "/usr/bin/python3"})

        warnings = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert "PET_NNODES: torchrun's environment spelling" in warnings
        assert "PYTHON_EXEC is set but not read by elasticd" in warnings


class TestWorkerEnvironment:
    def test_every_variable_torch_s_agent_sets_is_set(self):
        agent = pytest.importorskip("torch.distributed.elastic.agent.server.local_elastic_agent")
        source = textwrap.dedent(inspect.getsource(agent.LocalElasticAgent._start_workers))
        theirs = {key.value for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                  and any(getattr(t, "id", "") == "worker_env" for t in node.targets)
                  for key in node.value.keys} | {"LOCAL_RANK"}
        round_ = Round(number=3, members=(Member("a", 0, "h0", 2), Member("b", 1, "h1", 2)),
                       master_addr="h0", master_port=29500, reason="", leader="a",
                       created_at=0.0)

        env = {**startup_env(2, {}), **worker_envs(
            round_, "b", job_id="j", restart_count=1, max_restarts=3, agent_socket="/s",
            checkpoint_dir=None, hang_timeout_s=0, role="trainer")[1]}

        # Left at torch's default on purpose (agent.assign's docstring says why).
        not_set = {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}
        assert len(theirs) >= 15 and theirs - set(env) == not_set
        assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["ROLE_NAME"]) == (
            "3", "1", "1", "trainer")
        assert (env["TORCHELASTIC_USE_AGENT_STORE"], env["OMP_NUM_THREADS"]) == ("False", "1")

    def test_nccl_error_handling_is_torch_s_default_or_the_agent_s_own(self):
        # torch's default 3 ends a worker whose collective failed without
        # ncclCommAbort, which may hang when a peer is gone; torchrun forces 1.
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in startup_env(1, {})
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in startup_env(
            1, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})  # inherited by the workers
