"""faulthandler's dumps read back: the main thread's innermost user frame and collective."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading

import pytest

from agent.stack_text import (
    MAX_FLIGHT_RECORD_BYTES,
    MAX_NAME_CHARS,
    InFlight,
    StackSummary,
    in_flight,
    parse_threads,
    summarize,
)

SITE = "/venv/lib/python3.11/site-packages"
DUMP = f'''Thread 0x00007f3e2f7fe640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f3e3c2a3740 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "{SITE}/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/home/u/train.py", line 60 in train_step
  File "/home/u/train.py", line 120 in <module>
  File "<frozen runpy>", line 88 in _run_code
'''


def test_the_main_thread_is_the_last_block_and_its_collective_and_user_frame_are_named():
    assert summarize(DUMP) == StackSummary("train.py:60 in train_step", "all_reduce")


def test_outside_a_collective_the_innermost_user_frame_is_the_place():
    dump = ('Current thread 0x1 (most recent call first):\n'
            '  File "/usr/lib/python3.11/time.py", line 1 in helper\n'
            '  File "/home/u/train.py", line 88 in next_batch\n'
            '  File "/home/u/train.py", line 120 in <module>\n')
    assert summarize(dump) == StackSummary("train.py:88 in next_batch", "")


def test_frames_under_a_library_root_are_not_the_user_s():
    dump = ('Current thread 0x1 (most recent call first):\n'
            '  File "/repo/elastic/worker/runtime.py", line 9 in step\n'
            '  File "/home/u/train.py", line 7 in main\n')
    assert summarize(dump, ("/repo/elastic/",)).place == "train.py:7 in main"
    assert summarize(dump).place == "runtime.py:9 in step"


def test_garbage_long_lines_and_control_characters_are_bounded():
    evil = "x\x1b[2J" * 100
    dump = ("junk\n" + "A" * 10_000 + "\n"
            "Thread 0x1 (most recent call first):\n"
            f'  File "/home/{evil}.py", line 1 in {evil}\n'
            '  File "???", line ??? in ???\n')
    [frames] = parse_threads(dump)
    assert len(frames[0].file) <= MAX_NAME_CHARS and "\x1b" not in frames[0].function
    assert frames[1].line == 0
    assert summarize("") == StackSummary("")
    assert summarize("no dump at all\n") == StackSummary("")


def test_a_real_dump_of_this_process_is_read_back(tmp_path):
    path = tmp_path / "stacks"
    release = threading.Event()
    worker = threading.Thread(target=release.wait, daemon=True)
    worker.start()
    with open(path, "w") as f:
        faulthandler.register(signal.SIGUSR2, file=f, all_threads=True, chain=False)
        try:
            os.kill(os.getpid(), signal.SIGUSR2)
        finally:
            faulthandler.unregister(signal.SIGUSR2)
    release.set()
    threads = parse_threads(path.read_text())
    assert len(threads) >= 2
    here = summarize(path.read_text(), (os.path.dirname(os.path.dirname(__file__)) + "/x",))
    assert here.place.startswith("test_stack_text.py:") and here.collective == ""


def record(*entries) -> bytes:
    return json.dumps({"version": "2.10", "entries": list(entries)}).encode()


def entry(seq, name="gloo:all_reduce", retired=False, state="scheduled", created=1_000 + 0):
    return {"collective_seq_id": seq, "profiling_name": name, "retired": retired,
            "state": state, "time_created_ns": created}


def test_the_flight_record_names_the_oldest_collective_in_flight_and_when_it_was_entered():
    assert in_flight(record(entry(3, retired=True), entry(5, "nccl:barrier", created=9),
                            entry(4, created=7))) == InFlight("all_reduce", 7)
    assert in_flight(record(entry(3, retired=True), entry(4, state="completed"))) is None


def test_a_flight_record_that_is_not_torch_s_names_nothing():
    assert in_flight(b"not json") is None
    assert in_flight(b"[1, 2]") is None
    assert in_flight(record({"collective_seq_id": "x", "profiling_name": 3, "retired": False}))\
        is None
    assert in_flight(b" " * (MAX_FLIGHT_RECORD_BYTES + 1)) is None
    assert in_flight(record(entry(1, created=-5))) == InFlight("all_reduce", 0)


def test_torch_s_own_flight_record_reads_back(tmp_path):
    # The recorder of this torch (gloo), through the one home of its internals.
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from elastic._compat import torch_flight_recorder

    assert torch_flight_recorder.enabled({"TORCH_FR_BUFFER_SIZE": "100"})
    assert not torch_flight_recorder.enabled({"TORCH_FR_BUFFER_SIZE": "x"})
    data = torch_flight_recorder.dump_json()
    assert data is None or in_flight(data) is None  # no process group here: nothing in flight
    assert dist.is_available() and torch.__version__
