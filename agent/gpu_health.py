"""Whether this node's GPUs are fit for a round: pure rules over NVML readings.

Before the workers of a round start on this node (``--gpu-check warn`` or
``enforce``), the agent reads its GPUs through a :class:`GpuReader` (the
real one is :class:`agent.nvml.NvmlReader`; tests pass
``tests.fakes.gpus.FakeGpuReader``) and :func:`decide` judges the reading.
No I/O and no clock reads here: the agent's loop passes ``now`` and reads
again when :func:`decide` says WAIT, so tests move time by passing another
``now``.

Which GPUs the node expects (:func:`expected_gpus`, decided once, from the
configuration):

* ``--nproc-per-node gpu`` (or ``auto`` on a host with visible GPUs): one GPU
  per worker, the first ``nproc`` that CUDA sees.
* a number of workers with ``CUDA_VISIBLE_DEVICES`` naming GPUs: the first
  ``nproc`` it names (worker ``LOCAL_RANK`` k uses CUDA device k).
* ``--nproc-per-node cpu`` (or ``auto`` without GPUs), or
  ``CUDA_VISIBLE_DEVICES`` hiding every GPU: none.
* a number of workers and no ``CUDA_VISIBLE_DEVICES``: the first ``nproc``
  GPUs NVML sees, if it sees any; none is required (the workers may well run
  on the CPU).

CUDA ordinals are matched to NVML's indices, which follow the PCI bus
(CUDA's own order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and on a node of one
GPU model); ``GPU-``/``MIG-`` UUIDs (or their prefixes, as CUDA takes them)
are matched to the GPU's UUID or to one of its MIG instances.

The rules, in order:

* ``off``: nothing is read; start.
* A node that expects GPUs and cannot read NVML (no ``pynvml``, no driver)
  has a problem; one that expects none, or requires none, passes.
* Problems that waiting cannot cure: an expected GPU missing, an expected GPU
  NVML cannot read, uncorrectable ECC errors since the driver loaded
  (volatile; the lifetime count is only reported), pages waiting to be
  retired, rows waiting to be remapped or a failed row remap (each needs a
  GPU reset).
* Problems that may clear within ``release_wait_s`` of the stop of the last
  round (``since``): a process holding memory on an expected GPU (after a
  SIGKILL the driver frees a process's memory asynchronously), other than
  this agent's warm workers; a worker of the last round still alive (it
  outlived SIGKILL). While one is present and the wait is not over: WAIT,
  reading again at ``wake_at``. ``enforce`` does not wait when a problem
  that waiting cannot cure is already known.
* Problems left: ``enforce`` keeps the node out (LEAVE: it leaves the job);
  ``warn`` starts the workers anyway (WARN), except over a worker of the last
  round that is still alive, which always makes the node leave: its
  replacement cannot be started while it lives, and it may hold its GPU.
* No problem: PASS.

:func:`decide_when_settled` applies the same rules to reads it makes itself,
waiting between them: what an agent with ``enforce`` does once before it
joins, and a check script.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

from agent.devices import visible_cuda_devices
from elastic.errors import GpuUnavailableError

GPU_CHECK_MODES = ("off", "warn", "enforce")
# How long after the last round's stop the check waits for its processes to
# release GPU memory (and for a worker that outlived SIGKILL to go): the
# driver frees a killed process's memory asynchronously, in about a second
# for tens of GiB.
RELEASE_WAIT_S = 10.0
# How often the check reads again while it waits.
POLL_S = 0.5

# The problems, as bounded labels (metrics), in the order reasons list them.
PROBLEMS = ("no_nvml", "missing", "read_error", "ecc", "retired_pages_pending",
            "row_remap", "memory_foreign", "memory_held", "survived_kill")
_TRANSIENT = frozenset({"memory_held", "survived_kill"})

_MIB = 1 << 20


# ------------------------------------------------------------------ readings

@dataclass(frozen=True)
class GpuProcess:
    """A process with a CUDA context on a GPU; ``used_bytes`` None when NVML
    does not say (some containers, Windows' WDDM)."""

    pid: int
    used_bytes: int | None = None


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML sees it. A counter or flag is None when the GPU does not
    support it (ECC off, no page retirement on Ampere and later, no row
    remapping before Ampere). ``error``: why the GPU could not be read ("" if
    it was), e.g. "GPU is lost"."""

    index: int
    uuid: str = ""
    name: str = ""
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapping_failed: bool | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    mig_uuids: tuple[str, ...] = ()
    error: str = ""

    def label(self) -> str:
        return f"GPU {self.index}" + (f" ({self.uuid})" if self.uuid else "")


@dataclass(frozen=True)
class NvmlReading:
    """Every GPU NVML sees, or why NVML could not be read (``unavailable``)."""

    gpus: tuple[GpuReading, ...] = ()
    driver: str = ""
    unavailable: str = ""


class GpuReader(Protocol):
    """Reads this host's GPUs. ``read`` returns every GPU NVML sees (a GPU it
    cannot read carries its ``error``); raises
    :class:`elastic.errors.GpuUnavailableError` when NVML cannot be used here
    and :class:`elastic.errors.GpuError` when it fails as a whole or does not
    answer within its deadline. ``close`` releases NVML (idempotent)."""

    def read(self) -> NvmlReading: ...

    def close(self) -> None: ...


class NoGpuReader:
    """A reader for a node built without NVML (tests, the simulator): NVML is
    never available."""

    def read(self) -> NvmlReading:
        raise GpuUnavailableError("no NVML reader was given to this agent")

    def close(self) -> None:
        pass


NO_GPU_READER = NoGpuReader()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# ------------------------------------------------------------- expectation

@dataclass(frozen=True)
class GpuExpectation:
    """The GPUs this node's workers use, from its configuration.

    ``selectors``: what names each GPU, in local-rank order: a CUDA ordinal
    ("3") or a ``GPU-``/``MIG-`` UUID (or its prefix); empty: no GPU.
    ``required``: a selector that matches no GPU (or no NVML at all) is a
    problem; otherwise the node may run on the CPU and only the GPUs found are
    checked. ``why``: where this comes from, for reasons."""

    selectors: tuple[str, ...] = ()
    required: bool = False
    why: str = "no GPUs expected"


def cuda_visible_entries(value: str) -> tuple[str, ...]:
    """The GPUs ``CUDA_VISIBLE_DEVICES=value`` names, in order, read as CUDA
    reads it: ordinals (each read like ``strtoul``, so ``1gpu`` is 1) or
    ``GPU-``/``MIG-`` UUIDs of the first entry's kind, up to the first entry
    that is neither; a repeated entry, or an empty value, hides every GPU."""
    entries = [e.strip() for e in value.split(",")]
    named: list[str] = []
    prefix = entries[0][:4] if entries[0].startswith(("GPU-", "MIG-")) else None
    for entry in entries:
        if prefix is not None:
            if not entry.startswith(prefix):
                break
            name = entry
        else:
            name = entry[:len(entry) - len(entry.lstrip("0123456789"))]
            if not name:
                break
            name = str(int(name))
        if name in named:
            return ()
        named.append(name)
    return tuple(named)


def expected_gpus(spec: int | str, nproc: int, environ: Mapping[str, str],
                  physical_gpus: Callable[[], int]) -> GpuExpectation:
    """The GPUs a node expects, from its ``--nproc-per-node`` as given
    (``spec``, see :func:`agent.devices.parse_nproc_per_node`), as resolved
    (``nproc``), and the agent's ``CUDA_VISIBLE_DEVICES``; see the module
    docstring. ``physical_gpus`` is asked only for ``auto``."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    named = cuda_visible_entries(cvd) if cvd is not None else None
    shown = f"CUDA_VISIBLE_DEVICES={cvd!r}"
    if spec == "cpu" or (spec == "auto" and visible_cuda_devices(physical_gpus(), cvd) == 0):
        return GpuExpectation((), False, f"no GPUs expected (--nproc-per-node {spec})")
    if named is not None and not named:
        return GpuExpectation((), False, f"no GPUs expected ({shown} hides every GPU)")
    if spec in ("gpu", "auto"):
        selectors = named[:nproc] if named else tuple(str(i) for i in range(nproc))
        where = f", {shown}" if named else ""
        return GpuExpectation(selectors, True, f"{_plural(len(selectors), 'GPU')} expected "
                                               f"(--nproc-per-node {spec}{where})")
    if named:
        selectors = named[:nproc]
        return GpuExpectation(selectors, True, f"{_plural(len(selectors), 'GPU')} expected "
                                               f"({shown}, {_plural(nproc, 'worker')})")
    return GpuExpectation(tuple(str(i) for i in range(nproc)), False,
                          f"GPUs 0-{nproc - 1} if present (--nproc-per-node {nproc}, "
                          "no CUDA_VISIBLE_DEVICES)" if nproc > 1 else
                          "GPU 0 if present (--nproc-per-node 1, no CUDA_VISIBLE_DEVICES)")


