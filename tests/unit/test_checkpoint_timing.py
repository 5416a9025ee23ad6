"""The phases a save and a restore report to a recorder (elastic.checkpoint.timing),
the hook the checkpoint bench times them with. One process, real files."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")

from elastic.checkpoint import timing  # noqa: E402
from elastic.checkpoint.checkpointer import Checkpointer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Recorder:
    """Each phase as it starts, by call path ("persist.write.dcp_save"), per thread."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(name)
        with self._lock:
            self.seen.append(".".join(stack))
        try:
            yield
        finally:
            stack.pop()

    def take(self) -> list[str]:
        """The phases seen so far, without the CRC-32s (one per write or read), forgotten."""
        with self._lock:
            seen, self.seen = self.seen, []
        return [path for path in seen if not path.endswith(".crc")]


@pytest.fixture
def recorder():
    recorder = Recorder()
    previous = timing.install(recorder)
    yield recorder
    assert timing.install(previous) is recorder


SAVE = ["collect", "persist", "persist.prepare", "persist.write", "persist.write.dcp_save",
        "persist.verify", "persist.commit"]


def test_a_recorder_sees_each_phase_of_a_save_once_in_order(tmp_path, recorder):
    model = torch.nn.Linear(3, 2)
    ckpt = Checkpointer(str(tmp_path), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    recorder.take()
    ckpt.save(1, async_=False)
    assert recorder.take() == SAVE
    ckpt.save(2)  # async: the blocked part stages what forward changes, the rest later
    ckpt.wait()
    assert recorder.take() == ["collect", "stage", "persist", "persist.stage", *SAVE[2:]]
    ckpt.close()


def test_a_recorder_sees_each_phase_of_a_restore_once_in_order(tmp_path, recorder):
    model = torch.nn.Linear(3, 2)
    ckpt = Checkpointer(str(tmp_path), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt.save(1, async_=False)
    recorder.take()
    assert ckpt.restore() == 2
    assert recorder.take() == ["choose", "load", "load.verify", "load.collect",
                               "load.dcp_load", "load.apply"]
    ckpt.close()


def test_without_a_recorder_nothing_is_recorded(tmp_path):
    assert timing.install(None) is None
    assert isinstance(timing.phase("persist"), contextlib.nullcontext)
    model = torch.nn.Linear(3, 2)
    ckpt = Checkpointer(str(tmp_path), model=model)
    ckpt.save(1, async_=False)
    assert ckpt.restore() == 2
    ckpt.close()
