"""The chaos campaign's network: one namespace per etcd member and per node, on one bridge.

::

    root namespace: bridge <p>br  10.213.<k>.1/24   (the harness talks to etcd through it)
      |-- veth <p>e0p  ==  <p>e0  in namespace <p>-e0   10.213.<k>.10   etcd member 0
      |-- ...                                            10.213.<k>.11, .12
      |-- veth <p>s1p  ==  <p>s1  in namespace <p>-s1   10.213.<k>.21   node slot 1
      '-- ...                                            slots 2..4: .22 .. .24

``<p>`` is a short prefix unique to the run (``cx`` + 4 hex digits: interface
names stay within Linux's 15 characters) and ``<k>`` a subnet byte derived from
it and checked against the routes in use, so two runs can share the machine.
A node *slot* is a namespace a node's agent runs in; the node id is the
agent's business (a node that joins later takes a free slot).

Creation and removal are idempotent; every run records its owner pid under
:data:`STATE_DIR`, and :func:`cleanup_leftovers` removes the namespaces, links
and tagged processes of runs whose owner is dead (a crashed earlier run).
:class:`Topology` is a context manager that always removes what it created.

When namespaces cannot be created (no root, no ``ip``), the topology falls
back to loopback: every host is a 127.0.0.x address of this namespace and the
faults that need namespaces (cuts, link down, delay/loss) are unavailable
(``Topology.isolated`` is false). The reason is in ``Topology.fallback_reason``.

Network faults: :meth:`Topology.cut` silently drops all traffic between a host
and a set of others with a classic-BPF ``tc`` filter on both sides' egress
(neither iptables nor nftables is needed, nor installed here),
:meth:`Topology.link_down` takes the host's switch port down, and
:meth:`Topology.impair` adds delay and loss to a host's egress: with ``tc
netem`` when the kernel has it, else with :mod:`tests.chaos.impair`, a
userspace forwarder spliced between the host's veth and the bridge.

The checkpoint disk: :meth:`Topology.mount_disk` mounts a small tmpfs (as
root) where the run keeps its checkpoints, so that a fault can fill it. Its
source name is ``<p>-ckpt``: :func:`remove_prefix` finds and unmounts it by
that name (the topology's own cleanup, and a later run's cleanup of a
crashed one), like the namespaces and links.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from tests.proctable import live_environments

log = logging.getLogger(__name__)

STATE_DIR = "/tmp/elastic-chaos"
BASE = "cx"
TAG_ENV = "CHAOS_TAG"  # every process a run starts carries CHAOS_TAG=<prefix>[-<part>]
_PREFIX_RE = re.compile(rf"^{BASE}[0-9a-f]{{4}}")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TopologyError(RuntimeError):
    """A network command failed; the message names it and quotes its stderr."""


def run_ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``ip [-n netns] args...``; raises TopologyError on failure when ``check``."""
    cmd = ["ip"] + (["-n", netns] if netns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise TopologyError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc


@dataclass
class Host:
    """A place processes run: a namespace with one address, or loopback."""

    name: str  # "e0", "s1"
    addr: str
    netns: str | None = None  # None: loopback mode
    ifname: str | None = None  # the veth end inside the namespace
    port: str | None = None  # the veth end on the bridge
    cuts: set = field(default_factory=set)  # addresses this host's egress drops

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run in this host's namespace (``ip netns exec`` execs: the pid is cmd's)."""
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else list(cmd)


# ----------------------------------------------------------------------------- leftovers


def _owner_alive(prefix: str) -> bool:
    try:
        with open(os.path.join(STATE_DIR, f"{prefix}.json")) as f:
            pid = int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tagged_pids(tag: str | None = None) -> dict[int, str]:
    """Live (not zombie) processes carrying ``CHAOS_TAG`` (``tag``, or any), pid -> tag."""
    found: dict[int, str] = {}
    for pid, env in live_environments():
        for item in env:
            if item.startswith(f"{TAG_ENV}=".encode()):
                value = item.split(b"=", 1)[1].decode(errors="replace")
                if tag is None or value == tag:
                    found[pid] = value
                break
    return found


def _run_pids(tag: str) -> list[int]:
    """Processes tagged ``tag`` or ``<tag>-<part>`` (a part of the run, e.g. its reference job)."""
    return [p for p, t in tagged_pids().items() if t == tag or t.startswith(f"{tag}-")]


def kill_tagged(tag: str, *, grace_s: float = 0.0) -> list[int]:
    """SIGKILL (after SIGCONT, and SIGTERM + ``grace_s`` if given) every process
    tagged ``tag`` or ``<tag>-<part>``; returns the pids that were alive."""
    pids = _run_pids(tag)
    for pid in pids:
        for sig in ((signal.SIGCONT, signal.SIGTERM) if grace_s else (signal.SIGCONT,)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while grace_s and time.monotonic() < deadline and _run_pids(tag):
        time.sleep(0.1)
    for pid in _run_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _netns_names() -> list[str]:
    proc = run_ip("netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    proc = run_ip("-o", "link", "show", check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _disk_source(prefix: str) -> str:
    return f"{prefix}-ckpt"


def _disk_mounts() -> list[tuple[str, str]]:
    """(source, mount point) of every chaos checkpoint disk mounted in this namespace."""
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        source, target = line.split()[:2]
        if _PREFIX_RE.match(source) and source == _disk_source(source[:len(BASE) + 4]):
            # /proc/mounts writes a space, tab, newline or backslash as an octal escape.
            found.append((source, re.sub(r"\\([0-7]{3})",
                                         lambda m: chr(int(m.group(1), 8)), target)))
    return found


def remove_prefix(prefix: str) -> None:
    """Remove everything of run ``prefix``: its tagged processes, namespaces
    (and the processes in them), links, checkpoint disk and state file. Idempotent."""
    kill_tagged(prefix)
    for ns in _netns_names():
        if ns.startswith(prefix + "-"):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run_ip("netns", "del", ns, check=False)
    for name in _link_names():
        if name.startswith(prefix):
            run_ip("link", "del", name, check=False)
    for source, target in _disk_mounts():
        if source == _disk_source(prefix):
            # Lazy: a file the harness still holds open must not keep the disk mounted.
            subprocess.run(["umount", "-l", target], capture_output=True, timeout=20)
    try:
        os.unlink(os.path.join(STATE_DIR, f"{prefix}.json"))
    except FileNotFoundError:
        pass


def cleanup_leftovers() -> list[str]:
    """Remove the remains of earlier runs whose owner process is gone; returns their prefixes."""
    prefixes = set()
    for name in _netns_names() + _link_names():
        m = _PREFIX_RE.match(name)
        if m:
            prefixes.add(m.group(0))
    try:
        for name in os.listdir(STATE_DIR):
            m = _PREFIX_RE.match(name)
            if m:
                prefixes.add(m.group(0))
    except FileNotFoundError:
        pass
    for pid, tag in tagged_pids().items():
        if _PREFIX_RE.match(tag):
            prefixes.add(tag[:len(BASE) + 4])
    for source, _ in _disk_mounts():
        prefixes.add(source[:len(BASE) + 4])
    stale = sorted(p for p in prefixes if not _owner_alive(p))
    for prefix in stale:
        log.info("Removing the leftovers of chaos run %s (its owner is gone).", prefix)
        remove_prefix(prefix)
    return stale


# ----------------------------------------------------------------------------- topology


def drop_filter(addrs: list[str]) -> str:
    """A classic BPF program for ``tc filter ... bpf bytecode <it> da`` that drops
    (TC_ACT_SHOT) IPv4 packets to any of ``addrs`` and passes everything else.

    Needs only cls_bpf (no act_gact, no netfilter): in direct-action mode the
    program's return value is the verdict. The frame starts at the Ethernet
    header: the EtherType is at byte 12, the IPv4 destination at byte 30.
    """
    n = len(addrs)
    pass_at, drop_at = 3 + n, 4 + n
    ins = [(0x28, 0, 0, 12),  # ldh [12]
           (0x15, 0, pass_at - 2, 0x0800),  # jeq IPv4, else pass
           (0x20, 0, 0, 30)]  # ld [30]: destination address
    for k, addr in enumerate(addrs):
        value = int.from_bytes(socket.inet_aton(addr), "big")
        ins.append((0x15, drop_at - (3 + k + 1), 0, value))  # jeq addr -> drop
    ins += [(0x06, 0, 0, 0xFFFFFFFF),  # ret TC_ACT_UNSPEC: pass
            (0x06, 0, 0, 2)]  # ret TC_ACT_SHOT: drop
    return f"{len(ins)}," + ",".join(f"{c} {jt} {jf} {k}" for c, jt, jf, k in ins)


class Topology:
    """Namespaces, veths and a bridge for ``n_etcd`` members and ``n_slots`` nodes."""

    def __init__(self, n_etcd: int = 3, n_slots: int = 4, *, force_loopback: bool = False,
                 prefix: str | None = None):
        self.prefix = prefix or BASE + secrets.token_hex(2)
        self.n_etcd = n_etcd
        self.n_slots = n_slots
        self.force_loopback = force_loopback
        self.isolated = False
        self.fallback_reason = ""
        self.subnet = ""
        self.bridge = f"{self.prefix}br"
        self.etcd_hosts: list[Host] = []
        self.slots: list[Host] = []
        self.netem = False
        self.disk = ""  # the mount point of the checkpoint disk, "" when none
        self._impairs: dict[str, tuple] = {}  # host name -> (forwarder proc | None, links)

    @property
    def tag(self) -> str:
        return self.prefix

    # -- lifecycle --------------------------------------------------------------------------

    def create(self) -> "Topology":
        os.makedirs(STATE_DIR, exist_ok=True)
        cleanup_leftovers()
        with open(os.path.join(STATE_DIR, f"{self.prefix}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "started": time.time()}, f)
        if self.force_loopback:
            self._loopback("loopback requested")
            return self
        try:
            self._create_namespaces()
        except (TopologyError, OSError, subprocess.SubprocessError) as exc:
            remove_prefix(self.prefix)
            with open(os.path.join(STATE_DIR, f"{self.prefix}.json"), "w") as f:
                json.dump({"pid": os.getpid(), "started": time.time()}, f)
            self._loopback(f"network namespaces unavailable ({exc})")
        return self

    def destroy(self) -> None:
        for name in list(self._impairs):
            self.unimpair(self._host(name))
        remove_prefix(self.prefix)

    def __enter__(self) -> "Topology":
        try:
            return self.create()
        except BaseException:
            self.destroy()
            raise

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _loopback(self, reason: str) -> None:
        self.isolated = False
        self.fallback_reason = reason
        self.etcd_hosts = [Host(f"e{i}", "127.0.0.1") for i in range(self.n_etcd)]
        self.slots = [Host(f"s{i + 1}", f"127.0.0.{21 + i}") for i in range(self.n_slots)]

    def _pick_subnet(self) -> str:
        routes = run_ip("-4", "route", "show", "table", "all", check=False).stdout
        start = int(hashlib.sha1(self.prefix.encode()).hexdigest(), 16) % 200
        for i in range(200):
            candidate = f"10.213.{(start + i) % 200}"
            if f"{candidate}.0/24" not in routes:
                return candidate
        raise TopologyError("no free 10.213.x.0/24 subnet")

    def _create_namespaces(self) -> None:
        if sys.platform != "linux" or os.geteuid() != 0:
            raise TopologyError("not root on Linux")
        self.subnet = self._pick_subnet()
        run_ip("link", "add", self.bridge, "type", "bridge")
        run_ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        run_ip("link", "set", self.bridge, "up")
        self.etcd_hosts = [self._add_host(f"e{i}", f"{self.subnet}.{10 + i}")
                           for i in range(self.n_etcd)]
        self.slots = [self._add_host(f"s{i + 1}", f"{self.subnet}.{21 + i}")
                      for i in range(self.n_slots)]
        self.isolated = True
        probe = self.slots[0]
        test = run_ip("netns", "exec", probe.netns, "tc", "qdisc", "add", "dev", probe.ifname,
                      "root", "netem", "delay", "1ms", check=False)
        self.netem = test.returncode == 0
        if self.netem:
            run_ip("netns", "exec", probe.netns, "tc", "qdisc", "del", "dev", probe.ifname,
                   "root", check=False)

    def _add_host(self, name: str, addr: str) -> Host:
        ns, inner, port = f"{self.prefix}-{name}", f"{self.prefix}{name}", f"{self.prefix}{name}p"
        if ns not in _netns_names():
            run_ip("netns", "add", ns)
        if port not in _link_names():
            run_ip("link", "add", inner, "type", "veth", "peer", "name", port)
            run_ip("link", "set", inner, "netns", ns)
        run_ip("link", "set", port, "master", self.bridge)
        run_ip("link", "set", port, "up")
        run_ip("addr", "replace", f"{addr}/24", "dev", inner, netns=ns)
        run_ip("link", "set", inner, "up", netns=ns)
        run_ip("link", "set", "lo", "up", netns=ns)
        return Host(name, addr, ns, inner, port)

    def mount_disk(self, path: str, size_mib: int) -> str:
        """Mount a ``size_mib`` MiB tmpfs at ``path`` (created if missing) as the
        run's checkpoint disk; :meth:`destroy` unmounts it. Returns "" when it
        is mounted, else why not (not root, or mount refused); never raises."""
        os.makedirs(path, exist_ok=True)
        if sys.platform != "linux" or os.geteuid() != 0:
            return "not root on Linux"
        try:
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755",
                                   _disk_source(self.prefix), path],
                                  capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"mount failed: {exc}"
        if proc.returncode != 0:
            return f"mount failed: {proc.stderr.strip() or proc.returncode}"
        self.disk = path
        return ""

    def _host(self, name: str) -> Host:
        return next(h for h in self.etcd_hosts + self.slots if h.name == name)

    def describe(self) -> str:
        if not self.isolated:
            return f"loopback fallback: {self.fallback_reason}"
        return (f"network namespaces {self.prefix}-*, bridge {self.bridge} {self.subnet}.0/24, "
                f"delay/loss by {'tc netem' if self.netem else 'userspace forwarder (no netem)'}")

    # -- faults -----------------------------------------------------------------------------

    def cut(self, host: Host, others: list[Host]) -> None:
        """Silently drop all traffic between ``host`` and ``others``: each side's
        egress filter drops packets to the other (like iptables DROP, which
        this machine may not have: see :func:`drop_filter`)."""
        self._need_isolation("cut")
        for other in others:
            host.cuts.add(other.addr)
            other.cuts.add(host.addr)
        for h in [host, *others]:
            self._apply_cuts(h)

    def heal(self, host: Host, others: list[Host]) -> None:
        for other in others:
            host.cuts.discard(other.addr)
            other.cuts.discard(host.addr)
        for h in [host, *others]:
            self._apply_cuts(h)

    def _apply_cuts(self, host: Host) -> None:
        tc = ["netns", "exec", host.netns, "tc"]
        run_ip(*tc, "qdisc", "replace", "dev", host.ifname, "clsact")
        if host.cuts:
            run_ip(*tc, "filter", "replace", "dev", host.ifname, "egress", "prio", "1",
                   "handle", "1", "bpf", "bytecode", drop_filter(sorted(host.cuts)), "da")
        else:
            run_ip(*tc, "filter", "del", "dev", host.ifname, "egress", check=False)

    def link_down(self, host: Host) -> None:
        """Take the host's switch port down: nothing in or out, addresses kept."""
        self._need_isolation("link down")
        run_ip("link", "set", host.port, "down")

    def link_up(self, host: Host) -> None:
        run_ip("link", "set", host.port, "up")

    def impair(self, host: Host, delay_ms: int, loss_pct: float, seed: int) -> str:
        """Delay and lose ``host``'s outgoing packets; returns how ("tc netem", "forwarder")."""
        self._need_isolation("delay/loss")
        if self.netem:
            run_ip("netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", host.ifname,
                   "root", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct:g}%")
            self._impairs[host.name] = (None, ())
            return "tc netem"
        # Splice a forwarder between the host's port and the bridge:
        # host veth == <p><h>p (off the bridge) <-forwarder-> <p><h>x == <p><h>y (on the bridge)
        a, b = f"{self.prefix}{host.name}x", f"{self.prefix}{host.name}y"
        if b not in _link_names():
            run_ip("link", "add", a, "type", "veth", "peer", "name", b)
        run_ip("link", "set", host.port, "nomaster")
        run_ip("link", "set", b, "master", self.bridge)
        for link in (a, b, host.port):
            run_ip("link", "set", link, "up", "promisc", "on")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.impair", "--from-host", host.port, "--to-net", a,
             "--delay-ms", str(delay_ms), "--loss-pct", f"{loss_pct:g}", "--seed", str(seed)],
            cwd=REPO, env={**os.environ, TAG_ENV: self.tag}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = proc.stdout.readline()
        if "ready" not in ready:
            proc.kill()
            raise TopologyError(f"impairment forwarder did not start: {ready}"
                                f"{proc.stdout.read()}")
        self._impairs[host.name] = (proc, (a, b))
        return "userspace forwarder"

    def unimpair(self, host: Host) -> None:
        proc, links = self._impairs.pop(host.name, (None, ()))
        if self.netem and proc is None:
            run_ip("netns", "exec", host.netns, "tc", "qdisc", "del", "dev", host.ifname,
                   "root", check=False)
            return
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for link in links[:1]:
            run_ip("link", "del", link, check=False)
        run_ip("link", "set", host.port, "master", self.bridge, check=False)
        run_ip("link", "set", host.port, "up", check=False)

    def _need_isolation(self, what: str) -> None:
        if not self.isolated:
            raise TopologyError(f"{what} needs network namespaces ({self.fallback_reason})")
