"""Records kept in etcd, read as hostile input: the limits every record
obeys, the one sanitiser of free text, ids, and the readers of record fields.

Below the store, the rendezvous and the checkpoint: each of them (and the
agent) validates what it reads from etcd, a gRPC request or a worker's file
with these, so a record written by hand or by an incompatible version is
refused naming its key and field (:class:`~elastic.errors.MalformedRecordError`)
rather than crashing a node. No I/O here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict
from typing import Any, Callable

from elastic.errors import ConfigError, MalformedRecordError
from elastic.hostport import MAX_PORT, HostPort

__all__ = [
    "MAX_HOST_CHARS", "MAX_NPROC", "MAX_REASON_CHARS", "MAX_RECORD_BYTES",
    "MAX_WALL_TIME_S", "addr_field", "cap_text", "host_field", "id_field", "id_in_key",
    "int_field", "load_object", "port_field", "printable_text", "text_field", "time_field",
    "typed_field", "valid_addr", "valid_host", "validate_id",
]

# Free text (reasons, event messages) is cut to this many characters wherever it
# enters a record: a round transaction carries the round's reason and an event,
# and etcd refuses requests over 1.5 MiB, so one huge reason would make every
# round commit fail and the leader retry forever.
MAX_REASON_CHARS = 1024
# A record read from etcd larger than this is refused unparsed, naming its key:
# none the project writes comes near it (a round of 1,000 members is ~100 KB),
# and etcd's own request limit is 1.5 MiB by default.
MAX_RECORD_BYTES = 1 << 20
# Wall times in records (seconds since the epoch) beyond this (the year 5138)
# are refused: time.localtime and strftime fail on them when a command prints them.
MAX_WALL_TIME_S = 1e11
# Host names and HOST:PORT addresses: what DNS names, IPv4 and bracketed IPv6
# literals (with a %zone) are made of; nothing that would select another gRPC
# transport ("unix:/path"), and no space or control character for a log line.
MAX_HOST_CHARS = 253
# More workers than this on one node is not a configuration but a typo or an
# attack (a world size in the billions would make every rank's env absurd).
MAX_NPROC = 1 << 16
_HOST_RE = re.compile(r"[A-Za-z0-9._:%\[\]-]*")

# fullmatch, never match with "$": "$" also matches before a final newline ("a\n").
_JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def validate_id(kind: str, value: str) -> str:
    """Return ``value`` if it is a usable job or node id, else raise ConfigError."""
    if not isinstance(value, str) or not _JOB_ID_RE.fullmatch(value):
        raise ConfigError(
            f"invalid {kind} {cap_text(repr(value), 80)}: use 1-128 letters, digits, '.', "
            "'_' or '-', "
            "starting with a letter or digit"
        )
    return value


# What must not reach a log line or a terminal as it is: C0 and C1 control
# characters (escape sequences that drive the terminal, carriage returns and
# newlines that overwrite or forge a line), DEL, the invisible format characters
# that reorder or hide text (bidirectional overrides and isolates, zero-width
# characters, line and paragraph separators) and lone surrogates (which cannot
# even be encoded to print: a UnicodeEncodeError at the terminal).
_UNPRINTABLE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"
    r"\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    char = match.group()
    if char in "\t\n\r":
        return " "  # a traceback or a multi-line message stays readable on one line
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable_text(text: str) -> str:
    """``text`` safe to log or print: tabs and line breaks become spaces, and
    every other control or invisible format character (see ``_UNPRINTABLE``)
    becomes its escape (``\\x1b``, ``\\u202e``), so it is seen, not obeyed.

    The one sanitiser of free text from outside (etcd records, gRPC requests,
    worker error files); :func:`cap_text` applies it. Idempotent.
    """
    if not _UNPRINTABLE.search(text):
        return text
    return _UNPRINTABLE.sub(_escape, text)


def cap_text(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` made printable (:func:`printable_text`) if that has at most
    ``limit`` characters, else its start followed by ``"... [N more
    characters]"``, the whole at most ``limit`` characters long.

    Idempotent: a capped text is returned unchanged. A ``limit`` too small to
    hold the marker cuts without it.
    """
    text = printable_text(text)
    if len(text) <= limit:
        return text
    # The marker for N = len(text) is the longest it can be, so using its length
    # guarantees the result fits whatever N turns out to be.
    longest_marker = len(f"... [{len(text)} more characters]")
    if limit < longest_marker:
        return text[:max(0, limit)]
    kept = limit - longest_marker
    return f"{text[:kept]}... [{len(text) - kept} more characters]"




# Readers of record fields, shared by every record kept in etcd (events too).
# Each returns a value of the promised type and range or raises
# MalformedRecordError naming the key and the field: records are hostile input.

def load_object(key: str, raw: bytes) -> dict[str, Any]:
    """``raw`` parsed as a JSON object; MalformedRecordError if it is not one,
    or if it is larger than MAX_RECORD_BYTES (refused before it is parsed)."""
    if len(raw) > MAX_RECORD_BYTES:
        raise MalformedRecordError(key, f"{len(raw)} bytes, more than the {MAX_RECORD_BYTES} "
                                        "a record may have")
    try:
        obj = json.loads(raw.decode("utf-8"))
    # ValueError also covers bad UTF-8 and integers of more than 4300 digits;
    # RecursionError, arrays nested thousands deep (json recurses per level).
    except (ValueError, RecursionError) as exc:
        raise MalformedRecordError(key, f"not JSON ({cap_text(str(exc), 200)})") from exc
    if not isinstance(obj, dict):
        raise MalformedRecordError(key, f"expected a JSON object, got {type(obj).__name__}")
    return obj


_MISSING = object()


