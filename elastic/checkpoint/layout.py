"""The checkpoint directory: names, manifests, verification, retention. No torch.

Layout under the checkpoint root::

    latest                              FileCommitLog's record (json), if that log is used
    step-000000000100/                  one checkpoint, named by its step
        .metadata                       DCP's global metadata (written by rank 0)
        __0_0.distcp, __1_0.distcp ...  DCP's shard files, one or more per rank
        rank-00000.pt ...               each rank's own non-tensor state (RNG, scheduler,
                                        data position, extras, step)
        manifest-00000.json ...         each rank's list of the files it wrote, with
                                        size and CRC-32 (and, for DCP's shard files,
                                        the CRC-32 of each item in them)
        COMMITTED                       json {step, round, world_size, path, time}: written
                                        after the commit log accepted the checkpoint
    .tmp-step-200-round-3/              a save being written (or one that crashed)
    .trash-step-000000000050-.../       a directory being deleted

Modes: every directory and file a save creates (the temporary directory, DCP's
files, the rank states, manifests, ``COMMITTED``, ``latest``) gets exactly the
checkpointer's mode (default 0o700 for directories, 0o600 for files), set
explicitly so that no umask widens it.

Checksum: CRC-32 (``zlib.crc32``'s polynomial and values). The threat is
storage going wrong (a truncated copy, a torn write, a flipped bit), not an
adversary, and CRC-32 catches every burst of up to 32 flipped bits and all but
2**-32 of the rest; sizes are checked as well, so truncation never depends on
the checksum. :func:`crc32` is zlib-ng's when the ``zlib-ng`` package is
installed (the same values, computed with carry-less multiplication: ~30 GB/s
on one core here), else the standard library's (~4 GB/s here, which is about
the rate at which DCP loads from the page cache, so with it the CRC-32 of what
a restore reads costs about as much as reading it).

A manifest lists, per file, its size and CRC-32, and for a DCP shard file the
CRC-32 of each *item* (one tensor chunk or object, as DCP's ``.metadata``
locates it: ``[offset, length, crc32]``), which tile the file: their CRC-32s
combine (:func:`crc32_combine`) to the file's. Both are computed from the bytes
as they are written (:mod:`elastic.checkpoint.dcp_io`), so a save reads nothing
back. Manifests without items (written before items existed) stay valid: the
format number is unchanged, and older readers ignore the items.

Verification: :func:`verify_structure` reads the manifests (small) and checks
``.metadata``'s presence, then stats every listed file for its size and checks
that its items' CRC-32s combine to its CRC-32 (no file is read). That is what a
save checks before it commits. :func:`verify_checksums` reads whole files and
compares their CRC-32s (one sequential read of the checkpoint; callers split it
across ranks with ``part``/``parts``, balanced by bytes,
:func:`split_by_bytes`); restore needs it only for shard files without items,
since it checks each item as DCP reads it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import stat
import time
from typing import Iterable

from elastic.checkpoint import timing
from elastic.checkpoint.api import CommitEntry
from elastic.errors import CheckpointError, ConfigError
from elastic.records import cap_text

try:  # the same CRC-32 (polynomial, values) as zlib's, several times faster
    from zlib_ng.zlib_ng import crc32 as _crc32
    CRC32_IMPLEMENTATION = "zlib-ng"
except ImportError:
    from zlib import crc32 as _crc32
    CRC32_IMPLEMENTATION = "zlib"

METADATA_FILE = ".metadata"
MARKER_FILE = "COMMITTED"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
MANIFEST_FORMAT = 1
# What a save creates is private to the job's user by default, whatever the umask
# (a checkpoint is the model); Checkpointer(mode=0o750) lets a group read.
DIR_MODE = 0o700
FILE_MODE = 0o600

_STEP_DIR = re.compile(r"^step-(\d{12,})$")
_TMP_DIR = re.compile(r"^\.tmp-step-(\d+)-round-(\d+)$")
_MANIFEST = re.compile(r"^manifest-(\d{5,})\.json$")
_RANK_STATE = re.compile(r"^rank-(\d{5,})\.pt$")
_CHUNK = 1 << 20  # one reused read buffer: a checkpoint thread's arena keeps what it touched
# A checkpoint's own files are read as hostile input (anyone who can write the
# checkpoint storage can edit them): a manifest or marker larger than these
# is refused unread, and no name in a manifest can point outside its directory.
MAX_MANIFEST_BYTES = 16 << 20
MAX_MARKER_BYTES = 1 << 16
# More ranks than this in a manifest is a lie, not a job: the problems it makes
# (one per missing manifest) must stay few.
MAX_WORLD_SIZE = 1 << 24
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_CRC32 = re.compile(r"[0-9a-f]{8}")
_MAX_INT64 = 2**63 - 1


def step_dir_name(step: int) -> str:
    """``step-000000000100``: zero-padded so names sort by step."""
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed-checkpoint directory name, or None."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def tmp_dir_name(step: int, round_: int) -> str:
    """``.tmp-step-<step>-round-<round>``: where a save writes before it commits."""
    return f".tmp-step-{step}-round-{round_}"


def parse_tmp_dir(name: str) -> tuple[int, int] | None:
    """``(step, round)`` of a temporary directory name, or None."""
    match = _TMP_DIR.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def rank_state_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def manifest_name(rank: int) -> str:
    return f"manifest-{rank:05d}.json"


def is_shard_file(name: str) -> bool:
    """Whether a file a manifest lists is one of DCP's shard files (not
    ``.metadata``, not a rank's state)."""
    return name != METADATA_FILE and not _RANK_STATE.match(name)


