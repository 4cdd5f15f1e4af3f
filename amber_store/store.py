"""Save, load and commit: the :class:`Store` a training job talks to.

A save encodes every tensor against the base step (see :mod:`amber_store.pipeline`), writes all
array data into a fresh attempt group, and then writes the step's manifest under ``commits/``
with an exclusive create: that single object is the commit point, so an interrupted save leaves
no visible step and never touches committed data.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np
import torch
from tqdm.auto import tqdm
from zarr.abc.store import Store as ZarrStore
from zarr.core.array import AsyncArray
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import StorePath

from . import format as fmt
from . import export as export_
from . import retention
from .codecs import CodecPolicy, DeltaCodec, Policy
from .errors import (
    AmberError,
    ConcurrentWriterError,
    CorruptDataError,
    FormatVersionError,
    NotAnAmberStoreError,
    StepNotFoundError,
    StepOrderError,
    StorageAccessError,
)
from .format import Manifest, TensorEntry
from .lazy import LazyStateDict, LazyTensor, materialize
from .pipeline import AccountingStore, Background, Base, Snapshots, Writer, encode, json_buffer
from .retention import GCReport
from .uri import Location, probe, put_atomic, put_if_absent, resolve

Mode = Literal["r", "a", "w"]
BasePolicy = Literal["chain", "full"]


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

    Args:
        full_every: a delta step follows the previous one until ``full_every - 1`` deltas have
            been written since the last full step; the next save is then full. Larger values
            store less but make reads of late steps walk longer chains.
        base_policy: ``"chain"`` diffs each step against the previous step (smallest deltas,
            reads walk up to ``full_every`` arrays); ``"full"`` diffs every step against the
            last full step (reads touch two arrays; deltas grow as training drifts).
        chunk_bytes: target size of one chunk (one stored object before compression).
        compression_level: zstd level of every chunk.
        verify_checksums: check each materialized chunk's crc32c on read.
        progress: show a tqdm bar while saving and loading.
        codec: the delta codec of each tensor: ``"xor"`` (lossless, default), ``"sparse"``,
            ``"quant8"``, ``"quant4"``, a :class:`~amber_store.codecs.DeltaCodec`, or rules
            ``[(key pattern, codec), ...]`` such as ``[("optim/*", "sparse")]``; see
            :class:`~amber_store.codecs.Policy`. Full steps are always lossless.
        max_pending: how many :meth:`save_async` calls may be unfinished at once.
        snapshot: where :meth:`save_async` copies the state: ``"host"`` (pinned host buffers;
            deltas encoded on the host) or ``"device"`` (the tensors' device; deltas encoded
            there, one more copy of the state in device memory).
        write_concurrency, max_inflight_bytes: how many tensors of one step are written at
            once, and the bound on encoded bytes waiting to be written.
    """

    def __init__(
        self,
        location: Location,
        *,
        mode: Mode = "a",
        full_every: int = 10,
        base_policy: BasePolicy = "chain",
        chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
        compression_level: int = 1,
        verify_checksums: bool = True,
        progress: bool = False,
        write_concurrency: int = 64,
        max_inflight_bytes: int = 1 << 30,
        codec: CodecPolicy = "xor",
        max_pending: int = 1,
        snapshot: str = "host",
    ) -> None:
        if full_every < 1:
            raise ValueError("full_every must be >= 1")
        if base_policy not in ("chain", "full"):
            raise ValueError(f"base_policy must be 'chain' or 'full', not {base_policy!r}")
        self._loc = location
        self._zstore = AccountingStore(location.store)
        self.mode: Mode = mode
        self.full_every = full_every
        self.base_policy: BasePolicy = base_policy
        self.chunk_bytes = chunk_bytes
        self.compression_level = compression_level
        self.verify_checksums = verify_checksums
        self.progress = progress
        self._write_concurrency = write_concurrency
        self.policy = Policy(codec)
        self._max_inflight = max_inflight_bytes
        self._manifests: dict[int, Manifest] = {}
        self._arrays: dict[str, AsyncArray[Any]] = {}
        self._cache_step: int | None = None
        self._cache: dict[str, torch.Tensor] = {}
        self._writer = uuid.uuid4().hex[:12]
        self._last_commit: int | None = None
        self._submitted: int | None = None
        self._background = Background(max_pending)
        self._snapshots = Snapshots(snapshot)
        sync(self._init_root())

    # --- opening ------------------------------------------------------------------------

    @property
    def uri(self) -> str:
        return self._loc.uri

    def __repr__(self) -> str:
        return f"amber_store.Store({self.uri!r}, mode={self.mode!r})"

    async def _init_root(self) -> None:
        raw = await self._zstore.get("zarr.json", default_buffer_prototype())
        if raw is not None:
            attrs = json.loads(raw.to_bytes()).get("attributes", {}).get(fmt.ROOT_ATTR)
            if not isinstance(attrs, dict) or attrs.get("format") != fmt.FORMAT_NAME:
                raise NotAnAmberStoreError(f"{self.uri}: holds a zarr hierarchy that is not an amber-store")
            if self.mode != "w":
                self._check_version(attrs.get("format_version"))
                return
            # Only ever wipe what is recognisably ours.
            await self._zstore.delete_dir("")
        if self.mode == "r":
            raise NotAnAmberStoreError(f"{self.uri}: no amber-store here (nothing to read)")
        if not await self._zstore.is_empty(""):
            raise NotAnAmberStoreError(
                f"{self.uri}: not empty and not an amber-store; refusing to write into it"
            )
        root = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION}
        await self._zstore.set("zarr.json", json_buffer(fmt.group_metadata({fmt.ROOT_ATTR: root})))

    def _check_version(self, version: Any) -> None:
        if not isinstance(version, int) or version > fmt.FORMAT_VERSION:
            raise FormatVersionError(
                f"{self.uri}: written with format version {version}; this amber-store reads "
                f"up to {fmt.FORMAT_VERSION}; upgrade amber-store"
            )

    def close(self) -> None:
        """Wait for pending async saves, then drop cached state and close the storage
        client's connections. Raises the failure of a pending save, after closing."""
        try:
            self._background.wait()
        finally:
            self._background.close()
            self._release()

    def _release(self) -> None:
        self._cache.clear()
        self._cache_step = None
        self._manifests.clear()
        self._arrays.clear()
        client = getattr(self._loc.fs, "_s3", None)
        if client is not None:
            sync(client.close())
            self._loc.fs._s3 = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- listing ------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending. Uncommitted (crashed or in-progress) saves never appear."""
        return sync(self._steps())

    async def _steps(self) -> list[int]:
        names = [n async for n in self._zstore.list_dir(fmt.COMMITS_DIR)]
        return sorted(s for s in map(fmt.parse_commit_key, names) if s is not None)

    def latest(self) -> int | None:
        """The newest committed step, or ``None`` for an empty store."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> Manifest:
        """The committed manifest of ``step`` (raises :class:`StepNotFoundError`)."""
        return sync(self._manifest(step))

    async def _manifest(self, step: int) -> Manifest:
        if step in self._manifests:
            return self._manifests[step]
        raw = await self._zstore.get(fmt.commit_key(step), default_buffer_prototype())
        if raw is None:
            known = await self._steps()
            hint = f"committed steps: {known[:5]}{'...' if len(known) > 5 else ''}" if known else "the store is empty"
            raise StepNotFoundError(f"{self.uri}: step {step} is not committed ({hint})")
        m = Manifest.from_json(raw.to_bytes())
        self._check_version(m.format_version)
        self._manifests[step] = m
        return m

    def info(self, step: int) -> dict[str, Any]:
        """Kind, base, chain and per-tensor bytes of a committed step, as plain data."""
        return sync(self._info(step))

    async def _info(self, step: int) -> dict[str, Any]:
        m = await self._manifest(step)
        tensors = {}
        chain: set[int] = set()
        for key, e in m.tensors.items():
            deps = await self._dependencies(step, key)
            chain.update(deps)
            tensors[key] = {
                "dtype": e.dtype,
                "shape": e.shape,
                "chunks": e.chunks,
                "encoding": e.encoding,
                "base": e.base,
                "nbytes_raw": e.nbytes,
                "nbytes_stored": e.stored,
                "chain": deps,
            }
        return {
            "step": m.step,
            "kind": m.kind,
            "base": m.base,
            "depth": m.depth,
            "chain": sorted(chain),
            "nbytes_raw": m.nbytes_raw,
            "nbytes_stored": m.nbytes_stored,
            "seconds": m.seconds,
            "created": m.created,
            "tensors": tensors,
        }

    async def _dependencies(self, step: int, key: str) -> list[int]:
        """Steps whose arrays are read to materialize ``key`` at ``step``, oldest first."""
        deps: list[int] = []
        e = (await self._manifest(step)).tensors[key]
        while True:
            if e.encoding != "same":
                deps.append(step)
            if e.encoding == "full" or e.base is None:
                return deps[::-1]
            step = e.base
            e = (await self._manifest(step)).tensors[key]

    # --- saving -------------------------------------------------------------------------

    def save(self, step: int, state_dict: Any, *, full: bool | None = None) -> CommitInfo:
        """Save ``state_dict`` as ``step`` and commit it; deltas are encoded on the tensors'
        device.

        ``full=True`` forces a full step, ``full=False`` a delta (when a base exists), ``None``
        follows ``full_every``. Raises :class:`StepOrderError` unless ``step`` is newer than
        every committed step. On any error nothing becomes visible. Waits for pending
        :meth:`save_async` calls first.
        """
        self._require_writable()
        self.wait()
        t0 = time.perf_counter()
        tree, tensors = self._validate(step, state_dict)
        return self._save_now(step, tree, tensors, full, t0)

    def save_async(self, step: int, state_dict: Any, *, full: bool | None = None,
                   after: Callable[[CommitInfo], None] | None = None) -> Future[CommitInfo]:
        """Snapshot ``state_dict`` and save it in the background; returns once the snapshot is
        taken, so training may update its tensors right away.

        The snapshot is a copy into reused buffers (``snapshot="host"``: pinned host memory for
        accelerator tensors; ``"device"``: on the tensors' device); encoding, compression,
        writes and the commit run on a background thread, one save after the other. At most ``max_pending`` saves are unfinished: beyond that this call waits
        (back-pressure), so host memory stays bounded at ``max_pending`` snapshots plus
        ``max_inflight_bytes`` of encoded data. A failure is set on the returned future and
        raised (as :class:`AsyncSaveError`) by the next call of ``save``, ``save_async`` or
        :meth:`wait`. ``after(info)``, if given, runs on the save thread once the step is
        committed and before the future completes (retention, notifications).
        """
        self._require_writable()
        self._background.raise_failure()
        t0 = time.perf_counter()
        tree, tensors = self._validate(step, state_dict)
        if self._submitted is not None and step <= self._submitted:
            raise StepOrderError(f"{self.uri}: step {step} is not newer than the pending save of step {self._submitted}")
        self._background.reserve()
        try:
            snapshot = self._snapshots.take(tensors)
        except BaseException:
            self._background.release()
            raise
        self._submitted = step

        def work() -> CommitInfo:
            info = self._save_now(step, tree, snapshot, full, t0)
            if after is not None:
                after(info)
            return info

        return self._background.submit(step, work, lambda: self._snapshots.give_back(snapshot))

    def wait(self) -> None:
        """Block until every :meth:`save_async` has committed; raise the first failure."""
        self._background.wait()

    @staticmethod
    def _validate(step: int, state_dict: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        return fmt.flatten(state_dict)

    def _save_now(self, step: int, tree: dict[str, Any], tensors: dict[str, torch.Tensor], full: bool | None,
                  t0: float) -> CommitInfo:
        """Check the step against the store as it is now, then write and commit it."""
        latest = self.latest()
        self._check_sole_writer(latest)
        if latest is not None and step <= latest:
            raise StepOrderError(f"{self.uri}: step {step} is not newer than the latest committed step {latest}")
        prev = self.manifest(latest) if latest is not None else None
        base = self._choose_base(prev, full)
        try:
            manifest, values = self._write_step(step, tree, tensors, prev, base, t0)
            sync(self._commit(manifest, latest))
        except Exception as e:
            if isinstance(e, AmberError) or not _is_storage_error(e):
                raise
            raise StorageAccessError(
                f"{self.uri}: saving step {step} failed, the step is not committed and earlier steps "
                f"are untouched ({type(e).__name__}: {e})"
            ) from e
        if self.base_policy == "chain" or base is None:
            self._cache = values
            self._cache_step = step
        return CommitInfo(step, manifest.kind, manifest.base, manifest.nbytes_raw, manifest.nbytes_stored,
                          time.perf_counter() - t0)

    def _write_step(
        self, step: int, tree: dict[str, Any], tensors: dict[str, torch.Tensor], prev: Manifest | None,
        base: Manifest | None, t0: float,
    ) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """Encode and write every tensor into a fresh attempt group; returns the manifest to
        commit and each tensor's new materialized bits (the next base)."""
        attempt = uuid.uuid4().hex[:8]
        group = fmt.step_group(step, attempt)
        writer = Writer(self._zstore, concurrency=self._write_concurrency, max_inflight_bytes=self._max_inflight)
        try:
            sync(self._write_groups(group, step, tensors))
            items = tqdm(tensors.items(), desc=f"save {step}", unit="tensor", disable=not self.progress)
            for key, tensor in items:
                ref = self._base_for(base, key) if base is not None else None
                codec = self.policy.for_tensor(key, fmt.dtype_name(tensor.dtype), tensor.numel())
                writer.submit(
                    encode(key, tensor, ref, step=step, group=group, chunk_bytes=self.chunk_bytes,
                           level=self.compression_level, codec=codec)
                )
            by_key = {enc.key: enc for enc in writer.finish()}
        finally:
            writer.close()
        manifest = Manifest(
            step=step,
            kind="full" if base is None else "delta",
            base=None if base is None else base.step,
            depth=0 if base is None or prev is None else prev.depth + 1,
            group=group,
            tree=tree,
            tensors={key: by_key[key].entry for key in tensors},
            created=time.time(),
            seconds=time.perf_counter() - t0,
            attempt=attempt,
            writer=self._writer,
        )
        return manifest, {key: by_key[key].value for key in tensors}

    def _choose_base(self, prev: Manifest | None, full: bool | None) -> Manifest | None:
        if prev is None or full is True:
            return None
        if full is None and prev.depth + 1 >= self.full_every:
            return None
        if self.base_policy == "full" and prev.kind == "delta":
            assert prev.base is not None
            return self.manifest(prev.base)
        return prev

    def _base_for(self, base: Manifest, key: str,
                  cache: tuple[int | None, dict[str, torch.Tensor]] | None = None) -> Base | None:
        """The value of ``key`` at step ``base``, and the entry that holds its data; from
        ``cache`` (``(step, values)``, default this store's own) when it holds that step."""
        entry = base.tensors.get(key)
        if entry is None:
            return None
        holder = base.step
        if entry.encoding == "same":
            assert entry.base is not None
            holder, entry = entry.base, self.manifest(entry.base).tensors[key]
        cache_step, values = cache if cache is not None else (self._cache_step, self._cache)
        if cache_step == base.step and key in values:
            return Base(holder, entry, values[key])
        # Another process wrote the base, or this store was just opened: read it once.
        return Base(holder, entry, fmt.to_bits(self._materialized(holder, key)))

    def _materialized(self, step: int, key: str) -> torch.Tensor:
        e = self.manifest(step).tensors[key]
        return fmt.numpy_to_tensor(sync(self._read_bits(step, key, fmt.whole(tuple(e.shape)))), e.dtype)

    def _forget(self) -> None:
        """Drop cached manifests and array handles (after gc rewrote or removed some)."""
        self._manifests.clear()
        self._arrays.clear()

    async def _write_groups(self, group: str, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """zarr.json of the step group and of every nested container, so plain zarr can browse."""
        parents = {f"{group}/{k.rsplit('/', 1)[0]}" for k in tensors if "/" in k}
        for p in list(parents):
            while p.count("/") > group.count("/") + 1:
                p = p.rsplit("/", 1)[0]
                parents.add(p)
        top = fmt.group_metadata({fmt.ROOT_ATTR: {"step": step, "created": time.time()}})
        await self._zstore.set(f"{group}/zarr.json", json_buffer(top))
        empty = json_buffer(fmt.group_metadata())
        await asyncio.gather(*(self._zstore.set(f"{p}/zarr.json", empty) for p in parents))

    async def _is_ours(self, key: str, manifest: Manifest) -> bool:
        """Whether an existing commit object is this very attempt (a retried request that had
        in fact succeeded before its connection failed)."""
        raw = await self._zstore.get(key, default_buffer_prototype())
        return raw is not None and Manifest.from_json(raw.to_bytes()).attempt == manifest.attempt

    def _check_sole_writer(self, latest: int | None) -> None:
        """Refuse to save once another writer has committed after this one.

        A store object that has not committed yet may continue any run (a resumed job); once
        it has, the newest step must stay its own, or two jobs are interleaving one history.
        """
        if self._last_commit is not None and latest != self._last_commit:
            other = self.manifest(latest).writer if latest is not None else "?"
            raise ConcurrentWriterError(
                f"{self.uri}: step {latest} was committed by another writer ({other}) after this "
                f"writer's ({self._writer}) step {self._last_commit}; two jobs are writing one store"
            )

    async def _commit(self, manifest: Manifest, latest: int | None) -> None:
        if (now := (await self._steps() or [None])[-1]) != latest:
            raise ConcurrentWriterError(
                f"{self.uri}: step {now} was committed by another writer while step "
                f"{manifest.step} was being saved; this save was not committed"
            )
        key = fmt.commit_key(manifest.step)
        if not await put_if_absent(self._loc, key, manifest.to_json()) and not await self._is_ours(key, manifest):
            raise ConcurrentWriterError(
                f"{self.uri}: another writer committed step {manifest.step} first; this save "
                f"(attempt {manifest.attempt}) was not committed and its data is orphaned"
            )
        self._manifests[manifest.step] = manifest
        self._last_commit = manifest.step

    # --- lifecycle ----------------------------------------------------------------------

    def gc(self, keep_last: int | None = None, keep_every: int | None = None, *, dry_run: bool = False,
           grace_seconds: float = 3600.0) -> GCReport:
        """Delete steps outside the retention policy without breaking any kept step.

        Keeps the last ``keep_last`` steps (``None``: all), every step divisible by
        ``keep_every``, and every pinned step; kept steps that depend on deleted ones are folded
        first, so they still materialize bit-exactly. Also removes the data of crashed saves
        (of a step newer than the latest commit only once ``grace_seconds`` old: it may be a
        save in progress). Safe to interrupt; see :mod:`amber_store.retention`. Run it from the
        writing process, or while no other process saves or reads.
        """
        self._require_writable()
        return retention.gc(self, keep_last, keep_every, dry_run=dry_run, grace_seconds=grace_seconds)

    def pin(self, step: int, name: str) -> None:
        """Keep ``step`` through every ``gc`` until ``unpin(name)``."""
        self._require_writable()
        self.manifest(step)
        data = json.dumps({"step": step}).encode()
        sync(put_atomic(self._loc, retention.pin_key(name), data))

    def unpin(self, name: str) -> None:
        self._require_writable()
        sync(self._zstore.delete(retention.pin_key(name)))

    def pins(self) -> dict[str, int]:
        """``{pin name: step}``."""
        return sync(self._pins())

    async def _pins(self) -> dict[str, int]:
        out = {}
        async for name in self._zstore.list_dir(retention.PINS_DIR):
            if name.endswith(".json"):
                raw = await self._zstore.get(f"{retention.PINS_DIR}/{name}", default_buffer_prototype())
                if raw is not None:
                    out[name[: -len(".json")]] = int(json.loads(raw.to_bytes())["step"])
        return out

    def export(self, step: int, path: str | os.PathLike[str], *, format: str | None = None,
               subtree: str | None = None) -> Any:
        """Write ``step`` as a safetensors or ``torch.save`` file (format from the suffix);
        see :func:`amber_store.export.export`."""
        return export_.export(self, step, path, format=format, subtree=subtree)  # type: ignore[arg-type]

    def import_checkpoint(self, step: int, path: str | os.PathLike[str], *, format: str | None = None) -> CommitInfo:
        """Save an existing ``torch.save`` or safetensors file as a full ``step``."""
        return export_.import_checkpoint(self, step, path, format=format)  # type: ignore[arg-type]

    def du(self) -> dict[str, Any]:
        """Stored bytes by step and by top-level group of the state (``model``, ``optim``, ...)."""
        by_step: dict[int, int] = {}
        by_group: dict[str, int] = {}
        for step in self.steps():
            m = self.manifest(step)
            by_step[step] = m.nbytes_stored
            for key, e in m.tensors.items():
                group = key.split("/", 1)[0]
                by_group[group] = by_group.get(group, 0) + e.stored
        return {"total": sum(by_step.values()), "steps": by_step, "groups": by_group}

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
        for s in tqdm(steps, desc="verify", unit="step", disable=not self.progress):
            m = self.manifest(s)
            report[s] = sync(self._verify_step(m))
        return report

    async def _verify_step(self, m: Manifest) -> dict[str, str | None]:
        async def one(key: str, e: TensorEntry) -> str | None:
            try:
                await self._read_bits(m.step, key, fmt.whole(tuple(e.shape)), check=True)
            except CorruptDataError as err:
                return str(err)
            return None

        errors = await asyncio.gather(*(one(key, e) for key, e in m.tensors.items()))
        return dict(zip(m.tensors, errors))

    # --- loading ------------------------------------------------------------------------

    def load(self, step: int | None = None, *, lazy: bool = True, device: torch.device | str | None = None) -> Any:
        """Open a committed step (``None``: the latest).

        Lazy (default): a structure mirroring the saved state dict whose dicts are
        :class:`LazyStateDict` and whose tensors are :class:`LazyTensor`; nothing is read until a
        tensor or slice is used. ``lazy=False``: every tensor is read now (concurrently) and put
        on ``device``.
        """
        if step is None:
            step = self.latest()
            if step is None:
                raise StepNotFoundError(f"{self.uri}: the store is empty (no committed step)")
        m = self.manifest(step)
        lazy_sd = fmt.unflatten(m.tree, lambda key: LazyTensor(self, step, key, m.tensors[key]), LazyStateDict)
        return lazy_sd if lazy else materialize(lazy_sd, device)

    async def _array(self, path: str, step: int, key: str) -> AsyncArray[Any]:
        arr = self._arrays.get(path)
        if arr is None:
            try:
                arr = await AsyncArray.open(StorePath(self._zstore, path))
            except (FileNotFoundError, KeyError, ValueError) as e:
                raise CorruptDataError(
                    f"{self.uri}: step {step}, tensor {key!r}: array {path} is missing or unreadable ({e})",
                    step=step, tensor=key,
                ) from None
            self._arrays[path] = arr
        return arr

    async def _read_bits(self, step: int, key: str, region: tuple[slice, ...], check: bool | None = None) -> np.ndarray:
        """Materialized raw bits of a chunk-aligned ``region`` of ``key`` at ``step``.

        Checked against the saved crc32c per chunk when ``check`` (default: ``verify_checksums``).
        """
        e = (await self._manifest(step)).tensors[key]
        data = await self._read_chain(step, key, e, region)
        if self.verify_checksums if check is None else check:
            self._check_crcs(step, key, e, region, data)
        return data

    async def _read_chain(self, step: int, key: str, e: TensorEntry, region: tuple[slice, ...]) -> np.ndarray:
        if e.encoding == "same":
            assert e.base is not None
            return await self._read_chain(e.base, key, (await self._manifest(e.base)).tensors[key], region)
        assert e.array is not None
        arr = await self._array(e.array, step, key)

        async def own() -> np.ndarray:
            try:
                return np.asarray(await arr.getitem(region))
            except (ValueError, RuntimeError) as err:
                raise CorruptDataError(
                    f"{self.uri}: step {step}, tensor {key!r}: stored chunk failed its checksum or "
                    f"decoding ({err})", step=step, tensor=key,
                ) from None

        if e.encoding == "full":
            return await own()
        assert e.base is not None
        base_entry = (await self._manifest(e.base)).tensors[key]
        delta, base = await asyncio.gather(own(), self._read_chain(e.base, key, base_entry, region))
        codec = arr.metadata.codecs[0]
        if not isinstance(codec, DeltaCodec):
            raise CorruptDataError(f"{self.uri}: step {step}, tensor {key!r}: array {e.array} has no delta codec",
                                   step=step, tensor=key)
        return codec.apply(delta, base, region, e)

    def _check_crcs(self, step: int, key: str, e: TensorEntry, region: tuple[slice, ...], data: np.ndarray) -> None:
        for flat, idx, got in fmt.region_crcs(data, region, tuple(e.shape), tuple(e.chunks)):
            if got != e.crc32c[flat]:
                raise CorruptDataError(
                    f"{self.uri}: step {step}, tensor {key!r}, chunk {idx}: checksum mismatch "
                    f"(materialized data differs from what was saved)", step=step, tensor=key, chunk=idx,
                )


def _is_storage_error(e: BaseException) -> bool:
    """I/O failures (disk, network, the object store's answers), as opposed to bugs."""
    return isinstance(e, (OSError, TimeoutError)) or type(e).__module__.split(".")[0] in (
        "botocore", "aiobotocore", "aiohttp", "s3fs")


def open(
    uri: str | os.PathLike[str] | ZarrStore,
    storage_options: dict[str, Any] | None = None,
    mode: Mode = "a",
    **options: Any,
) -> Store:
    """Open (``"a"``: or create; ``"r"``: read only; ``"w"``: wipe and create) a checkpoint store.

    ``uri`` is a local path, ``file://``, ``memory://name``, ``s3://bucket/prefix`` or any other
    fsspec URL; or a zarr :class:`~zarr.abc.store.Store` instance. ``storage_options`` go to the
    fsspec filesystem (e.g. ``{"endpoint_url": "http://127.0.0.1:9000", "key": ..., "secret": ...}``
    for MinIO). ``options`` are :class:`Store`'s keyword arguments.
    """
    if mode not in ("r", "a", "w"):
        raise ValueError(f"mode must be 'r', 'a' or 'w', not {mode!r}")
    if isinstance(uri, ZarrStore):
        loc = Location(uri, repr(uri), "zarr")
    else:
        loc = resolve(uri, storage_options, read_only=mode == "r")
        sync(probe(loc))
    return Store(loc, mode=mode, **options)
