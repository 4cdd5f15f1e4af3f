"""torch.distributed.checkpoint storage for amber-store: incremental, sharded, lazily read.

``dcp.save(state_dict, storage_writer=AmberStorageWriter(uri))`` and
``dcp.load(state_dict, storage_reader=AmberStorageReader(uri))`` (and ``dcp.async_save``) use
DCP's planner for everything distributed: which rank writes which shard (DTensor / FSDP2 local
shards, deduplicated replicas), and how a checkpoint saved from N ranks is resharded onto M.
amber-store only stores the items: each DCP write item (one tensor shard, or a pickled object)
becomes one tensor of an amber step, encoded as a delta against the same item of the previous
step by the rank that owns it, which keeps that base for its own shards (``base_cache``: a
local spill file by default, :mod:`amber_store.bases`). Each
rank writes through the same step writer as :meth:`Store.save`: its small items into one pack
of its own (``pack-r<rank>``), each large item as one object.

A save is the store's one step transaction (:mod:`amber_store.writer`), its stages spread over
DCP's: the coordinator plans the step in ``prepare_global_plan`` (newer than the latest, this
process the store's only writer, its bases, its attempt group) and sends the plan to every
rank; every rank writes its items in ``write_data`` by the save's deadline; DCP gathers the
results on the coordinator, and only then ``finish`` seals the group and commits the manifest.
A failure on any rank means ``finish`` never runs, so the step stays invisible.

The manifest records how the items make the state the ranks saved (:mod:`amber_store.shards`),
so ``amber_store.open(uri).load(step)`` in any single process, without a process group, opens a
sharded step as that nested state: one lazy tensor of global shape per sharded tensor. That
record is also what ``dcp.load`` plans with (:func:`metadata_of`): no pickle is stored or read.
:func:`import_checkpoint` moves a checkpoint directory written by DCP's ``FileSystemWriter``
into a store.

With FSDP2 / DTensor models, take the state with
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` and put it back
with ``set_state_dict`` after ``dcp.load``: both work unchanged with these classes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
import operator
import os
import pickle
import re
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import crc32c
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.futures import Future
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from . import format as fmt
from . import shards
from .dcp_private import EmptyStateDictLoadPlanner, load_state_dict, set_element, unflatten_state_dict
from .errors import CorruptDataError, NotAnAmberStoreError, StepNotFoundError, UnsafeValueError
from .format import Manifest
from .lazy import LazyTensor
from .options import Options
from .reader import ReadSession
from .runtime import gather, sync
from .bases import BaseCache, Bits
from .stepwriter import Written
from .store import Store, check_metrics, open
from .writer import StepPlan

class _Process:
    """What this process keeps of one store across DCP saves: the store itself, so that its
    writer identity (the sole-writer check) and history live from one save to the next, as a
    :class:`Store`'s do; the values of the items this rank wrote, so that the next save diffs
    against memory (a save's values join the cache only once its step is seen committed: only
    the coordinator learns of the commit directly); and, on the coordinator, the plan of a save
    that has not reached its commit."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cache = BaseCache(store.options.base_cache, store.options.spill_dir)
        self.pending: tuple[int, dict[str, Bits]] | None = None
        self.unfinished: StepPlan | None = None
        self.plans: list[SavePlan] = []  # the coordinator's: which rank writes which item
        self.numbered = False  # whether a save without a step has been told so

    def promote(self) -> None:
        """Cache the last save's values as a base once its step is committed."""
        if self.pending is not None:
            step, values = self.pending
            if step in self.store.steps():
                self.cache.put(step, values)
                self.cache.keep(self.store.writer.live_bases(sync(self.store.history.index(step))))
                self.pending = None


_PROCESS: dict[str, _Process] = {}
_PROCESS_LOCK = threading.Lock()


def _process(uri: str, storage_options: dict[str, Any] | None, options: dict[str, Any],
             store: Store | None = None) -> _Process:
    """This process's state of the store at ``uri``: of ``store`` if given, else opened now if
    it is not (or was with other options)."""
    with _PROCESS_LOCK:
        held = _PROCESS.get(uri)
        if store is not None:
            if held is None or held.store is not store:
                held = _PROCESS[uri] = _Process(store)
        elif held is None or held.store.options != Options(**options):
            held = _PROCESS[uri] = _Process(open(uri, storage_options, mode="a", **options))
        return held


