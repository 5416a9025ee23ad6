"""Shared fixtures: one real etcd server per test session, a store per test, unique job ids.

Tests that use ``etcd_server`` (directly or through ``etcd_endpoint`` or
``etcd_store``) are marked ``integration`` automatically, so
``pytest -m "not integration"`` runs the fast tier without starting etcd.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import pytest
from hypothesis import settings

from elastic.net import no_grpc_fork_handlers
from tests.local_etcd import running_etcd

# Property tests run on two shared cores beside agents and etcd: an example's time says
# how busy the machine is, not whether the code is right, so no example has a deadline.
settings.register_profile("shared-cores", deadline=None)
settings.load_profile("shared-cores")
no_grpc_fork_handlers()  # tests fork agents and etcd while their own gRPC clients run
# Agents started by tests keep their rank logs in a temporary state directory,
# never in /var/lib/elasticd (the default for root).
os.environ.setdefault("ELASTIC_STATE_DIR", tempfile.mkdtemp(prefix="elastic-test-state-"))

_ETCD_FIXTURES = frozenset({"etcd_server", "etcd_endpoint", "etcd_store"})


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "starts_first: runs before every other test (tests/marks.py: STARTS_FIRST)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _ETCD_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
    # A stable sort: the marked tests first, each part in the order collected.
    items.sort(key=lambda item: item.get_closest_marker("starts_first") is None)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """The etcd shared by the whole session."""
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def etcd_endpoint(etcd_server) -> str:
    """The client URL of the session's etcd server, e.g. ``http://127.0.0.1:23791``."""
    return etcd_server.endpoint


@pytest.fixture
def etcd_store(etcd_endpoint):
    """An :class:`~elastic.store.etcd.EtcdStore` on the session's server, closed after the test."""
    from elastic.store.etcd import EtcdStore

    store = EtcdStore(etcd_endpoint)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def job_id() -> str:
    """A job id no other test uses, so tests sharing one etcd never see each other's keys."""
    return "test-" + uuid.uuid4().hex[:8]


@pytest.fixture
def sock_dir():
    # Not tmp_path: a Unix socket path must stay under 108 bytes.
    path = tempfile.mkdtemp(prefix="elastic-test-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
