"""The security suite: attacks of issue 24 replayed against real processes.

Each test plays what an attacker did (another local user, simulated with
``setpriv`` as uid/gid 65534; a client of an open etcd) against a real
``elasticd`` and a real etcd, and checks that it now fails with a clear
message. They run as root (the CI and the dev machines do): giving a file to
another user, and becoming one, needs it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from tests.integration.procs import REPO, AgentProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="becoming another user needs root and setpriv")]

OTHER = 65534  # nobody
SCRIPT = os.path.join(REPO, "tests", "integration", "scripts", "progress_worker.py")


def as_other_user(*cmd: str, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` as uid/gid 65534 with no supplementary groups."""
    return subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}",
                           "--clear-groups", *cmd], capture_output=True, text=True,
                          timeout=60, **kw)


@pytest.fixture
def shared_dir():
    """A directory every user may write in, as /tmp (pytest's tmp_path is root's, 0700)."""
    path = tempfile.mkdtemp(prefix="elastic-attack-")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _agent(etcd_endpoint, tmp_path, job: str, *extra: str, env=None) -> AgentProcess:
    (tmp_path / "progress").mkdir(exist_ok=True)
    return AgentProcess(etcd_endpoint, job, "n1", "1", [
        "--progress-dir", str(tmp_path / "progress"), "--work-s", "30"],
        nproc=1, script=SCRIPT, extra=("--no-prestart", *extra), env=env)


def test_a_log_dir_made_in_advance_by_another_user_is_refused(etcd_endpoint, tmp_path,
                                                               shared_dir):
    # The attack: that user plants round-N there and the agent fails at each start.
    logs = os.path.join(shared_dir, "logs")
    made = as_other_user("mkdir", "-m", "0755", logs)
    assert made.returncode == 0, made.stderr
    agent = _agent(etcd_endpoint, tmp_path, "attack-logdir", "--log-dir", logs)
    assert agent.wait_exit(30) == 2, agent.text  # a configuration error
    assert f"belongs to uid {OTHER}" in agent.text and "another --log-dir" in agent.text


def test_a_state_dir_others_may_write_in_is_refused(etcd_endpoint, tmp_path, shared_dir):
    state = os.path.join(shared_dir, "state")
    os.mkdir(state)
    os.chmod(state, 0o1777)  # as /tmp: sticky does not stop a planted <job>
    agent = _agent(etcd_endpoint, tmp_path, "attack-statedir", "--state-dir", state)
    assert agent.wait_exit(30) == 2, agent.text
    assert "(--state-dir) is writable by its group and others" in agent.text
    assert "choose another --state-dir" in agent.text


ETCD_PASSWORD = "s3cret-" + uuid.uuid4().hex  # unique: searched for
AUTH_ARGS = ("--auth-token", "simple", "--bcrypt-cost", "4")

PEEK_SCRIPT = """
import os, sys, time
# A worker is user code of the agent's user: it tries the agent's environment.
try:
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        seen = f.read()
except OSError as exc:
    seen = f"refused: {exc.strerror}".encode()
with open(sys.argv[1], "wb") as f:
    f.write(seen)
time.sleep(60)
"""


@pytest.fixture
def etcd_with_a_user(tmp_path):
    """An etcd with authentication on and one user, ``trainer``, for job ``attack-env``."""
    from elastic.store.server import EtcdServer

    server = EtcdServer(data_dir=str(tmp_path / "etcd"), log_path=str(tmp_path / "etcd.log"),
                        unsafe_no_fsync=True, extra_args=AUTH_ARGS).start()
    try:
        server.add_user("trainer", ETCD_PASSWORD, prefixes=["/elastic/v1/attack-env/"])
        server.enable_auth("r00t-" + uuid.uuid4().hex)
        yield server
    finally:
        server.stop()


@functools.cache
def python_of_other_user() -> tuple[str, dict[str, str]]:
    """A Python that uid 65534 may execute, with this one's packages: this one, or
    (a virtual environment of an interpreter under /root, 0700) the system's of
    the same version with the environment's site-packages on PYTHONPATH. The
    workers are started with the agent's sys.executable, so it must be one."""
    check = ["-c", "import os, sys, grpc, agent.daemon; "
                   "sys.exit(not os.access(os.path.realpath(sys.executable), os.X_OK))"]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = os.path.join(sys.prefix, "lib", version, "site-packages")
    for python, env in ((sys.executable, {}),
                        *((f"{bin_dir}/{version}", {"PYTHONPATH": f"{REPO}:{site}"})
                          for bin_dir in ("/usr/bin", "/usr/local/bin"))):
        if os.path.isfile(python) and as_other_user(*_with_env(env), python, *check,
                                                    cwd=REPO).returncode == 0:
            return python, env
    pytest.skip("no Python with this one's packages that uid 65534 may execute")


def _with_env(env: dict[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())]


