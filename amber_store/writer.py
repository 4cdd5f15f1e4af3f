"""Writing steps: the write side of a store, as :mod:`amber_store.reader` is its read side.

A save checks the step against the history (newer than the latest, this the only writer),
picks each tensor's base (:meth:`History.base_steps`), creates a fresh attempt group, encodes
and writes every tensor into it on a writer thread (:class:`~amber_store.stepwriter.StepWriter`),
seals the group (its consolidated metadata, then durability) and commits the manifest last.
Retention's folds and the DCP writer build steps from the same pieces (:meth:`Writer.open_group`,
:meth:`Writer.add_tensors`, :meth:`Writer.seal`, :meth:`Writer.bases_for`).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import time
import uuid
from contextlib import suppress
from collections.abc import Mapping
from typing import Any

import torch
from tqdm.auto import tqdm
from zarr.core.sync import sync

from . import format as fmt
from .codecs import DeltaCodec
from .errors import ConcurrentWriterError, StepOrderError, StorageAccessError
from .format import Manifest, TensorEntry
from .history import PARENTS, History, json_bytes, next_segment, parent_policies, parent_policy, step_base
from .options import Options
from .reader import Reader, ReadSession
from .runtime import gather, writer_pool
from .stepwriter import Base, BaseCache, StepWriter, Written
from .storage import is_storage_error

#: save_timeout="auto": this many seconds, plus one per AUTO_TIMEOUT_RATE bytes of state.
AUTO_TIMEOUT_SECONDS = 300.0
AUTO_TIMEOUT_RATE = 20e6
#: how long a failed save may spend deleting its own attempt's data
DISCARD_TIMEOUT = 10.0


class Writer:
    """Saves steps into one store with its :class:`~amber_store.options.Options`, keeping in
    memory the values later deltas diff against (:attr:`bases`)."""

    def __init__(self, history: History, reader: Reader, options: Options) -> None:
        self.backend = history.backend
        self.history = history
        self.reader = reader
        self.options = options
        self.bases = BaseCache()
        #: the format version the store's root names (a save of this version updates it)
        self.root_version: int | None = None

    def _timeout(self, tensors: dict[str, torch.Tensor]) -> float | None:
        if self.options.save_timeout == "auto":
            return AUTO_TIMEOUT_SECONDS + sum(t.nbytes for t in tensors.values()) / AUTO_TIMEOUT_RATE
        return self.options.save_timeout

    async def save(self, step: int, tree: dict[str, Any], tensors: dict[str, torch.Tensor], full: bool | None,
                   t0: float, metrics: dict[str, float]) -> Manifest:
        """Write ``tensors`` (the leaves of ``tree``) as ``step`` and commit it, within the save's
        timeout; returns its manifest. An attempt that fails before its commit is deleted where
        it is known to be dead (:meth:`_discard`)."""
        timeout = self._timeout(tensors)
        deadline = None if timeout is None else time.monotonic() + timeout
        group = fmt.step_group(step, uuid.uuid4().hex[:8])
        doing = ["listing the steps"]  # the stage reached, for the message of a save out of time
        try:
            manifest, latest, values = await asyncio.wait_for(
                self._stage(step, group, tree, tensors, full, t0, deadline, metrics, doing), timeout)
        except (asyncio.TimeoutError, TimeoutError) as e:
            if deadline is None or time.monotonic() < deadline:
                raise  # one request's own timeout
            raise StorageAccessError(
                f"{self.history.uri}: saving step {step} did not finish within save_timeout={timeout:.0f} s, stopped "
                f"while {doing[-1]} (is the storage answering?); the step is not committed and earlier steps "
                "are untouched"
            ) from e
        except Exception as e:
            await self._discard(group, e)
            raise
        # Not under the deadline: once sent, a commit's outcome must be learnt, not abandoned
        # (a retried create that finds its own manifest is a success).
        try:
            await self.history.commit(manifest, latest)
        except ConcurrentWriterError as e:
            await self._discard(group, e)
            raise
        self.bases.put(step, values)
        self.bases.keep(self.live_bases(manifest))
        return manifest

    async def _discard(self, group: str, cause: BaseException) -> None:
        """Delete the data of an attempt known not to be committed at once, rather than at the
        next gc, where the storage still answers: after a bug, a refused or lost race, or a full
        disk (deleting frees space). After a network failure the attempt stays for gc."""
        if not is_storage_error(cause) or getattr(cause, "errno", None) == errno.ENOSPC:
            await self.discard(group)

    async def discard(self, group: str) -> None:
        """Delete an attempt group that is never committed (best effort, bounded in time)."""
        with suppress(Exception):
            await asyncio.wait_for(self.backend.delete_dir(group), DISCARD_TIMEOUT)

    async def _stage(self, step: int, group: str, tree: dict[str, Any], tensors: dict[str, torch.Tensor],
                     full: bool | None, t0: float, deadline: float | None, metrics: dict[str, float],
                     doing: list[str]) -> tuple[Manifest, int | None, dict[str, torch.Tensor]]:
        """Write and seal everything of the step but its commit; returns its manifest, the
        latest step seen before, and the step's values as later deltas' bases. Each stage
        reached is appended to ``doing``."""
        history = self.history
        steps = await history.steps()
        latest = steps[-1] if steps else None
        doing.append("checking for other writers")
        await history.check_sole_writer(latest)
        if latest is not None and step <= latest:
            raise StepOrderError(f"{self.history.uri}: step {step} is not newer than the latest committed step {latest}")
        doing.append("reading the manifests of its bases")
        prev = await history.manifest(latest) if latest is not None else None
        bases = await history.base_steps(prev, self.options.base_policy, self.options.full_every, full, steps)
        segment = next_segment(prev, bases, step)
        doing.append("creating its group")
        await self.open_group(group, step)
        doing.append("waiting for a writer thread")
        job = asyncio.get_running_loop().run_in_executor(writer_pool(), self._write_tensors, group, step, tensors,
                                                         bases, len(segment) - 1, deadline, doing)
        try:
            written = await asyncio.shield(job)
        except asyncio.CancelledError:
            # The deadline passed: the writer thread stops at the same deadline; wait for it,
            # so no write of this attempt outlives the failed save. Its own error (e.g. writes
            # unanswered at the deadline) goes into the save's.
            await asyncio.wait([job])
            if not job.cancelled() and job.exception() is not None:
                doing.append(f"writing its data ({job.exception()})")
            raise
        doing.append("sealing its group")
        created = await self.seal(group, step, written)
        if self.root_version != fmt.FORMAT_VERSION:
            await history.write_root()  # an older store now holds steps of this version
            self.root_version = fmt.FORMAT_VERSION
        manifest = Manifest(
            step=step,
            kind="delta" if bases else "full",
            base=step_base(bases, self.options.base_policy),
            depth=len(segment) - 1,
            group=group,
            tree=tree,
            tensors={key: written.entries[key] for key in tensors},
            created=created,
            seconds=time.perf_counter() - t0,
            attempt=group.rsplit("-", 1)[1],
            writer=history.writer_id,
            packs=written.packs,
            segment=segment,
            extra={"metrics": metrics} if metrics else {},
        )
        return manifest, latest, written.values

    def live_bases(self, m: Manifest) -> set[int]:
        """Steps of ``m``'s segment that a later save may diff against."""
        return {m.segment[q] for q in self._parents(m.depth, parent_policies(self.options.base_policy)) if 0 <= q <= m.depth}

    def kept_as_base(self, depth: int) -> dict[bool, bool]:
        """For lossless (``True``) and lossy tensors: whether a later save may diff against a
        step at position ``depth`` of its segment (so its values are worth keeping in memory)."""
        return {lossless: depth in self._parents(depth, (parent_policy(self.options.base_policy, lossless),))
                for lossless in (True, False)}

    def _parents(self, depth: int, policies: tuple[str, ...]) -> set[int]:
        """Segment positions that a later position than ``depth`` diffs against under ``policies``."""
        horizon = 2 * max(self.options.full_every, depth + 2)
        return {PARENTS[p](r) for p in policies for r in range(depth + 1, horizon)}

    def _write_tensors(self, group: str, step: int, tensors: dict[str, torch.Tensor],
                       bases: dict[str, int], depth: int, deadline: float | None, doing: list[str]) -> Written:
        """Encode and write every tensor into ``group`` (on a worker thread, so the event loop
        stays free for the writes), giving up at ``deadline`` (``time.monotonic()``). The step
        is at position ``depth`` of its segment: a tensor whose codec's parent rule never
        diffs against that position (a lossless one under ``auto`` in a delta step) keeps no
        copy of its value (:meth:`kept_as_base`)."""
        doing.append("encoding and writing its data")
        out = self.step_writer(group, recycle=self.bases.recycle, deadline=deadline)
        try:
            self.add_tensors(out, tensors, bases, depth, desc=f"save {step}")
            return out.finish()
        finally:
            out.close()

    def add_tensors(self, out: StepWriter, tensors: dict[str, torch.Tensor], bases: dict[str, int], depth: int,
                    cache: BaseCache | None = None, desc: str | None = None) -> None:
        """Add ``tensors`` to the step writer ``out`` for a step at position ``depth`` of its
        segment, each with its codec against its base (:meth:`tensor_bases`), keeping the values
        a later save may diff against (:meth:`kept_as_base`); ``desc`` labels a progress bar
        (``progress=True``)."""
        codecs = self.codecs_for(tensors)
        refs = self.tensor_bases(bases, codecs, cache)
        keep = self.kept_as_base(depth)
        items = tqdm(tensors.items(), desc=desc, unit="tensor", disable=desc is None or not self.options.progress)
        for key, tensor in items:
            out.add(key, tensor, refs.get(key), codecs[key], keep=keep[codecs[key].lossless])

    def codecs_for(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, DeltaCodec]:
        """The delta codec of each tensor under this store's codec policy."""
        return {key: self.options.policy.for_tensor(key, fmt.dtype_name(t.dtype), t.numel()) for key, t in tensors.items()}

    def tensor_bases(self, bases: dict[str, int], codecs: dict[str, DeltaCodec],
                     cache: BaseCache | None = None) -> dict[str, Base | None]:
        """Each tensor's base: the step its codec's parent rule picked in ``bases``
        (:meth:`History.base_steps`; lossless and lossy tensors may differ under ``"auto"``)."""
        keys: dict[int, list[str]] = {}
        for key, codec in codecs.items():
            base = bases.get(parent_policy(self.options.base_policy, codec.lossless))
            if base is not None:
                keys.setdefault(base, []).append(key)
        refs: dict[str, Base | None] = {}
        for base, some in keys.items():
            refs.update(self.bases_for(sync(self.history.manifest(base)), some, cache))
        return refs

    def step_writer(self, group: str, pack_name: str = fmt.PACK_PREFIX, **kwargs: Any) -> StepWriter:
        """A writer of tensors into the attempt group ``group`` with this store's options."""
        return StepWriter(functools.partial(self.backend.put_object, durable=self.options.durable), group,
                          self.options, pack_name=pack_name, **kwargs)

    async def open_group(self, group: str, step: int) -> None:
        """Create the attempt group before its data, stamped with its start time, so retention
        can tell a save in progress from the remains of a crashed one (``grace_seconds``)."""
        await self.backend.put_object(f"{group}/zarr.json", [json_bytes(fmt.step_group_metadata(step, time.time(), {}))])

    async def seal(self, group: str, step: int, written: Written) -> float:
        """Write the group's zarr.json (with the consolidated metadata of its arrays), then make
        every object of the group durable; returns the creation time recorded. After this, only
        the commit is left."""
        created = time.time()
        key = f"{group}/zarr.json"
        await self.backend.put_object(key, [json_bytes(fmt.step_group_metadata(step, created, written.arrays))])
        if self.options.durable:
            await self.backend.make_durable(written.keys + [key])
        return created

    def bases_for(self, base: Manifest, keys: list[str], cache: BaseCache | None = None) -> dict[str, Base | None]:
        """The value of each of ``keys`` at step ``base`` as host bits, with the entry holding
        its data (``None``: not in that step); from ``cache`` (default: this store's) when it
        holds that step, else read now, all in one pass."""
        cache = cache or self.bases
        return sync(self._bases_for(base, keys, cache))

    async def _bases_for(self, base: Manifest, keys: list[str], cache: BaseCache) -> dict[str, Base | None]:
        refs: dict[str, Base | None] = {}
        missing: list[tuple[str, int, TensorEntry]] = []
        for key in keys:  # (one task per tensor only for the bits to read: thousands of tasks cost ms)
            found = await self.history.holder(base.step, key)
            bits = None if found is None else cache.get(base.step, key)
            if found is not None and bits is None:  # another process wrote the base, or this store was just opened
                missing.append((key, *found))
            else:
                refs[key] = None if found is None else Base(*found, bits)
        session = ReadSession()

        async def read(key: str, holder: int, entry: TensorEntry) -> Base:
            raw = await self.reader.read(holder, key, session=session)
            return Base(holder, entry, fmt.to_bits(fmt.numpy_to_tensor(raw, entry.dtype)))

        refs.update(zip([key for key, _, _ in missing], await gather(read(*m) for m in missing)))
        return refs

    def materialized(self, step: int, key: str) -> torch.Tensor:
        """The whole tensor ``key`` of ``step``, read now."""
        e = sync(self.history.manifest(step)).tensors[key]
        return fmt.numpy_to_tensor(sync(self.reader.read(step, key)), e.dtype)