def _matches(selector: str, gpu: GpuReading) -> bool:
    if selector.startswith("GPU-"):
        return bool(gpu.uuid) and gpu.uuid.startswith(selector)
    if selector.startswith("MIG-"):
        return any(m.startswith(selector) for m in gpu.mig_uuids)
    return selector.isdigit() and int(selector) == gpu.index


# ---------------------------------------------------------------- decision

class GpuAction(enum.Enum):
    """What the agent does before starting this round's workers."""

    PASS = "pass"  # the GPUs are fit (or the check is off): start
    WAIT = "wait"  # memory still held (or a worker still alive): read again at wake_at
    WARN = "warn"  # problems found, --gpu-check warn: start anyway, and say so
    LEAVE = "leave"  # problems found: this node leaves the job (see the module docstring)


@dataclass(frozen=True)
class GpuObservation:
    """What the agent saw before a round: the NVML reading; the pids of the
    last round's workers on this node (``last_round_pids``) and those of them
    still alive after their stop (``leftovers``); its warm workers, whose
    memory is this node's own and no leftover; and ``foreign_pids``, processes
    that hold GPU memory, live, and are none of this agent's: another
    program's, which no wait releases (reported at once, as ``memory_foreign``)."""

    nvml: NvmlReading
    leftovers: tuple[int, ...] = ()
    last_round_pids: frozenset[int] = frozenset()
    warm_pids: frozenset[int] = frozenset()
    foreign_pids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class GpuDecision:
    action: GpuAction
    reason: str
    problems: tuple[str, ...] = ()  # labels from PROBLEMS, in that order, each once
    wake_at: float | None = None  # WAIT: when to read again
    waited_s: float = 0.0  # from ``since`` to this decision


