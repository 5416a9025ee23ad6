"""torch internals the checkpoint's reader relies on, each with its fallback.

Tested on torch 2.6.0, 2.8.0, 2.9.1, 2.11.0, 2.12.1, 2.13.0 and 2.15.0 (the
torch matrix, ``make test-torch``; ``tests/unit/test_compat.py`` runs in each).

* :func:`zip_archive`: ``torch._C.PyTorchFileReader``, the reader of the zip
  files ``torch.save`` writes (one per DCP item), so an item's tensor can be
  described (dtype, shape, where its bytes lie) without ``torch.load``. Fallback:
  None, and every item goes ``torch.load``'s way (slower, same result).
* :func:`storage_type_names`: ``torch.storage._dtype_to_storage_type_map``, the
  names ``torch.save`` pickles a storage's type as. Fallback: an empty table,
  with the same effect as above.
* :data:`SLICE_FILE_HOOK`: DCP's ``FileSystemReader._slice_file``, where DCP turns
  an item's storage info into a stream over its bytes; the verifying reader
  overrides it. Fallback: none is needed for safety, since the reader counts the
  items that went through it and fails a load that read around it
  (:meth:`elastic.checkpoint.dcp_io.VerifyingReader.read_data`).
* :func:`dcp_metadata_globals`: the classes DCP pickles into ``.metadata``
  (``torch.distributed.checkpoint.metadata``'s records, the file reader's
  ``_StorageInfo``) and the name ``torch.save`` pickles a layout by
  (``torch.serialization._get_layout``), for the restricted unpickler of
  :mod:`elastic.checkpoint.trust`. Fallback: the ones this torch has; a
  ``.metadata`` that needs a missing one is refused, naming it.
* :func:`single_process`: ``no_dist`` for ``dcp.save``/``dcp.load`` (2.8 and
  newer). Fallback (2.6): no argument; that DCP tells a single process from
  ``torch.distributed.is_initialized()`` itself, which is what we pass.
* :func:`load_weights_only`: ``torch.load(weights_only=True)`` with an
  allow-list for the one call (``torch.serialization.safe_globals``, public
  since 2.5), and :func:`unsafe_globals`, the globals outside it that a file
  names (``get_unsafe_globals_in_checkpoint``, public since 2.6). Fallbacks:
  none needed on the matrix; without them, the allow-list cannot be widened
  (a file that needs more is refused) and the names come from torch's error.
* :func:`save_unzipped`: ``torch.save``'s older, unzipped format
  (``_use_new_zipfile_serialization=False``), which ``torch.load`` reads like
  the zip. For a value made of plain values only (no tensor) it is a fixed
  header, the value's pickle (protocol 2) and an empty list of storages: the
  header is taken from ``torch.save`` itself once, and the value pickled by
  the C pickler, the bytes ``torch.save`` writes at a fifth of its cost.
  Fallback: ``torch.save``, for a value that is not plain or a torch whose
  file does not have that shape. :func:`unzipped_pickle` finds the value's
  pickle in such a file again, for a restricted unpickler (``torch.load`` then
  only for a file of another frame).
* :func:`copy_all`: ``torch._foreach_copy_``, every tensor of a list copied
  in one call (one dispatch, not one per tensor). Fallback: ``copy_`` each.
* :func:`module_tensors`: each module's ``_parameters`` and ``_buffers``, the
  dicts ``parameters()`` and ``buffers()`` read, without their generators'
  cost (a quarter of it: 5 us, not 20, for a 7-module model). Fallback:
  ``parameters()`` then ``buffers()``.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import importlib
import io
import pickle
import re
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader

SLICE_FILE_HOOK = "_slice_file"


def file_reader_slices() -> bool:
    """Whether this torch's DCP file reader cuts items through :data:`SLICE_FILE_HOOK`."""
    return callable(getattr(FileSystemReader, SLICE_FILE_HOOK, None))


