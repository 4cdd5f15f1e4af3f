"""Writing steps: the write side of a store, as :mod:`amber_store.reader` is its read side.

Every step is written by one transaction, whoever writes it (:meth:`Store.save`, the ranks of a
DCP save, gc's folds):

1. :meth:`Writer.plan`: check the step against the history (newer than the latest, this the
   only writer), pick its bases (:meth:`History.base_steps`) and create a fresh attempt group,
   stamped with its start time. The plan is data: a DCP coordinator sends it to every rank.
2. :meth:`Writer.write`: encode and write tensors into the group on a writer thread
   (:class:`~amber_store.stepwriter.StepWriter`), by a deadline; one call per rank.
3. :meth:`Writer.seal`: the group's consolidated metadata, then durability of every object.
4. :meth:`Writer.commit`: the manifest, created exclusively (a fold replaces its step's).

An attempt that fails before its commit (an error, a deadline, an interrupt) is deleted
(:meth:`Writer.abandon`) where it is known never to be committed and the storage answers; what
a killed process leaves is gc's, and :meth:`Usage.stray_attempts <amber_store.usage.Usage.stray_attempts>` reports it.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import threading
import time
import uuid
from contextlib import suppress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import crc32c
import torch
from tqdm.auto import tqdm

from . import format as fmt
from .bases import BaseCache, Keeper, Stored
from .codecs import DeltaCodec
from .errors import ConcurrentWriterError, StepOrderError, StorageAccessError
from .format import Manifest, TensorEntry
from .chains import PARENTS, next_segment, parent_policies, parent_policy, step_base
from .history import History, json_bytes
from .options import Options
from .reader import Reader, ReadSession
from .runtime import READ_AHEAD_BYTES, Budget, finish, gather, sync, writer_pool
from .stepwriter import Base, StepWriter, Written
from .storage import is_storage_error

#: save_timeout="auto": this many seconds, plus one per AUTO_TIMEOUT_RATE bytes of state.
AUTO_TIMEOUT_SECONDS = 300.0
AUTO_TIMEOUT_RATE = 20e6
#: how long a failed save may spend deleting its own attempt's data
DISCARD_TIMEOUT = 10.0
#: how long a save out of time waits for that delete before it reports (the storage is likely
#: not answering: the delete goes on, and what it leaves is gc's)
DEADLINE_DISCARD_WAIT = 1.0
_DISCARDING: set[asyncio.Future[None]] = set()


@dataclass(frozen=True)
class StepPlan:
    """One step's transaction, decided before any data is written."""

    step: int
    #: the attempt group its data goes to (``steps/<step>-<attempt>``)
    group: str
    #: the newest committed step when planned: the commit refuses a step committed since
    latest: int | None
    #: the steps it diffs against, by parent rule (:meth:`History.base_steps`); empty: full
    bases: dict[str, int]
    #: the steps of its segment since the last full step, this one last
    segment: list[int]

    @property
    def depth(self) -> int:
        return len(self.segment) - 1

    @property
    def attempt(self) -> str:
        return self.group.rsplit("-", 1)[1]


@dataclass(frozen=True)
class Deadline:
    """When a save must be done by (``save_timeout``): ``seconds`` from its start, due at ``at``
    (``time.monotonic()``); both ``None`` for a save without one."""

    seconds: float | None
    at: float | None

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def missed(self, what: str, where: str) -> StorageAccessError:
        """The error of a save (``what``) out of time, ``where`` it stopped."""
        return StorageAccessError(f"{what} did not finish within save_timeout={self.seconds:.0f} s, {where}; the "
                                  "step is not committed and earlier steps are untouched")


