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
"""

from __future__ import annotations

import functools
from typing import Any, Callable

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