# --- durable writes -------------------------------------------------------------------------


def fsync_dir(path: str) -> None:
    """fsync a directory, so entries created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_mode(mode: int) -> int:
    """``mode`` when it is a usable mode for the checkpoint directories: the
    owner's ``rwx`` at least, nothing writable by others (anyone could then plant
    a checkpoint), no special bits. Raises ConfigError."""
    if (type(mode) is not int or mode & ~0o777 or mode & 0o700 != 0o700 or mode & 0o002):
        shown = oct(mode) if type(mode) is int else repr(mode)
        raise ConfigError(f"checkpoint mode {shown}: expected a directory mode between 0o700 "
                          f"and 0o775 with the owner's rwx and nothing writable by others "
                          f"(e.g. 0o700, the default, or 0o750 to let the group read)")
    return mode


def root_exposure(root: str) -> str | None:
    """Why others than this process's user can write into the checkpoint root
    (it is writable by every user, sticky or not: they could create a step
    directory; or it belongs to another user than this one or root), or None
    when they cannot or it cannot be told."""
    try:
        info = os.stat(root)
    except OSError:
        return None
    if info.st_mode & stat.S_IWOTH:
        return f"is writable by every user (mode {stat.S_IMODE(info.st_mode):o})"
    if info.st_uid not in (os.getuid(), 0):
        return f"belongs to another user (uid {info.st_uid})"
    return None


def file_mode(dir_mode: int) -> int:
    """The mode of the files in directories of ``dir_mode``: the same, without
    execute bits (0o700 -> 0o600, 0o750 -> 0o640)."""
    return dir_mode & 0o666


def make_dir(path: str, mode: int = DIR_MODE) -> None:
    """Create the directory ``path`` with exactly ``mode``, whatever the umask.
    Raises FileExistsError when it exists."""
    os.mkdir(path, mode)
    os.chmod(path, mode)  # mkdir's mode is masked by the umask


def open_new(path: str, mode: int = FILE_MODE) -> int:
    """A descriptor of ``path`` created (or truncated) for writing with exactly
    ``mode``, whatever the umask, not through a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits; an old file keeps its mode
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_durably(path: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Create ``path`` with ``data`` and ``mode`` and fsync it (not atomic: for
    files that a manifest or the commit protocol vouches for)."""
    with open(open_new(path, mode), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Replace ``path`` with ``data`` atomically and durably (tmp file, fsync,
    rename, fsync of the directory): a reader sees the old or the new content."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_durably(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


# --- manifests and verification -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ItemDigest:
    """One item of a DCP shard file: its byte range and the CRC-32 of those bytes."""

    offset: int
    length: int
    crc32: str  # 8 lowercase hex digits


@dataclasses.dataclass(frozen=True)
class FileDigest:
    """A file's size and CRC-32; ``items``, for a DCP shard file, tile it in order
    (None for other files and in manifests written before items existed)."""

    size: int
    crc32: str  # 8 lowercase hex digits
    items: tuple[ItemDigest, ...] | None = None

    def to_record(self) -> dict:
        record: dict = {"size": self.size, "crc32": self.crc32}
        if self.items is not None:
            record["items"] = [[i.offset, i.length, i.crc32] for i in self.items]
        return record


def file_digest(path: str) -> FileDigest:
    """Size and CRC-32 of a file, read into one reused 1 MiB buffer (``readinto``:
    no allocation per chunk, so the reading thread's heap stays small; the CRC-32
    releases the GIL on large buffers, so this runs beside other work)."""
    value = 0
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0, opener=_no_follow) as f:
        while n := f.readinto(buffer):
            value = crc32(view[:n], value)
            size += n
    return FileDigest(size=size, crc32=f"{value:08x}")


def bytes_digest(data: bytes) -> FileDigest:
    """Size and CRC-32 of a file's content held in memory."""
    return FileDigest(size=len(data), crc32=f"{crc32(data):08x}")


def check_bytes(path: str, data: bytes, expected: FileDigest) -> Problem | None:
    """A problem when ``data``, read whole from ``path``, is not what ``expected`` says."""
    if len(data) != expected.size:
        return Problem(path, f"truncated or overwritten: {len(data)} bytes, expected "
                             f"{expected.size}")
    actual = f"{crc32(data):08x}"
    if actual != expected.crc32:
        return Problem(path, f"corrupt: CRC-32 {actual}, expected {expected.crc32}")
    return None


def crc32(data: bytes | memoryview, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, by :data:`CRC32_IMPLEMENTATION`: every CRC-32
    of a checkpoint's bytes (as written, as read, whole files) is computed here
    (the ``crc`` phase of :mod:`elastic.checkpoint.timing`)."""
    with timing.phase("crc"):
        return _crc32(data, value)


# CRC-32 arithmetic (zlib's crc32_combine, which Python's zlib does not expose):
# polynomials over GF(2) modulo the reflected CRC-32 polynomial.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo p(x), both reflected 32-bit polynomials."""
    if a == 0:
        return 0
    m = 1 << 31
    product = 0
    while True:
        if a & m:
            product ^= b
            if a & (m - 1) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache
def _x2n_table() -> tuple[int, ...]:
    """x**(2**k) modulo p(x) for k = 0..31."""
    table = [1 << 30]  # x**1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return tuple(table)


@functools.lru_cache(maxsize=4096)  # items of a model repeat a few lengths
def _shift(length: int) -> int:
    """x**(8 * length) modulo p(x): appending ``length`` zero bytes to a CRC."""
    table = _x2n_table()
    product = 1 << 31  # x**0
    k = 3
    while length:
        if length & 1:
            product = _multmodp(table[k & 31], product)
        length >>= 1
        k += 1
    return product


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    return _multmodp(_shift(length2), crc1) ^ crc2


def combined_crc32(items: Iterable[ItemDigest]) -> str:
    """The CRC-32 of the concatenation of ``items`` (in order), from theirs."""
    value = 0
    for item in items:
        value = crc32_combine(value, int(item.crc32, 16), item.length)
    return f"{value:08x}"


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The files one rank wrote into one checkpoint."""

    rank: int
    world_size: int
    step: int
    round: int
    files: dict[str, FileDigest]

    def to_json(self) -> bytes:
        record = {"format": MANIFEST_FORMAT, "rank": self.rank, "world_size": self.world_size,
                  "step": self.step, "round": self.round,
                  "files": {name: d.to_record() for name, d in sorted(self.files.items())}}
        return json.dumps(record, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        """Raises ValueError (or a subclass) when ``data`` is not a valid manifest:
        not a JSON object of format MANIFEST_FORMAT; ``rank``, ``step`` or
        ``round`` not an integer 0..2**63-1 (``rank`` below ``world_size``,
        which is 1..MAX_WORLD_SIZE); a file name that is not a plain name in
        the checkpoint's directory (letters, digits, '.', '_', '-'; not "." or
        ".."); a size not an integer 0..2**63-1; a CRC-32 not 8 hex digits;
        ``items`` present but not a list of ``[offset, length, crc32]``."""
        try:
            record = json.loads(data)
        except RecursionError:  # nested thousands deep: json recurses per level
            raise ValueError("JSON nested too deeply") from None
        if not isinstance(record, dict):
            raise ValueError(f"not a JSON object but a {type(record).__name__}")
        if record.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unknown manifest format {_shown(record.get('format'))}")
        world_size = _int(record, "world_size", 1, MAX_WORLD_SIZE)
        rank = _int(record, "rank", 0, world_size - 1)
        files = record.get("files")
        if not isinstance(files, dict):
            raise ValueError(f"field 'files' is {_shown(files)}, not an object")
        digests = {}
        for name, digest in files.items():
            if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
                raise ValueError(f"file name {_shown(name)} is not a plain name inside the "
                                 "checkpoint")
            if not isinstance(digest, dict):
                raise ValueError(f"the digest of {name} is {_shown(digest)}, not an object")
            crc = _crc_field(digest.get("crc32"), f"the CRC-32 of {name}")
            size = _int(digest, "size", 0, _MAX_INT64)
            items = digest.get("items")
            digests[name] = FileDigest(size=size, crc32=crc, items=(
                None if items is None else _items(name, items)))
        return cls(rank=rank, world_size=world_size, step=_int(record, "step", 0, _MAX_INT64),
                   round=_int(record, "round", 0, _MAX_INT64), files=digests)


def _items(name: str, items: object) -> tuple[ItemDigest, ...]:
    """A file's items from a manifest (see :meth:`Manifest.from_json`); whether
    they tile the file is :func:`verify_structure`'s to say."""
    if not isinstance(items, list):
        raise ValueError(f"the items of {name} are {_shown(items)}, not a list")
    parsed = []
    for entry in items:
        if not isinstance(entry, list) or len(entry) != 3:
            raise ValueError(f"an item of {name} is {_shown(entry)}, not [offset, length, "
                             f"crc32]")
        offset, length, crc = entry
        for value in (offset, length):
            if type(value) is not int or not 0 <= value <= _MAX_INT64:
                raise ValueError(f"an item of {name} is {_shown(entry)}: offsets and lengths "
                                 f"are integers 0..{_MAX_INT64}")
        parsed.append(ItemDigest(offset, length, _crc_field(crc, f"an item's CRC-32 in {name}")))
    return tuple(parsed)


def _crc_field(value: object, what: str) -> str:
    if not isinstance(value, str) or not _CRC32.fullmatch(value):
        raise ValueError(f"{what} is {_shown(value)}, not 8 hex digits")
    return value


def _int(record: dict, name: str, low: int, high: int) -> int:
    value = record.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"field {name!r} is {_shown(value)}, expected an integer {low}..{high}")
    return value