def item_key(index: MetadataIndex, kind: WriteItemType | LoadItemType) -> str:
    """The amber tensor key of a DCP item: its FQN, then its shard offset (or ``bytes``)."""
    if kind in (WriteItemType.BYTE_IO, LoadItemType.BYTE_IO):
        return fmt.sharding.value_key(index.fqn)
    return fmt.sharding.item_key(index.fqn, index.offset or ())


#: Replicated items up to this many bytes are written by the lowest rank holding them (:class:`AmberSavePlanner`).
SMALL_REPLICA_BYTES = 1 << 20


class AmberSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a replicated item of up to
    :data:`SMALL_REPLICA_BYTES` (an optimizer's ``step``, a norm's weight under tensor
    parallelism, a Python value) is written by the lowest rank that holds it rather than spread
    over the ranks. A resuming rank needs every replicated item; written by one rank, their
    records are in that rank's fragment, so a resume reads the index, that fragment and its
    own (spread, the fragments of every rank that wrote one: up to all of them). Larger
    replicas stay balanced as DCP balances them. Pass it to ``dcp.save``/``dcp.async_save``
    (``planner=AmberSavePlanner()``); :class:`~amber_store.manager.CheckpointManager` does."""

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        lowest: dict[MetadataIndex, int] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                if _small(item):
                    lowest.setdefault(item.index, rank)
        # (an item not small is in no entry: its own rank keeps it for DCP's balancing below)
        plans = [dataclasses.replace(plan, items=[item for item in plan.items if lowest.get(item.index, rank) == rank])
                 for rank, plan in enumerate(all_plans)]
        return super()._dedup_save_plans(plans)


def _small(item: Any) -> bool:
    if item.type == WriteItemType.BYTE_IO:
        return True
    size = item.tensor_storage_size()
    return size is not None and size <= SMALL_REPLICA_BYTES


def store_for(uri: str, storage_options: dict[str, Any] | None = None, **options: Any) -> Store:
    """The store DCP saves to ``uri`` go through in this process, opened (writable, created if
    need be) on first use: one writer identity and one cache of bases for every save, which
    retention (``gc``) in this process must share; ``options`` are :func:`amber_store.open`'s."""
    return _process(uri, storage_options, options).store