def zip_archive(stream: Any) -> Any:
    """A reader of the ``torch.save`` zip in ``stream`` (``get_record``,
    ``has_record``, ``get_all_records``, ``get_record_offset``), or None when
    this torch has no such reader. Raises what the reader raises for a file
    that is not such a zip."""
    reader: Callable[[Any], Any] | None = getattr(torch._C, "PyTorchFileReader", None)
    return reader(stream) if reader is not None else None


@functools.cache
def storage_type_names() -> dict[torch.dtype, str]:
    """``{dtype: "FloatStorage", ...}``: how ``torch.save`` names each dtype's
    storage type; empty when this torch does not say."""
    table = getattr(torch.storage, "_dtype_to_storage_type_map", None)
    try:
        return dict(table()) if table is not None else {}
    except Exception:  # noqa: BLE001 - another shape: the slower, general path
        return {}


@functools.cache
def _takes_no_dist() -> bool:
    import inspect

    import torch.distributed.checkpoint as dcp

    return all("no_dist" in inspect.signature(call).parameters for call in (dcp.save, dcp.load))


def single_process(no_dist: bool) -> dict[str, bool]:
    """The keyword arguments that tell ``dcp.save``/``dcp.load`` whether they run
    in a single process: ``{"no_dist": no_dist}``, or none where DCP does not
    take it (2.6) and decides from ``torch.distributed.is_initialized()``."""
    return {"no_dist": no_dist} if _takes_no_dist() else {}


# What DCP's .metadata pickles, by module: the names dcp_metadata_globals looks
# up, which every torch of the matrix has (tests/unit/test_compat.py pins them).
DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}


@functools.cache
def _layouts() -> dict[str, torch.layout]:
    return {str(value): value for value in vars(torch).values()
            if isinstance(value, torch.layout)}


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``'s lookup, on public names only."""
    try:
        return _layouts()[name]
    except (KeyError, TypeError):
        raise ValueError(f"no torch layout is named {name!r}") from None


@functools.cache
def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """``{(module, name): object}``: what unpickling DCP's ``.metadata`` may look
    up besides builtins, ``torch.Size`` and dtypes: DCP's metadata classes that
    this torch has, and a layout's lookup by name (ours, with the same result)."""
    table: dict[tuple[str, str], Any] = {("torch.serialization", "_get_layout"): _layout}
    for module_name, names in DCP_METADATA_CLASSES.items():
        module = importlib.import_module(module_name)
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, type):
                table[(module_name, name)] = value
    return table


def load_weights_only(stream: Any, allowed: Sequence[Any], map_location: Any = None) -> Any:
    """``torch.load(stream, map_location=map_location, weights_only=True)`` that
    also accepts the classes and functions in ``allowed`` (for this call only). Raises
    what ``torch.load`` raises (``pickle.UnpicklingError`` for a global outside
    the allow-list)."""
    context = getattr(torch.serialization, "safe_globals", None)
    if not allowed or context is None:
        scope: Any = contextlib.nullcontext()
    else:
        scope = context(list(allowed))
    with scope:
        return torch.load(stream, map_location=map_location, weights_only=True)


# torch's words for a refused global: one outside the allow-list, or one of a
# module it blocks outright (os, posix, subprocess, ...), which it says even when
# it cannot list a file's globals (the unzipped format).
_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+) (?:was not an allowed global|whose module)")


def unsafe_globals(data: bytes, error: BaseException, allowed: Sequence[Any]) -> list[str]:
    """The ``module.name`` of each global in the ``torch.save`` file ``data``
    that ``torch.load(weights_only=True)`` refused (with ``allowed`` added);
    from torch's own error when this torch cannot list them."""
    lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    context = getattr(torch.serialization, "safe_globals", None)
    if lister is not None:
        try:
            scope: Any = (context(list(allowed)) if allowed and context is not None
                          else contextlib.nullcontext())
            with scope:
                names = lister(io.BytesIO(data))
            if names:
                return list(names)
        except Exception:  # noqa: BLE001 - the error's text is the fallback
            pass
    return _UNSUPPORTED_GLOBAL.findall(str(error))


