"""Existing checkpoints into a store, each as a full step: ``torch.save`` and safetensors files
(read by :mod:`amber_store.export`) and torch.distributed.checkpoint directories (by
:mod:`amber_store.dcp`). It sits above the :class:`~amber_store.store.Store` facade, so that the
facade imports neither adapter and no adapter imports back a module that imports it."""

from __future__ import annotations

import os
import time

from . import export
from .store import CommitInfo, Store


def import_checkpoint(store: Store, step: int, path: str | os.PathLike[str], *, format: str | None = None,
                      subtree: str | None = None) -> CommitInfo:
    """Save an existing checkpoint as the full ``step`` of ``store``: a ``torch.save`` or
    safetensors file (a safetensors file under ``subtree``, by default the one
    :meth:`Store.export` recorded in it; see :func:`amber_store.export.read`), or a
    torch.distributed.checkpoint directory (``FileSystemWriter``'s), which becomes a sharded step
    that ``dcp.load`` reshards (see :func:`amber_store.dcp.import_checkpoint`)."""
    if not os.path.isdir(path):
        return store.save(step, export.read(path, format=format, subtree=subtree), full=True)  # type: ignore[arg-type]
    from . import dcp  # torch.distributed's checkpoint modules, for DCP directories only

    t0 = time.perf_counter()
    m = dcp.import_checkpoint(store, step, path)
    return CommitInfo(step, m.kind, m.base, m.nbytes_raw, m.nbytes_stored, time.perf_counter() - t0)
