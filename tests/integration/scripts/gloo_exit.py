"""Leave a gloo worker without an interpreter shutdown, once its work is done.

A gloo worker thread drops its last reference to a finished collective's
tensors after the caller has moved on, and dropping a tensor that Python has
seen takes the GIL. If the interpreter is finalizing by then, CPython ends
that thread inside a C++ destructor and libstdc++ aborts the process
("terminate called without an active exception", -6) after the job
succeeded: 1 run in 39 of ``torchrun_ddp.py`` here, and once in CI (the core
shows ``~AsyncAllgatherWork`` in ``take_gil`` under ``Py_FinalizeEx``;
pytorch/pytorch#179291 describes the same race). A worker whose results are
written and whose peers are released has nothing left for a shutdown to do.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process with ``code``, skipping finalization."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
