"""The checkpoint directory: names, manifests, verification, retention. No torch.

Layout under the checkpoint root::

    latest                              FileCommitLog's record (json), if that log is used
    step-000000000100/                  one checkpoint, named by its step
        .metadata                       DCP's global metadata (written by rank 0)
        __0_0.distcp, __1_0.distcp ...  DCP's shard files, one or more per rank
        rank-00000.pt ...               each rank's own non-tensor state (RNG, scheduler,
                                        data position, extras, step)
        manifest-00000.json ...         each rank's list of the files it wrote, with
                                        size and CRC-32
        COMMITTED                       json {step, round, world_size, path, time}: written
                                        after the commit log accepted the checkpoint
    .tmp-step-200-round-3/              a save being written (or one that crashed)
    .trash-step-000000000050-.../       a directory being deleted

Checksum: CRC-32 (``zlib.crc32``). The threat is storage going wrong (a
truncated copy, a torn write, a flipped bit), not an adversary, and CRC-32
catches every burst of up to 32 flipped bits and all but 2**-32 of the rest,
at about 2 GB/s on one core, which is 2-3x SHA-256 here; sizes are checked as
well, so truncation never depends on the checksum.

Verification (:func:`verify`) reads the manifests (small) and the
``.metadata`` presence for the structure, then stats every listed file and,
when asked, reads it once to compare the CRC-32. Its cost is one sequential
read of the checkpoint (disk or network bound; CRC-32 itself is not the
bottleneck), and callers split it across ranks with ``part``/``parts``
(balanced by bytes, :func:`split_by_bytes`). The cheap part
(:func:`verify_structure`) and the CRC pass (:func:`verify_checksums`) can
run separately: restore runs the CRC pass concurrently with the load.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import stat
import time
import zlib
from typing import Iterable

from elastic.checkpoint.api import CommitEntry
from elastic.errors import CheckpointError
from elastic.rendezvous.api import cap_text

METADATA_FILE = ".metadata"
MARKER_FILE = "COMMITTED"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
MANIFEST_FORMAT = 1

_STEP_DIR = re.compile(r"^step-(\d{12,})$")
_TMP_DIR = re.compile(r"^\.tmp-step-(\d+)-round-(\d+)$")
_MANIFEST = re.compile(r"^manifest-(\d{5,})\.json$")
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


# --- durable writes -------------------------------------------------------------------------


def fsync_dir(path: str) -> None:
    """fsync a directory, so entries created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` and fsync it (not atomic: for files that a
    manifest or the commit protocol vouches for)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (tmp file, fsync,
    rename, fsync of the directory): a reader sees the old or the new content."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_durably(tmp, data)
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
class FileDigest:
    size: int
    crc32: str  # 8 lowercase hex digits


def file_digest(path: str) -> FileDigest:
    """Size and CRC-32 of a file, read into one reused 1 MiB buffer (``readinto``:
    no allocation per chunk, so the reading thread's heap stays small; ``zlib.crc32``
    releases the GIL on large buffers, so this runs beside other work)."""
    crc = 0
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0, opener=_no_follow) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return FileDigest(size=size, crc32=f"{crc:08x}")


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
                  "files": {name: dataclasses.asdict(d) for name, d in sorted(self.files.items())}}
        return json.dumps(record, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        """Raises ValueError (or a subclass) when ``data`` is not a valid manifest:
        not a JSON object of format MANIFEST_FORMAT; ``rank``, ``step`` or
        ``round`` not an integer 0..2**63-1 (``rank`` below ``world_size``,
        which is 1..MAX_WORLD_SIZE); a file name that is not a plain name in
        the checkpoint's directory (letters, digits, '.', '_', '-'; not "." or
        ".."); a size not an integer 0..2**63-1; a CRC-32 not 8 hex digits."""
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
            crc32 = digest.get("crc32")
            if not isinstance(crc32, str) or not _CRC32.fullmatch(crc32):
                raise ValueError(f"the CRC-32 of {name} is {_shown(crc32)}, not 8 hex digits")
            digests[name] = FileDigest(size=_int(digest, "size", 0, _MAX_INT64), crc32=crc32)
        return cls(rank=rank, world_size=world_size, step=_int(record, "step", 0, _MAX_INT64),
                   round=_int(record, "round", 0, _MAX_INT64), files=digests)


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


def write_manifest(directory: str, manifest: Manifest) -> None:
    write_durably(os.path.join(directory, manifest_name(manifest.rank)), manifest.to_json())


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


def verify_structure(directory: str, *, part: int = 0, parts: int = 1
                     ) -> tuple[list[Problem], list[tuple[str, FileDigest]]]:
    """The cheap checks, and the files left for :func:`verify_checksums`.

    Checks that every rank's manifest is there and consistent, that DCP's
    ``.metadata`` is listed and present, and that every file of this part's
    share (see :func:`split_by_bytes`) exists with its recorded size. Only
    part 0 reports the structural problems, so merged results carry no
    duplicates. Returns ``(problems, share)``: ``share`` is ``(path, expected
    digest)`` for this part's files whose size was right.
    """
    manifests, problems = read_manifests(directory)
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
        problem = _check_size(path, expected)
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


def write_marker(directory: str, entry: CommitEntry) -> None:
    """Write ``COMMITTED`` (the entry as json) into a checkpoint, durably."""
    record = dict(entry.to_dict(), written_at=time.time())
    write_durably(os.path.join(directory, MARKER_FILE), json.dumps(record).encode())
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