def _mib(n: int | None) -> str:
    return "an unknown amount" if n is None else f"{(n + _MIB - 1) // _MIB} MiB"


def _pid_words(pid: int, obs: GpuObservation) -> str:
    if pid in obs.last_round_pids:
        return f"pid {pid} (a worker of the last round)"
    return f"pid {pid}"


def _gpu_findings(gpu: GpuReading, obs: GpuObservation) -> list[tuple[str, str]]:
    """(problem, text) for one expected GPU."""
    if gpu.error:
        return [("read_error", f"{gpu.label()}: NVML cannot read it: {gpu.error}")]
    found = []
    if gpu.ecc_uncorrected_volatile:
        lifetime = (f", {gpu.ecc_uncorrected_aggregate} in its lifetime"
                    if gpu.ecc_uncorrected_aggregate else "")
        found.append(("ecc", f"{gpu.label()}: {gpu.ecc_uncorrected_volatile} uncorrectable "
                             f"ECC errors since the driver loaded{lifetime}"))
    if gpu.retired_pages_pending:
        found.append(("retired_pages_pending",
                      f"{gpu.label()}: memory pages wait to be retired (needs a GPU reset)"))
    if gpu.remapping_failed:
        found.append(("row_remap", f"{gpu.label()}: a memory row remap failed (replace the GPU)"))
    elif gpu.remapped_rows_pending:
        found.append(("row_remap",
                      f"{gpu.label()}: memory rows wait to be remapped (needs a GPU reset)"))
    holders = [p for p in gpu.processes if p.pid not in obs.warm_pids]
    foreign = [p for p in holders if p.pid in obs.foreign_pids]
    releasing = [p for p in holders if p.pid not in obs.foreign_pids]
    for problem, processes, whose in (("memory_foreign", foreign, " (not this agent's)"),
                                      ("memory_held", releasing, "")):
        if processes:
            held = ", ".join(f"{_pid_words(p.pid, obs)}{whose} holds {_mib(p.used_bytes)}"
                             for p in processes[:4])
            more = f" and {len(processes) - 4} more" if len(processes) > 4 else ""
            found.append((problem, f"{gpu.label()}: {held}{more}"))
    return found


