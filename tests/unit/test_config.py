"""agent.config reads an option the same way from a flag, an ELASTIC_* variable
and the YAML file: text stays the text written, numbers must be finite."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from agent import config
from agent.netaddr import HostNetwork
from agent.stragglers import StragglerPolicy
from elastic.errors import EXIT_BAD_INPUT, ConfigError, exit_code_for

REQUIRED = {"job-id": "j", "nnodes": "1", "etcd": "http://127.0.0.1:2379"}
SOURCES = ["flag", "env", "file"]


def load_with(tmp_path, source: str, name: str, written: str) -> config.AgentConfig:
    """Load a config where option ``name`` is written as ``written`` in ``source``
    and every other required option is given as a flag."""
    script = tmp_path / "train.py"
    script.write_text("")
    argv, environ = [], {}
    for other, value in REQUIRED.items():
        if other != name:
            argv += [f"--{other}", value]
    key = name.replace("-", "_")
    if source == "flag":
        argv.append(f"--{name}={written}")  # "=": a value may start with "-"
    elif source == "env":
        environ["ELASTIC_" + key.upper()] = written
    else:
        path = tmp_path / "elasticd.yaml"
        path.write_text(f"{key}: {written}\n")
        argv += ["--config", str(path)]
    return config.load(argv + [str(script)], environ)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name, written, field, expected", [
    ("nnodes", "2:4", ("min_nodes", "max_nodes"), (2, 4)),  # YAML 1.1: base 60, 124
    ("job-id", "0123", "job_id", "0123"),  # YAML 1.1: octal, 83
    ("job-id", "yes", "job_id", "yes"),  # YAML 1.1: True
    ("node-id", "1e3", "node_id", "1e3"),
    ("node-id", "1.50", "node_id", "1.50"),  # YAML: 1.5
    ("node-id", "0x1F", "node_id", "0x1F"),  # YAML: 31
    ("etcd", "2379", "etcd", "2379"),
    ("advertise-addr", "10.0.0.1", "advertise_addr", "10.0.0.1"),
    ("log-dir", "0777", "log_dir", "0777"),
    ("restart-window", "1e3", "restart_window_s", 1000.0),
    ("hang-timeout", "0", "hang_timeout_s", 0.0),
])
def test_text_options_keep_the_text_written(tmp_path, source, name, written, field,
                                            expected):
    cfg = load_with(tmp_path, source, name, written)

    if isinstance(field, tuple):
        assert tuple(getattr(cfg, f) for f in field) == expected
    else:
        assert getattr(cfg, field) == expected


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name, written", [
    ("lease-ttl", "nan"),  # crashed with a traceback
    ("restart-window", "nan"),  # turned the restart budget off
    ("restart-window", "inf"),
    ("hang-timeout", "inf"),
    ("settle", "-inf"),
    ("join-timeout", "NaN"),
    ("connect-timeout", "1e999"),  # overflows to inf
    ("max-restarts", "3.5"),
])
def test_non_finite_or_mistyped_numbers_are_refused_by_name(tmp_path, source, name, written):
    with pytest.raises(ConfigError, match=f"--{name} '{written}'"):
        load_with(tmp_path, source, name, written)


@pytest.mark.parametrize("written", [".nan", ".inf", "-.Inf"])
def test_yaml_spellings_of_non_finite_numbers_are_refused(tmp_path, written):
    with pytest.raises(ConfigError, match="--restart-window"):
        load_with(tmp_path, "file", "restart-window", written)


@pytest.mark.parametrize("source", ["env", "file"])
@pytest.mark.parametrize("written, expected", [("no", False), ("off", False), ("true", True),
                                                ("yes", True)])
def test_flags_still_read_yaml_and_env_booleans(tmp_path, source, written, expected):
    assert load_with(tmp_path, source, "prestart", written).prestart is expected


def test_a_list_where_text_belongs_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="--node-id"):
        load_with(tmp_path, "file", "node-id", "[a, b]")


def test_an_empty_key_in_the_file_means_not_given(tmp_path):
    cfg = load_with(tmp_path, "file", "log-dir", "")

    assert cfg.log_dir == os.path.join(config.default_state_dir({}), "j", cfg.node_id, "logs")


def test_rank_logs_live_under_the_state_dir_and_systemd_chooses_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    common = ["--job-id", "j", "--nnodes", "1", "--etcd", "http://127.0.0.1:2379",
              "--node-id", "n1", str(script)]

    by_flag = config.load(["--state-dir", str(tmp_path / "st")] + common, {})
    by_systemd = config.load(common, {"STATE_DIRECTORY": str(tmp_path / "sd")})

    assert by_flag.log_dir == str(tmp_path / "st" / "j" / "n1" / "logs")
    assert by_flag.state_dir == str(tmp_path / "st" / "j" / "n1")
    assert by_systemd.log_dir == str(tmp_path / "sd" / "j" / "n1" / "logs")


def test_the_script_and_its_arguments_can_come_from_the_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    environ = {"ELASTIC_JOB_ID": "j", "ELASTIC_NNODES": "1", "ELASTIC_ETCD": "http://127.0.0.1:2379",
               "ELASTIC_SCRIPT": str(script),
               "ELASTIC_SCRIPT_ARGS": "--lr 0.1 --name 'two words'"}

    cfg = config.load([], environ)
    as_module = config.load([], {**environ, "ELASTIC_SCRIPT": "pkg.train",
                                 "ELASTIC_MODULE": "1"})

    assert (cfg.script, cfg.script_args) == (str(script), ("--lr", "0.1", "--name", "two words"))
    assert (as_module.module, as_module.script) == ("pkg.train", None)


def test_unbalanced_quotes_in_the_script_arguments_are_refused_by_name(tmp_path):
    environ = {"ELASTIC_JOB_ID": "j", "ELASTIC_NNODES": "1", "ELASTIC_ETCD": "http://127.0.0.1:2379",
               "ELASTIC_SCRIPT": "pkg.train", "ELASTIC_MODULE": "1",
               "ELASTIC_SCRIPT_ARGS": "--name 'open"}

    with pytest.raises(ConfigError, match="ELASTIC_SCRIPT_ARGS"):
        config.load([], environ)


@pytest.mark.parametrize("name, bad", [("log-format", "xml"), ("metrics-port", "70000"),
                                       ("metrics-port", "-1")])
def test_log_format_and_metrics_port_refuse_bad_values_by_name(tmp_path, name, bad):
    with pytest.raises(ConfigError, match=f"--{name}"):
        load_with(tmp_path, "env", name, bad)


def test_script_and_its_arguments_from_the_file_stay_text(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    path = tmp_path / "elasticd.yaml"
    path.write_text(f"script: {script}\nmodule: false\nscript_args: [--lr, 0.10, --epochs, 010]\n")

    cfg = config.load(["--config", str(path), "--job-id", "j", "--nnodes", "1", "--etcd",
                       REQUIRED["etcd"]], {})

    assert cfg.script == str(script) and cfg.module is None
    assert cfg.script_args == ("--lr", "0.10", "--epochs", "010")


def test_the_advertised_address_and_why_are_logged_once_at_load(tmp_path, caplog):
    script = tmp_path / "train.py"
    script.write_text("")
    hosts = {"localhost": ["127.0.0.1"], "etcd1": ["10.0.0.9"]}
    net = HostNetwork(fqdn=lambda: "localhost", resolve=lambda host: hosts.get(host, []),
                      route_source=lambda addr, port: "10.0.0.5")
    caplog.set_level("INFO", logger="agent.config")

    cfg = config.load(["--job-id", "j", "--nnodes", "2", "--node-id", "n1",
                       "--etcd", "http://etcd1:2379", str(script)], {}, net=net)

    assert cfg.advertise_addr == "10.0.0.5"
    lines = [r.getMessage() for r in caplog.records if "advertising" in r.getMessage()]
    assert len(lines) == 1
    assert "job j node n1 round 0: advertising 10.0.0.5" in lines[0]
    assert "route to etcd at etcd1:2379" in lines[0]


def test_no_usable_address_is_bad_input_that_names_the_flag(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    hosts = {"localhost": ["127.0.0.1"], "etcd1": ["10.0.0.9"]}
    net = HostNetwork(fqdn=lambda: "localhost", resolve=lambda host: hosts.get(host, []),
                      route_source=lambda addr, port: None)

    with pytest.raises(ConfigError, match="--advertise-addr") as info:
        config.load(["--job-id", "j", "--nnodes", "2", "--etcd", "http://etcd1:2379",
                     str(script)], {}, net=net)

    assert exit_code_for(info.value) == EXIT_BAD_INPUT


@pytest.mark.parametrize("source", SOURCES)
def test_the_failure_stop_grace_is_read_like_every_option(tmp_path, source):
    assert load_with(tmp_path, source, "failure-stop-grace", "0.5").failure_stop_grace_s == 0.5
    assert load_with(tmp_path, source, "stop-grace", "90").failure_stop_grace_s == 3.0
    with pytest.raises(ConfigError, match="failure-stop-grace"):
        load_with(tmp_path, source, "failure-stop-grace", "-1")


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
        c = config.load(["--config", str(cfg_file), "--standalone", "--job-id", "j",
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
        c = config.load([script, "--lr", "0.1"], env)
        assert c.etcd == "http://127.0.0.1:2379" and c.job_id == "job1"
        assert c.prestart is False
        assert c.script_args == ("--lr", "0.1")

    def test_module_mode_keeps_the_module_name(self):
        c = config.load(["--standalone", "--job-id", "j", "--nnodes", "1", "-m",
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
            config.load(argv + [script], {})
        assert needle in str(info.value)

    def test_missing_script_is_named(self):
        with pytest.raises(ConfigError, match="training script 'nope.py' not found"):
            config.load(["--standalone", "--job-id", "j", "--nnodes", "1", "nope.py"], {})

    def test_unknown_file_key_is_an_error_not_ignored(self, tmp_path, script):
        f = tmp_path / "c.yaml"
        f.write_text("hang_timout: 5\n")
        with pytest.raises(ConfigError, match="unknown option.*hang_timout"):
            config.load(["--config", str(f), "--standalone", "--job-id", "j",
                               "--nnodes", "1", script], {})

    def test_unknown_environment_variable_is_warned_about(self, script, caplog):
        config.load(["--standalone", "--job-id", "j", "--nnodes", "1", script],
                          {"ELASTIC_HANG_TIMOUT": "5", "ELASTIC_ROUND": "3"})
        assert "ELASTIC_HANG_TIMOUT" in caplog.text
        assert "ELASTIC_ROUND" not in caplog.text  # set by the agent for workers


# ------------------------------------------------------------ one table, one object

# A host whose network is never asked: FULL_LINE gives the advertised address.
NET = HostNetwork(fqdn=lambda: "unused", resolve=lambda host: [],
                  route_source=lambda addr, port: None)
FULL_LINE = ["--job-id", "j", "--nnodes", "2:3", "--etcd", "http://10.0.0.9:2379",
             "--node-id", "n1", "--advertise-addr", "10.0.0.5", "--listen", ":29401",
             "--probe-listen", ":29403", "--state-dir", "/s", "--max-restarts", "4",
             "--stop-grace", "7", "--warm-sets", "3", "--gpu-check", "off", "-r", "1"]


def test_every_option_names_a_field_of_agent_config_at_most_once():
    fields = {f.name for f in dataclasses.fields(config.AgentConfig)}
    named = [o.field for o in config.OPTIONS if o.field]

    assert set(named) <= fields and len(named) == len(set(named))


def test_load_sets_every_field_from_the_table_or_one_phase():
    """Options' fields, the validated and the discovered ones, and the six load
    derives from several options together, cover AgentConfig once each."""
    parts = [[o.field for o in config.OPTIONS if o.field],
             [f.name for f in dataclasses.fields(config.Validated)],
             [f.name for f in dataclasses.fields(config.Found)],
             ["state_dir", "log_dir", "prestart", "console", "freeze_timeout_s",
              "stragglers"]]
    every = [name for part in parts for name in part]

    assert sorted(every) == sorted(f.name for f in dataclasses.fields(config.AgentConfig))


def test_the_phases_build_what_load_builds(script):
    environ: dict[str, str] = {}
    given = config.resolve([*FULL_LINE, script], environ)
    valid = config.validate(given, environ)
    found = config.discover(given, valid, environ, net=NET)
    cfg = config.load([*FULL_LINE, script], environ, net=NET)

    assert given.fields()["max_restarts"] == cfg.max_restarts == 4
    assert (valid.job_id, valid.min_nodes, valid.max_nodes, valid.node_id) == ("j", 2, 3, "n1")
    assert (found.listen, found.probe_listen) == ("10.0.0.5:29401", "10.0.0.5:29403")
    assert found.script == cfg.script == os.path.abspath(script)
    assert cfg.state_dir == os.path.join("/s", "j", "n1")


def test_a_port_only_listen_takes_the_advertised_ipv6_address_in_brackets(script):
    cfg = config.load([*FULL_LINE, "--advertise-addr", "fe80::5", script], {}, net=NET)

    assert (cfg.listen, cfg.probe_listen) == ("[fe80::5]:29401", "[fe80::5]:29403")


def test_an_empty_checkpoint_dir_is_not_given_and_a_relative_one_is_made_absolute(script):
    assert config.load([*FULL_LINE, "--checkpoint-dir=", script], {}, net=NET
                       ).checkpoint_dir is None
    assert config.load([*FULL_LINE, "--checkpoint-dir", "ck", script], {}, net=NET
                       ).checkpoint_dir == os.path.abspath("ck")


def test_the_rendezvous_reactor_and_supervisor_get_their_part_of_the_config(script):
    cfg = config.load([*FULL_LINE, script, "--lr", "1"], {}, net=NET)

    rdzv = cfg.rendezvous()
    settings = cfg.reactor_settings()
    options = cfg.supervisor_options()
    assert (rdzv.job_id, rdzv.min_nodes, rdzv.max_nodes, rdzv.max_restarts) == ("j", 2, 3, 4)
    assert (settings.node_id, settings.nproc, settings.job_id, settings.gpu_check) == (
        "n1", 1, "j", "off")
    assert settings.lease_ttl_s == cfg.lease_ttl_s
    assert options["entrypoint"] == cfg.entrypoint()
    assert options["entrypoint"].script == cfg.script
    assert options["entrypoint"].args == ("--lr", "1")
    assert (options["nproc"], options["stop_grace_s"], options["warm_sets"]) == (1, 7.0, 3)
    assert options["console"].redirected == cfg.console.redirected


def test_straggler_options_make_one_policy_and_a_threshold_of_0_turns_detection_off(script):
    def load(*flags):
        return config.load([*FULL_LINE, *flags, script], {}, net=NET)

    assert load("--straggler-threshold", "1.5", "--straggler-window", "30",
                "--straggler-action", "replace").stragglers == StragglerPolicy(
        threshold=1.5, window_s=30.0, action="replace")
    assert load().stragglers == StragglerPolicy()
    assert load("--straggler-threshold", "0").stragglers is None


@pytest.mark.parametrize("flag, value, says", [
    ("--straggler-threshold", "1", "must be above 1 (1.2: 20% slower than its peers) or 0"),
    ("--straggler-threshold", "0.5", "must be above 1"),
    ("--straggler-window", "0", "must be greater than 0"),
    ("--straggler-action", "evict", "expected one of report, replace"),
])
def test_a_bad_straggler_option_says_what_is_expected(script, flag, value, says):
    with pytest.raises(ConfigError, match=re.escape(f"{flag} ")) as caught:
        config.load([*FULL_LINE, flag, value, script], {}, net=NET)
    assert says in str(caught.value)
