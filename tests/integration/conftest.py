"""Set-up shared by the integration tests."""

from __future__ import annotations

import os
import textwrap

import pytest

from agent.config import OPTIONS
from agent.supervisor import Entrypoint, WorkerSupervisor
from elastic.events import parse_events
from elastic.keyspace import JobKeys
from elastic.store.etcd import EtcdStore
from tests.integration.supervising import Exits
from tests.local_etcd import running_etcd
from tests.proctable import alive

# Every agent these tests start keeps one warm set, not the default two: until
# an agent's template has imported torch its warm workers are spawned, so a
# second set is two more `import torch` at every agent's start, beside the
# training the test watches, on the 2 cores the suite gets. Two sets are
# covered by tests/integration/test_supervisor.py and by bench/recovery.py.
WARM_SETS_ENV = next(o.env for o in OPTIONS if o.name == "warm-sets")


@pytest.fixture(scope="package", autouse=True)
def one_warm_set_per_agent():
    before = os.environ.get(WARM_SETS_ENV)
    os.environ.setdefault(WARM_SETS_ENV, "1")
    yield
    if before is None:
        os.environ.pop(WARM_SETS_ENV, None)



@pytest.fixture(autouse=True)
def no_straggler_named_unless_expected(request):
    """A straggler named in a test that does not expect one
    (``@pytest.mark.names_stragglers``) is a false positive: after each test
    whose job lives in the session's etcd, its events must name none. The
    default --straggler-window (60 s) outlasts most tests' jobs; run the suite
    with ELASTIC_STRAGGLER_WINDOW=5 to judge them all."""
    if not {"job_id", "etcd_endpoint"} <= set(request.fixturenames) \
            or request.node.get_closest_marker("names_stragglers"):
        yield
        return
    # Read now: this fixture's teardown runs after theirs.
    keys = JobKeys(request.getfixturevalue("job_id"))
    endpoint = request.getfixturevalue("etcd_endpoint")
    yield
    with EtcdStore(endpoint) as store:
        events, _ = parse_events(keys, store.get_prefix(keys.events)[0])
    named = [e.message for _, e in events if e.kind == "straggler"]
    assert not named, f"stragglers named in a job that has none: {named}"


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd of the test's own, free to be restarted or frozen (the session's is shared)."""
    with running_etcd(tmp_path) as server:
        yield server


@pytest.fixture
def supervise(tmp_path):
    """Build a supervisor for a script text; shut down after the test, which must leave
    no process behind."""
    made: list[WorkerSupervisor] = []

    def make(script: str, nproc: int = 1, **kw) -> tuple[WorkerSupervisor, Exits]:
        path = tmp_path / f"worker{len(made)}.py"
        path.write_text(textwrap.dedent(script))
        exits = Exits()
        kw.setdefault("prestart", False)
        kw.setdefault("stop_grace_s", 1.0)
        entrypoint = Entrypoint(script=str(path), args=tuple(kw.pop("args", ())))
        sup = WorkerSupervisor(job_id="job-t", node_id="node-a", nproc=nproc,
                               entrypoint=entrypoint, log_dir=str(tmp_path / "logs"),
                               on_exit=exits, **kw)
        made.append(sup)
        return sup, exits

    yield make
    for sup in made:
        sup.shutdown()
        left = [pid for pid in sup.pids() if alive(pid)]
        assert not left, f"processes left behind: {left}"
