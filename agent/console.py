"""Which worker output the agent copies to its console (every line always goes to the rank logs).

Two settings, with torchrun's syntax and meaning:

- ``--redirects``: streams kept off the console (torchrun sends them to files
  only). ``3`` (or ``0:3,1:2``, per local rank): 0 none, 1 stdout, 2 stderr,
  3 both.
- ``--local-ranks-filter 0,1``: only these local ranks reach the console.

``--tee`` uses the same syntax; elasticd always writes both streams of every
rank to its log and to the console unless the two settings above say
otherwise, so a tee asks for nothing more (:func:`parse_streams` validates it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic.errors import ConfigError

STDOUT, STDERR = "stdout", "stderr"
_STREAMS = {0: frozenset(), 1: frozenset({STDOUT}), 2: frozenset({STDERR}),
            3: frozenset({STDOUT, STDERR})}
_MAX_LOCAL_RANK = 1 << 16


@dataclass(frozen=True)
class Streams:
    """Output streams per local rank: ``every`` for ranks not in ``by_rank``."""

    every: frozenset[str] = frozenset()
    by_rank: tuple[tuple[int, frozenset[str]], ...] = ()

    def of(self, local_rank: int) -> frozenset[str]:
        return dict(self.by_rank).get(local_rank, self.every)


def _small_int(text: str, largest: int) -> int | None:
    """``text`` as a whole number from 0 to ``largest``, or None. Its length is
    checked before ``int`` reads it: Python refuses to convert very long digit
    strings (ValueError), and no such number is valid here anyway."""
    if not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > len(str(largest)):
        return None
    number = int(text)
    return number if number <= largest else None


def _std_value(name: str, raw: str, text: str) -> frozenset[str]:
    if _small_int(text, max(_STREAMS)) not in _STREAMS:
        raise ConfigError(f"--{name} {raw!r}: expected 0 (none), 1 (stdout), 2 (stderr) or "
                          "3 (both), or LOCAL_RANK:VALUE,... e.g. 0:3,1:2")
    return _STREAMS[int(text)]


def parse_streams(name: str, raw: Any) -> Streams:
    """torchrun's ``Std`` syntax (``3``, or ``0:1,1:2``) -> :class:`Streams`;
    ConfigError naming ``--name`` otherwise. A rank given twice is an error."""
    if not isinstance(raw, (str, int)) or isinstance(raw, bool):
        raise ConfigError(f"--{name} {raw!r}: expected text such as 3 or 0:1,1:2")
    text = str(raw).strip()
    if ":" not in text:
        return Streams(every=_std_value(name, str(raw), text))
    by_rank: dict[int, frozenset[str]] = {}
    for item in text.split(","):
        rank, sep, value = (part.strip() for part in item.partition(":"))
        if not sep or _small_int(rank, _MAX_LOCAL_RANK) is None:
            raise ConfigError(f"--{name} {raw!r}: expected LOCAL_RANK:VALUE,... e.g. 0:3,1:2")
        if int(rank) in by_rank:
            raise ConfigError(f"--{name} {raw!r}: local rank {int(rank)} is given twice")
        by_rank[int(rank)] = _std_value(name, str(raw), value)
    return Streams(by_rank=tuple(sorted(by_rank.items())))


def parse_local_ranks(name: str, raw: Any) -> frozenset[int] | None:
    """``0,1,2`` -> those local ranks; empty -> None (every rank). ConfigError otherwise."""
    if not isinstance(raw, (str, int)) or isinstance(raw, bool):
        raise ConfigError(f"--{name} {raw!r}: expected local ranks such as 0,1,2")
    text = str(raw).strip()
    if not text:
        return None
    ranks = [r.strip() for r in text.split(",")]
    if not all(_small_int(r, _MAX_LOCAL_RANK) is not None for r in ranks):
        raise ConfigError(f"--{name} {raw!r}: expected comma-separated local ranks, "
                          "e.g. 0 or 0,1,2")
    return frozenset(int(r) for r in ranks)


@dataclass(frozen=True)
class ConsoleFilter:
    """What reaches the console: every line of every worker unless ``redirected``
    keeps a stream of a rank off it or ``local_ranks`` (None: all) leaves the rank out."""

    redirected: Streams = field(default_factory=Streams)
    local_ranks: frozenset[int] | None = None

    @property
    def shows_everything(self) -> bool:
        return (self.local_ranks is None and not self.redirected.every
                and not any(s for _, s in self.redirected.by_rank))

    def shows(self, local_rank: int | None, stream: str) -> bool:
        """Whether a line of ``stream`` from ``local_rank`` goes to the console.
        A warm worker (``local_rank`` None: no rank yet) shows only when
        everything does; its lines reach the log of the rank it becomes."""
        if local_rank is None:
            return self.shows_everything
        if self.local_ranks is not None and local_rank not in self.local_ranks:
            return False
        return stream not in self.redirected.of(local_rank)