def _shown(value) -> str:
    """A value read from a file, short and printable, for a message."""
    return cap_text(repr(value), 80)


def _no_follow(path: str, flags: int) -> int:
    """An ``opener`` that refuses a symbolic link (ELOOP): a checkpoint's files
    are never links, and one could point anywhere (/dev/zero, a secret)."""
    return os.open(path, flags | os.O_NOFOLLOW)


def read_limited(path: str, limit: int) -> bytes:
    """The bytes of the file at ``path`` (not through a symbolic link); raises
    ValueError when it has more than ``limit``, OSError when it cannot be read."""
    with open(path, "rb", opener=_no_follow) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def write_manifest(directory: str, manifest: Manifest, mode: int = FILE_MODE) -> None:
    write_durably(os.path.join(directory, manifest_name(manifest.rank)), manifest.to_json(),
                  mode)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why a checkpoint failed verification; ``path`` names the file at fault."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def read_manifests(directory: str) -> tuple[list[Manifest], list[Problem]]:
    """All ranks' manifests of a checkpoint, checked for completeness: one per
    rank ``0..world_size-1``, agreeing on world size and step."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return [], [Problem(directory, "directory does not exist")]
    except NotADirectoryError:
        return [], [Problem(directory, "not a directory")]
    manifests: list[Manifest] = []
    problems: list[Problem] = []
    for name in names:
        match = _MANIFEST.match(name)
        if not match:
            continue
        path = os.path.join(directory, name)
        try:
            manifest = Manifest.from_json(read_limited(path, MAX_MANIFEST_BYTES))
        except (OSError, ValueError) as exc:
            problems.append(Problem(path, f"unreadable manifest ({cap_text(str(exc), 300)})"))
            continue
        if manifest.rank != int(match.group(1)):
            problems.append(Problem(path, f"manifest of rank {manifest.rank} under the wrong name"))
            continue
        manifests.append(manifest)
    if not manifests:
        return [], problems or [Problem(os.path.join(directory, manifest_name(0)), "no manifest")]
    world_size = manifests[0].world_size
    step = manifests[0].step
    for manifest in manifests:
        if manifest.world_size != world_size or manifest.step != step:
            problems.append(Problem(os.path.join(directory, manifest_name(manifest.rank)),
                                    f"says world size {manifest.world_size} and step "
                                    f"{manifest.step}; rank {manifests[0].rank} says "
                                    f"{world_size} and {step}"))
    present = {m.rank for m in manifests}
    # One problem per missing manifest, but only the first few: a manifest that
    # claims millions of ranks must not make millions of problems (and log lines).
    missing = (rank for rank in range(world_size) if rank not in present)
    for count, rank in enumerate(missing):
        if count == 8:
            left = world_size - sum(0 <= r < world_size for r in present) - count
            problems.append(Problem(directory, f"and {left} more rank(s)' manifests are "
                                               f"missing (of {world_size})"))
            break
        problems.append(Problem(os.path.join(directory, manifest_name(rank)),
                                f"missing (the checkpoint was written by {world_size} ranks)"))
    for rank in sorted(r for r in present if not 0 <= r < world_size):
        problems.append(Problem(os.path.join(directory, manifest_name(rank)),
                                f"rank {rank} is outside world size {world_size}"))
    return manifests, problems


def manifest_bytes(manifests: list[Manifest]) -> int:
    """The size of a checkpoint's files that ``manifests`` list (each file once)."""
    sizes = {name: d.size for m in manifests for name, d in m.files.items()}
    return sum(sizes.values())