def python_as_other_user(shared_dir: str, source: str, *args: str
                         ) -> subprocess.CompletedProcess:
    """Run ``source`` (a Python script, written into ``shared_dir``) as uid 65534."""
    script = os.path.join(shared_dir, "attack.py")
    with open(script, "w") as f:
        f.write(source)
    os.chmod(script, 0o644)
    python, env = python_of_other_user()
    return as_other_user(*_with_env(env), python, script, *args, cwd=REPO)


def elasticd_as_other_user(args: list[str], env: dict[str, str], log_path: str
                           ) -> subprocess.Popen:
    """``elasticd ARGS`` run as uid 65534; its output goes to ``log_path``."""
    python, python_env = python_of_other_user()
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups",
             python, "-m", "agent.daemon", *args],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **python_env, **env})


def test_the_etcd_password_cannot_be_read_from_the_agents_environ(etcd_with_a_user, tmp_path,
                                                                   shared_dir):
    # The attack: a worker (user code, the agent's uid) read the password from
    # /proc/<agent pid>/environ, which os.environ.pop does not clear.
    private = os.path.join(shared_dir, "agent")
    made = as_other_user("mkdir", "-m", "0700", private)
    assert made.returncode == 0, made.stderr
    script, seen = os.path.join(shared_dir, "peek.py"), os.path.join(private, "seen")
    with open(script, "w") as f:
        f.write(PEEK_SCRIPT)
    os.chmod(script, 0o644)
    log_path = str(tmp_path / "agent.log")
    agent = elasticd_as_other_user(
        ["--etcd", etcd_with_a_user.endpoint, "--etcd-user", "trainer",
         "--job-id", "attack-env", "--node-id", "n1", "--nnodes", "1",
         "--nproc-per-node", "1", "--no-prestart", "--advertise-addr", "127.0.0.1",
         "--listen", "127.0.0.1:0", "--state-dir", os.path.join(private, "state"),
         script, seen],
        {"ELASTIC_ETCD_PASSWORD": ETCD_PASSWORD}, log_path)
    try:
        wait_until(lambda: os.path.exists(seen) and os.path.getsize(seen) > 0, timeout_s=60,
                   what="the worker's peek",
                   context=lambda: open(log_path, errors="replace").read()[-3000:])
        # Another process of the same user, not a child: refused too.
        peek = as_other_user("cat", f"/proc/{agent.pid}/environ")
        with open(seen, "rb") as f:
            by_worker = f.read()
    finally:
        agent.kill()
        agent.wait()
    assert ETCD_PASSWORD.encode() not in by_worker, "a worker read the etcd password"
    assert by_worker == b"refused: Permission denied"
    assert ETCD_PASSWORD not in peek.stdout and peek.returncode != 0, peek
    assert "Permission denied" in peek.stderr
    with open(log_path, errors="replace") as f:
        assert "the agent is non-dumpable" in f.read()


def _tls_agent(endpoint, tmp_path, job: str, certs, *extra: str, env=None) -> AgentProcess:
    return _agent(endpoint, tmp_path, job, "--tls-cert", certs.agent.cert, "--tls-key",
                  certs.agent.key, "--tls-ca", certs.ca, "--tls-allowed-cn", "ops-alice",
                  *extra, env=env)


def test_mutual_tls_over_an_open_etcd_is_warned_and_control_takes_only_allowed_cns(
        etcd_endpoint, etcd_store, tmp_path):
    # The bypass: control also travels through etcd (requests/drain/<node>), so
    # with etcd open to all, mutual TLS on --listen guarded nothing, silently.
    from agent import peers
    from agent.tls import AgentTLS
    from elastic.errors import NotAuthorisedError
    from elastic.keyspace import JobKeys
    from elastic.rendezvous.api import NodeInfo
    from tests.tls_certs import make_certs

    certs = make_certs(str(tmp_path))
    agent = _tls_agent(etcd_endpoint, tmp_path, "attack-open-etcd", certs)
    try:
        agent.wait_output("registered", 30)
        assert (f"Control on --listen takes mutual TLS, but etcd at {etcd_endpoint} is plain "
                "text without authentication") in agent.text
        kv = etcd_store.get(JobKeys("attack-open-etcd").node("n1"))
        addr = NodeInfo.from_json(kv.key, kv.value).addr
        # Any certificate of the CA could drain or restart: now only the CNs listed.
        mallory = AgentTLS(cert=certs.mallory.cert, key=certs.mallory.key, ca=certs.ca)
        with pytest.raises(NotAuthorisedError, match="refused to the certificate CN "
                                                     "'ops-mallory'"):
            peers.request_drain(addr, "not yours", tls=mallory)
        agent.wait_output("refused Drain from", 10)  # the audit line
        assert agent.proc.poll() is None
    finally:
        agent.stop()
        peers.close_channels()


