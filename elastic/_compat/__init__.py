"""The one home of what we take from torch's and grpc's internals.

Every use of a private name of torch or grpc (a leading underscore, or a
module or class not in their public API) lives in a module of this package,
never elsewhere. Each shim says which versions it was tested on (the torch
matrix, ``make test-torch TORCH=X.Y.Z``, runs ``tests/unit/test_compat.py`` in
each version's venv) and what it falls back to, on public API only, where the
internal is missing or changed shape.

Modules:

* :mod:`elastic._compat.torch_checkpoint`: the reader of ``torch.save``'s zip
  files, torch's storage-type table and DCP's ``FileSystemReader._slice_file``
  (``elastic.checkpoint.dcp_io``); DCP's metadata classes, the layout lookup
  ``torch.serialization._get_layout`` and ``torch.load(weights_only=True)``
  with an allow-list (``elastic.checkpoint.trust``). The staging copy is our own, on public API
  (``elastic.checkpoint.staging``): torch's ``DefaultStager`` changed its
  lifecycle across releases and is missing before 2.9.
* :mod:`elastic._compat.torch_cuda`: whether a forked child could still use CUDA
  (``torch._C._cuda_isInBadFork``, for the template's fork check).
* :mod:`elastic._compat.torch_flight_recorder`: torch's flight recorder, the
  collectives in flight as JSON (``elastic.worker.stacks``, for the hang reason).
* :mod:`elastic._compat.grpc_waits`: the slice of grpc-python's blocking
  waits, ``grpc._common.MAXIMUM_WAIT_TIMEOUT`` (``elastic.net``).
* :mod:`elastic._compat.runpy_main`: ``runpy._run_module_as_main``, how
  ``python -m`` runs a module (``elastic.worker.bootstrap``).
"""
