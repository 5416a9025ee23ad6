"""Every reader of what someone else wrote, fed hostile input (property tests).

Whatever a key in etcd, a checkpoint's files or the configuration hold,
each parser returns a valid value whose text is printable and capped, or
raises one of the project's own errors (an :class:`ElasticError`, or the
documented ValueError of a checkpoint manifest): never a TypeError,
RecursionError, UnicodeError, OverflowError or KeyError from deep inside.

Companion of tests/unit/test_records.py (which checks the field-by-field
validity of rounds, nodes, restart requests and events); this file covers
every other record and the configuration loader, and the cross-cutting
properties: size limits, printable text, paths that stay inside the
checkpoint root.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import config as agent_config
from agent.netaddr import HostNetwork
from agent.status_record import StatusRecord
from elastic.checkpoint import layout
from elastic.checkpoint.api import CommitEntry
from elastic.checkpoint.etcd_log import decode_latest
from elastic.errors import CheckpointError, ElasticError, MalformedRecordError
from elastic.events import Event
from elastic.keyspace import JobKeys
from elastic.records import MAX_REASON_CHARS, MAX_RECORD_BYTES, cap_text, printable_text
from elastic.rendezvous.api import (
    DrainRequest,
    NodeInfo,
    Report,
    RestartRequest,
    Round,
    Standbys,
)
from elastic.rendezvous.config import RendezvousConfig
from elastic.rendezvous.election import leader_in
from elastic.store.api import KeyValue

KEYS = JobKeys("job")
PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# --- hostile values --------------------------------------------------------------------------

# Any character at all: controls, escape sequences, bidi overrides, lone surrogates.
any_char = st.characters(exclude_categories=())
nasty_text = (st.text(any_char, max_size=16)
              | st.sampled_from(["\x1b[2J\x1b[H", "a\nb", "\r", "\u202e", "\ud800", "../x",
                                 "/etc/passwd", "..", ".", "a/b", "", " ", "x" * 300,
                                 "unix:/tmp/sock", "h:99999", "h:1", "a\x00b"]))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | nasty_text
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([2**63, -2**63 - 1, 2**100, 1e300, -1e300, 10**300]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(nasty_text, inner, max_size=4),
    max_leaves=12)
hostile = (st.sampled_from([0, -1, 1, 65535, 65536, 2**31, 2**53 + 1, 2**63, True, False,
                            1.5, float("nan"), float("inf"), None, [], {}, [None], "1"])
           | json_values)


@st.composite
def spoiled(draw, valid):
    """A valid record, often with a few fields removed or replaced by hostile values."""
    obj = draw(valid)
    for name in draw(st.lists(st.sampled_from(sorted(obj)), max_size=3)):
        if draw(st.booleans()):
            obj.pop(name, None)
        else:
            obj[name] = draw(hostile)
    return obj


def records(valid):
    """What a key may hold: any bytes, deeply nested JSON, any JSON, a spoiled record."""
    return (st.binary(max_size=64)
            | st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n)
            | st.integers(1, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)
            | (spoiled(valid) | json_values).map(
                lambda v: json.dumps(v, allow_nan=True).encode()))


texts = st.text(any_char, max_size=12)
ids = st.sampled_from(["a", "b", "elasticctl", "../a", "a/b", "a\n", "", "x" * 200])
times = st.floats(0, 2e9) | hostile


def assert_printable(value, limit=MAX_REASON_CHARS, path="record"):
    """Every string in ``value`` (a dataclass, dict, list...) is printable text
    of at most ``limit`` characters: safe for a log line and a terminal."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, str):
        assert printable_text(value) == value, (path, value)
        assert len(value) <= limit, (path, len(value))
        value.encode("utf-8")  # no lone surrogate: it prints
    elif isinstance(value, dict):
        for k, v in value.items():
            assert_printable(k, limit, f"{path}.{k}")
            assert_printable(v, limit, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_printable(v, limit, f"{path}[{i}]")


def parsed_or_refused(parse, key):
    """The parser's result, or None when it refused with a MalformedRecordError naming ``key``."""
    try:
        result = parse()
    except MalformedRecordError as exc:
        assert exc.key == key
        assert_printable(exc.problem, limit=10_000)
        return None
    assert_printable(result)
    return result


# --- every record kept in etcd ---------------------------------------------------------------

NODE_KEY = KEYS.node("a")
node = st.fixed_dictionaries({
    "node_id": ids, "host": st.sampled_from(["h", "10.0.0.1", "[::1]", "", "a b", "h\n"]),
    "nproc": st.integers(-1, 8), "addr": st.sampled_from(["", "h:1", "h", "unix:/x", ":1"]),
    "master_port": st.integers(-1, 70000), "version": texts, "running_round": st.integers(-1, 9)})
members = st.lists(st.fixed_dictionaries({
    "node_id": ids, "node_rank": st.integers(-1, 3), "host": st.sampled_from(["h", "h h"]),
    "nproc": st.integers(0, 4), "addr": st.sampled_from(["", "h:1", "unix:/x"])}), max_size=3)
round_record = st.fixed_dictionaries({
    "number": st.integers(0, 2), "members": members, "master_addr": st.sampled_from(["h", "\x1b"]),
    "master_port": st.integers(-1, 70000), "reason": texts, "leader": ids, "created_at": times,
    "failures": st.lists(times, max_size=2), "outcome": st.sampled_from(["", "failed", "x"])})
restart = st.fixed_dictionaries({"node_id": ids, "round": st.integers(-1, 9), "reason": texts,
                                 "failure": st.booleans()})
report = st.fixed_dictionaries({"round": st.integers(-1, 9), "by": ids})
drain = st.fixed_dictionaries({"by": ids, "reason": texts})
event = st.fixed_dictionaries({"time": times, "node_id": ids, "round": st.integers(-1, 9),
                               "kind": texts, "message": texts})
standbys = st.fixed_dictionaries({"addrs": st.lists(
    st.sampled_from(["h:1", "10.0.0.1:29400", "[::1]:5", "unix:/tmp/x", "h", "h:0", "a b:1"]),
    max_size=4)})
latest = st.fixed_dictionaries({
    "step": st.integers(-1, 2**64), "round": st.integers(-1, 9), "world_size": st.integers(-1, 8),
    "path": st.sampled_from(["step-000000000005", "../../etc", "/etc", ".hidden", "a/b", "",
                             "step\n5", "..", "x" * 300]),
    "time": times, "save_s": times, "size_bytes": st.integers(-1, 2**64)})
settings_record = st.fixed_dictionaries({
    "min_nodes": st.integers(-1, 4), "max_nodes": st.integers(-1, 4),
    "max_restarts": st.integers(-1, 4), "restart_window_s": times,
    "exit_barrier_timeout_s": times, "scale_up_wait_s": times})
worker_row = st.fixed_dictionaries({
    "local_rank": st.integers(-1, 2), "rank": st.integers(-1, 2), "pid": st.integers(-1, 9),
    "state": texts, "last_step": st.integers(-2, 9), "step_rate": times,
    "heartbeat_age_s": times, "exit_code": st.integers(-300, 300)})
status = st.fixed_dictionaries({
    "node_id": ids, "state": texts, "round": st.integers(-1, 9),
    "node_rank": st.none() | st.integers(-1, 3), "workers": st.lists(spoiled(worker_row),
                                                                     max_size=3),
    "last_step": st.integers(-2, 9), "step_rate": times, "restarts": st.integers(-1, 9),
    "last_failure": texts})

PARSERS = {
    "round": (KEYS.round, round_record, lambda k, raw: Round.from_json(k, raw, 1)),
    "nodes/<id>": (NODE_KEY, node, NodeInfo.from_json),
    "requests/restart/...": (KEYS.restart_request(3, "a"), restart, RestartRequest.from_json),
    "requests/drain/<id>": (KEYS.drain_request("a"), drain, DrainRequest.from_json),
    "requests/started/<id>": (KEYS.started_report("a"), report, Report.from_json),
    "requests/done/<id>": (KEYS.done_report("a"), report, Report.from_json),
    "requests/suspect/<id>": (KEYS.suspect_report("a"), report, Report.from_json),
    "events/...": (KEYS.events + "a/0001", event, Event.from_json),
    "standbys": (KEYS.standbys, standbys, Standbys.from_json),
    "checkpoint/latest": (KEYS.checkpoint_latest, latest, decode_latest),
    "config": (KEYS.config, settings_record, RendezvousConfig.settings_from_json),
    "status/<id>": (KEYS.status_of("a"), status, StatusRecord.from_json),
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_record_parser_returns_a_printable_record_or_refuses_naming_the_key(name):
    key, valid, parse = PARSERS[name]

    @PROPERTY
    @given(records(valid))
    def check(raw):
        parsed_or_refused(lambda: parse(key, raw), key)

    check()


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_record_over_the_size_limit_is_refused_unread_naming_the_key(name):
    key, _, parse = PARSERS[name]
    # Valid JSON, even a plausible record, just too large: never parsed.
    huge = json.dumps({"reason": "x" * MAX_RECORD_BYTES, "message": "m"}).encode()
    with pytest.raises(MalformedRecordError) as info:
        parse(key, huge)
    assert info.value.key == key and "bytes" in info.value.problem


@PROPERTY
@given(st.binary(max_size=40) | nasty_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
       st.sampled_from([0, 7]))
def test_the_leader_key_names_a_valid_node_or_no_leader(value, lease):
    holder = leader_in(KeyValue(KEYS.leader, value, 1, 1, 1, lease))
    assert holder is None or (lease and holder.encode() == value and assert_printable(holder)
                              is None)


def test_a_leader_key_without_a_lease_is_no_leader():
    assert leader_in(KeyValue(KEYS.leader, b"a", 1, 1, 1, lease=0)) is None
    assert leader_in(KeyValue(KEYS.leader, b"a", 1, 1, 1, lease=7)) == "a"
    assert leader_in(KeyValue(KEYS.leader, b"a\n", 1, 1, 1, lease=7)) is None


# --- checkpoint/latest: the path never leaves the checkpoint root -----------------------------

@pytest.mark.parametrize("path", ["../../etc", "/etc/passwd", "..", ".", "a/b", ".tmp-step-1",
                                  "step-1\n", "", "step-1/../../x", "x" * 300])
def test_a_commit_record_path_outside_the_root_is_refused(path):
    record = {"step": 1, "round": 1, "world_size": 1, "path": path, "time": 1.0}
    with pytest.raises(CheckpointError, match="'path'"):
        CommitEntry.from_dict(record)
    with pytest.raises(MalformedRecordError, match="'path'"):
        decode_latest(KEYS.checkpoint_latest, json.dumps(record).encode())


@PROPERTY
@given(spoiled(latest))
def test_a_parsed_commit_entry_stays_inside_the_root(record):
    try:
        entry = CommitEntry.from_dict(record)
    except CheckpointError:
        return
    root = "/ckpt/root"
    joined = os.path.normpath(os.path.join(root, entry.path))
    assert os.path.dirname(joined) == root and entry.path not in (".", "..")
    assert 0 <= entry.step < 2**63 and 0 <= entry.world_size < 2**31
    assert 0 <= entry.time <= 1e11 and 0 <= entry.save_s <= 1e11


def test_a_symbolic_link_out_of_the_root_is_outside_it(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "step-000000000001").symlink_to(elsewhere)
    (root / "step-000000000002").mkdir()
    (root / "step-000000000003").symlink_to(root / "step-000000000002")
    assert "outside the checkpoint root" in str(
        layout.outside_root(str(root), "step-000000000001"))
    assert layout.outside_root(str(root), "step-000000000002") is None
    assert layout.outside_root(str(root), "step-000000000003") is None  # a link inside
    assert layout.outside_root(str(root), "..") is not None


# --- checkpoint metadata: manifests and markers ------------------------------------------------

manifest = st.fixed_dictionaries({
    "format": st.sampled_from([1, 1, 2, "1"]), "rank": st.integers(-1, 3),
    "world_size": st.integers(-1, 4) | st.just(2**40), "step": st.integers(-1, 9),
    "round": st.integers(-1, 9),
    "files": st.dictionaries(
        st.sampled_from([".metadata", "__0_0.distcp", "../x", "a/b", "a\x00b", "..", ""]),
        st.fixed_dictionaries({"size": st.integers(-1, 9) | hostile,
                               "crc32": st.sampled_from(["cbf43926", "CBF43926", "zz", ""])
                               | hostile}) | hostile, max_size=3)})


@PROPERTY
@given(records(manifest))
def test_a_manifest_parses_to_a_valid_one_or_raises_value_error(raw):
    try:
        parsed = layout.Manifest.from_json(raw)
    except ValueError as exc:
        assert_printable(str(exc), limit=10_000)
        return
    assert 0 <= parsed.rank < parsed.world_size <= layout.MAX_WORLD_SIZE
    for name, digest in parsed.files.items():
        assert "/" not in name and name not in ("", ".", "..") and "\x00" not in name
        assert 0 <= digest.size < 2**63 and len(digest.crc32) == 8


@PROPERTY
@given(records(manifest))
def test_reading_a_hostile_manifest_gives_problems_not_exceptions(raw):
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, layout.manifest_name(0)), "wb") as f:
            f.write(raw)
        with open(os.path.join(directory, layout.MARKER_FILE), "wb") as f:
            f.write(raw)
        problems, share = layout.verify_structure(directory)
        assert layout.read_marker(directory) is None or isinstance(
            layout.read_marker(directory), CommitEntry)
        assert len(problems) < 50  # a lying world size does not make millions of them
        assert all(os.path.dirname(path) == directory for path, _ in share)