class AmberStorageWriter(StorageWriter):
    """A DCP StorageWriter that saves into an amber-store step.

    ``uri`` names the store, or is an open writable :class:`Store` (saves then go through its
    writer). The step is ``step``, or the one DCP's ``checkpoint_id`` names the way per-step directories
    do (``<uri>/step_<N>`` saves step N of the store at ``<uri>``); with neither, the latest
    step + 1 (said once, in a warning: a training job wants its own step numbers). ``options``
    are :func:`amber_store.open` options (``full_every``, ``codec``, ``save_timeout``, ...).
    ``metrics`` are kept with the step as :meth:`Store.save`'s are; ``after(manifest)`` runs on
    the coordinator once the step is committed (retention), before the save returns.

    A save is one step transaction (:mod:`amber_store.writer`): the coordinator plans it (the
    step must be newer than the latest, and this process the store's only writer), every rank
    writes its items by the save's deadline, and the coordinator seals and commits it in
    ``finish``. A rank that fails deletes what it wrote; the coordinator deletes the rest of
    an attempt that never reached ``finish`` at its next save.
    """

    def __init__(self, uri: str | os.PathLike[str] | Store, storage_options: dict[str, Any] | None = None, *,
                 step: int | None = None, full: bool | None = None, metrics: Mapping[str, float] | None = None,
                 after: Callable[[Manifest], None] | None = None, **options: Any) -> None:
        super().__init__()
        self._store = uri if isinstance(uri, Store) else None
        self.uri = uri.uri if isinstance(uri, Store) else os.fspath(uri)
        self.storage_options = storage_options
        self.options = options
        self.step = self._step = step
        self.full = full
        self.metrics = check_metrics(metrics)
        self.after = after
        self._is_coordinator = False
        self.last_commit: Manifest | None = None

    # DCP protocol ---------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        previous = self.uri
        if _retarget(self, checkpoint_id) and self.last_commit is not None:
            warnings.warn(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} is a different store than the last save's "
                f"({previous}): each store starts with a full step, so nothing is incremental; give every "
                "save the same id, or '<root>/step_<N>'", RuntimeWarning, stacklevel=2)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator
        if is_coordinator:
            self._held()  # creates the store; other ranks open it once plans arrive

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not all(getattr(p, "usable", True) for p in plans):
            # DCP's plan caching sends ranks whose plan is unchanged nothing, and they write by the
            # plan they cached: the last save's, whose step and attempt group this one is not.
            raise ValueError("AmberStorageWriter does not work with DefaultSavePlanner(enable_plan_caching=True): "
                             "ranks would write by an earlier save's plan; use a planner without plan caching")
        held = self._held()
        store = held.store
        if held.unfinished is not None:  # a save of this process that failed before its commit
            sync(store.writer.discard(held.unfinished.group))
            held.unfinished = None
        step = self.step
        if step is None:
            latest = store.latest()
            step = latest + 1 if latest is not None else 0
            if not held.numbered:
                held.numbered = True
                warnings.warn(
                    f"{store.uri}: a DCP save without a step is saved as step {step}, the latest + 1; to number "
                    "checkpoints by training step, pass AmberStorageWriter(uri, step=N) or "
                    "checkpoint_id='<uri>/step_<N>' (said once)", RuntimeWarning, stacklevel=2)
        decision = sync(store.writer.plan(step, self.full))
        held.unfinished = decision  # finish() gets no plan: the coordinator remembers it
        held.plans = plans
        return [dataclasses.replace(p, storage_data=decision) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        decision: StepPlan = plan.storage_data
        held = self._held()
        writer = held.store.writer
        held.promote()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        keyed = {item_key(item.index, item.type): item for item in plan.items}
        tensors = {key: _item_tensor(planner.resolve_data(item)) for key, item in keyed.items()}
        deadline = writer.deadline(sum(t.nbytes for t in tensors.values()))
        fut: Future[list[WriteResult]] = Future()  # DCP waits on torch futures
        if not keyed:  # (a rank whose every item another rank writes)
            fut.set_result([])
            return fut
        try:
            written = writer.write(decision, lambda out: writer.add_tensors(out, tensors, decision, cache=held.cache),
                                   pack_name=f"{fmt.PACK_PREFIX}-r{rank}", keeper=held.cache.keeper(),
                                   deadline=deadline.at)
        except (TimeoutError, asyncio.TimeoutError) as e:
            if not deadline.passed():
                raise  # one request's own timeout
            raise deadline.missed(f"{held.store.uri}: saving step {decision.step} on rank {rank}",
                                  f"stopped at: {e}") from e
        try:
            fragment = sync(writer.seal_rank(decision, written, rank))
        except BaseException:
            sync(writer.delete_objects(written.keys))
            raise
        held.pending = (decision.step, written.values)
        # One result a rank: the coordinator's work is per rank, not per item.
        first = next(iter(keyed.values()))
        fut.set_result([WriteResult(index=first.index, size_in_bytes=sum(e.stored for e in written.entries.values()),
                                    storage_data={"fragment": fragment, "items": items_written(plan)})])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        held = self._held()
        writer = held.store.writer
        decision = held.unfinished
        assert decision is not None, "finish() before prepare_global_plan()"
        t0 = time.perf_counter()
        fragments: list[dict[str, Any] | None] = [None] * len(results)
        written_by: list[dict[str, Any] | None] = [None] * len(results)
        for rank, rank_results in enumerate(results):
            for r in rank_results:
                fragments[rank], written_by[rank] = r.storage_data["fragment"], r.storage_data["items"]
        tree, state = sharded_index(metadata, held.plans, written_by)
        held.plans = []
        created = sync(writer.seal(decision, Written(), consolidated=False))
        extra: dict[str, Any] = {"dcp": {"state": state}}
        if self.metrics:
            extra["metrics"] = self.metrics
        # Once sent, a commit's outcome is the commit's to settle, as in Store.save: if its answer
        # is lost, the manifest may have landed, so the next save must not discard its attempt.
        held.unfinished = None
        self.last_commit = sync(writer.commit(decision, Written(), tree, created, time.perf_counter() - t0, extra,
                                              fragments=fragments))
        held.promote()
        if self.after is not None:
            self.after(self.last_commit)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _looks_like_uri(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.uri, save_id=uuid.uuid4().hex)

    # helpers ----------------------------------------------------------------------------

    def _held(self) -> _Process:
        store = self._store if self._store is not None and self._store.uri == self.uri else None
        return _process(self.uri, self.storage_options, self.options, store)


class _Leaf:
    def __init__(self, name: str) -> None:
        self.name = name


def items_written(plan: SavePlan) -> dict[str, Any]:
    """What the coordinator needs to know of a rank's items to say which rank holds each shard,
    in a form it handles without a Python step per item: the place of each of its shards in its
    tensor's chunks (DCP's default planner numbers them), as int32 bytes in plan order, with a
    checksum of their tensors' names (ranks holding shards of the same tensors send the same);
    and its whole tensors and values (few: each is written by one rank)."""
    fqns, positions, whole = [], [], []
    for item in plan.items:
        index = item.index
        if item.type == WriteItemType.SHARD and index.index is not None:
            fqns.append(index.fqn)
            positions.append(index.index)
        else:
            whole.append([index.fqn, None if index.offset is None else list(index.offset)])
    return {"names": _names_crc(fqns), "positions": np.asarray(positions, dtype="<i4").tobytes(), "whole": whole}


def _names_crc(fqns: list[str]) -> int:
    return crc32c.crc32c("\0".join(fqns).encode())


def _writers(metadata: Metadata, plans: list[SavePlan], written_by: list[dict[str, Any] | None]
             ) -> tuple[dict[str, tuple[int, int]], np.ndarray, dict[str, int]]:
    """Which rank wrote each chunk of each tensor: a flat array of ranks, each tensor's
    ``(start, count)`` in it, and each value's rank. Ranks whose shards belong to the same
    tensors share one lookup of their names (from the global plan); the rest is array work."""
    saved = metadata.state_dict_metadata
    where: dict[str, tuple[int, int]] = {}
    total = 0
    for fqn, md in saved.items():
        if isinstance(md, TensorStorageMetadata):
            where[fqn] = (total, len(md.chunks))
            total += len(md.chunks)
    flat = np.full(total, -1, dtype=np.int32)
    values: dict[str, int] = {}
    lookups: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for rank, items in enumerate(written_by):
        if items is None:
            continue
        positions = np.frombuffer(items["positions"], dtype="<i4").astype(np.int64)
        lookup = lookups.get(items["names"])
        if lookup is None:
            fqns = [it.index.fqn for it in plans[rank].items
                    if it.type == WriteItemType.SHARD and it.index.index is not None]
            if _names_crc(fqns) != items["names"] or len(fqns) != len(positions):
                raise ValueError(f"rank {rank} wrote other items than the global plan gave it")
            starts, counts = (np.fromiter((where[f][i] for f in fqns), np.int64, len(fqns)) for i in (0, 1))
            lookup = lookups[items["names"]] = (starts, counts)
        starts, counts = lookup
        if len(positions) != len(starts) or ((positions < 0) | (positions >= counts)).any():
            raise ValueError(f"rank {rank}'s shards are not at places of their tensors' chunks")
        slots = starts + positions
        if (flat[slots] >= 0).any():
            raise ValueError(f"rank {rank} wrote a shard another rank wrote")
        flat[slots] = rank
        for fqn, offset in items["whole"]:
            if fqn not in where:
                values[fqn] = rank
                continue
            start, n = where[fqn]
            chunks = saved[fqn].chunks
            i = next((i for i, c in enumerate(chunks) if list(c.offsets) == list(offset or ())), None)
            if i is None or flat[start + i] >= 0:
                raise ValueError(f"rank {rank} wrote a shard of {fqn} at {offset} that DCP's metadata lacks")
            flat[start + i] = rank
    if (flat < 0).any():
        missing = int(np.argmax(flat < 0))
        fqn = next(f for f, (s, n) in where.items() if s <= missing < s + n)
        raise ValueError(f"{fqn}: shard {saved[fqn].chunks[missing - where[fqn][0]]} is in DCP's metadata but "
                         "no rank wrote it")
    return where, flat, values


def sharded_index(metadata: Metadata, plans: list[SavePlan], written_by: list[dict[str, Any] | None]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The index of a sharded save (format 10): the state's tree, DCP's flattened keys
    unflattened as DCP's own ``unflatten_state_dict`` does (``planner_data``), and
    ``extra.dcp.state``: each tensor's dtype, global shape and shards (a grid where they make
    one: :mod:`amber_store.format.sharding`) with the row of ``owners`` saying which rank's
    fragment holds each shard, and each value's item and rank. ``plans``: the global plan;
    ``written_by``: each rank's :func:`items_written` (``None``: it wrote nothing)."""
    saved = metadata.state_dict_metadata
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    order = _state_order(metadata)
    paths = {fqn: tuple(mapping.get(fqn, (fqn,))) for fqn in order}
    where, flat, value_writer = _writers(metadata, plans, written_by)
    rows: dict[bytes, int] = {}
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    leaves: dict[str, _Leaf] = {}
    for fqn in order:
        md = saved[fqn]
        name = "/".join(fmt.escape_segment(p) for p in paths[fqn])
        leaves[fqn] = _Leaf(name)
        if not isinstance(md, TensorStorageMetadata):
            values[name] = [fmt.sharding.value_key(fqn), value_writer[fqn]]
            continue
        shape = tuple(md.size)
        start, n = where[fqn]
        w = flat[start: start + n]
        grid = _in_grid_order(shape, md.chunks)
        if grid is not None:  # (the common case, checked at C speed: DTensor's chunks in rank order)
            row, desc = w, {"grid": grid}
        else:
            w = w.tolist()
            shards_ = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
            described = fmt.sharding.describe(shape, shards_)
            if described is not None:
                grid, cells = described
                row = np.zeros(len(cells), dtype=np.int32)
                row[np.asarray(cells)] = w
                desc = {"grid": grid}
            else:
                row, desc = np.asarray(w, dtype=np.int32), {"shards": [[list(o), list(s)] for o, s in shards_]}
        k = rows.setdefault(np.asarray(row, dtype=np.int32).tobytes(), len(rows))
        tensors[name] = {"dtype": fmt.dtype_name(md.properties.dtype), "shape": list(shape), **desc, "owners": k}

    def node(obj: Any) -> dict[str, Any]:
        if isinstance(obj, _Leaf):
            return {"tensor": obj.name}
        if isinstance(obj, dict):
            return {"dict": [[k, node(v)] for k, v in obj.items()]}
        if isinstance(obj, list):
            return {"list": [node(v) for v in obj]}
        return {"value": None}  # a list slot that DCP's unflatten fills with None

    tree = node(unflatten_state_dict(leaves, paths))
    return tree, {"tensors": tensors, "values": values,
                  "owners": [np.frombuffer(r, dtype=np.int32).tolist() for r in rows]}


def _in_grid_order(shape: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> list[int] | None:
    """The grid of pieces as long as the first chunk's sides (``torch.chunk``'s split), if
    ``chunks`` are exactly its cells in grid order; else ``None``."""
    if not chunks or any(o for o in chunks[0].offsets):
        return None
    grid = list(chunks[0].sizes)
    if any(c < 1 for c in grid):
        return None
    cells = _cells(shape, tuple(grid))
    return grid if len(cells) == len(chunks) and list(map(_OFFSETS_SIZES, chunks)) == cells else None


_OFFSETS_SIZES = operator.attrgetter("offsets", "sizes")


@functools.lru_cache(maxsize=256)
def _cells(shape: tuple[int, ...], grid: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return list(fmt.sharding.cells(shape, grid))


def _state_order(metadata: Metadata) -> list[str]:
    """The saved keys in the state's own order: the flattening's mapping lists them so, the
    metadata in the global plan's order."""
    saved = metadata.state_dict_metadata
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return [fqn for fqn in mapping if fqn in saved] + [fqn for fqn in saved if fqn not in mapping]


def metadata_of(m: Manifest) -> Metadata:
    """DCP's ``Metadata`` of a sharded step, rebuilt from its record: each tensor's shards as
    chunks, each value as bytes, the flattening's paths as ``planner_data``. Since format 10,
    from the index alone, tensors of one shape and grid sharing one list of chunks (DCP's load
    planner only reads them), so that it costs a rank the tensors and the grids, not every
    shard; before, from the layout, with each item's key as ``storage_data``."""
    state: dict[str, Any] = {}
    planner_data: dict[str, tuple[str | int, ...]] = {}
    index = m.extra["dcp"]["state"]
    if "owners" in index:
        chunk_lists: dict[str, list[ChunkStorageMetadata]] = {}
        for name, path in shards.paths(m.tree).items():
            fqn = ".".join(map(str, path))  # DCP's flattened key
            planner_data[fqn] = path
            t = index["tensors"].get(name)
            if t is None:
                state[fqn] = BytesStorageMetadata()
                continue
            described = json.dumps([t["shape"], t.get("grid"), t.get("shards")])
            chunks = chunk_lists.get(described)
            if chunks is None:
                chunks = chunk_lists[described] = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                                                   for o, s in shards.cells_of(t["shape"], t)]
            state[fqn] = TensorStorageMetadata(TensorProperties(dtype=fmt.DTYPES[t["dtype"]]), torch.Size(t["shape"]),
                                               chunks)
        return Metadata(state, planner_data=planner_data)
    layout = shards.layout_of(m)
    assert layout is not None
    keys: dict[MetadataIndex, str] = {}
    for name, path in shards.paths(layout.tree).items():
        fqn = ".".join(map(str, path))
        planner_data[fqn] = path
        if name in layout.values:
            state[fqn] = BytesStorageMetadata()
            keys[MetadataIndex(fqn)] = layout.values[name]
            continue
        t = layout.tensors[name]
        chunks = []
        for (offset, item), size in zip(t.shards, t.sizes):
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(size)))
            keys[MetadataIndex(fqn, torch.Size(offset))] = item
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=fmt.DTYPES[t.dtype]), torch.Size(t.shape), chunks)
    return Metadata(state, planner_data=planner_data, storage_data=keys)


