"""The GPU check's pure rules (agent.gpu_health), driven with explicit times:
readings in, verdict and reason out; no NVML, no sleeping."""

from __future__ import annotations

import pytest

from agent.gpu_health import (
    POLL_S,
    RELEASE_WAIT_S,
    GpuAction,
    GpuExpectation,
    GpuObservation,
    GpuProcess,
    NvmlReading,
    cuda_visible_entries,
    decide,
    expected_gpus,
)
from tests.fakes.gpus import MIB, node

T0 = 100.0  # when the node's part of the round began (the last round just stopped)
TWO = GpuExpectation(("0", "1"), True, "2 GPUs expected (--nproc-per-node gpu)")
NONE = GpuExpectation((), False, "no GPUs expected (--nproc-per-node cpu)")
NO_NVML = NvmlReading(unavailable="pynvml is not installed")


def judge(reading, expected=TWO, mode="enforce", now=T0, **observed):
    return decide(GpuObservation(reading, **observed), expected, mode, since=T0, now=now)


def held(pid, mib=1024):
    return {"processes": (GpuProcess(pid, mib * MIB),)}


class TestFitGpus:
    def test_all_good_passes_and_says_what_was_checked(self):
        d = judge(node(2))
        assert d.action is GpuAction.PASS
        assert d.problems == ()
        assert d.reason.startswith("2 GPUs fit (2 GPUs expected (--nproc-per-node gpu))")
        assert "no process holding memory" in d.reason

    def test_gpus_beyond_the_expected_ones_are_not_judged(self):
        d = judge(node(4, g3={"ecc_uncorrected_volatile": 9}))
        assert d.action is GpuAction.PASS

    def test_lifetime_ecc_errors_alone_do_not_fail(self):
        d = judge(node(2, g1={"ecc_uncorrected_aggregate": 3}))
        assert d.action is GpuAction.PASS

    def test_ecc_off_or_unsupported_counters_are_no_problem(self):
        d = judge(node(2, g0={"ecc_uncorrected_volatile": None, "remapped_rows_pending": None,
                              "remapping_failed": None}))
        assert d.action is GpuAction.PASS

    def test_this_agents_warm_workers_may_hold_memory(self):
        d = judge(node(2, g0=held(77)), warm_pids=frozenset({77}))
        assert d.action is GpuAction.PASS


class TestLastingProblems:
    def test_missing_gpu_names_the_expectation_and_what_nvml_sees(self):
        d = judge(node(1))
        assert d.action is GpuAction.LEAVE
        assert d.problems == ("missing",)
        assert d.reason == ("2 GPUs expected (--nproc-per-node gpu), but NVML sees 1: "
                            "1 missing")

    def test_uncorrectable_ecc_errors_fail_and_report_the_lifetime_count(self):
        d = judge(node(2, g1={"ecc_uncorrected_volatile": 2, "ecc_uncorrected_aggregate": 5}))
        assert d.action is GpuAction.LEAVE
        assert d.problems == ("ecc",)
        assert d.reason == ("GPU 1 (GPU-00000001-0000-0000-0000-000000000000): 2 uncorrectable "
                            "ECC errors since the driver loaded, 5 in its lifetime")

    def test_pending_page_retirement_needs_a_reset(self):
        d = judge(node(2, g0={"retired_pages_pending": True}))
        assert d.action is GpuAction.LEAVE
        assert d.problems == ("retired_pages_pending",)
        assert "memory pages wait to be retired (needs a GPU reset)" in d.reason

    def test_pending_row_remap_and_failed_remap(self):
        d = judge(node(2, g0={"remapped_rows_pending": True}, g1={"remapping_failed": True}))
        assert d.action is GpuAction.LEAVE
        assert d.problems == ("row_remap",)
        assert "GPU 0 (GPU-00000000" in d.reason and "memory rows wait to be remapped" in d.reason
        assert "a memory row remap failed (replace the GPU)" in d.reason

    def test_a_gpu_nvml_cannot_read(self):
        reading = node(2)
        lost = reading.gpus[1].__class__(index=1, error="GPU is lost")
        d = judge(NvmlReading(gpus=(reading.gpus[0], lost)))
        assert d.action is GpuAction.LEAVE
        assert d.problems == ("read_error",)
        assert d.reason == "GPU 1: NVML cannot read it: GPU is lost"

    def test_warn_starts_anyway_with_the_same_reason(self):
        bad = node(2, g1={"ecc_uncorrected_volatile": 2})
        warned, enforced = judge(bad, mode="warn"), judge(bad, mode="enforce")
        assert warned.action is GpuAction.WARN
        assert enforced.action is GpuAction.LEAVE
        assert warned.reason == enforced.reason and warned.problems == ("ecc",)

    def test_off_passes_whatever_the_reading(self):
        d = judge(node(0, ), mode="off", leftovers=(5,))
        assert d.action is GpuAction.PASS
        assert d.reason == "GPU check off (--gpu-check off)"

    def test_several_problems_are_all_listed_in_order(self):
        d = judge(node(1, g0={"ecc_uncorrected_volatile": 1, "retired_pages_pending": True}))
        assert d.problems == ("missing", "ecc", "retired_pages_pending")

    def test_an_unknown_mode_is_refused(self):
        with pytest.raises(ValueError, match="expected one of off, warn, enforce"):
            judge(node(2), mode="strict")


