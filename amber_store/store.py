"""The :class:`Store` a training job talks to: a thin facade over the history of commits
(:mod:`amber_store.history`), the writer of steps (:mod:`amber_store.writer`) and the reader
(:mod:`amber_store.reader`).

A save encodes every tensor against its base step, writes a few objects into a fresh attempt
group (one pack of small tensors, one shard per large tensor, the group's consolidated
metadata), makes them durable, and then creates the step's manifest under ``commits/`` with an
exclusive create: that single object is the commit point, so an interrupted save leaves no
visible step and never touches committed data.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from tqdm.auto import tqdm

from . import format as fmt
from . import shards, validation
from .errors import (AmberError, CorruptDataError, InvalidURIError, StateMismatchError,
                     StepNotFoundError, StepOrderError, StorageAccessError, warn)
from .format import Manifest
from .history import History
from .background import Background
from .lazy import LazyStateDict, LazyTensor, destinations, materialize
from .reader import Reader, ReadSession
from .runtime import gather, interruptible, return_free_memory, sync
from .snapshot import Snapshots
from .storage import Backend, connect, is_storage_error, storage_errors
from .options import Options
from .usage import GRACE_SECONDS, Usage
from .writer import Writer

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore

    from . import retention
    from .retention import GCReport

Mode = Literal["r", "a", "w"]
#: save_async warns (once) when back-pressure has held training up for more than this share of
#: its time since the first two saves finished, and for longer than BACKPRESSURE_WARN_SECONDS in all:
#: a wait that matters against the step time, not a first save's warm-up
BACKPRESSURE_WARN_SHARE = 0.1
BACKPRESSURE_WARN_SECONDS = 3.0


@dataclass(frozen=True)
class CommitInfo:
    """What one committed save wrote."""

    step: int
    kind: Literal["full", "delta"]
    base: int | None
    nbytes_raw: int
    nbytes_stored: int
    seconds: float

    @property
    def ratio(self) -> float:
        """Raw tensor bytes per stored byte (higher is smaller)."""
        return self.nbytes_raw / max(1, self.nbytes_stored)


class Store:
    """A checkpoint store rooted at one URI. Create it with :func:`amber_store.open`.

    ``options`` are those of :class:`~amber_store.options.Options` (``full_every``,
    ``base_policy``, ``codec``, ``save_timeout``, ...), checked here; :attr:`options` holds them.
    """

    def __init__(self, backend: Backend, *, mode: Mode = "a", **options: Any) -> None:
        self.options = Options(**options)
        self.mode: Mode = mode
        self.history = History(backend)
        self.reader = Reader(self.history, verify=self.options.verify_checksums)
        self.writer = Writer(self.history, self.reader, self.options)
        self._submitted: int | None = None
        self._background = Background(self.options.max_pending)
        self._warned_backpressure = False
        self._waits = (0.0, 0.0)  # (when the clock started, seconds held up since)
        self._saves_async = 0
        self._snapshots = Snapshots(self.options.snapshot)
        self._walked = fmt.FlattenMemo()  # the last state saved, as flatten found it
        self._saving = threading.Lock()  # one save at a time: its checks against the history assume so
        with storage_errors(self.history.uri, "opening the store"):
            self.writer.root_version = sync(self.history.initialize(mode, exclusive_commits=not self.options.single_writer))
        if mode != "r" and _first_rank():  # (one rank of a job says it, and pays for the listing)
            self._warn_of_strays()

    # --- opening ------------------------------------------------------------------------

    def _warn_of_strays(self) -> None:
        """Say once, at a writable open, what dead saves or gc runs left (gc would delete it)."""
        strays = [a for a in sync(Usage(self.history).stray_attempts()) if not a.maybe_saving]
        if strays:
            steps = sorted({a.step for a in strays})
            shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
            cli = self.uri if self.history.backend.reopens else "URI"
            warn(f"{self.uri}: {len(strays)} attempt(s) no committed step uses (step(s) {shown}) still hold data, "
                 f"left by saves or gc runs that died midway; `store.gc()` or `amber-store gc {cli}` deletes them "
                 f"(`amber-store du {cli}` says how much)")

    @property
    def uri(self) -> str:
        return self.history.uri

    @property
    def exists(self) -> bool:
        """Whether a store is there: opened writable on an empty location, nothing is created
        until the first save."""
        return self.writer.root_version is not None

    @property
    def verify_checksums(self) -> bool:
        return self.reader.verify

    def __repr__(self) -> str:
        return f"amber_store.Store({self.uri!r}, mode={self.mode!r})"

    def close(self) -> None:
        """Wait for pending async saves (and a save of another thread), then drop cached state
        and close the storage client's connections. Raises the failure of a pending save,
        after closing."""
        try:
            self._background.wait()
        finally:
            self._background.close()
            with self._saving:
                self._release()

    def _release(self) -> None:
        self.writer.bases.clear()
        self._snapshots.clear()
        self.history.close()
        return_free_memory()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- listing ------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending. Uncommitted (crashed or in-progress) saves never appear."""
        return sync(self.history.steps())

    def latest(self) -> int | None:
        """The newest committed step, or ``None`` for an empty store."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> Manifest:
        """The committed manifest of ``step`` (raises :class:`StepNotFoundError`)."""
        return sync(self.history.manifest(step))

    def info(self, step: int) -> dict[str, Any]:
        """Kind, base, chain and per-tensor bytes of a committed step, as plain data."""
        return sync(Usage(self.history).info(step))

    # --- saving -------------------------------------------------------------------------

    def save(self, step: int, state_dict: Any, *, full: bool | None = None,
             metrics: Mapping[str, float] | None = None) -> CommitInfo:
        """Save ``state_dict`` as ``step`` and commit it; deltas are encoded on the tensors'
        device.

        ``full=True`` forces a full step, ``full=False`` a delta (when a base exists), ``None``
        follows ``full_every``. ``metrics`` (name -> number, e.g. ``{"loss": 2.31}``) are kept in
        the manifest, for retention by metric (``gc(policy=retention.BestN(...))``). Raises
        :class:`StepOrderError` unless ``step`` is newer than every committed step. On any error
        nothing becomes visible. Waits for pending :meth:`save_async` calls first. Threads
        saving through one store take turns.
        """
        self._require_writable()
        self.wait()
        t0 = time.perf_counter()
        _check_step(step)
        tree, tensors = fmt.flatten(state_dict, self._walked)
        return self._save_now(step, tree, tensors, full, t0, check_metrics(metrics))

    def save_async(self, step: int, state_dict: Any, *, full: bool | None = None,
                   metrics: Mapping[str, float] | None = None,
                   after: Callable[[CommitInfo], None] | None = None) -> Future[CommitInfo]:
        """Snapshot ``state_dict`` and save it in the background; returns once the snapshot is
        taken, so training may update its tensors right away.

        The snapshot is a copy into reused buffers (``snapshot="host"``: pinned host memory for
        accelerator tensors; ``"device"``: on the tensors' device); encoding, compression,
        writes and the commit run on a background thread, one save after the other. At most
        ``max_pending`` saves are unfinished: beyond that this call waits (back-pressure), so
        host memory stays bounded at ``max_pending`` snapshots plus ``max_inflight_bytes`` of
        encoded data, plus the bases of the next delta when ``base_cache="memory"`` (the
        default, ``"spill"``, keeps them in a local file). :meth:`close` gives the snapshot
        buffers back. A failure is set on the returned future and raised (as
        :class:`AsyncSaveError`) by the next call of ``save``, ``save_async`` or :meth:`wait`.
        ``after(info)``, if given, runs on the save thread once the step is committed and before
        the future completes (retention, notifications).
        """
        self._require_writable()
        self._background.raise_failure()
        t0 = time.perf_counter()
        _check_step(step)
        scores = check_metrics(metrics)
        if self._submitted is not None and step <= self._submitted:
            raise StepOrderError(f"{self.uri}: step {step} is not newer than the pending save of step {self._submitted}")
        waited = self._background.reserve()
        self._warn_if_held_up(step, waited, time.perf_counter())
        try:
            tree, snapshot = self._snapshots.take(lambda: fmt.flatten(state_dict, self._walked))
        except BaseException:
            self._background.release()
            raise
        self._submitted = step

        def work() -> CommitInfo:
            info = self._save_now(step, tree, snapshot, full, t0, scores)
            if after is not None:
                after(info)
            return info

        return self._background.submit(step, work, lambda: self._snapshots.give_back(snapshot))

    def _warn_if_held_up(self, step: int, waited: float, now: float) -> None:
        # The clock starts once the first two saves are done: waiting for them is warm-up (a
        # full step; the first delta's kernels loading, or compiling on a fresh install: 7 s),
        # not a checkpoint interval too short.
        self._saves_async += 1
        if self._saves_async <= 3:
            self._waits = (now, 0.0)
            return
        first, held = self._waits
        held += waited
        self._waits = (first, held)
        elapsed = now - first
        if self._warned_backpressure or held <= max(BACKPRESSURE_WARN_SECONDS, BACKPRESSURE_WARN_SHARE * elapsed):
            return
        self._warned_backpressure = True
        warn(f"{self.uri}: by step {step}, training has waited {held:.1f} s of {elapsed:.1f} s for checkpoints "
             f"to finish (max_pending={self._background.max_pending}): they take longer than the interval between "
             "them. Save less often, raise max_pending (one more snapshot of host memory each), or use faster "
             "storage. (Warned once per store.)")

    def wait(self) -> None:
        """Block until every :meth:`save_async` has committed; raise the first failure."""
        self._background.wait()

    def _save_now(self, step: int, tree: dict[str, Any], tensors: dict[str, torch.Tensor], full: bool | None,
                  t0: float, metrics: dict[str, float]) -> CommitInfo:
        """Check the step against the store as it is now, then write and commit it; threads
        saving through one store take turns here."""
        try:
            with self._saving:
                manifest = interruptible(self.writer.save(step, tree, tensors, full, t0, metrics))
        except Exception as e:
            if isinstance(e, AmberError) or not is_storage_error(e):
                raise
            raise StorageAccessError(
                f"{self.uri}: saving step {step} failed, the step is not committed and earlier steps "
                f"are untouched ({type(e).__name__}: {e})"
            ) from e
        return CommitInfo(step, manifest.kind, manifest.base, manifest.nbytes_raw, manifest.nbytes_stored,
                          time.perf_counter() - t0)

    # --- lifecycle ----------------------------------------------------------------------

    def gc(self, keep_last: int | None = None, keep_every: int | None = None, *,
           policy: retention.Retention | None = None, dry_run: bool = False,
           grace_seconds: float = GRACE_SECONDS) -> GCReport:
        """Delete steps outside the retention policy without breaking any kept step.

        Keeps the last ``keep_last`` steps (``None``: all), every step divisible by
        ``keep_every``, the steps ``policy`` preserves (e.g. ``retention.BestN(3, "loss")`` over
        the ``metrics`` saved with each step; any of these), every pinned step and the latest.
        Kept steps that depend on deleted ones are folded first, so they still materialize
        bit-exactly. Also removes the data of crashed saves (of a step newer than the latest
        commit only once ``grace_seconds`` old: it may be a save in progress). Safe to
        interrupt; see :mod:`amber_store.retention`. Run it from the writing process, or while
        no other process saves or reads.
        """
        self._require_writable()
        from . import retention  # (the write side is imported when used: a load needs none of it)

        rules = retention.policy(keep_last, keep_every)
        if policy is not None:
            rules = policy if rules is None else retention.AnyOf(rules, policy)
        return interruptible(retention.gc(self.writer, rules, dry_run=dry_run, grace_seconds=grace_seconds))

    def delete(self, step: int, *, dry_run: bool = False) -> GCReport:
        """Remove one committed step. Steps that read its data are folded off it first (as
        :meth:`gc` does), so every other step still materializes bit-exactly; safe to
        interrupt. A pinned step is refused: unpin it first."""
        self._require_writable()
        self.wait()
        self.manifest(step)  # StepNotFoundError if it is not committed
        pinned = sorted(name for name, s in self.pins().items() if s == step)
        if pinned:
            raise AmberError(f"{self.uri}: step {step} is pinned ({', '.join(pinned)}); unpin it first")
        steps = self.steps()
        from . import retention

        report = interruptible(retention.remove(self.writer, [s for s in steps if s != step], steps, dry_run=dry_run))
        if not dry_run and self.history.last_commit == step:
            self.history.last_commit = None  # this writer's newest step is gone: it may go on
        return report

    def pin(self, step: int, name: str) -> None:
        """Keep ``step`` through every ``gc`` until ``unpin(name)``."""
        self._require_writable()
        sync(self.history.pin(step, name))

    def unpin(self, name: str) -> None:
        """Remove the pin ``name`` (raises :class:`PinNotFoundError` if there is none)."""
        self._require_writable()
        sync(self.history.unpin(name))

    def pins(self) -> dict[str, int]:
        """``{pin name: step}``."""
        return sync(self.history.pins())

    def export(self, step: int, path: str | os.PathLike[str], *, format: str | None = None,
               subtree: str | None = None) -> Any:
        """Write ``step`` as a safetensors or ``torch.save`` file (format from the suffix);
        see :func:`amber_store.export.export`."""
        from . import export as export_

        return export_.export(self.load(step), step, path, format=format, subtree=subtree)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def writing(self) -> Iterator[Writer]:
        """This store's writer, held by the calling thread alone once pending async saves have
        committed: for an adapter that writes a step through it rather than through
        :meth:`save` (:func:`amber_store.dcp.import_checkpoint`)."""
        self._require_writable()
        self.wait()
        with self._saving:
            yield self.writer

    def du(self) -> dict[str, Any]:
        """Stored bytes by step and by top-level group of the state (``model``, ``optim``, ...),
        and what the whole location occupies (``storage``: objects, bytes, allocated disk
        blocks; uncommitted leftovers and metadata included)."""
        return sync(Usage(self.history).du())

    def _require_writable(self) -> None:
        if self.mode == "r":
            raise PermissionError(f"{self.uri}: opened read-only (mode='r')")

    # --- verifying ----------------------------------------------------------------------

    def verify(self, step: int | None = None) -> dict[int, dict[str, str | None]]:
        """Read every chunk of one step (``None``: every committed step) and check checksums.

        Returns ``{step: {tensor key: None if intact else the error}}``; raises nothing for
        damaged data, so one bad tensor does not hide the state of the others.
        """
        steps = self.steps() if step is None else [step]
        report: dict[int, dict[str, str | None]] = {}
        for s in tqdm(steps, desc="verify", unit="step", disable=not self.options.progress):
            report[s] = sync(self._verify_step(self.manifest(s)))
        return report

    async def _verify_step(self, m: Manifest) -> dict[str, str | None]:
        session = ReadSession()

        async def one(key: str) -> str | None:
            try:
                await self.reader.read(m.step, key, session=session, check=True)
            except CorruptDataError as err:
                return str(err)
            return None

        errors = dict(zip(m.tensors, await gather(one(key) for key in m.tensors)))
        layout = shards.layout_of(m)
        if layout is None:
            return errors
        report: dict[str, str | None] = {}  # by the tensors and values the ranks saved
        for item, name in layout.names().items():
            error = errors.pop(item)
            if report.get(name) is None:
                report[name] = None if error is None else f"shard {item!r}: {error}"
        return {**report, **errors}

    # --- loading ------------------------------------------------------------------------

    def load(self, step: int | None = None, *, lazy: bool = True, device: torch.device | str | None = None,
             tree: dict[str, Any] | None = None, strict: bool = True, into: Any = None,
             allow_pickle: bool = False) -> Any:
        """Open a committed step (``None``: the latest).

        Lazy (default): a structure mirroring the saved state dict whose dicts are
        :class:`LazyStateDict` and whose tensors are :class:`LazyTensor`; nothing is read until a
        tensor or slice is used. A step saved through torch.distributed.checkpoint opens as the
        nested state its ranks saved: each sharded tensor one LazyTensor of its global shape (a
        slice reads only the shards it overlaps), its other values read now with
        ``weights_only=True`` (:class:`UnsafeValueError` for one that needs more, unless
        ``allow_pickle=True``: for a store trusted as its writer's code would be, since
        unpickling runs code; docs/SECURITY.md). ``lazy=False``: every tensor is read now (concurrently, each
        stored object once) and put on ``device``. ``tree``: a state tree of the step's form
        (:func:`amber_store.format.flatten`'s, as a framework's pointer file keeps one) naming
        tensors of the step, in place of the step's own tree;
        ``tree=amber_store.shards.items_tree(store.manifest(step))`` opens a sharded step as its
        stored items. ``strict=False`` (with ``lazy=False``): tensors whose stored data is
        damaged are left out, and a warning names them, instead of failing the whole load
        (``amber-store verify`` says which chunks).

        ``into`` (implies ``lazy=False``): a state tree of the step's form whose tensors are
        filled in place, as ``torch.distributed.checkpoint.load`` fills its state dict, e.g.
        ``store.load(step, into={"model": model.state_dict()})`` for a model built before the
        resume: its CPU tensors are decoded into directly (no new memory, no copy), others
        copied into; the result holds them. A tensor of another shape or dtype than the step's raises ValueError
        before anything is read (:func:`amber_store.lazy.destinations`). Strict: a tensor of
        ``into`` the step lacks, or one of the step (under the parts of the state ``into`` names)
        that ``into`` has no place for, raises :class:`StateMismatchError` naming them (its
        ``missing`` and ``unexpected``) before anything is read, so that a resume never silently
        restores nothing (a DDP model's ``module.`` prefix, say); ``strict=False`` loads the rest
        and warns, naming them.
        """
        if step is None:
            step = self.latest()
            if step is None:
                raise StepNotFoundError(f"{self.uri}: the store is empty (no committed step)")
        m = self.manifest(step)
        if tree is not None:  # (a pointer file's: untrusted as the store is)
            validation.check_tree(tree, set(m.tensors))
        layout = shards.layout_of(m) if tree is None else None
        values = {} if layout is None else sync(self._values(m, layout, allow_pickle))

        @functools.cache  # tied weights: one LazyTensor, so one tensor, for all their keys
        def leaf(key: str) -> Any:
            if layout is None:
                return LazyTensor(self.reader, step, key, m.tensors[key])
            if key in values:
                return values[key]
            t = layout.tensors[key]
            return LazyTensor.assembled(key, t.shape, t.dtype, [
                (offset, LazyTensor(self.reader, step, item, m.tensors[item])) for offset, item in t.shards])

        lazy_sd = fmt.unflatten(m.tree if tree is None else tree, leaf, LazyStateDict)
        if lazy and into is None:
            return lazy_sd
        dest = destinations(lazy_sd, into)
        if dest.missing or dest.unexpected:
            message = _mismatch(self.uri, step, dest.missing, dest.unexpected)
            if strict:
                raise StateMismatchError(f"{message}; nothing was read; strict=False loads the rest",
                                         missing=dest.missing, unexpected=dest.unexpected)
            warn(f"{message}; the rest was loaded")
        damaged: dict[str, str] | None = None if strict else {}
        state = materialize(lazy_sd, device, damaged=damaged, into=dest)
        if damaged:
            warn(f"{self.uri}: step {step}: left out {len(damaged)} damaged tensor(s): "
                 f"{', '.join(sorted(damaged))}; `amber-store verify` names their chunks")
        return state

    async def _values(self, m: Manifest, layout: shards.Layout, allow_pickle: bool) -> dict[str, Any]:
        """The Python values of a sharded step, read now (each stored object once)."""
        session = ReadSession()
        raws = await gather(self.reader.read(m.step, item, session=session) for item in layout.values.values())
        return {name: shards.value(raw, m.step, name, item, allow_pickle)
                for (name, item), raw in zip(layout.values.items(), raws)}


def _mismatch(uri: str, step: int, missing: list[str], unexpected: list[str]) -> str:
    """The message of a load into a state whose tensors do not match the step's, with a hint
    where one side's keys are the other's behind a prefix (a DDP model's ``module.``)."""
    def some(places: list[str]) -> str:
        return ", ".join(places[:5]) + (f" and {len(places) - 5} more" if len(places) > 5 else "")

    parts = []
    if missing:
        parts.append(f"into= has {len(missing)} tensor(s) the step lacks: {some(missing)}")
    if unexpected:
        parts.append(f"the step has {len(unexpected)} tensor(s) into= has no place for: {some(unexpected)}")
    hint = ""
    for prefix in ("module.", "_orig_mod."):
        for outer, inner, side in ((unexpected, missing, "the step's"), (missing, unexpected, "into='s")):
            if outer and {p.replace(prefix, "", 1) for p in outer} == set(inner):
                hint = (f" ({side} keys carry a {prefix!r} prefix the other's lack, as a DDP- or torch.compile-"
                        "wrapped model's state does: save and load the unwrapped model's state_dict, or strip the "
                        "prefix with torch.nn.modules.utils.consume_prefix_in_state_dict_if_present)")
    return f"{uri}: step {step} does not match the state given as into=: " + "; ".join(parts) + hint


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")


def check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    """Metrics as stored in a manifest: string names, finite numbers."""
    out = {}
    for name, value in (metrics or {}).items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"metrics map names to numbers, not {name!r}: {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} is {value}: a retention policy cannot rank it")
        out[name] = float(value)
    return out


def _first_rank() -> bool:
    """Whether this process is rank 0 of a torch.distributed job, or in none."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def open(
    uri: str | os.PathLike[str] | ZarrStore,
    storage_options: dict[str, Any] | None = None,
    mode: Mode = "a",
    **options: Any,
) -> Store:
    """Open (``"a"``: or create; ``"r"``: read only; ``"w"``: wipe and create) a checkpoint store.
    A store comes into being at its first save: a writable open of an empty location creates
    nothing there (:attr:`Store.exists` says whether a store is there), so a mistyped path
    leaves nothing behind; ``"r"`` refuses a location without a store
    (:class:`NotAnAmberStoreError`).

    ``uri`` is a local path, ``file://``, ``memory://name``, ``s3://bucket/prefix`` or any other
    fsspec URL; or a zarr :class:`~zarr.abc.store.Store` instance. ``storage_options`` go to the
    fsspec filesystem (e.g. ``{"endpoint_url": "http://127.0.0.1:9000", "key": ..., "secret": ...}``
    for MinIO). ``options`` are :class:`Store`'s keyword arguments.
    """
    if mode not in ("r", "a", "w"):
        raise ValueError(f"mode must be 'r', 'a' or 'w', not {mode!r}")
    try:
        backend = connect(uri, storage_options, read_only=mode == "r") if isinstance(uri, (str, os.PathLike)) \
            else _zarr_store_backend(uri)
        return Store(backend, mode=mode, **options)
    except AmberError as e:
        # the message says what is wrong; the frames of the sync machinery beneath it do not
        raise e.with_traceback(None)


def _zarr_store_backend(store: Any) -> Backend:
    """The backend of a zarr store object handed to :func:`open` (zarr imported only then)."""
    from zarr.abc.store import Store as ZarrStore

    from .storage.zarrstore import ZarrStoreBackend

    if not isinstance(store, ZarrStore):
        raise InvalidURIError(f"{store!r}: give a path, a URI or a zarr store, not a {type(store).__name__}")
    return ZarrStoreBackend(store)