class _SafeValuesPlanner(EmptyStateDictLoadPlanner):
    """Rebuilds the saved state from the checkpoint's metadata (as torch's own
    ``format_utils.dcp_to_torch_save`` does), in the state's own order, but reads values with
    ``weights_only=True``."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        if metadata is not None:
            saved = metadata.state_dict_metadata
            metadata.state_dict_metadata = {fqn: saved[fqn] for fqn in _state_order(metadata)}
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeValueError(f"{fqn!r} is a pickled object that cannot be read without running code stored "
                                   f"with it ({str(e).splitlines()[0]}); it is not imported") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def import_checkpoint(store: Store, step: int, path: str | os.PathLike[str]) -> Manifest:
    """Save the checkpoint directory ``path`` written by DCP's ``FileSystemWriter`` as the full
    ``step`` of ``store``, as a DCP step (each tensor one shard), so that it opens as a state
    dict and ``dcp.load`` reshards it onto any number of ranks. Values are read with
    ``weights_only=True``. Holds the whole checkpoint in memory once."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise NotAnAmberStoreError(f"{path}: a directory without DCP's .metadata; import reads a torch.save or "
                                   "safetensors file, or a torch.distributed.checkpoint directory")
    state: dict[str, Any] = {}
    writer = AmberStorageWriter(store, step=step, full=True)
    with store.writing(), warnings.catch_warnings():  # (warnings: "torch.distributed is disabled ...": one process is the intent)
        warnings.simplefilter("ignore", UserWarning)
        try:
            load_state_dict(state, storage_reader=FileSystemReader(os.fspath(path)), planner=_SafeValuesPlanner(),
                             no_dist=True)
            torch_dcp.save(state, storage_writer=writer, no_dist=True)
        except CheckpointException as e:  # one process: its one failure, as it was raised
            raise next(iter(e.failures.values()))[0] from None
    assert writer.last_commit is not None
    return writer.last_commit