def verify(directory: str, *, checksums: bool = True, part: int = 0,
           parts: int = 1) -> list[Problem]:
    """The problems that make a checkpoint directory unusable; empty when it verifies.

    :func:`verify_structure` (manifests, ``.metadata``, sizes of this part's
    share) followed by :func:`verify_checksums` of the share's files whose size
    was right (when ``checksums``). ``parts`` callers (one per rank) with
    ``part`` ``0..parts-1`` together check every file exactly once.
    """
    problems, share = verify_structure(directory, part=part, parts=parts)
    if checksums:
        problems += verify_checksums(share)
    return problems


@timing.timed("verify")
def verify_structure(directory: str, *, part: int = 0, parts: int = 1,
                     manifests: tuple[list[Manifest], list[Problem]] | None = None
                     ) -> tuple[list[Problem], list[tuple[str, FileDigest]]]:
    """The cheap checks, and the files left for :func:`verify_checksums`.

    Checks that every rank's manifest is there and consistent, that DCP's
    ``.metadata`` is listed and present, and that every file of this part's
    share (see :func:`split_by_bytes`) exists with its recorded size and, when
    the manifest lists its items, that their CRC-32s combine to the file's
    (a manifest that contradicts itself). Reads no file but the manifests. Only
    part 0 reports the structural problems, so merged results carry no
    duplicates. Returns ``(problems, share)``: ``share`` is ``(path, expected
    digest)`` for this part's files whose size was right. ``manifests`` is
    what :func:`read_manifests` returned for ``directory``, for a caller that
    has read them already (they are read here otherwise).
    """
    manifests, problems = manifests if manifests is not None else read_manifests(directory)
    problems = list(problems)
    if not manifests:
        return (problems if part == 0 else []), []
    listed = sorted((name, digest) for m in manifests for name, digest in m.files.items())
    if METADATA_FILE not in {name for name, _ in listed}:
        problems.append(Problem(os.path.join(directory, METADATA_FILE),
                                "not listed in any manifest"))
    counts = collections.Counter(name for name, _ in listed)
    for name in sorted(n for n, count in counts.items() if count > 1):
        problems.append(Problem(os.path.join(directory, name), "listed by more than one rank"))
    if part != 0:
        problems = []
    share = []
    for name, expected in split_by_bytes(listed, parts)[part]:
        path = os.path.join(directory, name)
        problem = _check_size(path, expected) or _check_items(path, expected)
        if problem is not None:
            problems.append(problem)
        else:
            share.append((path, expected))
    return problems, share


