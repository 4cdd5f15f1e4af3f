"""torch.distributed.checkpoint storage for amber-store: incremental, sharded, lazily read.

``dcp.save(state_dict, storage_writer=AmberStorageWriter(uri))`` and
``dcp.load(state_dict, storage_reader=AmberStorageReader(uri))`` (and ``dcp.async_save``) use
DCP's planner for everything distributed: which rank writes which shard (DTensor / FSDP2 local
shards, deduplicated replicas), and how a checkpoint saved from N ranks is resharded onto M.
amber-store only stores the items: each DCP write item (one tensor shard, or a pickled object)
becomes one tensor of an amber step, encoded as a delta against the same item of the previous
step by the rank that owns it, which keeps that base in host memory for its own shards. Each
rank writes through the same step writer as :meth:`Store.save`: its small items into one pack
of its own (``pack-r<rank>``), each large item as one object.

The commit is DCP's: every rank writes its items in ``write_data``, DCP gathers the results
on the coordinator, and only then ``finish`` writes the step's manifest (the commit point). A
failure on any rank means ``finish`` never runs, so the step stays invisible.

With FSDP2 / DTensor models, take the state with
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` and put it back
with ``set_state_dict`` after ``dcp.load``: both work unchanged with these classes.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import threading
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from zarr.core.sync import sync

from . import format as fmt
from .errors import CorruptDataError, NotAnAmberStoreError, StepNotFoundError, StepOrderError
from .format import Manifest, TensorEntry
from .history import next_segment, step_base
from .reader import ReadSession
from .runtime import gather
from .stepwriter import BaseCache, Written
from .store import Store, open

_METADATA = "dcp.metadata"


@dataclass(frozen=True)
class _StepPlan:
    """What the coordinator decides for one save and sends to every rank in its plan."""

    step: int
    bases: dict[str, int]  # by parent rule (History.base_steps); empty: a full step
    depth: int
    group: str
    attempt: str
    latest: int | None
    segment: list[int]


class _RankBases:
    """This process's materialized values of the items it wrote, per store URI, so the next save
    diffs against memory, not storage. A save's values join the cache only once its step is
    seen committed (only the coordinator learns of the commit directly)."""

    def __init__(self) -> None:
        self.cache = BaseCache()
        self.pending: tuple[int, dict[str, torch.Tensor]] | None = None


_BASES: dict[str, _RankBases] = {}
_BASES_LOCK = threading.Lock()


def _bases(uri: str) -> _RankBases:
    with _BASES_LOCK:
        return _BASES.setdefault(uri, _RankBases())


def item_key(index: MetadataIndex, kind: WriteItemType | LoadItemType) -> str:
    """The amber tensor key of a DCP item: its FQN, then its shard offset (or ``bytes``)."""
    if kind in (WriteItemType.BYTE_IO, LoadItemType.BYTE_IO):
        return f"{fmt.escape_segment(index.fqn)}/bytes"
    offset = "_".join(str(o) for o in (index.offset or ())) or "scalar"
    return f"{fmt.escape_segment(index.fqn)}/{offset}"


class AmberStorageWriter(StorageWriter):
    """A DCP StorageWriter that saves into an amber-store step (``step=None``: latest + 1).

    ``options`` are :func:`amber_store.open` options (``full_every``, ``codec``, ...). DCP's
    ``checkpoint_id`` may repeat the store's URI, or name a step of it the way per-step
    directories do: ``<uri>/step_<N>`` saves step N of the store at ``<uri>``.
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
                 step: int | None = None, full: bool | None = None, **options: Any) -> None:
        super().__init__()
        self.uri = os.fspath(uri)
        self.storage_options = storage_options
        self.options = options
        self.step = self._step = step
        self.full = full
        self._store: Store | None = None
        self._is_coordinator = False
        self._plan: _StepPlan | None = None
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
            self._open()  # creates the store; other ranks open it once plans arrive

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        store = self._open()
        steps = store.steps()
        latest = steps[-1] if steps else None
        step = self.step if self.step is not None else (latest + 1 if latest is not None else 0)
        if latest is not None and step <= latest:
            raise StepOrderError(f"{store.uri}: step {step} is not newer than the latest committed step {latest}")
        prev = store.manifest(latest) if latest is not None else None
        bases = sync(store.history.base_steps(prev, store.options.base_policy, store.options.full_every, self.full, steps))
        attempt = uuid.uuid4().hex[:8]
        segment = next_segment(prev, bases, step)
        decision = _StepPlan(step, bases, len(segment) - 1, fmt.step_group(step, attempt), attempt, latest, segment)
        sync(store.writer.open_group(decision.group, step))
        self._plan = decision  # finish() gets no plan: the coordinator remembers its decision
        return [dataclasses.replace(p, storage_data=decision) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        decision: _StepPlan = plan.storage_data
        store = self._open()
        bases = _bases(store.uri)
        _promote(store, bases)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        out = store.writer.step_writer(decision.group, pack_name=f"{fmt.PACK_PREFIX}-r{rank}",
                                       recycle=bases.cache.recycle)
        keyed = {item_key(item.index, item.type): item for item in plan.items}
        tensors = {key: _item_tensor(planner.resolve_data(item)) for key, item in keyed.items()}
        try:
            store.writer.add_tensors(out, tensors, decision.bases, decision.depth, cache=bases.cache)
            written = out.finish()
        finally:
            out.close()
        bases.pending = (decision.step, written.values)
        # The rank's packs, array metadata and object keys ride on its first result.
        shared = {"packs": written.packs, "arrays": written.arrays, "keys": written.keys}
        results = [WriteResult(index=keyed[key].index, size_in_bytes=e.nbytes,
                               storage_data={"key": key, "entry": dataclasses.asdict(e), **(shared if i == 0 else {})})
                   for i, (key, e) in enumerate(written.entries.items())]
        fut: Future[list[WriteResult]] = Future()  # DCP waits on torch futures
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self._open()
        decision = self._plan
        assert decision is not None, "finish() before prepare_global_plan()"
        entries: dict[str, TensorEntry] = {}
        index_to_key: dict[MetadataIndex, str] = {}
        written = Written()
        for rank_results in results:
            for r in rank_results:
                entries[r.storage_data["key"]] = TensorEntry(**r.storage_data["entry"])
                index_to_key[r.index] = r.storage_data["key"]
                written.packs.update(r.storage_data.get("packs", {}))
                written.arrays.update(r.storage_data.get("arrays", {}))
                written.keys.extend(r.storage_data.get("keys", []))
        metadata.storage_data = index_to_key
        blob = pickle.dumps(metadata)
        meta_key = f"{decision.group}/{_METADATA}"
        sync(store.history.backend.put_object(meta_key, [blob]))
        written.keys.append(meta_key)
        created = sync(store.writer.seal(decision.group, decision.step, written))
        manifest = Manifest(
            step=decision.step,
            kind="delta" if decision.bases else "full",
            base=step_base(decision.bases, store.options.base_policy),
            depth=decision.depth,
            group=decision.group,
            tree={"dict": [[k, {"tensor": k}] for k in sorted(entries)]},
            tensors=dict(sorted(entries.items())),
            created=created,
            seconds=0.0,
            attempt=decision.attempt,
            writer=store.history.writer_id,
            extra={"dcp": {"metadata": meta_key, "bytes": len(blob)}},
            packs=written.packs,
            segment=decision.segment,
        )
        sync(store.history.commit(manifest, decision.latest))
        self.last_commit = manifest
        _promote(store, _bases(store.uri))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _looks_like_uri(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.uri, save_id=uuid.uuid4().hex)

    # helpers ----------------------------------------------------------------------------

    def _open(self) -> Store:
        if self._store is None:
            self._store = open(self.uri, self.storage_options, mode="a", **self.options)
        return self._store


def _item_tensor(data: Any) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.detach()
    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _promote(store: Store, bases: _RankBases) -> None:
    """Cache the last save's values as a base once its step is committed."""
    if bases.pending is not None:
        step, values = bases.pending
        if step in store.steps():
            bases.cache.put(step, values)
            bases.cache.keep(store.writer.live_bases(store.manifest(step)))
            bases.pending = None


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
    adapter.uri, adapter._store = uri, None
    return True


def _looks_like_uri(checkpoint_id: str | os.PathLike[str]) -> bool:
    text = os.fspath(checkpoint_id)
    return "://" in text or os.path.isabs(text) or text.startswith(".")


class AmberStorageReader(StorageReader):
    """A DCP StorageReader for a step saved by :class:`AmberStorageWriter` (``step=None``: latest).

    Each rank reads only the regions of the stored shards that its own state dict needs.
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
                 step: int | None = None, **options: Any) -> None:
        super().__init__()
        self.uri = os.fspath(uri)
        self.storage_options = storage_options
        self.options = options
        self.step = self._step = step
        self._store: Store | None = None
        self._keys: dict[MetadataIndex, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        _retarget(self, checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        store = self._open()
        step = self.step if self.step is not None else store.latest()
        if step is None:
            raise StepNotFoundError(f"{store.uri}: the store is empty (no committed step)")
        self.step = step
        manifest = store.manifest(step)
        dcp_info = manifest.extra.get("dcp")
        if not dcp_info:
            raise NotAnAmberStoreError(f"{store.uri}: step {step} was not written through torch.distributed.checkpoint")
        raw = sync(store.history.backend.get(dcp_info["metadata"]))
        if raw is None:
            raise CorruptDataError(f"{store.uri}: step {step}: DCP metadata is missing", step=step, tensor=_METADATA)
        metadata: Metadata = pickle.loads(raw.to_bytes())
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._keys = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        store = self._open()
        assert self.step is not None
        lazy = store.load(self.step)
        wanted = [(req, lazy[self._keys[req.storage_index]]) for req in plan.items]

        async def read_all() -> list[torch.Tensor]:
            session = ReadSession()  # every object, and each pack, fetched once
            return await gather(lt._read(
                Ellipsis if req.type == LoadItemType.BYTE_IO or not req.lengths
                else tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths)), session)
                for req, lt in wanted)

        for (req, lt), tensor in zip(wanted, sync(read_all())):
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(tensor.numpy().tobytes()))
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

    def _open(self) -> Store:
        if self._store is None:
            self._store = open(self.uri, self.storage_options, mode="r", **self.options)
        return self._store
