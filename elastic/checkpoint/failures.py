"""A rank's failure as a value that travels in a collective, and how it reads.

Every rank of a save or a restore makes the same collective calls in the same
order, whatever fails locally: :func:`capture` turns a local step's failure
into a :class:`RankFailure` (it pickles), the next collective carries it, and
every rank then raises the same error. :func:`describe_failure` writes one
line for any exception, ours or torch's.
"""

from __future__ import annotations

import dataclasses
import errno as errno_module
from typing import Callable

from torch.distributed.checkpoint.api import CheckpointException

from elastic.errors import CheckpointWriteError, ElasticError, FencedError


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """A failure on one rank, in a form that pickles through an object collective."""

    rank: int
    message: str
    errno: int | None
    fenced: bool = False

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> "RankFailure":
        """Describe ``exc`` as seen on ``rank``; when it wraps another rank's OS
        error (DCP spreads one rank's failure to all), name that rank."""
        found = find_os_error(exc, rank)
        if found is not None:
            origin, os_error = found
            where = f" ({os_error.filename})" if os_error.filename else ""
            code = errno_module.errorcode.get(os_error.errno, os_error.errno)
            return cls(origin, f"[Errno {os_error.errno} {code}] {os_error.strerror}{where}",
                       os_error.errno)
        return cls(rank, describe_failure(exc), None)

    def error(self, step: int, directory: str, more: int = 0) -> Exception:
        """The error every rank raises for the save of ``step`` into ``directory``:
        :class:`FencedError` for a fenced commit, else :class:`CheckpointWriteError`
        naming this rank (and ``more`` other failed ranks) and the errno."""
        if self.fenced:
            return FencedError(self.message)
        others = f" (and on {more} more rank(s))" if more else ""
        return CheckpointWriteError(f"saving checkpoint step {step} into {directory} failed on "
                                    f"rank {self.rank}{others}: {self.message}",
                                    directory, self.errno)


def capture(rank: int, action: Callable[[], None]) -> RankFailure | None:
    """Run a local step on ``rank``; its failure as a value (None when it succeeded),
    so that every rank still makes the next collective call. Never raises an
    ``Exception``: it is re-raised on every rank from the collective's result."""
    try:
        action()
    except FencedError as exc:
        return RankFailure(rank, str(exc), None, fenced=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised on every rank
        return RankFailure.of(rank, exc)
    return None


def find_os_error(exc: BaseException, rank: int) -> tuple[int, OSError] | None:
    """The first OSError in an exception's cause chain or in DCP's per-rank
    failures, with the rank it happened on."""
    seen = set()
    pending: list[tuple[int, BaseException | None]] = [(rank, exc)]
    while pending:
        origin, current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return origin, current
        if isinstance(current, CheckpointException):
            pending.extend((r, failure[0]) for r, failure in sorted(current.failures.items()))
        pending.extend([(origin, current.__cause__), (origin, current.__context__)])
    return None


def describe_failure(exc: BaseException) -> str:
    """One line for a rank's failure: our own errors by their message, others
    with their type too; for DCP's CheckpointException, the first inner error."""
    if isinstance(exc, CheckpointException):
        inner = [failure[0] for _, failure in sorted(exc.failures.items())]
        if inner:
            return f"{type(inner[0]).__name__}: {describe_failure(inner[0])}"
    text = str(exc).strip().splitlines()
    if isinstance(exc, ElasticError):
        return text[0] if text else type(exc).__name__
    # Not ours: its type says what went wrong when its text does not (a torch
    # error whose message is only "<class 'type'>").
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
