"""faulthandler's dumps read back: the main thread's innermost user frame and collective."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading

from agent.stack_text import MAX_NAME_CHARS, StackSummary, parse_threads, summarize

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