def _item_tensor(data: Any) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.detach()
    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def split_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> tuple[str, int | None]:
    """``(store URI, step)`` of a DCP checkpoint id: ``<uri>/step_<N>`` names step N of the store
    at ``<uri>``; anything else is a store URI (``step`` ``None``)."""
    text = os.fspath(checkpoint_id).rstrip("/")
    root, _, last = text.rpartition("/")
    m = re.fullmatch(r"step_(\d+)", last)
    return (root, int(m.group(1))) if m and root else (text, None)


def _retarget(adapter: AmberStorageWriter | AmberStorageReader, checkpoint_id: str | os.PathLike[str] | None) -> bool:
    """Point a writer or reader at DCP's ``checkpoint_id`` (its step, or the one it was built
    with); whether that is another store than before."""
    if checkpoint_id is None:
        return False
    uri, step = split_checkpoint_id(checkpoint_id)
    adapter.step = step if step is not None else adapter._step
    if uri == adapter.uri:
        return False
    adapter.uri = uri
    return True


def _looks_like_uri(checkpoint_id: str | os.PathLike[str]) -> bool:
    text = os.fspath(checkpoint_id)
    return "://" in text or os.path.isabs(text) or text.startswith(".")


class _MetadataUnpickler(pickle.Unpickler):
    """Reads the DCP ``Metadata`` that format-8 steps pickled beside them, resolving only the
    classes and functions such metadata is made of (torch's weights-only unpickler does not take
    the protocol it was written with): a crafted object naming anything else is refused, so
    nothing runs but these constructors."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


class AmberStorageReader(StorageReader):
    """A DCP StorageReader for a step saved by :class:`AmberStorageWriter` (``step=None``: latest).

    Each rank reads only the regions of the stored shards that its own state dict needs. Saved
    Python values are read with ``weights_only=True`` before DCP's planner sees them, so that
    ``dcp.load`` through this reader never runs code stored with them: one that needs more
    raises :class:`UnsafeValueError`, unless ``allow_pickle=True`` (a store trusted as its
    writer's code would be; docs/SECURITY.md).
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
                 step: int | None = None, allow_pickle: bool = False, **options: Any) -> None:
        super().__init__()
        self.uri = os.fspath(uri)
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.options = options
        self.step = self._step = step
        self._store: Store | None = None
        self._keys: dict[MetadataIndex, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if _retarget(self, checkpoint_id):
            self._store = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        store = self._open()
        step = self.step if self.step is not None else store.latest()
        if step is None:
            raise StepNotFoundError(f"{store.uri}: the store is empty (no committed step)")
        self.step = step
        manifest = sync(store.history.index(step))  # (a sharded step's fragments are read by the ranks needing them)
        dcp_info = manifest.extra.get("dcp")
        if not dcp_info:
            raise NotAnAmberStoreError(f"{store.uri}: step {step} was not written through torch.distributed.checkpoint")
        if dcp_info.get("state") is not None:
            if "owners" not in dcp_info["state"]:
                sync(store.history.manifest(step))  # format 9: shard sizes are in the entries
            return metadata_of(manifest)
        # format 8: DCP's Metadata pickled beside the step (written by this package's own writer)
        raw = sync(store.history.backend.get(dcp_info["metadata"]))
        if raw is None:
            raise CorruptDataError(f"{store.uri}: step {step}: DCP metadata is missing", step=step,
                                   tensor="dcp.metadata")
        try:
            return _MetadataUnpickler(io.BytesIO(raw.tobytes())).load()
        except Exception as e:  # a refused global, or bytes that are no pickle
            raise CorruptDataError(f"{store.uri}: step {step}: its DCP metadata ({dcp_info['metadata']}) is not "
                                   f"DCP metadata that reads without running code ({type(e).__name__}: {e})",
                                   step=step, tensor="dcp.metadata") from None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._keys = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        store = self._open()
        assert self.step is not None
        keys = [self._keys.get(req.storage_index) or item_key(req.storage_index, req.type) for req in plan.items]
        entries = sync(store.history.entries(self.step, sorted(set(keys))))  # only the fragments holding them
        wanted = [(req, LazyTensor(store.reader, self.step, key, entries[key])) for req, key in zip(plan.items, keys)]

        async def read_all() -> list[torch.Tensor]:
            session = ReadSession(whole_packs=False)  # every object once; of packs, the parts needed
            return await gather(lt._read(
                Ellipsis if req.type == LoadItemType.BYTE_IO or not req.lengths
                else tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths)), session)
                for req, lt in wanted)

        for (req, lt), tensor in zip(wanted, sync(read_all())):
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, self._safe_bytes(req.dest_index.fqn, tensor.numpy(), lt))
                continue
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"{lt.key}: stored region {tuple(tensor.shape)} vs target {tuple(target.shape)}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _looks_like_uri(checkpoint_id)

    def _safe_bytes(self, fqn: str, raw: Any, lt: LazyTensor) -> io.BytesIO:
        """A saved value's bytes as DCP's planner may unpickle them (its default planner does so
        with ``weights_only=False``): the value read with ``weights_only=True`` and saved again,
        so that what the planner unpickles was made here, from allow-listed types only."""
        if self.allow_pickle:
            return io.BytesIO(raw.tobytes())
        assert self.step is not None
        out = io.BytesIO()
        torch.save(shards.value(raw, self.step, fqn, lt.key), out)
        out.seek(0)
        return out

    def _open(self) -> Store:
        if self._store is None:
            self._store = open(self.uri, self.storage_options, mode="r", **self.options)
        return self._store
