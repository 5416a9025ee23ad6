"""What a restore may unpickle from a checkpoint: no code of the checkpoint's choosing runs.

A checkpoint directory is input from storage that others may be able to write,
not code (DESIGN.md, "Trust"); a CRC-32 in a manifest is no defence against a
person, who can recompute it. Restore reads three kinds of pickle, each
through an allow-list:

* DCP's ``.metadata`` (:func:`load_metadata`): a restricted unpickler that
  looks up only DCP's metadata records
  (:func:`elastic._compat.torch_checkpoint.dcp_metadata_globals`), builtin
  containers and scalars, ``torch.Size``, ``torch.device``, dtypes, layouts
  and ``pathlib`` paths (DCP records the checkpoint's path).
* DCP's objects (``BYTE_IO`` items, e.g. an optimizer's hyperparameters or a
  module's extra state; :func:`load_object`): the same unpickler, without
  ``torch.load``'s fixed cost per call (a restore reads one item per
  hyperparameter per parameter group); an object with a tensor inside goes to
  ``torch.load(weights_only=True)``.
* each rank's ``rank-<r>.pt`` (RNG states, LR schedulers, data position,
  extras; :func:`load_torch_file`): ``torch.load(weights_only=True)``, plus
  numpy's array types for the numpy RNG state of files written before it was
  saved as plain values.

Whatever else a pickle names is refused before it is looked up, with
:class:`CheckpointError` naming it (``module.qualname``) and the two ways to
allow it, both chosen by the caller through :class:`LoadPolicy`:
``safe_globals=[SomeClass]`` adds classes or functions to every allow-list
(harmless ones: a class whose construction and ``__setstate__`` run no code
that the file's data could steer); ``trusted=True`` unpickles as
``torch.load(weights_only=False)`` would, running whatever the files say, for
a checkpoint directory that nobody untrusted can write
(``Checkpointer(trust_checkpoint=True)`` or ``ELASTIC_CHECKPOINT_TRUST=1``).
"""

from __future__ import annotations

import _compat_pickle
import collections
import functools
import io
import os
import pathlib
import pickle
import re
from typing import Any, Iterable, Sequence

import torch

from elastic._compat import torch_checkpoint as compat
from elastic.errors import CheckpointError, ConfigError
from elastic.worker_env import CHECKPOINT_TRUST


class LoadPolicy:
    """How much of a checkpoint's pickles restore accepts (see the module docstring).

    ``safe_globals``: classes or functions, each named by its ``__module__`` and
    ``__qualname__``, allowed besides the built-in list. ``trusted``: accept
    anything, running what the files say. Raises ConfigError for an entry
    without a module and a name.
    """

    def __init__(self, *, trusted: bool = False, safe_globals: Iterable[Any] = ()):
        self.trusted = bool(trusted)
        self.safe_globals = tuple(safe_globals)
        self._by_name: dict[str, Any] = {}
        for obj in self.safe_globals:
            module = getattr(obj, "__module__", None)
            name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
            if not isinstance(module, str) or not isinstance(name, str):
                raise ConfigError(f"safe_globals must hold classes or functions (with a module "
                                  f"and a name), got {obj!r}")
            self._by_name[f"{module}.{name}"] = obj

    def __repr__(self) -> str:
        return (f"LoadPolicy(trusted={self.trusted}, "
                f"safe_globals={sorted(self._by_name)})")

    def lookup(self, module: str, name: str) -> Any:
        """What a pickle's global ``module.name`` resolves to; raises
        :class:`Refused` when it is not allowed."""
        found = _builtin_global(module, name)
        if found is not None:
            return found
        found = self._by_name.get(f"{module}.{name}")
        if found is not None:
            return found
        raise Refused(f"{module}.{name}")

    def refusal(self, what: str, names: Sequence[str]) -> CheckpointError:
        """The error for ``what`` (a file of a checkpoint) needing ``names``."""
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if names[3:] else "")
        return CheckpointError(
            f"{what} needs {shown or 'a type outside the allow-list'}, which restore does not "
            f"unpickle from a checkpoint (unpickling it could run code of whoever wrote the "
            f"file); if the type is yours and harmless, allow it with "
            f"Checkpointer(..., safe_globals=[...]); to load everything as "
            f"torch.load(weights_only=False) would, for a checkpoint directory that nobody "
            f"untrusted can write, pass trust_checkpoint=True or set {CHECKPOINT_TRUST}=1")


