"""A single-member etcd for tests: the session's shared one and a test's own."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def running_etcd(workdir):
    """A single-member etcd on loopback with its data and log under ``workdir``
    (the log of a failed run can be read afterwards), stopped on exit."""
    from elastic.store.server import EtcdServer

    server = EtcdServer(
        data_dir=str(workdir / "data"),
        log_path=str(workdir / "etcd.log"),
        unsafe_no_fsync=True,  # tests do not survive power loss; fsync only slows them
    )
    server.start(timeout_s=20.0)
    try:
        yield server
    finally:
        server.stop()