def test_a_manifest_that_claims_a_huge_world_makes_few_problems(tmp_path):
    record = {"format": 1, "rank": 0, "world_size": layout.MAX_WORLD_SIZE, "step": 1,
              "round": 1, "files": {}}
    (tmp_path / layout.manifest_name(0)).write_text(json.dumps(record))
    _, problems = layout.read_manifests(str(tmp_path))
    assert 8 < len(problems) < 12 and "more rank(s)' manifests are missing" in str(problems)


# --- free text -------------------------------------------------------------------------------

@PROPERTY
@given(st.text(any_char, max_size=200), st.integers(0, 300))
def test_cap_text_is_printable_bounded_and_idempotent(text, limit):
    capped = cap_text(text, limit)
    assert len(capped) <= limit and printable_text(capped) == capped
    assert cap_text(capped, limit) == capped
    capped.encode("utf-8")


def test_control_characters_are_shown_not_obeyed():
    assert printable_text("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert printable_text("line\nforged INFO: ok\r") == "line forged INFO: ok "
    assert printable_text("\u202eevil") == "\\u202eevil"
    assert printable_text("\ud800") == "\\ud800"
    assert printable_text("plain text, ünïcode ✓") == "plain text, ünïcode ✓"


# --- the configuration loader ------------------------------------------------------------------

NET = HostNetwork(fqdn=lambda: "localhost", resolve=lambda host: [],
                  route_source=lambda addr, port: None, interface_of=lambda addr: None)
VALUED = [o for o in agent_config.OPTIONS if not o.is_flag]
FLAGS = [o for o in agent_config.OPTIONS if o.is_flag]
option_text = (st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
                       max_size=12)
               | st.sampled_from(["2:4", "0", "-1", "1e999", "nan", "inf", "²", "1²", "٣",
                                  "9" * 5000, "0.0.0.0:0", "h:99999", ":", "yes", "",
                                  "http://127.0.0.1:1", "/nonexistent", "../x", "a\nb"]))