def test_an_etcd_with_a_user_closes_the_bypass_and_is_not_warned_about(etcd_with_a_user,
                                                                         tmp_path):
    from tests.tls_certs import make_certs

    certs = make_certs(str(tmp_path))
    endpoint = etcd_with_a_user.endpoint
    agent = _tls_agent(endpoint, tmp_path, "attack-env", certs, "--etcd-user", "trainer",
                       env={"ELASTIC_ETCD_PASSWORD": ETCD_PASSWORD})
    try:
        agent.wait_output("registered", 30)
        # elasticctl with no credentials: what drained the node through an open etcd.
        ctl = subprocess.run([sys.executable, "-m", "agent.ctl", "drain", "--etcd", endpoint,
                              "--job-id", "attack-env", "n1"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert ctl.returncode == 3, ctl.stdout
        assert f"etcd at {endpoint} requires authentication" in ctl.stderr, ctl.stderr
        assert "Control on --listen takes mutual TLS" not in agent.text
        assert agent.proc.poll() is None and "DRAINING" not in agent.text
    finally:
        agent.stop()


WRITE_DRAIN = """
import sys, grpc
from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc
endpoint, key = sys.argv[1], sys.argv[2]
target = ("unix:" + endpoint[len("unix://"):] if endpoint.startswith("unix://")
          else endpoint.split("://", 1)[1])
with grpc.insecure_channel(target) as channel:
    try:
        rpc_pb2_grpc.KVStub(channel).Put(
            rpc_pb2.PutRequest(key=key.encode(), value=b'{"by": "mallory"}'), timeout=5)
        print("wrote")
    except grpc.RpcError as exc:
        print("refused:", exc.code().name, exc.details())
"""


def test_another_user_cannot_reach_the_standalone_etcd(tmp_path, shared_dir):
    # The attack: the standalone etcd listened on a loopback port with no
    # authentication; another local user wrote requests/drain/<node> and the
    # leader drained the node.
    import re

    from elastic.keyspace import JobKeys

    (tmp_path / "progress").mkdir()
    agent = AgentProcess(None, "attack-standalone", "n1", "1", [
        "--progress-dir", str(tmp_path / "progress"), "--work-s", "30"],
        nproc=1, script=SCRIPT, extra=("--no-prestart",))
    try:
        agent.wait_output("registered", 30)
        endpoint = re.search(r"started a private etcd at (\S+)", agent.text).group(1)
        attack = python_as_other_user(shared_dir, WRITE_DRAIN, endpoint,
                                      JobKeys("attack-standalone").drain_request("n1"))
        assert attack.returncode == 0, attack.stderr
        assert attack.stdout.startswith("refused: UNAVAILABLE"), attack.stdout
        assert "Permission denied" in attack.stdout, attack.stdout
        assert endpoint.startswith("unix:///")
        assert os.stat(os.path.dirname(endpoint[len("unix://"):])).st_mode & 0o777 == 0o700
        assert agent.proc.poll() is None and "DRAINING" not in agent.text
        # The agent's own user still operates it with elasticctl.
        status = subprocess.run([sys.executable, "-m", "agent.ctl", "status", "--etcd",
                                 endpoint, "--job-id", "attack-standalone", "--json"],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and '"n1"' in status.stdout, status.stderr
    finally:
        agent.stop()


CONNECT = """
import socket, sys
for path in sys.argv[1:]:
    kind = socket.SOCK_DGRAM if path.endswith(".hb.sock") else socket.SOCK_STREAM
    try:
        s = socket.socket(socket.AF_UNIX, kind)
        s.connect(path)
        print(path, "connected")
    except OSError as exc:
        print(path, "refused:", exc.strerror)
"""


def test_another_user_cannot_reach_the_worker_sockets_nor_read_the_rank_logs(
        etcd_endpoint, tmp_path, shared_dir):
    # Whoever connects to the worker socket can fake heartbeats or commit a
    # checkpoint in the job's name; rank logs hold what the script prints.
    state = os.path.join(shared_dir, "state")
    os.mkdir(state, 0o755)  # others may look in, not write
    agent = _agent(etcd_endpoint, tmp_path, "attack-sockets", "--state-dir", state)
    try:
        node_dir = os.path.join(state, "attack-sockets", "n1")
        logs = os.path.join(node_dir, "logs")
        wait_until(lambda: os.path.isdir(logs) and any(
            name.startswith("round-") for name in os.listdir(logs)), 30,
            "a round's logs", context=lambda: agent.text[-3000:])
        sockets = [os.path.join(node_dir, name) for name in os.listdir(node_dir)
                   if name.endswith(".sock")]
        assert sockets, os.listdir(node_dir)
        attack = python_as_other_user(shared_dir, CONNECT, *sockets)
        assert attack.returncode == 0, attack.stderr
        lines = attack.stdout.splitlines()
        assert len(lines) == len(sockets) and all("refused: Permission denied" in line
                                                  for line in lines), attack.stdout
        read = as_other_user("ls", logs)
        assert read.returncode != 0 and "Permission denied" in read.stderr
    finally:
        agent.stop()
