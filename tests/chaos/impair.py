"""Userspace link impairment: delay and loss between two interfaces, where tc netem is missing.

    python -m tests.chaos.impair --from-host IF_A --to-net IF_B --delay-ms 200 --loss-pct 5

Frames that arrive on ``IF_A`` (sent by the impaired host) are dropped with
probability ``loss-pct`` and otherwise sent out of ``IF_B`` ``delay-ms`` later,
in order; frames arriving on ``IF_B`` go out of ``IF_A`` at once. That is what
``tc qdisc add dev <host's veth> root netem delay 200ms loss 5%`` does to the
host's egress. Both sockets use ``PACKET_VNET_HDR``, so the segmentation
offload and checksum state of the veth's large TCP frames travel with them.
Prints ``ready`` once both sockets are bound; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import random
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
MAX_FRAME = 65536 + 64


def _open(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.bind((ifname, 0))
    s.setblocking(False)
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-host", required=True)
    ap.add_argument("--to-net", required=True)
    ap.add_argument("--delay-ms", type=float, default=200.0)
    ap.add_argument("--loss-pct", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    a, b = _open(args.from_host), _open(args.to_net)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    delayed: collections.deque = collections.deque()  # (due, frame) from a, for b
    delay = args.delay_ms / 1000.0
    print("ready", flush=True)
    counts = collections.Counter()
    while not stop:
        timeout = max(0.0, delayed[0][0] - time.monotonic()) if delayed else 0.5
        try:
            readable, _, _ = select.select([a, b], [], [], timeout)
        except InterruptedError:
            continue
        for sock in readable:
            while True:
                try:
                    frame, addr = sock.recvfrom(MAX_FRAME)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:  # our own sends, seen on the way out
                    continue
                if sock is a:
                    if rng.random() * 100 < args.loss_pct:
                        counts["lost"] += 1
                        continue
                    delayed.append((time.monotonic() + delay, frame))
                else:
                    _send(a, frame, counts)
        now = time.monotonic()
        while delayed and delayed[0][0] <= now:
            _send(b, delayed.popleft()[1], counts)
    print(f"stopped: {dict(counts)}", flush=True)
    return 0


def _send(sock: socket.socket, frame: bytes, counts: collections.Counter) -> None:
    try:
        sock.send(frame)
        counts["sent"] += 1
    except OSError:
        counts["send_errors"] += 1


if __name__ == "__main__":
    sys.exit(main())
