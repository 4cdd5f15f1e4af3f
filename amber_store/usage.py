"""What a store holds, from its metadata alone: a committed step's report (``info``), stored
bytes by step and by group of the state (``du``), and the attempt groups no commit uses (the
data of interrupted or dead saves, which gc removes). Reads steps and manifests through the
store's :class:`~amber_store.history.History` and sizes and lists through its backend; writes
nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from . import format as fmt
from . import shards
from .format import Manifest, TensorEntry
from .chains import Chains
from .history import GROUP_NAME, History
from .runtime import REQUESTS_AT_ONCE, gather
from .storage import storage_errors

#: how old an attempt of a step newer than the latest commit must be before it is taken for
#: the remains of a dead save, rather than a save in progress (gc's ``grace_seconds``)
GRACE_SECONDS = 3600.0


@dataclass(frozen=True)
class Attempt:
    """An attempt group no committed step uses: the data of a save that was interrupted, died
    or lost a race (or, while ``maybe_saving``, of a save in progress)."""

    group: str
    step: int
    #: of a step newer than the latest commit, younger than the grace period: gc spares it
    maybe_saving: bool


def _young(created: float | bool | None, grace_seconds: float) -> bool:
    """Whether an attempt group created at ``created`` (``History.created``) may still be written
    by a save: younger than ``grace_seconds``, or of no known age."""
    return not isinstance(created, float) or time.time() - created < grace_seconds


class Usage:
    """The reports of one store (through ``history``, its chains and its backend)."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.chains = Chains(history)
        self.backend = history.backend

    @property
    def uri(self) -> str:
        return self.history.uri

    async def info(self, step: int) -> dict[str, Any]:
        """Kind, base, chain and per-tensor bytes of a committed step, as plain data (a packed
        tensor's ``nbytes_stored`` is its share of the pack by raw size: the pack compresses the
        step's small tensors together)."""
        m = await self.history.manifest(step)
        base = await self.history.manifest(m.base) if m.base is not None else None
        tensors = {}
        chain: set[int] = set()
        for key, e in m.tensors.items():
            deps = await self.chains.dependencies(step, key)
            chain.update(deps)
            tensors[key] = {
                "dtype": e.dtype,
                "shape": e.shape,
                "chunks": e.chunks,
                "encoding": e.encoding,
                "base": e.base,
                "packed": e.pack is not None,
                "nbytes_raw": e.nbytes,
                "nbytes_stored": e.stored,
                "chain": deps,
                "note": _full_in_delta(e, base.tensors.get(key) if base is not None else None, base,
                                       m.extra.get("folded")),
            }
        layout = shards.layout_of(m)
        if layout is not None:
            tensors = _logical(tensors, layout)
        return {
            "step": m.step,
            "kind": m.kind,
            "base": m.base,
            "depth": m.depth,
            "format_version": m.format_version,
            "chain": sorted(chain),
            "nbytes_raw": m.nbytes_raw,
            "nbytes_stored": m.nbytes_stored,
            "seconds": m.seconds,
            "created": m.created,
            "tensors": tensors,
        }

    async def du(self) -> dict[str, Any]:
        """Stored bytes by step and by top-level group of the state, in attempts no commit
        uses (``uncommitted``: data of interrupted or dead saves, which gc removes), and what
        the whole location occupies (``storage``). Manifests are read
        :data:`~amber_store.runtime.REQUESTS_AT_ONCE` at a time."""
        async def of(step: int) -> tuple[int, dict[str, int]]:  # (only these kept: every step is read)
            m = await self.history.manifest(step)
            layout = shards.layout_of(m)
            names = {} if layout is None else layout.names()
            groups: dict[str, int] = {}
            for key, e in m.tensors.items():
                group = names.get(key, key).split("/", 1)[0]
                groups[group] = groups.get(group, 0) + e.stored
            return m.nbytes_stored, groups

        steps = await self.history.steps()
        rows = await gather((of(s) for s in steps), limit=REQUESTS_AT_ONCE)
        by_step = {step: stored for step, (stored, _) in zip(steps, rows)}
        by_group: dict[str, int] = {}
        for _, groups in rows:
            for group, n in groups.items():
                by_group[group] = by_group.get(group, 0) + n
        return {"total": sum(by_step.values()), "steps": by_step, "groups": by_group,
                "uncommitted": await self.uncommitted(),
                "storage": await self.backend.footprint()}

    async def stray_attempts(self, grace_seconds: float = GRACE_SECONDS) -> list[Attempt]:
        """Attempt groups under ``steps/`` that no committed step uses (one listing, the
        manifests of the steps with more than one group, and each candidate's zarr.json: some
        servers, SeaweedFS, keep listing a "directory" whose objects are all deleted)."""
        steps = await self.history.steps()
        latest = steps[-1] if steps else -1
        groups: dict[int, list[str]] = {}
        with storage_errors(self.uri, "listing the attempts"):
            async for name in self.backend.list_dir(fmt.STEPS_DIR):
                found = GROUP_NAME.fullmatch(name.rstrip("/"))
                if found is not None:
                    groups.setdefault(int(found.group(1)), []).append(f"{fmt.STEPS_DIR}/{name.rstrip('/')}")
        committed = set(steps)
        candidates: list[tuple[int, str]] = []
        for step, names in sorted(groups.items()):
            if step in committed:
                if len(names) == 1:
                    continue  # its own (or, folded whole, its fold's)
                m = await self.history.manifest(step)
                names = [g for g in names if g not in (m.group, m.extra.get("folded", {}).get("group"))]
            candidates += [(step, g) for g in names]

        async def attempt(step: int, group: str) -> Attempt | None:
            created = await self.history.created(group)
            if created is None:
                return None  # nothing left of it
            return Attempt(group, step, step > latest and _young(created, grace_seconds))

        with storage_errors(self.uri, "reading the attempts"):
            found = await gather(attempt(*c) for c in candidates)
        return [a for a in found if a is not None]

    async def maybe_in_progress(self, group: str, grace_seconds: float) -> bool:
        """Whether an attempt group is younger than ``grace_seconds`` (a group without its
        zarr.json, or without a time in it, has only just begun)."""
        return _young(await self.history.created(group), grace_seconds)

    async def uncommitted(self) -> dict[str, int]:
        """What :meth:`stray_attempts` hold: ``attempts``, how many of them ``maybe_saving``,
        and their ``bytes``; and ``uploads``, the uploads in parts begun and never completed
        (:meth:`Backend.incomplete_uploads`: a killed process's, billed until gc aborts them)."""
        strays = await self.stray_attempts()
        with storage_errors(self.uri, "listing incomplete uploads"):
            uploads = await self.backend.incomplete_uploads()
        return {"attempts": len(strays), "maybe_saving": sum(a.maybe_saving for a in strays),
                "bytes": sum(await gather(self.attempt_bytes(a.group) for a in strays)), "uploads": len(uploads)}

    async def attempt_bytes(self, group: str) -> int:
        """Bytes stored under an attempt group."""
        with storage_errors(self.uri, f"sizing {group}"):
            return (await self.backend.footprint(f"{group}/"))["bytes"]


