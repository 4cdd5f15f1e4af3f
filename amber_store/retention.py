"""Retention and garbage collection that never breaks a delta chain.

``gc`` keeps the last N steps, every K-th step and the pinned ones (``Store.delete`` keeps all
but one), and deletes the rest in phases, each safe to interrupt:

1. **Drop what no fold reads**: steps to delete that no kept step's chain passes through are
   uncommitted (each once no other of them still committed reads it: newest first along each
   chain, chains side by side) and their objects swept, so a full disk gets space back before
   anything is written.
2. **Fold**: every kept step with a tensor whose chain passes through a step to delete is
   rewritten, oldest first (the tensors of one step read ahead while others are encoded): that
   tensor is re-encoded as a delta against the previous *kept*
   step (or full, when there is none), into a new attempt group, and the step's manifest is
   then replaced atomically. Its materialized bits do not change. A fold that fails (a full
   disk) deletes its own group and stops gc with a message naming the step.
3. **Uncommit** the remaining steps to delete, as in 1: no kept step reads them now, and a
   deleted step not yet uncommitted still has all of its bases.
4. **Sweep**: every object under ``steps/`` that no remaining manifest references is deleted,
   including the data of crashed saves, except attempt groups of steps newer than the latest
   commit that are younger than ``grace_seconds`` (a save may be writing them right now).

Interrupted anywhere, every kept step still loads, and running ``gc`` again finishes the job."""

from __future__ import annotations

import dataclasses
import errno
import time
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

import torch

from . import format as fmt
from .format import Manifest
from .errors import StorageAccessError
from .bases import Resident
from .chains import Chains
from .history import GROUP_NAME, History
from .usage import GRACE_SECONDS, Usage
from .runtime import REQUESTS_AT_ONCE, ahead, gather
from .stepwriter import Base
from .storage import storage_errors

if TYPE_CHECKING:
    from .stepwriter import StepWriter
    from .writer import Writer


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
    #: attempt groups left alone: of a step newer than the latest commit and younger than
    #: ``grace_seconds``, maybe a save in progress (a smaller grace removes them)
    spared: list[str] = field(default_factory=list)
    #: keys of uploads in parts begun at least ``grace_seconds`` ago and never completed, aborted
    uploads: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- policies: which steps to keep, apart from the mechanism that deletes --------------------

@dataclass(frozen=True)
class StepInfo:
    """What a retention policy sees of a committed step."""

    step: int
    metrics: Mapping[str, float]
    pinned: bool


class Retention(Protocol):
    """A retention policy: for committed steps (ascending), whether to keep each."""

    def should_preserve(self, infos: Sequence[StepInfo]) -> list[bool]: ...