def _findings(obs: GpuObservation, expected: GpuExpectation) -> tuple[list[tuple[str, str]], int]:
    """Every (problem, text) found, and how many expected GPUs were checked."""
    found: list[tuple[str, str]] = []
    if obs.leftovers:
        pids = ", ".join(str(p) for p in obs.leftovers)
        found.append(("survived_kill", f"workers of the last round (pid {pids}) are still "
                                       "alive after SIGKILL (stuck in the kernel?)"))
    if not expected.selectors:
        return found, 0
    if obs.nvml.unavailable:
        if expected.required:
            found.append(("no_nvml", f"{expected.why}, but NVML cannot be read: "
                                     f"{obs.nvml.unavailable}"))
        return found, 0
    checked = 0
    missing = []
    for selector in expected.selectors:
        gpu = next((g for g in obs.nvml.gpus if _matches(selector, g)), None)
        if gpu is None:
            missing.append(selector)
            continue
        checked += 1
        found.extend(_gpu_findings(gpu, obs))
    if missing and expected.required:
        found.append(("missing", f"{expected.why}, but NVML sees {len(obs.nvml.gpus)}: "
                                 f"{', '.join(missing)} missing"))
    return found, checked


def decide(obs: GpuObservation, expected: GpuExpectation, mode: str, since: float,
           now: float, release_wait_s: float = RELEASE_WAIT_S) -> GpuDecision:
    """Judge ``obs`` for a round whose check began at ``since`` (monotonic,
    like ``now``); see the module docstring for the rules. Raises ValueError
    for a mode not in GPU_CHECK_MODES."""
    if mode not in GPU_CHECK_MODES:
        raise ValueError(f"GPU check mode {mode!r}: expected one of {', '.join(GPU_CHECK_MODES)}")
    waited_s = max(0.0, now - since)
    if mode == "off":
        return GpuDecision(GpuAction.PASS, "GPU check off (--gpu-check off)", waited_s=waited_s)
    found, checked = _findings(obs, expected)
    problems = tuple(p for p in PROBLEMS if any(f == p for f, _ in found))
    text = "; ".join(t for _, t in found)
    deadline = since + release_wait_s
    lasting = [p for p in problems if p not in _TRANSIENT]
    if any(p in _TRANSIENT for p in problems) and now < deadline \
            and not (mode == "enforce" and lasting):
        return GpuDecision(GpuAction.WAIT, f"waiting up to {release_wait_s:g} s for the GPUs to "
                                           f"be let go: {text}",
                           problems, wake_at=min(now + POLL_S, deadline), waited_s=waited_s)
    waited = (f" (still after waiting {waited_s:.1f} s)"
              if now >= deadline and any(p in _TRANSIENT for p in problems) else "")
    if problems:
        if mode == "enforce" or "survived_kill" in problems:
            return GpuDecision(GpuAction.LEAVE, f"{text}{waited}", problems, waited_s=waited_s)
        return GpuDecision(GpuAction.WARN, f"{text}{waited}", problems, waited_s=waited_s)
    if not expected.selectors:
        return GpuDecision(GpuAction.PASS, expected.why, waited_s=waited_s)
    if checked == 0:
        why = obs.nvml.unavailable or "NVML sees none of them"
        return GpuDecision(GpuAction.PASS, f"no GPUs expected: {expected.why}; {why}",
                           waited_s=waited_s)
    released = f", let go after {waited_s:.1f} s" if waited_s >= POLL_S else ""
    return GpuDecision(GpuAction.PASS,
                       f"{_plural(checked, 'GPU')} fit ({expected.why}): no uncorrectable ECC "
                       "error, no pending page retirement or row remap, no process holding "
                       f"memory{released}", waited_s=waited_s)


def decide_when_settled(observe: Callable[[], GpuObservation], expected: GpuExpectation,
                        mode: str, sleep: Callable[[float], None],
                        release_wait_s: float = RELEASE_WAIT_S) -> GpuDecision:
    """:func:`decide` on ``observe()`` until the verdict is not WAIT, calling
    ``sleep`` between reads: for a caller with nothing else to do meanwhile
    (an agent before it joins, a check script). Time is counted on the reads'
    own schedule (0, POLL_S, ..., ``release_wait_s``), so no clock is read
    here; ``sleep`` may return at once in tests."""
    now = 0.0
    while True:
        decision = decide(observe(), expected, mode, 0.0, now, release_wait_s)
        if decision.action is not GpuAction.WAIT or decision.wake_at is None:
            return decision
        sleep(decision.wake_at - now)
        now = decision.wake_at


# The event kinds a check's result is recorded under (elasticctl events, status).
EVENT_KINDS = {GpuAction.PASS: "gpu_ok", GpuAction.WARN: "gpu_warning",
               GpuAction.LEAVE: "gpu_failed"}