# Protocol 2 is torch.save's (its DEFAULT_PROTOCOL), the one its weights-only
# unpickler reads: it has no opcode for bytes (pickled as _codecs.encode of a str).
_UNZIPPED_PROTOCOL = 2


class _NotPlain(Exception):
    """A value the fast path of :func:`save_unzipped` leaves to ``torch.save``."""


# The globals that plain values are pickled with at protocol 2 (bytes as
# _codecs.encode of a str, the others as calls of their type).
_PLAIN_GLOBALS = frozenset(map(id, (codecs.encode, set, frozenset, bytearray)))


class _PlainPickler(pickle.Pickler):
    """The C pickler, refusing anything that is not a plain value. It asks
    ``reducer_override`` only for what is not None, a bool, an int, a float, a
    str, bytes, a bytearray, or a dict, list, tuple, set or frozenset, and for
    the globals of :data:`_PLAIN_GLOBALS`, which it pickles by name as
    ``torch.save``'s pickler does; anything else (a tensor, an instance of a
    class, a class: ``torch.save`` records a module class's source) raises
    _NotPlain."""

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in _PLAIN_GLOBALS:
            return NotImplemented
        raise _NotPlain


def _torch_save_unzipped(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


@functools.cache
def _unzipped_frame() -> tuple[bytes, bytes] | None:
    """(header, end) of an unzipped ``torch.save`` file around a plain value's
    pickle; None when this torch writes another shape."""
    end = pickle.dumps([], _UNZIPPED_PROTOCOL)  # the storages' keys: none
    framed = _torch_save_unzipped(None)
    tail = pickle.dumps(None, _UNZIPPED_PROTOCOL) + end
    if not framed.endswith(tail):
        return None
    return framed[:-len(tail)], end


def save_unzipped(obj: Any) -> bytes:
    """``torch.save(obj, _use_new_zipfile_serialization=False)``'s bytes, the same
    bytes, written by the C pickler when ``obj`` is made of plain values only.
    Raises what ``torch.save`` raises for a value it cannot save."""
    frame = _unzipped_frame()
    if frame is not None:
        buffer = io.BytesIO()
        buffer.write(frame[0])
        try:
            _PlainPickler(buffer, _UNZIPPED_PROTOCOL).dump(obj)
        except _NotPlain:
            return _torch_save_unzipped(obj)
        buffer.write(frame[1])
        return buffer.getvalue()
    return _torch_save_unzipped(obj)


def unzipped_pickle(data: bytes) -> bytes | None:
    """The value's pickle in ``data`` when it is an unzipped ``torch.save`` file
    framed as this torch frames a plain value (:func:`save_unzipped`'s header,
    no storage after the pickle), else None. The pickle may still refer to
    storages by persistent id: its unpickler must refuse those."""
    frame = _unzipped_frame()
    if frame is None:
        return None
    header, end = frame
    if (len(data) <= len(header) + len(end) or not data.startswith(header)
            or not data.endswith(end)):
        return None
    return data[len(header):-len(end)]


def copy_all(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for each i, without autograd (same
    lengths; the shapes broadcast as ``copy_`` says). Raises what ``copy_`` raises."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if not targets:  # the foreach ops refuse empty lists
        return
    with torch.no_grad():
        if foreach is not None:
            foreach(targets, sources)
        else:
            for target, source in zip(targets, sources):
                target.copy_(source)


def module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``model`` and its submodules, each module's
    parameters then its buffers, module by module in ``modules()``'s order (a
    tensor that two modules hold is listed twice). The same order at each call
    while the modules and their tensors stay the same."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        for name in MODULE_TENSOR_DICTS:
            tensors = getattr(module, name, None)
            if not isinstance(tensors, dict):
                return [*model.parameters(), *model.buffers()]
            out += [t for t in tensors.values() if t is not None]
    return out


# Where a module keeps its own parameters and buffers (what parameters() and buffers() read).
MODULE_TENSOR_DICTS = ("_parameters", "_buffers")
