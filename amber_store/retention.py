"""Retention and garbage collection that never breaks a delta chain.

``gc`` keeps the last N steps, every K-th step and the pinned ones, and deletes the rest in three
phases, each safe to interrupt:

1. **Fold**: every kept step with a tensor whose chain passes through a step to delete is
   rewritten, oldest first: that tensor is re-encoded as a delta against the previous *kept*
   step (or full, when there is none), into a new attempt group, and the step's manifest is
   then replaced atomically. Its materialized bits do not change.
2. **Uncommit**: the manifests of the deleted steps are removed. No kept step reads them now.
3. **Sweep**: every object under ``steps/`` that no remaining manifest references is deleted,
   including the data of crashed saves, except attempt groups of steps newer than the latest
   commit that are younger than ``grace_seconds`` (a save may be writing them right now).

Interrupted anywhere, every kept step still loads, and running ``gc`` again finishes the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from . import format as fmt
from .format import Manifest
from .pipeline import Writer, encode
from .uri import put_atomic

if TYPE_CHECKING:
    from .store import Store

PINS_DIR = "pins"
_PIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_GROUP = re.compile(r"(\d{12})-[0-9a-f]+")


@dataclass
class GCReport:
    """What a ``gc`` kept, folded and removed (or would, with ``dry_run``)."""

    keep: list[int]
    delete: list[int]
    rewrite: list[int]
    dry_run: bool
    objects_removed: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    orphans: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def select(steps: list[int], keep_last: int | None, keep_every: int | None, pinned: Iterable[int]) -> list[int]:
    """Steps a retention policy keeps. ``keep_last=None`` keeps every step."""
    if keep_last is None:
        return list(steps)
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1: the latest step is always kept")
    keep = set(steps[-keep_last:]) | set(pinned)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return sorted(keep & set(steps))


def pin_key(name: str) -> str:
    if not _PIN_NAME.fullmatch(name):
        raise ValueError(f"pin name {name!r}: use letters, digits, '_', '.', '-' (at most 128)")
    return f"{PINS_DIR}/{name}.json"


async def _needs_fold(store: Store, step: int, deleted: set[int]) -> bool:
    m = await store._manifest(step)
    for key in m.tensors:
        if deleted & set(await store._dependencies(step, key)):
            return True
    return False


def gc(store: Store, keep_last: int | None, keep_every: int | None, *, dry_run: bool = False,
       grace_seconds: float = 3600.0) -> GCReport:
    t0 = time.perf_counter()
    steps = store.steps()
    keep = select(steps, keep_last, keep_every, store.pins().values())
    deleted = sorted(set(steps) - set(keep))
    rewrite = [s for s in keep if sync(_needs_fold(store, s, set(deleted)))]
    report = GCReport(keep, deleted, rewrite, dry_run)
    if dry_run:
        report.orphans = sync(_unreferenced(store, keep, steps, grace_seconds))
        report.seconds = time.perf_counter() - t0
        return report

    for step in rewrite:  # oldest first: a fold only ever diffs against already-safe steps
        report.bytes_written += _fold(store, step, [k for k in keep if k < step], set(deleted))
    for step in deleted:
        sync(store._zstore.delete(fmt.commit_key(step)))
    store._forget()
    garbage = sync(_unreferenced(store, keep, steps, grace_seconds))
    sync(_delete_all(store, garbage))
    report.orphans = garbage
    report.objects_removed = len(garbage)
    report.seconds = time.perf_counter() - t0
    return report


def _fold(store: Store, step: int, earlier_kept: list[int], deleted: set[int]) -> int:
    """Rewrite the tensors of ``step`` that depend on deleted steps; returns bytes written.

    Each becomes ``same`` as the previous kept step if equal to it, a delta against it if that
    step lies within the chain the tensor had (so chains never grow longer than they were),
    else full.
    """
    m = store.manifest(step)
    deps = {k: sync(store._dependencies(step, k)) for k in m.tensors}
    todo = [k for k in m.tensors if deleted & set(deps[k])]
    base_m = store.manifest(earlier_kept[-1]) if earlier_kept else None
    attempt = uuid.uuid4().hex[:8]
    group = fmt.step_group(step, attempt)
    entries = dict(m.tensors)
    writer = Writer(store._zstore)
    try:
        sync(store._write_groups(group, step, todo))
        for key in todo:
            old = m.tensors[key]
            value = store._materialized(step, key)
            ref = store._base_for(base_m, key) if base_m is not None else None
            options = dict(step=step, group=group, chunk_bytes=store.chunk_bytes, level=store.compression_level,
                           chunks=tuple(old.chunks))
            enc = encode(key, value, ref, **options)
            if enc.entry.encoding == "xor" and ref is not None and ref.step < deps[key][0]:
                enc = encode(key, value, None, **options)  # unchanged is free; a long new chain is not
            writer.submit(enc)
        done = writer.finish()
    finally:
        writer.close()
    for enc in done:
        entries[enc.key] = enc.entry
    kind = "full" if all(e.encoding == "full" for e in entries.values()) else "delta"
    bases = [e.base for e in entries.values() if e.base is not None]
    new_base = max(bases) if bases else None
    depth = 0 if new_base is None else store.manifest(new_base).depth + 1
    folded = Manifest(**{**dataclasses.asdict(m), "tensors": entries, "kind": kind, "base": new_base, "depth": depth,
                         "extra": {**m.extra, "folded": {"group": group, "at": time.time(), "from": sorted(deleted)}}})
    sync(put_atomic(store._loc, fmt.commit_key(step), folded.to_json()))
    store._forget()
    return sum(enc.entry.stored for enc in done)


def _referenced(manifests: list[Manifest]) -> tuple[set[str], set[str]]:
    """Arrays the manifests point at, and every directory above them."""
    arrays = {e.array for m in manifests for e in m.tensors.values() if e.array}
    dirs: set[str] = set()
    for a in arrays | {m.group for m in manifests}:
        parts = a.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return arrays, dirs


async def _maybe_in_progress(store: Store, group: str, grace_seconds: float) -> bool:
    """A group of a step newer than the latest commit is spared while it is young: a save may
    be writing it right now. Its creation time is in its zarr.json."""
    raw = await store._zstore.get(f"{group}/zarr.json", default_buffer_prototype())
    if raw is None:
        return True
    created = json.loads(raw.to_bytes()).get("attributes", {}).get(fmt.ROOT_ATTR, {}).get("created")
    return not isinstance(created, (int, float)) or time.time() - created < grace_seconds


async def _unreferenced(store: Store, keep: list[int], all_steps: list[int], grace_seconds: float) -> list[str]:
    """Keys under ``steps/`` that the kept steps do not read (dry runs: as if gc had run)."""
    manifests = [await store._manifest(s) for s in keep]
    arrays, dirs = _referenced(manifests)
    latest = all_steps[-1] if all_steps else -1
    spared: dict[str, bool] = {}
    garbage = []
    async for key in store._zstore.list_prefix(f"{fmt.STEPS_DIR}/"):
        group = key.split("/")[1] if key.count("/") >= 1 else ""
        m = _GROUP.fullmatch(group)
        if m is None:
            continue  # not ours
        if int(m.group(1)) > latest:
            if group not in spared:
                spared[group] = await _maybe_in_progress(store, f"{fmt.STEPS_DIR}/{group}", grace_seconds)
            if spared[group]:
                continue
        if key.endswith("/zarr.json") and key[: -len("/zarr.json")] in dirs:
            continue
        if _is_chunk_of(key, arrays):
            continue
        garbage.append(key)
    return sorted(garbage)


def _is_chunk_of(key: str, arrays: set[str]) -> bool:
    """Whether ``key`` is a chunk (``<array>/c/...``, or ``<array>/c`` for 0-d) of one of ``arrays``."""
    i = key.find("/c")
    while i >= 0:
        rest = key[i + 2:]
        if (rest == "" or rest.startswith("/")) and key[:i] in arrays:
            return True
        i = key.find("/c", i + 1)
    return False


async def _delete_all(store: Store, keys: list[str]) -> None:
    sem = asyncio.Semaphore(32)

    async def one(k: str) -> None:
        async with sem:
            await store._zstore.delete(k)

    await asyncio.gather(*(one(k) for k in keys))