file_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | option_text,
                          lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(option_text, inner, max_size=3), max_leaves=6)


@PROPERTY
@given(flags=st.dictionaries(st.sampled_from(VALUED), option_text, max_size=3),
       switches=st.dictionaries(st.sampled_from(FLAGS), st.booleans(), max_size=2),
       env=st.dictionaries(st.sampled_from(agent_config.OPTIONS), option_text, max_size=3),
       file=st.none() | st.dictionaries(st.sampled_from([o.key for o in agent_config.OPTIONS]
                                                        + ["script", "script_args", "module",
                                                           "bogus"]),
                                        file_value, max_size=4)
       | st.binary(max_size=64),
       script=st.booleans())
def test_config_load_returns_a_config_or_raises_a_config_error(flags, switches, env, file,
                                                               script):
    with tempfile.TemporaryDirectory() as directory:
        argv = ["--job-id", "j", "--nnodes", "1", "--etcd", "http://127.0.0.1:2379",
                "--advertise-addr", "127.0.0.1"]
        argv += [f"--{o.name}={value}" for o, value in flags.items()]
        argv += [f"--{'' if on else 'no-'}{o.name}" for o, on in switches.items()]
        environ = {o.env: value for o, value in env.items()}
        if file is not None:
            path = os.path.join(directory, "elasticd.yaml")
            with open(path, "wb") as f:
                f.write(file if isinstance(file, bytes)
                        else yaml.safe_dump(file, allow_unicode=True).encode("utf-8",
                                                                            "surrogatepass"))
            argv += ["--config", path]
        if script:
            open(os.path.join(directory, "train.py"), "w").close()
            argv.append(os.path.join(directory, "train.py"))
        try:
            agent_config.load(argv, environ, net=NET)
        except ElasticError as exc:
            assert str(exc)


