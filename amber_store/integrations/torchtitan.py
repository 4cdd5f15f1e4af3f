"""torchtitan: checkpoint a torchtitan run into an amber-store by changing one config line.

    from amber_store.integrations.torchtitan import CheckpointManager

    config.checkpoint = CheckpointManager.Config(enable=True, uri="s3://bucket/run1", interval=500,
                                                 keep_latest_k=3, async_mode="async")

torchtitan builds whichever manager class declares the ``Config`` it is given, so this subclass of
torchtitan's own DCP ``CheckpointManager`` is all a trainer needs. Every save of the training
state goes through ``torch.distributed.checkpoint`` into one store (:mod:`amber_store.dcp`):
each rank writes its shards as deltas against its previous save, and a step is visible once
committed. torchtitan's modes keep their meaning: ``disabled`` (``dcp.save``), ``async`` (a
thread) and ``async_with_pinned_mem`` (staged into pinned memory, written by DCP's checkpoint
process). ``keep_latest_k`` is the store's retention: one ``gc(keep_last=k)`` after each commit,
on rank 0, off the training thread (the next save waits for it, as torchtitan's waits for its
last upload). Resumes pick the latest step holding the whole training state (a model-only
export is skipped); ``load_step``, ``exclude_from_loading``, the seed checkpoint (step 0, model
only), ``initial_load_path`` (a DCP folder or Hugging Face weights as torchtitan reads them, or
``<store uri>/step-<N>``) and ``last_save_in_hf`` exports (to ``<dump_folder>/<folder>/step-<N>``,
beside the store as torchtitan writes them) work unchanged.

The dataloader's state torchtitan saves is a pickle its own ``load_state_dict`` unpickles; a
resume first checks that it is plain data (no opcode that names or calls code), so a crafted
store runs no code through it (``allow_pickle=True`` trusts the store as its writer's code would be).
"""

from __future__ import annotations

import dataclasses
import logging
import pickletools
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer import DATALOADER, MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.checkpointer.dcp import CheckpointManager as DCPCheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from .. import dcp
from ..errors import NotAnAmberStoreError, StepNotFoundError, UnsafeValueError
from ..manager import _together
from ..runtime import sync
from ..store import open as open_store

__all__ = ["CheckpointManager"]

_log = logging.getLogger("amber_store")