@dataclass(frozen=True)
class LatestN:
    """The newest ``n`` steps."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("keep_last must be >= 1: the latest step is always kept")

    def should_preserve(self, infos: Sequence[StepInfo]) -> list[bool]:
        return [i >= len(infos) - self.n for i in range(len(infos))]


@dataclass(frozen=True)
class EveryNSteps:
    """Every step divisible by ``n``."""

    n: int

    def should_preserve(self, infos: Sequence[StepInfo]) -> list[bool]:
        return [info.step % self.n == 0 for info in infos]


@dataclass(frozen=True)
class BestN:
    """The ``n`` steps with the best ``metric`` (a name in the metrics saved with the step, or a
    function of them); ``mode="min"`` (loss) or ``"max"`` (accuracy). Steps saved without it
    are not candidates; on a tie the older step wins."""

    n: int
    metric: str | Callable[[Mapping[str, float]], float]
    mode: Literal["min", "max"] = "min"

    def should_preserve(self, infos: Sequence[StepInfo]) -> list[bool]:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {self.mode!r}")
        scored = []
        for i, info in enumerate(infos):
            if callable(self.metric):
                score = self.metric(info.metrics)
            elif self.metric in info.metrics:
                score = info.metrics[self.metric]
            else:
                continue
            scored.append((score if self.mode == "min" else -score, i))
        best = {i for _, i in sorted(scored)[: self.n]}
        return [i in best for i in range(len(infos))]


@dataclass(frozen=True)
class Pinned:
    """Every pinned step."""

    def should_preserve(self, infos: Sequence[StepInfo]) -> list[bool]:
        return [info.pinned for info in infos]


class AnyOf:
    """Keep a step if any of the policies keeps it."""

    def __init__(self, *policies: Retention) -> None:
        self.policies = policies

    def should_preserve(self, infos: Sequence[StepInfo]) -> list[bool]:
        votes = [p.should_preserve(infos) for p in self.policies]
        return [any(v) for v in zip(*votes)] if votes else [False] * len(infos)


def policy(keep_last: int | None, keep_every: int | None) -> Retention | None:
    """``gc(keep_last, keep_every)`` as a policy; ``None`` (keep every step) without keep_last."""
    if keep_last is None:
        return None
    return AnyOf(LatestN(keep_last), *([EveryNSteps(keep_every)] if keep_every else []))


async def select(history: History, retention: Retention | None, steps: list[int]) -> list[int]:
    """The steps to keep: those ``retention`` preserves, every pinned step, and the latest."""
    if retention is None:
        return list(steps)

    async def metrics(step: int) -> dict[str, Any]:  # (only these kept: every step is read)
        return (await history.manifest(step)).extra.get("metrics", {})

    pins, metrics_of = await gather([history.pins(), gather((metrics(s) for s in steps), limit=REQUESTS_AT_ONCE)])
    pinned = set(pins.values())
    infos = [StepInfo(s, m, s in pinned) for s, m in zip(steps, metrics_of)]
    keep = AnyOf(retention, Pinned(), LatestN(1)).should_preserve(infos)
    return [s for s, k in zip(steps, keep) if k]


async def _manifests(history: History, steps: Sequence[int]) -> list[Manifest]:
    """The manifests of ``steps``, :data:`~amber_store.runtime.REQUESTS_AT_ONCE` read at a time
    (on an object store a round trip each, which one after another added up to seconds)."""
    return await gather((history.manifest(s) for s in steps), limit=REQUESTS_AT_ONCE)


async def _deleted_deps(chains: Chains, step: int, deleted: set[int]) -> set[int]:
    """The deleted steps whose data ``step`` reads (it needs a fold if any)."""
    m = await chains.history.manifest(step)
    out: set[int] = set()
    for key in m.tensors:
        out |= deleted & set(await chains.dependencies(step, key))
    return out


async def gc(writer: Writer, retention: Retention | None, *, dry_run: bool = False,
             grace_seconds: float = GRACE_SECONDS) -> GCReport:
    steps = await writer.history.steps()
    return await remove(writer, await select(writer.history, retention, steps), steps, dry_run=dry_run,
                        grace_seconds=grace_seconds)


async def remove(writer: Writer, keep: list[int], steps: list[int], *, dry_run: bool = False,
                 grace_seconds: float = GRACE_SECONDS) -> GCReport:
    """Delete every step of ``steps`` not in ``keep``, folding kept steps off them first, then
    sweep unreferenced objects."""
    t0 = time.perf_counter()
    history = writer.history
    deleted = sorted(set(steps) - set(keep))
    manifests = await _manifests(history, keep)
    needed = dict(zip(keep, await gather((_deleted_deps(writer.chains, k, set(deleted)) for k in keep),
                                         limit=REQUESTS_AT_ONCE)))
    folds = {k: _to_fold(m, set(deleted)) for k, m in zip(keep, manifests)}
    rewrite = [k for k in keep if folds[k]]
    report = GCReport(keep, deleted, rewrite, dry_run)
    if dry_run:  # what the sweep will find once the folds have replaced their steps' entries
        kept = [_without(m, folds[k]) for k, m in zip(keep, manifests)]
        report.orphans, report.spared = await _unreferenced(history, kept, steps, grace_seconds)
        report.orphans = sorted(report.orphans + await history.spent_claims())
        report.objects_removed = len(report.orphans)
        report.uploads = await _abort_uploads(history, grace_seconds, dry_run=True)
        report.seconds = time.perf_counter() - t0
        return report
    # First what no fold reads: on a full disk that frees space before anything is written.
    read_by_folds = set().union(*needed.values()) if needed else set()
    await _drop(report, writer.chains, [s for s in deleted if s not in read_by_folds], keep + sorted(read_by_folds),
                steps, grace_seconds)
    for step in rewrite:  # oldest first: a fold only ever diffs against already-safe steps
        try:
            report.bytes_written += await _fold(writer, step, [k for k in keep if k < step], set(deleted))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise StorageAccessError(
                f"{history.uri}: gc is out of space folding step {step} off deleted steps "
                f"{sorted(needed[step])}: it needs room for that step's rewritten tensors "
                f"({len(report.orphans)} objects were freed first); free some space, or keep the steps it "
                "depends on (a larger --keep-last) and run gc again") from e
    await _drop(report, writer.chains, sorted(read_by_folds), keep, steps, grace_seconds)
    claims = await history.spent_claims()
    await _delete_all(history, claims)
    report.orphans = sorted(report.orphans + claims)
    report.objects_removed += len(claims)
    report.uploads = await _abort_uploads(history, grace_seconds)
    report.seconds = time.perf_counter() - t0
    return report


async def _abort_uploads(history: History, grace_seconds: float, dry_run: bool = False) -> list[str]:
    """Abort the uploads in parts older than ``grace_seconds`` that never completed (a killed
    process's); their keys."""
    with storage_errors(history.uri, "aborting incomplete uploads"):
        stale = [u for u in await history.backend.incomplete_uploads() if time.time() - u.initiated >= grace_seconds]
        if not dry_run:
            await gather(history.backend.abort_upload(u) for u in stale)
    return sorted(u.key for u in stale)


async def _drop(report: GCReport, chains: Chains, steps: list[int], keep: list[int], all_steps: list[int],
                grace_seconds: float) -> None:
    """Uncommit ``steps`` (a step still committed never lacks its bases), then delete every
    object the steps in ``keep`` do not read."""
    history = chains.history
    await _uncommit(chains, steps)
    history.forget()
    garbage, report.spared = await _unreferenced(history, await _manifests(history, keep), all_steps, grace_seconds)
    await _delete_all(history, garbage)
    report.orphans += garbage
    report.objects_removed += len(garbage)


async def _uncommit(chains: Chains, steps: list[int]) -> None:
    """Uncommit ``steps``, each only once no step of them still committed reads it: in waves,
    each at once (on an object store a round trip per step, which one after another took most
    of the drop)."""
    reads = dict(zip(steps, await gather((chains.reads(s) for s in steps), limit=REQUESTS_AT_ONCE)))
    left = set(steps)
    while left:
        read = set().union(*(reads[s] if reads[s] is not None else {o for o in left if o < s} for s in left))
        wave = [s for s in left if s not in read] or [max(left)]  # (a crafted store's circle: newest first)
        await gather((chains.history.uncommit(s) for s in wave), limit=REQUESTS_AT_ONCE)
        left -= set(wave)


def _to_fold(m: Manifest, deleted: set[int]) -> list[str]:
    """The tensors of ``m`` a gc deleting ``deleted`` rewrites: those whose base is deleted (a
    kept base is folded first, oldest first, so a chain through it is whole again)."""
    return [k for k, e in m.tensors.items() if e.base in deleted and e.encoding != "full"]


def _without(m: Manifest, keys: list[str]) -> Manifest:
    """``m`` as it references data once a fold has rewritten ``keys`` into a group of its own."""
    if not keys:
        return m
    entries = {k: e for k, e in m.tensors.items() if k not in keys}
    packs = {n: p for n, p in m.packs.items() if any(e.pack and e.pack[0] == n for e in entries.values())}
    return dataclasses.replace(m, tensors=entries, packs=packs)


async def _fold(writer: Writer, step: int, earlier_kept: list[int], deleted: set[int]) -> int:
    """Rewrite the tensors of ``step`` that depend on deleted steps; returns bytes written.

    Each becomes ``same`` as, or a delta against, the newest kept step of its segment through
    which its chain reads no more layers than it did (a save's own bound on chains, kept
    through any gc), else full: what a fresh full save of it costs. Chunking and packing stay
    as they were: later steps' deltas build on them.
    """
    history, chains = writer.history, writer.chains
    m = await history.manifest(step)
    todo = _to_fold(m, deleted)
    layers = {key: len(await chains.dependencies(step, key)) for key in todo}
    # A step of another segment would add a layer a save never reads (and keep it alive).
    candidates = {k: await history.manifest(k) for k in reversed(earlier_kept) if k in m.segment}
    by_base: dict[int, list[str]] = {}
    for key in todo:
        # the newest through which a delta keeps the bound, else one it may only equal
        through = {k: len(await chains.dependencies(k, key)) for k, c in candidates.items() if key in c.tensors}
        k = next((k for k in through if through[k] < layers[key]),
                 next((k for k in through if through[k] == layers[key]), None))
        if k is not None:
            by_base.setdefault(k, []).append(key)
    bases = {key: found for k, keys in by_base.items() for key in keys
             if (found := await chains.holder(k, key)) is not None}  # (the step holding its data, its entry)
    # a delta against a base of as many layers as the step read is one layer more: only if equal
    only_if_equal = {key for key, (holder, _) in bases.items()
                     if len(await chains.dependencies(holder, key)) == layers[key]}
    holders = {key: await chains.holder(step, key) for key in todo}

    async def read(key: str) -> tuple[torch.Tensor, Base | None]:
        """The value to rewrite and its new base, read side by side (a base this process
        keeps is not read again), held only while its tensor is encoded: not spilled, nor all
        at once."""
        if key not in bases:
            return await writer.materialized(step, key), None
        holder, entry = bases[key]
        kept = writer.bases.get(holder, key)
        if kept is not None:
            return await writer.materialized(step, key), Base(holder, entry, kept)
        value, bits = await gather([writer.materialized(step, key), writer.base_bits(holder, key, entry)])
        return value, Base(holder, entry, Resident(bits))

    def fill(out: StepWriter) -> None:
        for key, (value, ref) in ahead(todo, read, lambda key: 2 * m.tensors[key].nbytes):
            if key in only_if_equal and not torch.equal(fmt.to_bits(value), ref.bits.whole()):
                ref = None
            found = holders[key]
            out.add(key, value, ref, layout=None if found is None else found[1])

    plan = await writer.fold_plan(m)
    group = plan.group
    try:
        written = await writer.written(plan, fill)
        created = await writer.seal(plan, written)
    except BaseException:
        await writer.discard(group)  # never to be used: give its space back at once
        raise
    for e in written.entries.values():  # the fold's pack sits beside the step's own
        if e.pack is not None:
            e.pack = [f"{e.pack[0]}@{group}", *e.pack[1:]]
    entries = {**m.tensors, **written.entries}
    packs = {**m.packs, **{f"{n}@{group}": p for n, p in written.packs.items()}}
    packs = {n: p for n, p in packs.items() if any(e.pack and e.pack[0] == n for e in entries.values())}
    kind = "full" if all(e.encoding == "full" for e in entries.values()) else "delta"
    bases = [e.base for e in entries.values() if e.base is not None]
    folded = dataclasses.replace(
        m, tensors=entries, packs=packs, kind=kind, base=max(bases) if bases else None,
        format_version=fmt.FORMAT_VERSION, fragments=None,  # (its records, now all here)
        extra={**m.extra, "folded": {"group": group, "at": created, "from": sorted(deleted)}})
    await history.replace(folded)
    return sum(e.stored for e in written.entries.values())


def _referenced(manifests: list[Manifest]) -> tuple[set[str], set[str], set[str]]:
    """Arrays (and packs) the manifests point at, every directory above them, and the other
    objects they name (a DCP step's metadata, a sharded step's fragments)."""
    arrays = {e.array for m in manifests for e in m.tensors.values() if e.array}
    arrays |= {p["array"] for m in manifests for p in m.packs.values()}
    groups = {m.group for m in manifests} | {m.extra["folded"]["group"] for m in manifests if "folded" in m.extra}
    groups |= {a.rsplit("/", 1)[0] for a in arrays}
    dirs: set[str] = set()
    for a in arrays | groups:
        parts = a.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    objects = {m.extra["dcp"]["metadata"] for m in manifests if "metadata" in m.extra.get("dcp", {})}
    objects |= {f["key"] for m in manifests for f in m.fragments or () if f is not None}
    return arrays, dirs, objects


async def _unreferenced(history: History, manifests: list[Manifest], all_steps: list[int],
                        grace_seconds: float) -> tuple[list[str], list[str]]:
    """Keys under ``steps/`` that ``manifests`` (the kept steps') do not read, and the attempt
    groups spared as maybe still being written."""
    arrays, dirs, objects = _referenced(manifests)
    latest = all_steps[-1] if all_steps else -1
    spared: dict[str, bool] = {}
    garbage = []
    async for key in history.backend.list_prefix(f"{fmt.STEPS_DIR}/"):
        group = key.split("/")[1] if key.count("/") >= 1 else ""
        m = GROUP_NAME.fullmatch(group)
        if m is None:
            continue  # not ours
        if int(m.group(1)) > latest:
            if group not in spared:
                spared[group] = await Usage(history).maybe_in_progress(f"{fmt.STEPS_DIR}/{group}", grace_seconds)
            if spared[group]:
                continue
        if key.endswith("/zarr.json") and key[: -len("/zarr.json")] in dirs:
            continue
        if key in objects or _is_chunk_of(key, arrays):
            continue
        garbage.append(key)
    return sorted(garbage), sorted(f"{fmt.STEPS_DIR}/{g}" for g, young in spared.items() if young)


def _is_chunk_of(key: str, arrays: set[str]) -> bool:
    """Whether ``key`` is data of one of ``arrays``: its shard (``<array>/0.0``, format 3) or a
    chunk (``<array>/c/...``, or ``<array>/c`` for 0-d; formats 1-2)."""
    if key.rsplit("/", 1)[0] in arrays:
        return True
    i = key.find("/c")
    while i >= 0:
        rest = key[i + 2:]
        if (rest == "" or rest.startswith("/")) and key[:i] in arrays:
            return True
        i = key.find("/c", i + 1)
    return False


async def _delete_all(history: History, keys: list[str]) -> None:
    await gather((history.backend.delete(k) for k in keys), limit=REQUESTS_AT_ONCE)
