"""How long one slice of grpc-python's blocking waits lasts: ``grpc._common.MAXIMUM_WAIT_TIMEOUT``.

grpc-python cuts every blocking wait (a stream waiting for its next message, a
call waiting for its answer) into slices of that module constant, 0.1 s, so
that a main thread blocked in a call still runs Python's signal handlers
promptly; ``grpc._common.wait`` reads it at every slice. The constant is
private and has no public setter.

Tested on grpcio 1.49.1 (our floor, ``make test-oldest``) and 1.85.3, where it
is a float of 0.1 read at call time. Fallback, where the module or the
constant is missing or no longer a float: nothing is changed, a debug line
says so, and the setter returns False (``tests/unit/test_compat.py`` and
``tests/unit/test_net.py`` fail then, so an upgrade does not silently bring
the wakeups back).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_CONSTANT = "MAXIMUM_WAIT_TIMEOUT"


def _common_module():
    """grpc's ``_common`` module where it still holds the constant as a float, else None."""
    try:
        from grpc import _common
    except ImportError:
        return None
    return _common if isinstance(getattr(_common, _CONSTANT, None), float) else None


def blocking_wait_slice_s() -> float | None:
    """The current slice of grpc's blocking waits in seconds, or None where
    the installed grpc has no such constant."""
    common = _common_module()
    return None if common is None else getattr(common, _CONSTANT)


def set_blocking_wait_slice_s(slice_s: float) -> bool:
    """Make grpc's blocking waits sleep ``slice_s`` per slice, process-wide.

    Returns True when set; False, changing nothing, where the installed grpc
    has no such constant (logged at debug level).
    """
    common = _common_module()
    if common is None:
        logger.debug("grpc has no float _common.%s; its blocking waits keep their own slice",
                     _CONSTANT)
        return False
    setattr(common, _CONSTANT, float(slice_s))
    return True
