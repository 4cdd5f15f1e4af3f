"""Lightning: every checkpoint of a run in one amber-store, one step per global step.

    from amber_store.integrations.lightning import AmberCheckpointIO

    trainer = Trainer(plugins=[AmberCheckpointIO("s3://bucket/run1")],
                      callbacks=[ModelCheckpoint(dirpath="ckpt", save_top_k=2, save_last=True, monitor="val_loss")])
    trainer.fit(model, ckpt_path="last")

Lightning keeps deciding which checkpoints exist and what they are called: each path it writes
(``last.ckpt``, a top-k file) becomes a small pointer file naming the store and the step, so its
``ckpt_path="last"``, ``best_model_path`` and top-k pruning work unchanged, while the data lives
once, delta-coded, in the store. A step is deleted from the store when Lightning removes (or
overwrites) the last pointer to it in that directory. A path that is not a pointer (a plain
Lightning checkpoint) loads as Lightning would load it.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from .. import format as fmt
from ..errors import StepNotFoundError, StepOrderError
from ..store import Store
from ..store import open as open_store
from . import pointers

__all__ = ["AmberCheckpointIO"]


class AmberCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves into the amber-store at ``uri``.

    ``storage_options`` and ``open_options`` are those of :func:`amber_store.open` (e.g.
    ``codec=``, ``full_every=``, ``single_writer=``). The step of a checkpoint is its
    ``global_step``. Saving a step that is already in the store (Lightning saves ``last.ckpt``
    right after a top-k file of the same step) writes no data: the tensors must be bit-identical
    to the stored ones (checked by checksum), and metadata that differs is kept in the pointer.
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
                 **open_options: Any) -> None:
        super().__init__()
        self.uri = os.fspath(uri)
        self.storage_options = storage_options
        self.open_options = open_options
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        """The store, opened on first use (so the plugin pickles to spawned workers unopened)."""
        if self._store is None:
            self._store = open_store(self.uri, self.storage_options, **self.open_options)
        return self._store

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AmberCheckpointIO takes no storage_options per save; give them to AmberCheckpointIO(...)")
        step = int(checkpoint["global_step"])
        previous = pointers.read(path)
        tree = None
        try:
            m = self.store.manifest(step)
        except StepNotFoundError:
            try:
                self.store.save(step, checkpoint)
            except StepOrderError as e:
                raise StepOrderError(
                    f"{e}. A run resumed from an earlier checkpoint cannot save into the same store past "
                    "its later steps: give the resumed run a new store URI") from e
        else:
            tree = _same_tensors(self.store, m, checkpoint)
        pointers.write(path, pointers.Pointer(self.store.uri, step, tree))
        if previous is not None and previous.uri == self.store.uri and previous.step != step:
            self._release(path, previous.step)  # an overwritten last.ckpt released its step

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        pointer = pointers.read(path)
        if pointer is None:
            return TorchCheckpointIO().load_checkpoint(path, map_location, weights_only)
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        if pointer.uri == self.store.uri:
            return self.store.load(pointer.step, lazy=False, device=device, tree=pointer.tree)
        other = open_store(pointer.uri, self.storage_options, mode="r")  # another run's checkpoint
        try:
            return other.load(pointer.step, lazy=False, device=device, tree=pointer.tree)
        finally:
            other.close()

    def remove_checkpoint(self, path: Any) -> None:
        pointer = pointers.read(path)
        fs, p = fsspec.core.url_to_fs(str(path))
        if fs.exists(p):
            fs.rm(p)
        if pointer is not None and pointer.uri == self.store.uri:
            self._release(path, pointer.step)

    def teardown(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def _release(self, path: Any, step: int) -> None:
        """Delete ``step`` unless another pointer beside ``path`` still names it."""
        if any(p.step == step and p.uri == self.store.uri for _, p in pointers.siblings(path)):
            return
        if step in self.store.steps():
            self.store.delete(step)


def _same_tensors(store: Store, m: fmt.Manifest, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """Check that ``checkpoint`` holds the tensors of the committed step ``m``, bit for bit;
    return its tree when that differs from the step's (``None``: identical)."""
    tree, tensors = fmt.flatten(checkpoint)
    same = tensors.keys() == m.tensors.keys() and all(
        fmt.dtype_name(t.dtype) == m.tensors[k].dtype and list(t.shape) == m.tensors[k].shape
        and fmt.tensor_crcs(t, m.tensors[k].chunks) == m.tensors[k].crc32c for k, t in tensors.items())
    if not same:
        raise StepOrderError(
            f"{store.uri}: step {m.step} is already committed with other tensors; Lightning saved global step "
            f"{m.step} twice with different weights (a lossy codec's stored values differ from the originals too)")
    return None if tree == m.tree else tree
