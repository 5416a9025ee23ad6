"""A small threaded TCP forwarder on loopback that a test can cut and restore.

Put one in front of a server (etcd) per client (an agent) to partition that
client alone: ``cut()`` drops every open connection through the proxy and
then blackholes new ones (accepted, never answered: what a client sees when
packets are silently dropped) or refuses them (reset at once); ``restore()``
forwards again and resets whatever was blackholed meanwhile, so clients that
were waiting reconnect through the working path at once. The server itself
keeps running for everyone else.

    with TcpProxy("127.0.0.1", etcd_port) as proxy:
        client_endpoint = proxy.endpoint    # http://127.0.0.1:<proxy port>
        proxy.cut()
        ...
        proxy.restore()

Thread-safe; ``close()`` is idempotent and ends every thread it started.
"""

from __future__ import annotations

import socket
import struct
import threading

from elastic.hostport import HostPort

_ACCEPT_POLL_S = 0.1
_CONNECT_TIMEOUT_S = 2.0
_CHUNK = 65536


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (SO_LINGER 0), ignoring errors."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class TcpProxy:
    """Forwards ``listen_host:<port>`` to ``target_host:target_port``.

    ``port`` is chosen by the OS unless ``listen_port`` is given. Counters
    ``accepted`` and ``dropped`` say how many connections it took and cut.
    """

    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0):
        self.target = (target_host, target_port)
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._held: list[socket.socket] = []  # blackholed while cut
        self._cut = False
        self._mode = "blackhole"
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self.accepted = 0
        self.dropped = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, listen_port))
        self._listener.listen(128)
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.host, self.port = self._listener.getsockname()[:2]
        self._start(self._accept_loop, "tcp-proxy-accept")

    @classmethod
    def for_url(cls, url: str) -> "TcpProxy":
        """A proxy in front of ``http://host:port``."""
        target = HostPort.parse(url.split("://", 1)[-1].rstrip("/"))
        return cls(target.host, target.port)

    @property
    def endpoint(self) -> str:
        """The proxy as an etcd client URL."""
        return f"http://{HostPort(self.host, self.port)}"

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self, new: str = "blackhole") -> None:
        """Drop every open connection; from now on ``new`` connections are
        ``"blackhole"``d (accepted, never answered) or ``"refuse"``d (reset)."""
        if new not in ("blackhole", "refuse"):
            raise ValueError(f"new must be 'blackhole' or 'refuse', not {new!r}")
        with self._lock:
            self._cut, self._mode = True, new
            pairs, self._pairs = self._pairs, set()
            self.dropped += len(pairs)
        for client, upstream in pairs:
            _reset(client)
            _reset(upstream)

    def restore(self) -> None:
        """Forward new connections again; reset the blackholed ones so their
        clients notice and reconnect."""
        with self._lock:
            self._cut = False
            held, self._held = self._held, []
        for sock in held:
            _reset(sock)

    def close(self) -> None:
        """Stop listening and close every connection. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.cut()
        self.restore()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        try:
            self._listener.close()
        except OSError:
            pass

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ threads

    def _start(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                cut, mode = self._cut, self._mode
                if cut and mode == "blackhole":
                    self._held.append(client)
                    continue
            if cut:
                _reset(client)
                continue
            self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=_CONNECT_TIMEOUT_S)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            return
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._cut:  # cut while we were connecting
                lost = True
            else:
                lost = False
                self._pairs.add((client, upstream))
        if lost:
            _reset(client)
            _reset(upstream)
            return
        self._start(self._pump, "tcp-proxy-up", client, upstream, (client, upstream))
        self._start(self._pump, "tcp-proxy-down", upstream, client, (client, upstream))

    def _pump(self, src: socket.socket, dst: socket.socket,
              pair: tuple[socket.socket, socket.socket]) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        # One side ended (or the pair was cut): end the other side too.
        with self._lock:
            mine = pair in self._pairs
            self._pairs.discard(pair)
        if mine:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    s.close()
                except OSError:
                    pass