class CheckpointManager(DCPCheckpointManager):
    """torchtitan's DCP checkpoint manager, saving into the amber-store ``config.uri``.

    Takes torchtitan's arguments unchanged (``dataloader``, ``model_parts``, ``optimizers``,
    ``lr_schedulers``, ``states``, ``sd_adapter``, ``base_folder``); see the module's docstring
    for what each of torchtitan's options does here.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(DCPCheckpointManager.Config):
        uri: str = ""
        """The store: a local path, ``s3://``, ``gs://``, ``az://`` or ``memory://`` URI. Empty:
        ``<dump_folder>/<folder>/amber``."""

        codec: str = "lossless"
        """The store's delta codec (``lossless``, bit-exact; or a lossy preset, e.g. ``sparse``)."""

        full_every: int = 10
        """Every ``full_every``-th save is a full step; the others are deltas."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """Options of the storage (credentials, endpoint), as :func:`amber_store.open` takes them."""

        allow_pickle: bool = False
        """Load dataloader states whose pickles name or call code (trusted stores only)."""

        def __post_init__(self) -> None:
            DCPCheckpointManager.Config.__post_init__(self)
            if self.full_every < 1:
                raise ValueError("full_every must be >= 1")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # torchtitan's purge thread deletes step folders; retention here is the store's gc
        super().__init__(dataclasses.replace(config, keep_latest_k=0), **kwargs)
        if not self.enable:
            return
        self.keep_latest_k = config.keep_latest_k
        self.uri = config.uri or filesystem.join(self.folder, "amber")
        self.storage_options = dict(config.storage_options) or None
        self.options: dict[str, Any] = {"codec": config.codec, "full_every": config.full_every}
        self.allow_pickle = config.allow_pickle
        self._retention = ThreadPoolExecutor(1, thread_name_prefix="amber-retention") if self._gcs() else None
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # torchtitan's stager copies into pinned memory without blocking: an accelerator's
            # copies; on a host without one it would wait forever, so copy plainly there
            device = torch.accelerator.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=device, use_shared_memory=True,
                                                       use_async_staging=True, use_non_blocking_copy=device))
        # rank 0 opens (creating) the store first: ranks creating it at once would see each
        # other's half-written root; every rank learns of any rank's failure
        coordinator = dist.get_rank() == 0

        def open_here() -> None:
            self.store = dcp.store_for(self.uri, self.storage_options, **self.options)

        _together(open_here if coordinator else lambda: None, src=0,
                  what=f"{self.uri}: the coordinator (rank 0) could not open the store")
        _together(lambda: None if coordinator else open_here(), src=None,
                  what=f"{self.uri}: rank(s) could not open the store")

    # saving ---------------------------------------------------------------------------------

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Future | AsyncSaveResponse | None:
        """Save ``state_dict`` as the step ``checkpoint_id`` names (``.../step-<N>``) into the
        store; Hugging Face exports (``to_hf``) are written as torchtitan writes them."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step = _step_of(checkpoint_id)
        planner = dcp.AmberSavePlanner()
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # DCP's checkpoint process writes (and so gc's): the writer goes there by name, not as
            # this process's store
            writer = dcp.AmberStorageWriter(self.uri, self.storage_options, step=step,
                                            after=_KeepLatest(self.uri, self.storage_options, self.options,
                                                              self.keep_latest_k) if self._gcs() else None,
                                            **self.options)
            return torch_dcp.async_save(state_dict, storage_writer=writer, planner=planner, process_group=self.pg,
                                        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                        async_stager=self.stager)
        writer = dcp.AmberStorageWriter(self.store, step=step)
        if async_mode == AsyncMode.ASYNC:
            saving = torch_dcp.async_save(state_dict, storage_writer=writer, planner=planner, process_group=self.pg)
            return self._then_retain(saving)
        torch_dcp.save(state_dict, storage_writer=writer, planner=planner)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return None

    def _purge_stale_checkpoints(self) -> None:
        # after a synchronous save (async saves retain once their commit is known)
        if self.async_mode == AsyncMode.DISABLED and self._gcs():
            assert self._retention is not None
            self.save_future = self._retention.submit(self._keep_latest)

    def _then_retain(self, saving: Future) -> Future:
        """A future of ``saving`` and then, on rank 0, its retention (on DCP's thread, after its
        last collective: inside them, every rank would wait for the gc)."""
        done: Future = Future()

        def retain(f: Future) -> None:
            try:
                result = f.result()
                if self._gcs():
                    self._keep_latest()
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                done.set_exception(e)
            else:
                done.set_result(result)

        saving.add_done_callback(retain)
        return done

    def _gcs(self) -> bool:
        return self.keep_latest_k > 0 and dist.get_rank() == 0

    def _keep_latest(self) -> None:
        report = self.store.gc(keep_last=self.keep_latest_k)
        if report.delete:
            _log.info("%s: retention (keep_latest_k=%d) deleted steps %s", self.uri, self.keep_latest_k,
                      report.delete)

    def _wait_for_saving(self) -> None:
        # (in torchtitan's synchronous mode too: the future is then the last save's retention)
        assert self.save_future is not None
        future, self.save_future = self.save_future, None
        future.result()

    def _close(self) -> None:
        try:
            if self.save_future is not None:
                self._wait_for_saving()
        finally:
            if self._retention is not None:
                self._retention.shutdown()
            super()._close()

    # loading --------------------------------------------------------------------------------

    def _find_load_step(self, folder: str = "") -> int:
        """The latest step of the store holding every state a resume loads (a model-only
        export at the last step is not one), or -1."""
        if folder and folder != self.folder:
            return super()._find_load_step(folder)
        wanted = set(self._states_to_load(model_only=False)) - set(self.states[MODEL].state_dict())
        for step in reversed(self.store.steps()):
            tree = sync(self.store.history.index(step)).tree  # (the index alone: no shard's record)
            saved = {key for key, _ in tree.get("dict", [])}
            if wanted <= saved:
                return step
            _log.info("%s: step %d holds no %s: not a resume point", self.uri, step, ", ".join(sorted(wanted - saved)))
        return -1

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if step != -1 and step not in self.store.steps():
            raise StepNotFoundError(f"--checkpoint.load_step={step}: {self.uri} has no step {step} "
                                    f"(steps: {self.store.steps()})")
        load_step = self._find_load_step() if step == -1 else step
        if load_step != -1:
            # torchtitan's step 0 is the seed checkpoint: the model only
            self._load_step(self.uri, self.storage_options, load_step, model_only=load_step == 0)
            return True
        initial = _split_step_id(self.initial_load_path or "", self.storage_options)
        if initial is not None and not self.initial_load_in_hf:
            self._load_step(*initial, model_only=self.initial_load_model_only)
            return True
        return super()._load(step)  # a fresh start, or torchtitan's own initial loads

    def _load_step(self, uri: str, storage_options: dict[str, Any] | None, step: int, model_only: bool) -> None:
        _log.info("Loading step %d of %s%s.", step, uri, " (model only)" if model_only else "")
        states = self._states_to_load(model_only)
        if not self.allow_pickle and isinstance(states.get(DATALOADER), Stateful):
            states[DATALOADER] = _CheckedPickles(states[DATALOADER])
        reader = dcp.AmberStorageReader(uri, storage_options, step=step, allow_pickle=self.allow_pickle,
                                        **(self.options if uri == self.uri else {}))
        torch_dcp.load(states, storage_reader=reader)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(states)