class TestMemoryOfTheLastRound:
    def test_memory_held_waits_then_passes_once_released(self):
        d = judge(node(2, g0=held(4242, 30_000)), now=T0, last_round_pids=frozenset({4242}))
        assert d.action is GpuAction.WAIT
        assert d.problems == ("memory_held",)
        assert d.wake_at == pytest.approx(T0 + POLL_S)
        assert d.reason == (f"waiting up to {RELEASE_WAIT_S:g} s for the GPUs to be let go: "
                            "GPU 0 (GPU-00000000-0000-0000-0000-000000000000): "
                            "pid 4242 (a worker of the last round) holds 30000 MiB")
        d = judge(node(2), now=T0 + 1.5)
        assert d.action is GpuAction.PASS
        assert d.reason.endswith("let go after 1.5 s")
        assert d.waited_s == pytest.approx(1.5)

    def test_the_last_read_before_the_deadline_is_at_the_deadline(self):
        d = judge(node(2, g0=held(1)), now=T0 + RELEASE_WAIT_S - 0.1)
        assert d.wake_at == pytest.approx(T0 + RELEASE_WAIT_S)

    @pytest.mark.parametrize("mode, action", [("enforce", GpuAction.LEAVE),
                                              ("warn", GpuAction.WARN)])
    def test_memory_still_held_after_the_wait(self, mode, action):
        d = judge(node(2, g1=held(99, 512)), mode=mode, now=T0 + RELEASE_WAIT_S)
        assert d.action is action
        assert d.problems == ("memory_held",)
        assert d.reason == ("GPU 1 (GPU-00000001-0000-0000-0000-000000000000): pid 99 holds "
                            f"512 MiB (still after waiting {RELEASE_WAIT_S:.1f} s)")

    def test_enforce_does_not_wait_when_a_lasting_problem_is_known(self):
        d = judge(node(2, g0={"ecc_uncorrected_volatile": 1, **held(5)}), mode="enforce")
        assert d.action is GpuAction.LEAVE
        assert d.problems == ("ecc", "memory_held")

    def test_warn_still_waits_so_the_replacement_does_not_start_on_a_held_gpu(self):
        d = judge(node(2, g0={"ecc_uncorrected_volatile": 1, **held(5)}), mode="warn")
        assert d.action is GpuAction.WAIT

    @pytest.mark.parametrize("mode, action", [("enforce", GpuAction.LEAVE),
                                              ("warn", GpuAction.WARN)])
    def test_another_programs_memory_is_reported_at_once_without_waiting(self, mode, action):
        d = judge(node(2, g0=held(777, 2200)), mode=mode, now=T0,
                  foreign_pids=frozenset({777}))
        assert d.action is action and d.waited_s == 0
        assert d.problems == ("memory_foreign",)
        assert d.reason == ("GPU 0 (GPU-00000000-0000-0000-0000-000000000000): pid 777 (not "
                            "this agent's) holds 2200 MiB")

    def test_a_dead_workers_memory_is_still_waited_for_beside_another_programs(self):
        d = judge(node(2, g0={"processes": (GpuProcess(777, 1 << 30), GpuProcess(4242, 1 << 30))}),
                  mode="warn", now=T0, foreign_pids=frozenset({777}),
                  last_round_pids=frozenset({4242}))
        assert d.action is GpuAction.WAIT
        assert d.problems == ("memory_foreign", "memory_held")

    def test_an_unknown_amount_of_memory(self):
        d = judge(node(2, g0={"processes": (GpuProcess(8, None),)}), now=T0 + RELEASE_WAIT_S)
        assert "pid 8 holds an unknown amount" in d.reason