@pytest.mark.parametrize("content, needle", [
    (b"\x00\x01\xff\xfe binary garbage \x80", "not"),
    (b"job_id: [" * 5000 + b"]" * 5000, "nested too deeply"),
    (b"job_id: " + b"{a: " * 5000 + b"1" + b"}" * 5000, "nested too deeply"),
    (b"# " + b"x" * (2 << 20), "larger than"),
    (b"node_id: [1, 2]\n", "expected text"),
    (b"job_id: [1, 2]\n", "expected text"),
    (b"nproc_per_node: {a: 1}\n", "expected a int"),
    (b"hang_timeout: [1]\n", "hang-timeout"),
    (b"prestart: {x: y}\n", "expected true or false"),
    (b"- a\n- b\n", "expected a mapping"),
    (b"\x1b[2J: 1\n", "not valid YAML"),
    ("bogus\u202e: 1\n".encode(), "unknown option"),
    (b"script_args: 5\n", "expected a list"),
    (b"nnodes: 1\xc2\xb2\n", "nnodes"),
    (b"metrics_port: \xc2\xb2\n", "metrics-port"),
    (b"listen: h:1\xc2\xb2\n", "listen"),
    (b"a: &a [*a]\n", "unknown option"),
])
def test_a_malformed_config_file_is_a_clear_config_error(tmp_path, content, needle):
    path = tmp_path / "elasticd.yaml"
    path.write_bytes(content)
    (tmp_path / "train.py").write_text("")
    argv = ["--etcd", "http://127.0.0.1:1", "--advertise-addr", "127.0.0.1", "--config",
            str(path)]
    # Flags win over the file: what the file sets is not given as a flag.
    for name, value in (("job_id", "j"), ("nnodes", "1")):
        if not content.startswith(name.encode()):
            argv += [f"--{name.replace('_', '-')}", value]
    if not content.startswith(b"script"):
        argv.append(str(tmp_path / "train.py"))
    with pytest.raises(ElasticError) as info:
        agent_config.load(argv, {}, net=NET)
    assert info.value.exit_code == 2, info.value
    assert needle in str(info.value) and len(str(info.value)) < 2000
    assert "\x1b" not in str(info.value) and "\u202e" not in str(info.value)
