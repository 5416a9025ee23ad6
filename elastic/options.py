"""Parsers for the numbers a user writes in an option: one wording for every flag and key.

elasticd's options (:mod:`agent.config`) and torchrun's ``--rdzv-conf`` keys
(:mod:`elastic.torchrun.conf`, read by elasticd and by the ``etcd3``
handler) parse their numbers here, so the same mistake gets the same line
whichever way it was written. A parser is called as ``parse(name, raw)``:
``name`` is how the value was given, without the leading dashes
(``"lease-ttl"``, ``"rdzv-conf join_timeout"``), and an error reads
``--<name> <raw!r>: ...``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from elastic.errors import ConfigError
from elastic.records import cap_text

Parser = Callable[[str, Any], Any]


def number(kind: type, *, allow_zero: bool) -> Parser:
    """A parser of a finite ``kind`` (int or float) that must be > 0, or >= 0
    with ``allow_zero``.

    The parser returns the number, or raises ConfigError naming ``--<name>``
    and the value as written (see the module docstring).
    """
    def parse(name: str, raw: Any) -> Any:
        given = f"--{name} {cap_text(repr(raw), 80)}"  # a value may come from anywhere
        try:
            if isinstance(raw, bool):  # a YAML !!bool (or Python's True) is no 1
                raise TypeError(raw)
            value = kind(raw)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{given}: expected a {kind.__name__}") from None
        # nan compares false with everything, so it would pass the checks below
        # (and turn a timeout or the restart budget off); inf is no better.
        if not math.isfinite(value):
            raise ConfigError(f"{given}: expected a finite number")
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{given}: must "
                              + ("not be negative" if allow_zero else "be greater than 0"))
        return value
    return parse


def positive(kind: type) -> Parser:
    """:func:`number` > 0."""
    return number(kind, allow_zero=False)


def non_negative(kind: type) -> Parser:
    """:func:`number` >= 0."""
    return number(kind, allow_zero=True)