class TestWorkerThatSurvivesSigkill:
    def test_waits_then_leaves_even_in_warn_mode(self):
        d = judge(node(2), mode="warn", leftovers=(31337,))
        assert d.action is GpuAction.WAIT
        assert d.problems == ("survived_kill",)
        d = judge(node(2, g0=held(31337)), mode="warn", now=T0 + RELEASE_WAIT_S,
                  leftovers=(31337,), last_round_pids=frozenset({31337}))
        assert d.action is GpuAction.LEAVE
        assert d.problems == ("memory_held", "survived_kill")
        assert d.reason.startswith("workers of the last round (pid 31337) are still alive after "
                                   "SIGKILL (stuck in the kernel?); GPU 0")

    def test_on_a_node_without_gpus_too(self):
        d = judge(NO_NVML, expected=NONE, mode="warn", now=T0 + RELEASE_WAIT_S, leftovers=(7,))
        assert d.action is GpuAction.LEAVE

    def test_gone_within_the_wait_passes(self):
        assert judge(node(2), now=T0 + 2.0).action is GpuAction.PASS


class TestWithoutNvml:
    def test_no_gpus_expected_passes(self):
        d = judge(NO_NVML, expected=NONE)
        assert d.action is GpuAction.PASS
        assert d.reason == "no GPUs expected (--nproc-per-node cpu)"

    @pytest.mark.parametrize("mode, action", [("enforce", GpuAction.LEAVE),
                                              ("warn", GpuAction.WARN)])
    def test_gpus_expected_fails_with_the_cause(self, mode, action):
        d = judge(NO_NVML, mode=mode)
        assert d.action is action
        assert d.problems == ("no_nvml",)
        assert d.reason == ("2 GPUs expected (--nproc-per-node gpu), but NVML cannot be read: "
                            "pynvml is not installed")

    def test_gpus_only_if_present_pass_without_nvml(self):
        maybe = GpuExpectation(("0", "1"), False, "GPUs 0-1 if present")
        d = judge(NO_NVML, expected=maybe)
        assert d.action is GpuAction.PASS
        assert d.reason == "no GPUs expected: GPUs 0-1 if present; pynvml is not installed"

    def test_gpus_only_if_present_are_checked_when_present(self):
        maybe = GpuExpectation(("0", "1", "2", "3"), False, "GPUs 0-3 if present")
        assert judge(node(2), expected=maybe).action is GpuAction.PASS  # none missing
        bad = judge(node(2, g1={"ecc_uncorrected_volatile": 1}), expected=maybe)
        assert bad.action is GpuAction.LEAVE and bad.problems == ("ecc",)