class Writer:
    """Saves steps into one store with its :class:`~amber_store.options.Options`, keeping in
    memory the values later deltas diff against (:attr:`bases`)."""

    def __init__(self, history: History, reader: Reader, options: Options) -> None:
        self.backend = history.backend
        self.history = history
        self.chains = reader.chains
        self.reader = reader
        self.options = options
        self.bases = BaseCache(options.base_cache, options.spill_dir)
        #: the format version the store's root names (a commit of this version updates it;
        #: ``None``: no store yet, the first save creates it)
        self.root_version: int | None = None

    def deadline(self, nbytes: int) -> Deadline:
        """The deadline of a save of ``nbytes`` of tensors starting now (``save_timeout``)."""
        seconds = self.options.save_timeout
        if seconds == "auto":
            seconds = AUTO_TIMEOUT_SECONDS + nbytes / AUTO_TIMEOUT_RATE
        return Deadline(seconds, None if seconds is None else time.monotonic() + seconds)

    # --- the transaction ------------------------------------------------------------------

    async def plan(self, step: int, full: bool | None = None, doing: list[str] | None = None) -> StepPlan:
        """Check ``step`` against the history and open its attempt group (``full``: force a
        full step, or a delta; ``None``: ``full_every`` decides). Each stage reached is
        appended to ``doing``."""
        doing = [] if doing is None else doing
        history = self.history
        if self.root_version is None:  # the store's first save: it comes into being now
            doing.append("creating the store")
            self.root_version = await history.create(exclusive_commits=not self.options.single_writer)
        unsettled = history.unsettled
        if unsettled is not None:  # the last commit's answer never came: learn its outcome first
            doing.append(f"settling the commit of step {unsettled.step}")
            if not await history.settle():
                await self.discard(unsettled.group)  # another writer's manifest holds its key
        doing.append("listing the steps")
        steps = await history.steps()
        latest = steps[-1] if steps else None
        doing.append("checking for other writers")
        await history.check_sole_writer(latest)
        if latest is not None and step <= latest:
            raise StepOrderError(f"{history.uri}: step {step} is not newer than the latest committed step {latest}")
        doing.append("reading the manifests of its bases")
        prev = await history.index(latest) if latest is not None else None
        bases = await self.chains.base_steps(prev, self.options.base_policy, self.options.full_every, full, steps)
        plan = StepPlan(step, fmt.step_group(step, uuid.uuid4().hex[:8]), latest, bases, next_segment(prev, bases, step))
        doing.append("creating its group")
        await self.open_group(plan)
        return plan

    async def fold_plan(self, manifest: Manifest) -> StepPlan:
        """A new attempt group for the committed step of ``manifest``, whose tensors a fold
        rewrites (its manifest is then replaced, not created)."""
        plan = StepPlan(manifest.step, fmt.step_group(manifest.step, uuid.uuid4().hex[:8]), None, {},
                        list(manifest.segment))
        await self.open_group(plan)
        return plan

    def write(self, plan: StepPlan, fill: Callable[[StepWriter], None], *, pack_name: str = fmt.PACK_PREFIX,
              keeper: Keeper | None = None, deadline: float | None = None,
              stop: threading.Event | None = None) -> Written:
        """Encode and write tensors into the plan's group: ``fill(out)`` adds them to a step
        writer (:meth:`add_tensors`, or a fold's own), which writes them as they are encoded
        and gives up at ``deadline`` (``time.monotonic()``) or once ``stop`` is set. Runs on the calling thread (a
        writer thread: the event loop must stay free for the writes). An attempt that fails
        here is never committed: the objects this call wrote are deleted (those of a DCP save's
        other ranks are not), but after a storage failure (see :meth:`abandon`). ``keeper``
        keeps the tensors' values as later saves' bases (``None``: none are kept)."""
        out = StepWriter(functools.partial(self.backend.put_object, durable=self.options.durable), plan.group,
                         self.options, pack_name=pack_name, keeper=keeper, deadline=deadline, stop=stop,
                         put_holds_copy=self.backend.put_holds_copy)
        try:
            fill(out)
            written = out.finish()
        except BaseException as e:
            out.close()  # writes in flight settle first (or are cancelled, past the deadline)
            if _dead(e):
                sync(self.delete_objects(out.keys))
            raise
        out.close()
        return written

    async def seal(self, plan: StepPlan, written: Written, consolidated: bool = True) -> float:
        """Write the group's zarr.json (with the consolidated metadata of its arrays, unless the
        ranks of a sharded step wrote each array's own: :meth:`seal_rank`), then make every
        object of the group durable; returns the creation time recorded. After this, only the
        commit is left."""
        created = time.time()
        key = f"{plan.group}/zarr.json"
        arrays = written.arrays if consolidated else None
        await self.backend.put_object(key, [json_bytes(fmt.step_group_metadata(plan.step, created, arrays))])
        if self.options.durable:
            await self.backend.make_durable(written.keys + [key])
        return created

    async def seal_rank(self, plan: StepPlan, written: Written, rank: int) -> dict[str, Any]:
        """One rank's part of sealing a sharded step: its arrays' zarr.json, its fragment (the
        records of the items it wrote: :mod:`amber_store.format.fragments`), then durability of
        all it wrote. Returns the fragment's record for the index."""
        data = fmt.fragments.encode(written.entries, written.packs)
        key = fmt.fragments.key(plan.group, rank)
        metadata = {f"{plan.group}/{name}/zarr.json": meta for name, meta in written.arrays.items()}
        await gather(self.backend.put_object(k, [json_bytes(meta)]) for k, meta in metadata.items())
        await self.backend.put_object(key, [data])
        if self.options.durable:
            await self.backend.make_durable(written.keys + list(metadata) + [key])
        return {"key": key, "crc32c": crc32c.crc32c(data), "nbytes": len(data), "items": len(written.entries)}

    async def commit(self, plan: StepPlan, written: Written, tree: dict[str, Any], created: float, seconds: float,
                     extra: dict[str, Any], fragments: list[dict[str, Any] | None] | None = None) -> Manifest:
        """Create the step's manifest, the commit point, from what was written and sealed (a
        sharded step's: its index, naming the ranks' ``fragments``); returns it. Not bounded by the save's deadline: once sent, a commit's outcome must be
        learnt, not abandoned (a retried create that finds its own manifest is a success). A
        commit another writer beat is abandoned."""
        if self.root_version != fmt.FORMAT_VERSION:
            await self.history.write_root()  # an older store now holds steps of this version
            self.root_version = fmt.FORMAT_VERSION
        manifest = Manifest(
            step=plan.step,
            kind="delta" if plan.bases else "full",
            base=step_base(plan.bases, self.options.base_policy),
            depth=plan.depth,
            group=plan.group,
            tree=tree,
            tensors=written.entries,
            created=created,
            seconds=seconds,
            attempt=plan.attempt,
            writer=self.history.writer_id,
            packs=written.packs,
            segment=plan.segment,
            extra=extra,
            fragments=fragments,
        )
        try:
            await self.history.commit(manifest, plan.latest)
        except ConcurrentWriterError as e:
            await self.abandon(plan, e)
            raise
        return manifest

    async def abandon(self, plan: StepPlan, cause: BaseException) -> None:
        """Delete the data of an attempt known not to be committed at once, rather than at the
        next gc, where the storage still answers: after a bug, a refused or lost race, or a full
        disk (deleting frees space). After a network failure the attempt stays for gc."""
        if _dead(cause):
            await self.discard(plan.group)

    async def discard(self, group: str, wait: float | None = None) -> None:
        """Delete an attempt group that is never committed (best effort, bounded in time);
        with ``wait``, return after that many seconds while the delete goes on."""
        async def delete() -> None:
            with suppress(Exception):
                await asyncio.wait_for(self.backend.delete_dir(group), DISCARD_TIMEOUT)

        task = asyncio.ensure_future(delete())
        _DISCARDING.add(task)  # (a task nobody holds may be collected before it ends)
        task.add_done_callback(_DISCARDING.discard)
        await asyncio.wait({task}, timeout=wait)

    async def delete_objects(self, keys: list[str]) -> None:
        """Delete objects of an attempt that will not be committed (best effort, bounded)."""
        async def one(key: str) -> None:
            with suppress(Exception):
                await self.backend.delete(key)

        with suppress(Exception):
            await asyncio.wait_for(gather(one(k) for k in keys), DISCARD_TIMEOUT)

    async def open_group(self, plan: StepPlan) -> None:
        """Create the attempt group before its data, stamped with its start time, so retention
        can tell a save in progress from the remains of a crashed one (``grace_seconds``)."""
        try:
            await self.backend.put_object(f"{plan.group}/zarr.json",
                                          [json_bytes(fmt.step_group_metadata(plan.step, time.time(), {}))])
        except BaseException as e:  # interrupted as it is written: the caller has no plan to abandon yet
            await self.abandon(plan, e)
            raise

    # --- a save ---------------------------------------------------------------------------

    async def save(self, step: int, tree: dict[str, Any], tensors: dict[str, torch.Tensor], full: bool | None,
                   t0: float, metrics: dict[str, float]) -> Manifest:
        """Write ``tensors`` (the leaves of ``tree``) as ``step`` and commit it; everything but
        the commit within the save's timeout. Returns its manifest."""
        deadline = self.deadline(sum(t.nbytes for t in tensors.values()))
        doing: list[str] = []  # the stage reached, for the message of a save out of time
        planned: list[StepPlan] = []
        try:
            written, created = await asyncio.wait_for(self._stage(step, tensors, full, deadline.at, doing, planned),
                                                      deadline.seconds)
        except (asyncio.TimeoutError, TimeoutError) as e:
            if not deadline.passed():
                raise  # one request's own timeout
            if planned:  # if the storage answers at once, the attempt's data goes now
                await self.discard(planned[0].group, wait=DEADLINE_DISCARD_WAIT)
            raise deadline.missed(f"{self.history.uri}: saving step {step}",
                                  f"stopped while {doing[-1]} (is the storage answering?)") from e
        except BaseException as e:  # an error, or the caller interrupted (cancelled)
            if planned:
                await self.abandon(planned[0], e)
            raise
        plan = planned[0]

        async def commit() -> Manifest:
            manifest = await self.commit(plan, written, tree, created, time.perf_counter() - t0,
                                         {"metrics": metrics} if metrics else {})
            self.bases.put(step, written.values)
            self.bases.keep(self.live_bases(manifest))
            return manifest

        # Once begun, the commit runs to its end: a caller interrupted meanwhile finds the step
        # committed (a manifest may be landing; one left half-way would strand the attempt).
        return await finish(commit())

    async def _stage(self, step: int, tensors: dict[str, torch.Tensor], full: bool | None, deadline: float | None,
                     doing: list[str], planned: list[StepPlan]) -> tuple[Written, float]:
        """Plan, write and seal everything of the step but its commit (the plan goes into
        ``planned`` as soon as it exists); returns what was written and the creation time."""
        plan = await self.plan(step, full, doing)
        planned.append(plan)
        doing.append("waiting for a writer thread")

        def fill(out: StepWriter) -> None:
            doing.append("encoding and writing its data")
            self.add_tensors(out, tensors, plan, desc=f"save {step}")

        def stopped(error: BaseException) -> None:  # (e.g. writes unanswered at the deadline)
            doing.append(f"writing its data ({error})")

        written = await self.written(plan, fill, stopped, keeper=self.bases.keeper(), deadline=deadline)
        doing.append("sealing its group")
        return written, await self.seal(plan, written)

    async def written(self, plan: StepPlan, fill: Callable[[StepWriter], None],
                      stopped: Callable[[BaseException], None] | None = None, **options: Any) -> Written:
        """:meth:`write` (with ``options``) on a writer thread, the event loop free for its
        writes. Cancelled (out of time, or the caller interrupted), the thread stops at its next
        tensor and is waited for, so no write of the attempt outlives the call; ``stopped``
        hears the thread's own error then."""
        stop = threading.Event()
        job = asyncio.get_running_loop().run_in_executor(
            writer_pool(), functools.partial(self.write, plan, fill, stop=stop, **options))
        try:
            return await finish(job, stop=stop.set)
        except asyncio.CancelledError:
            error = None if job.cancelled() else job.exception()
            if error is not None and stopped is not None:
                stopped(error)
            raise

    # --- what a step's tensors diff against --------------------------------------------------

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

    def add_tensors(self, out: StepWriter, tensors: dict[str, torch.Tensor], plan: StepPlan,
                    cache: BaseCache | None = None, desc: str | None = None) -> None:
        """Add ``tensors`` of the step of ``plan`` to the step writer ``out``, each with its
        codec against its base (:meth:`tensor_bases`), keeping the values a later save may diff
        against (a tensor whose codec's parent rule never diffs against the step's position, a
        lossless one under ``"auto"`` in a delta step, keeps no copy: :meth:`kept_as_base`);
        ``desc`` labels a progress bar (``progress=True``)."""
        codecs = self.codecs_for(tensors)
        refs = self.tensor_bases(plan, codecs, cache)
        keep = self.kept_as_base(plan.depth)
        items = tqdm(tensors.items(), desc=desc, unit="tensor", disable=desc is None or not self.options.progress)
        for key, tensor in items:
            out.add(key, tensor, refs.get(key), codecs[key], keep=keep[codecs[key].lossless])

    def codecs_for(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, DeltaCodec]:
        """The delta codec of each tensor under this store's codec policy."""
        return {key: self.options.policy.for_tensor(key, fmt.dtype_name(t.dtype), t.numel()) for key, t in tensors.items()}

    def tensor_bases(self, plan: StepPlan, codecs: dict[str, DeltaCodec],
                     cache: BaseCache | None = None) -> dict[str, Base | None]:
        """Each tensor's base: the step its codec's parent rule picked in ``plan.bases``
        (:meth:`History.base_steps`; lossless and lossy tensors may differ under ``"auto"``),
        unless its delta no longer pays (:meth:`_unpaid`): then none, and it is stored full."""
        keys: dict[int, list[str]] = {}
        for key, codec in codecs.items():
            base = plan.bases.get(parent_policy(self.options.base_policy, codec.lossless))
            if base is not None:
                keys.setdefault(base, []).append(key)
        refs: dict[str, Base | None] = {}
        for base, some in keys.items():
            full = sync(self._unpaid(plan.latest, base, some))
            refs.update(sync(self.bases_for(sync(self.history.index(base)), [k for k in some if k not in full], cache)))
        return refs

    async def _unpaid(self, latest: int | None, base: int, keys: list[str]) -> set[str]:
        """Those of ``keys`` to store full rather than diff against ``base`` (``full_above``):
        in the latest step, their delta stored more than ``full_above`` of the full layer it
        was read with, or they were stored full there for that reason (their base is older).
        Packed tensors are always diffed: their pack is one object, read whole either way."""
        share = self.options.full_above
        if share is None or latest is None:
            return set()
        full = set()
        for key in keys:
            e, found = await self.history.entry(latest, key), await self.chains.holder(base, key)
            if e is None or found is None or e.encoding == "same":
                continue
            if e.encoding == "full":
                unpaid = found[0] < latest
            else:
                _, layer = (await self.chains.chain(latest, key))[0]
                # (a packed tensor's stored bytes are its share of the pack's, not its own)
                unpaid = (layer.encoding == "full" and e.pack is None and layer.pack is None and layer.stored > 0
                          and e.stored > share * layer.stored)
            if unpaid:
                full.add(key)
        return full

    async def bases_for(self, base: Manifest, keys: list[str], cache: BaseCache | None = None) -> dict[str, Base | None]:
        """The value of each of ``keys`` at step ``base`` as host bits, with the entry holding
        its data (``None``: not in that step); from ``cache`` (default: this store's) when it
        holds that step, else read now, all in one pass."""
        cache = cache or self.bases
        refs: dict[str, Base | None] = {}
        missing: list[tuple[str, int, TensorEntry]] = []
        for key in keys:  # (one task per tensor only for the bits to read: thousands of tasks cost ms)
            found = await self.chains.holder(base.step, key)
            bits = None if found is None else cache.get(base.step, key)
            if found is not None and bits is None:  # another process wrote the base, or this store was just opened
                missing.append((key, *found))
            else:
                refs[key] = None if found is None else Base(*found, bits)
        read = functools.partial(self.base_bits, session=ReadSession())
        keeper = cache.keeper()
        if keeper is None:  # nothing kept: each base is read as the save reaches its tensor
            for key, holder, entry in missing:
                like = fmt.to_bits(torch.empty(0, dtype=fmt.DTYPES[entry.dtype]))
                refs[key] = Base(holder, entry, Stored(entry, tuple(entry.shape), like.dtype,
                                                       lambda h=holder, k=key, e=entry: sync(read(h, k, e))))
            return refs
        # read all at once, each kept as the cache keeps values; spilled ones as many at a time as
        # READ_AHEAD_BYTES holds (before, two: a round trip each pair), so that they never are all
        # in memory
        budget = Budget(READ_AHEAD_BYTES if keeper.spills else sum(e.nbytes for *_, e in missing))

        async def kept(key: str, holder: int, entry: TensorEntry) -> Base:
            async with budget.hold(entry.nbytes):
                bits = await read(holder, key, entry)
                return Base(holder, entry, await asyncio.to_thread(keeper.hold, key, bits))  # (a spill writes)

        refs.update(zip([key for key, _, _ in missing], await gather(kept(*m) for m in missing)))
        return refs

    async def base_bits(self, holder: int, key: str, entry: TensorEntry,
                        session: ReadSession | None = None) -> torch.Tensor:
        """The host bits of ``key`` at step ``holder``, whose ``entry`` stores it."""
        return fmt.to_bits(fmt.numpy_to_tensor(await self.reader.read(holder, key, session=session), entry.dtype))

    async def materialized(self, step: int, key: str) -> torch.Tensor:
        """The whole tensor ``key`` of ``step``."""
        e = await self.history.entry(step, key)
        assert e is not None, key
        return fmt.numpy_to_tensor(await self.reader.read(step, key), e.dtype)


def _dead(cause: BaseException) -> bool:
    """Whether an attempt that failed with ``cause`` is to be deleted at once: after a bug, a
    refused or lost race, an interrupt or a full disk (deleting frees space), but not after a
    storage failure, which a delete would likely meet too (the attempt then waits for gc)."""
    return not is_storage_error(cause) or getattr(cause, "errno", None) == errno.ENOSPC