class FieldsAsJson:
    """A dataclass record whose JSON is its fields (nested dataclasses included), keys sorted."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()  # type: ignore[call-overload]


def element_fields(key: str, list_name: str, index: int,
                   obj: Any) -> tuple[dict[str, Any], Callable[[str], str]]:
    """Element ``index`` of the list field ``list_name`` of the record at ``key``,
    its fields renamed as they sit in the record (``members[2].nproc``), and the
    function that names one of them: so that the field readers' errors name the
    field where a reader finds it. Raises MalformedRecordError when the element
    is not an object."""
    where = f"{list_name}[{index}]"
    if not isinstance(obj, dict):
        raise MalformedRecordError(key, f"field '{where}' is not an object")

    def name(field_name: str) -> str:
        return f"{where}.{field_name}"

    return {name(field_name): value for field_name, value in obj.items()}, name


def typed_field(key: str, obj: dict, name: str, kind: type | tuple[type, ...],
                default: Any = _MISSING) -> Any:
    """``obj[name]`` if it is a ``kind`` (a bool is never an int here), ``default``
    when absent and a default is given; else MalformedRecordError naming the field."""
    if name not in obj:
        if default is _MISSING:
            raise MalformedRecordError(key, f"missing field {name!r}")
        return default
    value = obj[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise MalformedRecordError(key, f"field {name!r} has the wrong type: {value!r}")
    if not isinstance(value, kind):
        raise MalformedRecordError(
            key, f"field {name!r} has the wrong type: {type(value).__name__}")
    return value


def int_field(key: str, obj: dict, name: str, low: int, high: int | None = None,
              default: Any = _MISSING) -> int:
    """An int field within ``low..high``; MalformedRecordError naming the field if not."""
    value = typed_field(key, obj, name, int, default)
    if value < low or (high is not None and value > high):
        bounds = f"{low}..{high}" if high is not None else f"at least {low}"
        raise MalformedRecordError(key, f"field {name!r} is {value}, expected {bounds}")
    return value


def port_field(key: str, obj: dict, name: str, default: Any = _MISSING) -> int:
    """A TCP port, 0..MAX_PORT (0: none)."""
    return int_field(key, obj, name, 0, MAX_PORT, default)


def time_field(key: str, obj: dict, name: str, value: Any = _MISSING) -> float:
    """A wall time, 0..MAX_WALL_TIME_S seconds since the epoch, as a float:
    ``obj[name]``, or ``value`` when given (an element of a list field). JSON
    has no NaN, but Python's json reads one."""
    if value is _MISSING:
        value = typed_field(key, obj, name, (int, float))
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedRecordError(key, f"field {name!r} holds a non-number: {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond a float's range
        seconds = math.inf
    if not math.isfinite(seconds):
        raise MalformedRecordError(key, f"field {name!r} is not a finite number")
    if not 0 <= seconds <= MAX_WALL_TIME_S:
        raise MalformedRecordError(key, f"field {name!r} is {seconds:g}, not a time "
                                        f"(0..{MAX_WALL_TIME_S:g} s since the epoch)")
    return seconds


def valid_host(host: str) -> bool:
    """Whether ``host`` is a host name or an IP address: 1..MAX_HOST_CHARS of
    what those are made of (letters, digits, '.', '-', '_', ':', '%', brackets)."""
    return 0 < len(host) <= MAX_HOST_CHARS and bool(_HOST_RE.fullmatch(host))


def host_field(key: str, obj: dict, name: str, default: Any = _MISSING) -> str:
    """A host name or address ("" allowed): at most MAX_HOST_CHARS of what host
    names and IP literals are made of."""
    value = typed_field(key, obj, name, str, default)
    if value and not valid_host(value):
        raise MalformedRecordError(key, f"field {name!r} is not a host name or address: "
                                        f"{cap_text(value, 64)!r}")
    return value


def valid_addr(addr: str) -> bool:
    """Whether ``addr`` is HOST:PORT (a host as :func:`host_field` takes it, a
    port 1..MAX_PORT): what a peer may dial, nothing else (no ``unix:`` path)."""
    try:
        endpoint = HostPort.parse(addr)
    except ValueError:
        return False
    return valid_host(endpoint.host) and endpoint.port > 0


def addr_field(key: str, obj: dict, name: str, default: Any = _MISSING) -> str:
    """An agent's gRPC address: "" (none) or HOST:PORT (:func:`valid_addr`)."""
    value = typed_field(key, obj, name, str, default)
    if value and not valid_addr(value):
        raise MalformedRecordError(key, f"field {name!r} is not HOST:PORT: "
                                        f"{cap_text(value, 64)!r}")
    return value


def id_field(key: str, obj: dict, name: str, kind: str = "node id") -> str:
    """A string that passes :func:`validate_id`."""
    value = typed_field(key, obj, name, str)
    try:
        return validate_id(kind, value)
    except ConfigError as exc:
        raise MalformedRecordError(key, f"field {name!r}: {exc}") from None


def text_field(key: str, obj: dict, name: str, default: str = "",
               limit: int = MAX_REASON_CHARS) -> str:
    """A free-text field, made printable and capped (:func:`cap_text`): a
    record someone else wrote may hold anything of any size."""
    return cap_text(typed_field(key, obj, name, str, default), limit)


def id_in_key(key: str, prefix: str) -> str:
    """The node id that ``key`` names right under ``prefix`` (``nodes/<id>``,
    ``requests/drain/<id>``...); MalformedRecordError when what follows the
    prefix is not one valid id (``nodes/../round``, ``nodes/a/b``)."""
    rest = key[len(prefix):] if key.startswith(prefix) else key
    try:
        return validate_id("node id", rest)
    except ConfigError as exc:
        raise MalformedRecordError(key, f"the key does not end in a node id: {exc}") from None