DEFAULT_POLICY = LoadPolicy()


def trust_from_env(environ: Any = None) -> bool:
    """``$ELASTIC_CHECKPOINT_TRUST`` as a flag: 1/true/yes/on, 0/false/no/off or
    unset (False). Raises ConfigError for anything else."""
    environ = os.environ if environ is None else environ
    raw = environ.get(CHECKPOINT_TRUST, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{CHECKPOINT_TRUST}={raw[:40]!r}: expected 1/true/yes/on or "
                      f"0/false/no/off")


class Refused(Exception):
    """A pickle named a global outside the allow-list (``str``: its ``module.name``)."""


class _NeedsTorchLoad(Exception):
    """The pickle refers to a storage, which only ``torch.load`` rebuilds."""


# --- the built-in allow-list ------------------------------------------------------------------


def _encode(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it for bytes (latin-1), and no
    other codec (some are bytes-to-bytes transforms, e.g. decompressors)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise Refused("_codecs.encode with another codec than latin-1")
    return text.encode("latin-1")


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` as pickle protocol 2 records one (from text and latin-1, or
    from bytes), never from a size (a few bytes of pickle asking for terabytes)."""
    if not args:
        return bytearray()
    if len(args) == 1 and type(args[0]) is bytes:
        return bytearray(args[0])
    if len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
        return bytearray(args[0], "latin-1")
    raise Refused("bytearray from anything but its bytes")


_PLAIN = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("_codecs", "encode"): _encode,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # a path object touches no file
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # Python 3.13's pickles
}


def _builtin_global(module: str, name: str) -> Any:
    found = _PLAIN.get((module, name))
    if found is not None:
        return found
    if module == "torch" and not name.startswith("_"):
        value = getattr(torch, name, None)  # torch.float32, torch.strided, ...
        if isinstance(value, (torch.dtype, torch.layout)):
            return value
        return None
    return compat.dcp_metadata_globals().get((module, name))


class _RestrictedUnpickler(pickle.Unpickler):
    """Looks up only what the policy allows. Another of torch's names (a
    tensor's rebuild function, a storage type) raises _NeedsTorchLoad: torch's
    own weights-only unpickler judges those; anything else raises :class:`Refused`."""

    def __init__(self, stream: Any, policy: LoadPolicy):
        super().__init__(stream, encoding="utf-8")
        self._policy = policy

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 names builtins as Python 2 did; pickle's own find_class maps them.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        try:
            return self._policy.lookup(module, name)
        except Refused:
            if module == "torch" or module.startswith("torch."):
                raise _NeedsTorchLoad(f"{module}.{name}") from None
            raise

    def persistent_load(self, pid: Any) -> Any:
        raise _NeedsTorchLoad("a persistent id")


# --- the three readers ------------------------------------------------------------------------


def load_metadata(data: bytes, policy: LoadPolicy, what: str) -> Any:
    """DCP's ``.metadata`` (a plain pickle of DCP's records) from its bytes.

    Raises CheckpointError when it names anything outside the allow-list or
    does not hold DCP's ``Metadata``; pickle's errors for a damaged file."""
    if policy.trusted:
        return pickle.loads(data)  # what DCP's own reader does
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(data), policy).load()
    except (Refused, _NeedsTorchLoad) as exc:
        raise policy.refusal(what, [str(exc)]) from None
    expected = compat.dcp_metadata_globals().get(
        ("torch.distributed.checkpoint.metadata", "Metadata"))
    if expected is not None and type(metadata) is not expected:
        raise CheckpointError(f"{what} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def load_object(data: bytes, policy: LoadPolicy, what: str) -> Any:
    """One of DCP's pickled objects (a ``torch.save`` zip) from its bytes: what
    ``torch.load`` returns for it, within the policy.

    Also an unzipped ``torch.save`` file (the memory tier's ``objects.pt``). A
    pickle that refers to no storage is unpickled here, in one call of the C
    unpickler; one with a tensor inside goes to :func:`load_torch_file` (objects
    met before the storage are then rebuilt twice, which for data changes
    nothing). Raises CheckpointError for a refused type, and what ``torch.load``
    raises for a file that is not a ``torch.save`` zip."""
    forced = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    pickled = None if policy.trusted and forced else _data_pickle(data)
    if pickled is not None:
        unpickler = (_TrustingUnpickler(io.BytesIO(pickled), encoding="utf-8") if policy.trusted
                     else _RestrictedUnpickler(io.BytesIO(pickled), policy))
        try:
            return unpickler.load()
        except _NeedsTorchLoad:
            pass
        except Refused as exc:
            raise policy.refusal(what, [str(exc)]) from None
    return load_torch_file(data, policy, what)


def load_torch_file(data: bytes, policy: LoadPolicy, what: str,
                    map_location: Any = None) -> Any:
    """``torch.load`` of a ``torch.save`` file's bytes: with ``weights_only=True``
    and the policy's allow-list (plus numpy's RNG state types), or
    ``weights_only=False`` when the policy trusts the checkpoint. Raises
    CheckpointError naming what the file needs beyond the allow-list, and what
    ``torch.load`` raises for a damaged file."""
    if policy.trusted:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    allowed = policy.safe_globals + _numpy_rng_types()
    try:
        return compat.load_weights_only(io.BytesIO(data), allowed, map_location)
    except pickle.UnpicklingError as exc:
        names = compat.unsafe_globals(data, exc, allowed)
        if not names:  # not a refused global: an opcode or a layout torch's unpickler refuses
            found = _WEIGHTS_UNPICKLER_ERROR.search(str(exc))
            names = [f"what torch.load(weights_only=True) refuses "
                     f"({found.group(1).strip()[:200] if found else type(exc).__name__})"]
        raise policy.refusal(what, names) from None


def _data_pickle(data: bytes) -> bytes | None:
    """The pickle of a ``torch.save`` zip without constants, or of an unzipped
    file framed as this torch frames a plain value (the memory tier's); None
    for anything else (``torch.load`` then reads it, or says what is wrong with it)."""
    plain = compat.unzipped_pickle(data)
    if plain is not None:
        return plain
    try:
        archive = compat.zip_archive(io.BytesIO(data))
        records = archive.get_all_records()
        if "data.pkl" in records and "constants.pkl" not in records:
            return archive.get_record("data.pkl")
    except Exception:  # noqa: BLE001 - not what torch.save writes: torch.load says why
        pass
    return None


class _TrustingUnpickler(pickle.Unpickler):
    """``torch.load(weights_only=False)``'s unpickler for a pickle without
    tensors (every global), for a trusted checkpoint; what ``torch.load`` maps or
    rebuilds (storages, renamed modules, persistent ids) raises _NeedsTorchLoad."""

    def find_class(self, module: str, name: str) -> Any:
        if "Storage" in name or module in _MAPPED_MODULES:
            raise _NeedsTorchLoad(f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _NeedsTorchLoad("a persistent id")


_TRUE = ("1", "y", "yes", "true")
_WEIGHTS_UNPICKLER_ERROR = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")
# torch.load renames these modules (its load_module_mapping, local to torch.serialization._load).
_MAPPED_MODULES = frozenset({"torch.tensor"})


@functools.cache
def _numpy_rng_types() -> tuple[Any, ...]:
    """What ``numpy.random.get_state()``'s array pickles as: files written
    before the state was saved as plain values hold one."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - depends on the environment
        return ()
    core = getattr(numpy, "_core", None) or getattr(numpy, "core", None)
    reconstruct = getattr(getattr(core, "multiarray", None), "_reconstruct", None)
    found = [numpy.ndarray, numpy.dtype]
    found += [reconstruct] if reconstruct is not None else []
    found += [type(numpy.dtype("uint32"))]  # numpy 2: numpy.dtypes.UInt32DType
    return tuple(found)
