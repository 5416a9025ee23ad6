"""The torch Store kept in etcd (elastic.torchrun.store): TCPStore's semantics, as
torch's agent uses them. One contract, run on the in-memory fake and on real etcd."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils import store as store_util

from elastic.store.api import Store
from elastic.torchrun.store import EtcdTorchStore
from tests.fakes.memory_store import MemoryStore
from tests.waiting import LOADED_SLACK_S

SHORT = timedelta(seconds=0.3)


class TorchStoreContract:
    """Bodies shared by the backends; subclasses supply ``backend`` (a Store)."""

    @pytest.fixture
    def prefix(self) -> str:
        return f"/test/{uuid.uuid4().hex[:8]}/torchrun/store/000000000001/"

    @pytest.fixture
    def store(self, backend: Store, prefix) -> EtcdTorchStore:
        return EtcdTorchStore(backend, prefix, timeout=timedelta(seconds=5))

    def test_set_then_get_across_two_stores_of_one_prefix(self, backend, prefix, store):
        other = EtcdTorchStore(backend, prefix)
        store.set("torchelastic/role_info/0", "text")
        store.set("raw", b"\x00\xff")
        assert other.get("torchelastic/role_info/0") == b"text"
        assert other.get("raw") == b"\x00\xff"

    def test_get_waits_for_a_key_set_later(self, store):
        setter = threading.Timer(0.2, lambda: store.set("late", "here"))
        setter.start()
        started = time.monotonic()
        assert store.get("late") == b"here"
        assert time.monotonic() - started >= 0.15
        setter.join()

    def test_get_of_a_missing_key_times_out_with_a_dist_store_error_naming_it(self, store):
        store.set_timeout(SHORT)
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="timed out waiting for keys \\['never'\\]"):
            store.get("never")
        assert 0.25 <= time.monotonic() - started < 0.3 + LOADED_SLACK_S

    def test_wait_takes_its_own_timeout_and_returns_once_all_keys_exist(self, store):
        store.set("a", "1")
        with pytest.raises(dist.DistStoreError, match="'b'"):
            store.wait(["a", "b"], SHORT)
        threading.Timer(0.2, lambda: store.set("b", "2")).start()
        store.wait(["a", "b"], timedelta(seconds=5))
        assert store.check(["a", "b"])

    def test_add_counts_from_zero_and_is_atomic_under_contention(self, store):
        assert store.add("n", 0) == 0
        threads = [threading.Thread(target=lambda: [store.add("n", 1) for _ in range(10)])
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.get("n") == b"40"
        assert store.add("n", -40) == 0

    def test_add_to_a_key_that_is_not_a_number_says_so(self, store):
        store.set("word", "hello")
        with pytest.raises(ValueError, match="key 'word' holds b'hello', not an integer"):
            store.add("word", 1)

    def test_compare_set_follows_tcpstore(self, store):
        # Absent and expected empty: written. Absent and expected given: not
        # written, and the expected value comes back (TCPStore's answer).
        assert store.compare_set("k", "", "first") == b"first"
        assert store.compare_set("absent", "x", "y") == b"x"
        assert not store.check(["absent"])
        # Present: written only when it holds the expected value; the value it holds comes back.
        assert store.compare_set("k", "wrong", "second") == b"first"
        assert store.compare_set("k", "first", "second") == b"second"
        assert store.get("k") == b"second"

    def test_check_delete_and_num_keys_see_only_this_prefix(self, backend, prefix, store):
        neighbour = EtcdTorchStore(backend, prefix.replace("000000000001", "000000000002"))
        neighbour.set("a", "other round")
        assert not store.check(["a"])
        store.multi_set(["a", "b", "c"], ["1", "2", b"3"])
        assert store.num_keys() == 3
        assert store.multi_get(["c", "a"]) == [b"3", b"1"]
        assert store.delete_key("a") is True
        assert store.delete_key("a") is False
        assert (store.num_keys(), store.check(["b", "c"]), store.check(["a"])) == (2, True, False)
        assert neighbour.get("a") == b"other round"

    def test_multi_set_refuses_mismatched_lists(self, store):
        with pytest.raises(ValueError, match="2 keys but 1 values"):
            store.multi_set(["a", "b"], ["1"])

    def test_torchs_own_prefix_store_calls_it_from_cpp(self, store):
        wrapped = dist.PrefixStore("job", store)
        wrapped.set("x", "1")
        assert wrapped.add("n", 5) == 5
        assert store.get("job/x") == b"1"
        assert wrapped.check(["x"]) and not wrapped.check(["y"])

    def test_torchs_agent_exit_barrier_completes_and_times_out(self, prefix, backend):
        # The very call torch's agent makes when its workers are done: three
        # agents pass; a fourth missing one makes the barrier time out.
        stores = [EtcdTorchStore(backend, prefix) for _ in range(3)]
        errors = []

        def agent(s, world):
            try:
                store_util.barrier(s, world_size=world, key_prefix="exit", barrier_timeout=5)
            except Exception as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        threads = [threading.Thread(target=agent, args=(s, 3)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert errors == []
        with pytest.raises(dist.DistStoreError):
            store_util.barrier(stores[0], world_size=2, key_prefix="lonely", barrier_timeout=0.3)


class TestOnMemoryStore(TorchStoreContract):
    @pytest.fixture
    def backend(self):
        store = MemoryStore()
        yield store
        store.close()

    def test_an_unreachable_store_is_a_dist_network_error(self, backend, store):
        backend.set_outage(True)
        with pytest.raises(dist.DistNetworkError, match="etcd store: set 'k'"):
            store.set("k", "v")


class TestOnEtcd(TorchStoreContract):
    @pytest.fixture
    def backend(self, etcd_store):
        return etcd_store
