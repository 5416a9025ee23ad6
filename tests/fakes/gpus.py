"""A GPU reader for tests: scripted NVML readings, no NVML."""

from __future__ import annotations

from typing import Callable

from agent.gpu_health import GpuProcess, GpuReading, NvmlReading
from elastic.errors import GpuError

MIB = 1 << 20


def healthy(index: int, *, processes: tuple[GpuProcess, ...] = (), **fields) -> GpuReading:
    """A fit GPU (ECC on and clean, nothing pending), with ``fields`` replaced."""
    values = dict(uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000", name="NVIDIA H100",
                  ecc_uncorrected_volatile=0, ecc_uncorrected_aggregate=0,
                  retired_pages_pending=None, remapped_rows_pending=False,
                  remapping_failed=False, memory_used_bytes=0,
                  memory_total_bytes=80 * 1024 * MIB, processes=processes)
    values.update(fields)
    return GpuReading(index=index, **values)


def node(count: int, **by_index: dict) -> NvmlReading:
    """A reading of ``count`` fit GPUs; ``by_index={"g1": {...}}`` changes GPU 1."""
    return NvmlReading(gpus=tuple(healthy(i, **by_index.get(f"g{i}", {}))
                                  for i in range(count)), driver="580.65.06")


class FakeGpuReader:
    """Implements :class:`agent.gpu_health.GpuReader`. ``readings`` is what
    each read returns, in turn (the last one again once they run out): an
    NvmlReading, or a GpuError to raise; or a function of the read's number
    (0, 1, ...) returning either. ``reads`` counts the calls."""

    def __init__(self, readings: list | Callable[[int], NvmlReading | GpuError]):
        self._readings = readings
        self.reads = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def read(self) -> NvmlReading:
        n, self.reads = self.reads, self.reads + 1
        if callable(self._readings):
            value = self._readings(n)
        else:
            value = self._readings[min(n, len(self._readings) - 1)]
        if isinstance(value, GpuError):
            raise value
        return value
