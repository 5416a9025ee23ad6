"""Set-up shared by the integration tests."""

from __future__ import annotations

import os

import pytest

from agent.config import OPTIONS

# Every agent these tests start keeps one warm set, not the default two: on the
# 2 cores the suite gets, each agent's second set (two more `import torch`)
# competes with the training the test watches, and costs the suite about a
# quarter of its integration time. Two sets are covered by
# tests/integration/test_supervisor.py and by bench/recovery.py.
WARM_SETS_ENV = next(o.env for o in OPTIONS if o.name == "warm-sets")


@pytest.fixture(scope="package", autouse=True)
def one_warm_set_per_agent():
    before = os.environ.get(WARM_SETS_ENV)
    os.environ.setdefault(WARM_SETS_ENV, "1")
    yield
    if before is None:
        os.environ.pop(WARM_SETS_ENV, None)



@pytest.fixture
def own_etcd(tmp_path):
    """An etcd of the test's own, free to be restarted or frozen (the session's is shared)."""
    from elastic.store.server import EtcdServer

    server = EtcdServer(data_dir=str(tmp_path / "data"), log_path=str(tmp_path / "etcd.log"),
                        unsafe_no_fsync=True)
    server.start(timeout_s=20.0)
    try:
        yield server
    finally:
        server.stop()