class _KeepLatest:
    """Retention run by DCP's checkpoint process once it committed a step (picklable: it goes
    there with the writer)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None, options: dict[str, Any], k: int) -> None:
        self.uri, self.storage_options, self.options, self.k = uri, storage_options, options, k

    def __call__(self, manifest: Any) -> None:
        dcp.store_for(self.uri, self.storage_options, **self.options).gc(keep_last=self.k)


class _CheckedPickles(Stateful):
    """A Stateful whose saved state holds pickles it unpickles itself (torchtitan's dataloader):
    each must be plain data before it is handed on."""

    def __init__(self, inner: Stateful) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            if isinstance(value, (bytes, bytearray)):
                calls = _calls_in_pickle(bytes(value))
                if calls:
                    raise UnsafeValueError(
                        f"dataloader state {key!r} is a pickle that names or calls code to load ({calls}); torchtitan "
                        "would unpickle it: set the checkpoint's allow_pickle=True only if the store is trusted as code")
        self.inner.load_state_dict(state_dict)


# The opcodes by which a pickle names a global or calls one: a pickle without them is plain data
# (dicts, lists, tuples, strings, bytes, numbers, booleans, None) and runs nothing when loaded.
_CODE_OPCODES = frozenset({"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD",
                           "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})


def _calls_in_pickle(data: bytes) -> str:
    """The opcodes of ``data`` that name or call code, with their arguments ("" if none); a
    pickle that does not parse is all suspect."""
    try:
        found = [f"{op.name} {arg!r}" if arg is not None else op.name
                 for op, arg, _ in pickletools.genops(data) if op.name in _CODE_OPCODES]
    except Exception as e:
        return f"unreadable: {e}"
    return ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")


def _step_of(checkpoint_id: str) -> int:
    m = re.search(r"step-(\d+)$", checkpoint_id.rstrip("/"))
    if m is None:
        raise ValueError(f"{checkpoint_id!r} names no step (torchtitan's ids end in step-<N>)")
    return int(m.group(1))


def _split_step_id(path: str, storage_options: dict[str, Any] | None
                   ) -> tuple[str, dict[str, Any] | None, int] | None:
    """``(store uri, storage options, step)`` when ``path`` is ``<store>/step-<N>`` of an
    amber-store, else ``None`` (a DCP folder or Hugging Face weights: torchtitan's to read)."""
    m = re.fullmatch(r"(.+)/step-(\d+)", path.rstrip("/"))
    if m is None:
        return None
    try:
        store = open_store(m.group(1), storage_options, mode="r")
    except NotAnAmberStoreError:  # torchtitan's own checkpoint folder
        return None
    step = int(m.group(2))
    if step not in store.steps():
        raise StepNotFoundError(f"checkpoint.initial_load_path: {m.group(1)} has no step {step} "
                                f"(steps: {store.steps()})")
    return m.group(1), storage_options, step