def verify_checksums(files: Iterable[tuple[str, FileDigest]]) -> list[Problem]:
    """Read each ``(path, expected)`` file once and compare its size and CRC-32."""
    problems = []
    for path, expected in files:
        problem = _check_digest(path, expected)
        if problem is not None:
            problems.append(problem)
    return problems


def split_by_bytes(files: Iterable[tuple[str, FileDigest]], parts: int
                   ) -> list[list[tuple[str, FileDigest]]]:
    """Split files into ``parts`` shares of about equal bytes (largest first, each
    to the share with the fewest bytes so far; ties by name, then by part), so
    every caller with the same manifests gets the same split, and each file is
    in exactly one share. Each share lists its files sorted by name."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    shares: list[list[tuple[str, FileDigest]]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for name, digest in sorted(files, key=lambda f: (-f[1].size, f[0])):
        target = min(range(parts), key=lambda i: (totals[i], i))
        shares[target].append((name, digest))
        totals[target] += digest.size
    return [sorted(share) for share in shares]


def _check_size(path: str, expected: FileDigest) -> Problem | None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Problem(path, "missing")
    except OSError as exc:
        return Problem(path, f"cannot stat ({exc})")
    if not stat.S_ISREG(info.st_mode):
        # A link could point anywhere; a checkpoint's files are plain files.
        return Problem(path, "not a regular file (a symbolic link, a directory or a device)")
    size = info.st_size
    if size != expected.size:
        return Problem(path, f"truncated or overwritten: {size} bytes, expected {expected.size}")
    return None


def _check_items(path: str, expected: FileDigest) -> Problem | None:
    """A problem when a file's items do not tile it in order, or their CRC-32s
    do not combine to its CRC-32: the manifest contradicts itself."""
    if expected.items is None:
        return None
    position = 0
    for item in expected.items:
        if item.offset != position:
            return Problem(path, f"its manifest lists an item at byte {item.offset} where one "
                                 f"at byte {position} was expected (the items must tile it)")
        position += item.length
    if position != expected.size:
        return Problem(path, f"its manifest's items end at byte {position}, but it has "
                             f"{expected.size} bytes")
    combined = combined_crc32(expected.items)
    if combined != expected.crc32:
        return Problem(path, f"corrupt: CRC-32 {expected.crc32} in its manifest, but its "
                             f"{len(expected.items)} items' CRC-32s combine to {combined}")
    return None


def _check_digest(path: str, expected: FileDigest) -> Problem | None:
    try:
        actual = file_digest(path)
    except FileNotFoundError:
        return Problem(path, "missing")
    except OSError as exc:
        return Problem(path, f"cannot read ({exc})")
    if actual.size != expected.size:
        return Problem(path, f"changed while read: {actual.size} bytes, expected {expected.size}")
    if actual.crc32 != expected.crc32:
        return Problem(path, f"corrupt: CRC-32 {actual.crc32}, expected {expected.crc32}")
    return None


# --- commit markers ---------------------------------------------------------------------------


def write_marker(directory: str, entry: CommitEntry, mode: int = FILE_MODE) -> None:
    """Write ``COMMITTED`` (the entry as json) into a checkpoint, durably."""
    record = dict(entry.to_dict(), written_at=time.time())
    write_durably(os.path.join(directory, MARKER_FILE), json.dumps(record).encode(), mode)
    fsync_dir(directory)


def read_marker(directory: str) -> CommitEntry | None:
    """The entry in a checkpoint's ``COMMITTED`` file; None when it is missing
    or unreadable (an unreadable marker is as good as none: also a link, one
    over MAX_MARKER_BYTES, or JSON nested too deeply to parse)."""
    try:
        data = read_limited(os.path.join(directory, MARKER_FILE), MAX_MARKER_BYTES)
        return CommitEntry.from_dict(json.loads(data))
    except (OSError, ValueError, RecursionError, CheckpointError):
        return None


def outside_root(root: str, name: str) -> Problem | None:
    """A problem when the checkpoint ``name`` (a commit record's ``path``, or a
    directory listed in ``root``) is not a plain name or resolves outside
    ``root`` (a symbolic link that leads elsewhere): restore must never read
    a checkpoint from anywhere but the checkpoint root. None when it is inside."""
    path = os.path.join(root, name)
    if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
        return Problem(path, "not a plain directory name inside the checkpoint root")
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        return Problem(path, f"resolves to {real}, outside the checkpoint root {real_root}")
    return None


def directory_round(directory: str) -> int | None:
    """The newest round that wrote into a checkpoint directory: the largest round
    of its ``COMMITTED`` marker and its readable manifests; None when neither
    says (an empty or foreign directory).

    A save uses it to tell a directory of a newer round (the saver is then a
    zombie and must leave it alone) from leftovers of its own or older rounds.
    """
    marker = read_marker(directory)
    manifests, _ = read_manifests(directory)
    rounds = [m.round for m in manifests] + ([marker.round] if marker is not None else [])
    return max(rounds, default=None)


# --- the root: candidates, retention, stale temporaries ------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointDir:
    step: int
    name: str
    marked: bool  # carries a readable COMMITTED marker


def list_checkpoints(root: str) -> list[CheckpointDir]:
    """The ``step-*`` directories under ``root``, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        step = parse_step_dir(name)
        if step is not None and os.path.isdir(os.path.join(root, name)):
            marked = read_marker(os.path.join(root, name)) is not None
            found.append(CheckpointDir(step, name, marked))
    return sorted(found, key=lambda d: d.step)