def _logical(items: dict[str, dict[str, Any]], layout: shards.Layout) -> dict[str, dict[str, Any]]:
    """``info``'s rows of a sharded step's items, one per tensor and value its ranks saved."""
    out = {}
    for name, t in layout.tensors.items():
        rows = [items[key] for _, key in t.shards]
        bases = [r["base"] for r in rows if r["base"] is not None]
        out[name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "shards": len(rows),
            "encoding": "+".join(sorted({r["encoding"] for r in rows})),
            "base": max(bases) if bases else None,
            "packed": all(r["packed"] for r in rows),
            "nbytes_raw": sum(r["nbytes_raw"] for r in rows),
            "nbytes_stored": sum(r["nbytes_stored"] for r in rows),
            "chain": sorted({s for r in rows for s in r["chain"]}),
            "note": next((f"{key}: {r['note']}" for (_, key), r in zip(t.shards, rows) if r["note"]), None),
        }
    for name, key in layout.values.items():
        out[name] = {**{k: v for k, v in items[key].items() if k != "chunks"}, "dtype": "object", "shape": [], "shards": 1}
    return out


def _full_in_delta(e: TensorEntry, was: TensorEntry | None, base: Manifest | None,
                   folded: dict[str, Any] | None = None) -> str | None:
    """Why a tensor of a delta step was stored whole (``folded``: the manifest's record of gc's
    fold, if any)."""
    if base is None or e.encoding != "full":
        return None
    if was is None:
        return f"stored full: new since base step {base.step}"
    if (list(was.shape), was.dtype) != (list(e.shape), e.dtype):
        return (f"stored full: {was.dtype}{list(was.shape)} at base step {base.step}, "
                f"now {e.dtype}{list(e.shape)}")
    if folded is not None and folded["group"] in f"{e.array} {e.pack}":
        return f"stored full by gc, which deleted step(s) {folded['from']} of its chain"
    return f"stored full: its delta against base step {base.step} no longer paid (full_above)"