class TestWhichGpus:
    def test_uuids_and_their_prefixes_select_gpus(self):
        reading = node(3)
        wanted = GpuExpectation(("GPU-00000002", "GPU-00000000-0000-0000-0000-000000000000"),
                                True, "2 GPUs expected")
        bad = node(3, g2={"ecc_uncorrected_volatile": 1})
        assert judge(reading, expected=wanted).action is GpuAction.PASS
        assert "GPU 2" in judge(bad, expected=wanted).reason

    def test_a_mig_instance_selects_its_gpu(self):
        reading = node(2, g1={"mig_uuids": ("MIG-aaaa-1111", "MIG-bbbb-2222"),
                              "ecc_uncorrected_volatile": 4})
        wanted = GpuExpectation(("MIG-bbbb",), True, "1 GPU expected")
        d = judge(reading, expected=wanted)
        assert d.action is GpuAction.LEAVE and "GPU 1" in d.reason

    def test_an_ordinal_past_the_last_gpu_is_missing(self):
        d = judge(node(2), expected=GpuExpectation(("1", "5"), True, "2 GPUs expected"))
        assert d.reason == "2 GPUs expected, but NVML sees 2: 5 missing"


class TestExpectation:
    @staticmethod
    def expect(spec, nproc, cvd=None, physical=0):
        environ = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
        return expected_gpus(spec, nproc, environ, lambda: physical)

    def test_one_gpu_per_worker_for_nproc_gpu(self):
        e = self.expect("gpu", 4, physical=4)
        assert e == GpuExpectation(("0", "1", "2", "3"), True,
                                   "4 GPUs expected (--nproc-per-node gpu)")

    def test_nproc_gpu_with_cuda_visible_devices(self):
        e = self.expect("gpu", 2, cvd="3,1", physical=4)
        assert e.selectors == ("3", "1") and e.required
        assert e.why == "2 GPUs expected (--nproc-per-node gpu, CUDA_VISIBLE_DEVICES='3,1')"

    def test_auto_follows_what_it_resolved_to(self):
        assert self.expect("auto", 8, physical=8).selectors == tuple(str(i) for i in range(8))
        cpu = self.expect("auto", 16, physical=0)
        assert cpu == GpuExpectation((), False, "no GPUs expected (--nproc-per-node auto)")

    def test_cpu_expects_none(self):
        assert self.expect("cpu", 2, cvd="0,1").selectors == ()

    def test_a_number_with_cuda_visible_devices_expects_the_first_nproc_it_names(self):
        e = self.expect(2, 2, cvd="GPU-aaa,GPU-bbb,GPU-ccc")
        assert e.selectors == ("GPU-aaa", "GPU-bbb") and e.required
        assert e.why == "2 GPUs expected (CUDA_VISIBLE_DEVICES='GPU-aaa,GPU-bbb,GPU-ccc', " \
                        "2 workers)"

    @pytest.mark.parametrize("cvd", ["", "-1", "0,0"])
    def test_cuda_visible_devices_hiding_every_gpu_expects_none(self, cvd):
        e = self.expect(2, 2, cvd=cvd)
        assert e.selectors == () and "hides every GPU" in e.why

    def test_a_number_alone_checks_the_gpus_present_without_requiring_them(self):
        e = self.expect(2, 2)
        assert e == GpuExpectation(("0", "1"), False, "GPUs 0-1 if present "
                                   "(--nproc-per-node 2, no CUDA_VISIBLE_DEVICES)")

    def test_cuda_visible_entries_reads_as_cuda_does(self):
        assert cuda_visible_entries("0,2,1") == ("0", "2", "1")
        assert cuda_visible_entries("1gpu,03") == ("1", "3")
        assert cuda_visible_entries("0,x,1") == ("0",)
        assert cuda_visible_entries("GPU-a, GPU-b,MIG-c") == ("GPU-a", "GPU-b")
        assert cuda_visible_entries("1,1") == ()
        assert cuda_visible_entries("") == ()