def restore_candidates(checkpoints: Iterable[CheckpointDir],
                       latest: CommitEntry | None) -> list[str]:
    """The directories restore may load, in the order it tries them.

    First the commit log's latest (whether or not it has a marker: the log is
    the authority), then every marked directory older than it, newest first.
    With no latest entry, every marked directory, newest first. A directory
    newer than the latest entry is never a candidate, marked or not.
    """
    candidates = [latest.path] if latest is not None else []
    for ckpt in sorted(checkpoints, key=lambda d: d.step, reverse=True):
        if latest is not None and ckpt.step >= latest.step:
            continue
        if ckpt.marked:
            candidates.append(ckpt.name)
    return candidates


def retention_victims(checkpoints: Iterable[CheckpointDir], keep: int,
                      latest: CommitEntry | None, protect: Iterable[str] = (),
                      unusable: Iterable[str] = ()) -> list[str]:
    """The checkpoint directories to delete so that ``keep`` committed ones remain.

    Committed means marked, or named by the latest entry; ``unusable`` ones
    (which failed verification) do not count towards ``keep``, so they never
    push out a good one. Kept: the ``keep`` newest committed ones, the latest
    entry's directory and ``protect`` (e.g. one being loaded), always.
    Deleted: every other directory older
    than the oldest kept committed one, and unmarked directories newer than
    the latest entry (saves that crashed after their rename or were fenced
    off: never committed). Unmarked directories between kept ones stay until
    they age out: they are never loaded, and a failed commit of unknown
    outcome may in truth have been recorded.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    checkpoints = sorted(checkpoints, key=lambda d: d.step)
    latest_name = latest.path if latest is not None else None
    unusable = set(unusable)
    committed = [d for d in checkpoints
                 if (d.marked or d.name == latest_name) and d.name not in unusable]
    kept = {d.name for d in committed[-keep:]} | set(protect)
    if latest_name is not None:
        kept.add(latest_name)
    oldest_kept = min((d.step for d in checkpoints if d.name in kept), default=None)
    victims = []
    for ckpt in checkpoints:
        if ckpt.name in kept:
            continue
        if oldest_kept is not None and ckpt.step < oldest_kept:
            victims.append(ckpt.name)
        elif latest is not None and ckpt.step > latest.step and not ckpt.marked:
            victims.append(ckpt.name)
    return victims


def stale_temporaries(names: Iterable[str], step: int, round_: int) -> list[str]:
    """Temporary directories that no save in flight can own, given that this
    job's saves are serialized and the current one is ``(step, round_)``.

    Stale: ``.trash-*`` leftovers, a temporary of an older round, and one of
    this round at an older step or at this save's own name (a crashed earlier
    attempt at the same step: its files must not mix with the new ones).
    Left alone: a newer step of this round (the next saves reach it) and
    anything of a newer round (then this writer is the zombie, and must not
    disturb the current round's save in flight).
    """
    stale = []
    for name in names:
        if name.startswith(TRASH_PREFIX):
            stale.append(name)
            continue
        parsed = parse_tmp_dir(name)
        if parsed is None:
            continue
        tmp_step, tmp_round = parsed
        if tmp_round < round_ or (tmp_round == round_ and tmp_step <= step):
            stale.append(name)
    return sorted(stale)
