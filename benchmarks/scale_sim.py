"""A sharded checkpoint's bookkeeping at 64 to 4,096 ranks, simulated in one process.

Drives the real code of a DCP save and resume with synthetic inputs, as DCP would hand them to
the storage layer of a job of R ranks training P parameters of ``--rows`` x ``--cols`` float32
with AdamW, every parameter and both its moments sharded ``Shard(0)`` over all ranks (as FSDP2
shards them) and each parameter's ``step`` a replicated scalar written by one rank: 3P sharded
tensors, 3PR + P items a step.

- **amber-store**: ``AmberStorageWriter.prepare_global_plan`` (the step plan), each rank's
  :meth:`Writer.seal_rank` (its fragment and its pack's zarr.json: the records of a full step
  whose every shard changed, a pack location and a crc32c each), then the coordinator's
  ``finish`` (the index and the commit) on a local directory. The tensors' bytes are not
  written: what is measured is bookkeeping. Resume: a rank opens the step as
  ``AmberStorageReader.read_metadata`` does (the index), then reads the records of the items
  it needs (:meth:`History.entries`): its own shards on the same world size, or on half the
  ranks, the two shards its rows span; the bytes and requests it reads are counted.
- **DCP's writer**: ``FileSystemWriter.finish`` with the same global metadata and one result
  per item (as its ranks return them), which writes ``.metadata``; a resume reads all of it on
  every rank (``FileSystemReader.read_metadata``). Where its inputs would not fit this
  machine's memory, its per-item figures are scaled from the largest size measured, and the
  table says so.

DCP's own planning (gathering the ranks' plans, deduplicating, validating the global plan, and
building the global metadata every resuming rank plans its reads with) is the same for both
writers and not counted; ``--dcp-planning`` times DCP's ``create_global_plan`` at the sizes
given, for scale.

    python benchmarks/scale_sim.py                      # 64, 256, 1,024 ranks x 1,000 and 10,000; 4,096 x 1,000
    python benchmarks/scale_sim.py --ranks 64 --params 1000 --out /tmp/sim.md
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,  # noqa: E402
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402
from amber_store.runtime import sync  # noqa: E402

import amber_store as amber  # noqa: E402
from amber_store import format as fmt  # noqa: E402
from amber_store.dcp import AmberStorageReader, AmberStorageWriter, items_written  # noqa: E402
from amber_store.format import TensorEntry  # noqa: E402
from amber_store.stepwriter import Written  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402

#: above this many items, DCP's writer is not run here (its per-item objects outgrow memory)
DCP_MAX_ITEMS = 8_000_000


class _Index:
    """What the coordinator reads of a write item's ``MetadataIndex`` (a slotted stand-in: 30M
    real ones outgrow this machine; DCP's own are the same fields)."""

    __slots__ = ("fqn", "offset", "index")

    def __init__(self, fqn: str, offset: torch.Size, index: int) -> None:
        self.fqn, self.offset, self.index = fqn, offset, index


class _Item:
    __slots__ = ("index", "type")

    def __init__(self, index: _Index, kind: WriteItemType) -> None:
        self.index, self.type = index, kind


class Job:
    """The global plan and metadata DCP hands the storage layer for one save."""

    def __init__(self, ranks: int, params: int, rows: int, cols: int, lowest: bool = False) -> None:
        self.ranks, self.params, self.rows, self.cols = ranks, params, rows, cols
        self.lowest = lowest
        self.piece = -(-rows // ranks)
        self.sizes = [max(0, min(self.piece, rows - r * self.piece)) for r in range(ranks)]
        self.sharded = [fqn for p in range(params) for fqn in (
            f"model.layers.{p}.weight", f"optim.state.layers.{p}.weight.exp_avg",
            f"optim.state.layers.{p}.weight.exp_avg_sq")]
        self.steps = [f"optim.state.layers.{p}.weight.step" for p in range(params)]

    def writes_step(self, p: int, r: int) -> bool:
        """Whether rank ``r`` writes parameter ``p``'s replicated ``step``: DCP's default
        deduplication spreads replicated items over the ranks (the smallest plan takes each);
        ``dedup_save_to_lowest_rank=True`` gives them all to rank 0."""
        return r == (0 if self.lowest else p % self.ranks)

    @property
    def items(self) -> int:
        return len(self.sharded) * self.ranks + len(self.steps)

    def path(self, fqn: str) -> tuple[str, ...]:
        if fqn.startswith("model."):
            return ("model", fqn[len("model."):])
        head, leaf = fqn[len("optim.state."):].rsplit(".", 1)
        return ("optim", "state", head, leaf)

    def metadata(self, shared: bool) -> Metadata:
        """DCP's global metadata (``shared``: one chunk list for every sharded tensor, which the
        storage layer only reads; DCP's own has one per tensor, and pickles each)."""
        props = TensorProperties(dtype=torch.float32)
        size = torch.Size([self.rows, self.cols])

        def chunks() -> list[ChunkStorageMetadata]:
            return [ChunkStorageMetadata(offsets=torch.Size([r * self.piece, 0]), sizes=torch.Size([n, self.cols]))
                    for r, n in enumerate(self.sizes) if n]

        one = chunks() if shared else None
        state: dict[str, Any] = {fqn: TensorStorageMetadata(props, size, one if shared else chunks())
                                 for fqn in self.sharded}
        scalar = [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
        state.update({fqn: TensorStorageMetadata(props, torch.Size([]), scalar if shared else list(scalar))
                      for fqn in self.steps})
        return Metadata(state, planner_data={fqn: self.path(fqn) for fqn in state})

    def plans(self) -> list[SavePlan]:
        """Each rank's final plan: its shard of every sharded tensor, and every R-th step."""
        out = []
        for r, n in enumerate(self.sizes):
            offset = torch.Size([r * self.piece, 0])
            items = [_Item(_Index(fqn, offset, r), WriteItemType.SHARD) for fqn in self.sharded] if n else []
            items += [_Item(_Index(fqn, torch.Size([]), 0), WriteItemType.TENSOR)
                      for p, fqn in enumerate(self.steps) if self.writes_step(p, r)]
            out.append(SavePlan(items))  # type: ignore[arg-type]
        return out

    def written(self, r: int, group: str, rng: random.Random) -> Written:
        """What rank ``r``'s step writer returns for a full step whose every shard changed:
        one packed record per item (a location in its pack and a crc32c), and its pack."""
        n = self.sizes[r]
        shard = [n, self.cols]
        raw = n * self.cols * 4
        entries: dict[str, TensorEntry] = {}
        offset = 0
        keys = [fmt.sharding.item_key(fqn, (r * self.piece, 0)) for fqn in self.sharded] if n else []
        keys += [fmt.sharding.item_key(fqn, ()) for p, fqn in enumerate(self.steps) if self.writes_step(p, r)]
        for key in keys:
            scalar = key.endswith("/scalar")
            nbytes = 4 if scalar else raw
            entries[key] = TensorEntry(dtype="float32", shape=[] if scalar else shard, chunks=[] if scalar else shard,
                                       encoding="full", base=None, array=None, crc32c=[rng.getrandbits(32)],
                                       nbytes=nbytes, stored=nbytes, pack=[f"pack-r{r}", offset, nbytes])
            offset += fmt.round_up(nbytes, fmt.PACK_ALIGN)
        part = fmt.PACK_CHUNK_BYTES
        pack = {"array": f"{group}/pack-r{r}", "chunk": part, "nbytes": offset,
                "index": [[i * part, part // 2] for i in range(-(-offset // part))]}
        meta = fmt.sharded_array_metadata((offset,), (part,), "uint8", [], {"pack": True})
        return Written(entries=entries, packs={f"pack-r{r}": pack}, arrays={f"pack-r{r}": meta})


class Counting:
    """Counts a backend's GETs and the bytes they return."""

    def __init__(self, backend: Any) -> None:
        self.requests = self.bytes = 0
        real = backend.get

        async def get(key: str, byte_range: Any = None) -> Any:
            got = await real(key, byte_range)
            self.requests += 1
            self.bytes += 0 if got is None else got.nbytes
            return got

        backend.get = get


def sizes_under(root: Path, prefix: str = "") -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()
            and str(p.relative_to(root)).startswith(prefix)}


def amber_run(job: Job, root: Path, seed: int = 0) -> dict[str, Any]:
    uri = str(root / "amber")
    rng = random.Random(seed)
    metadata = job.metadata(shared=True)
    plans = job.plans()
    writer = AmberStorageWriter(uri, step=1)
    writer.set_up_storage_writer(True)
    t0 = time.perf_counter()
    final = writer.prepare_global_plan(plans)  # type: ignore[arg-type]
    plan_s = time.perf_counter() - t0
    decision = final[0].storage_data
    store_writer = writer._held().store.writer
    results, seal_s = [], []
    for r in range(job.ranks):
        written = job.written(r, decision.group, rng)
        t0 = time.perf_counter()
        fragment = sync(store_writer.seal_rank(decision, written, r)) if written.entries else None
        items = items_written(final[r])
        seal_s.append(time.perf_counter() - t0)
        results.append([WriteResult(index=MetadataIndex("x"), size_in_bytes=0,
                                    storage_data={"fragment": fragment, "items": items})] if fragment else [])
        del written
    t0 = time.perf_counter()
    writer.finish(metadata, results)
    finish_s = time.perf_counter() - t0
    del plans, final, results
    gc.collect()
    files = sizes_under(Path(uri))
    index = files["commits/000000000001.json"]
    fragments = sum(n for k, n in files.items() if "/fragment-r" in k)
    zarr_json = sum(n for k, n in files.items() if k.endswith("zarr.json") and k.startswith("steps/0"))
    total = index + fragments + zarr_json
    # resume: one rank's metadata reads, same world size and half of it
    reads = {}
    for label, world in (("same", job.ranks), ("half", max(1, job.ranks // 2))):
        store = amber.open(uri, mode="r")
        counting = Counting(store.history.backend)
        reader = AmberStorageReader(uri, step=1)
        reader._store = store
        t0 = time.perf_counter()
        metadata = reader.read_metadata()  # the index, and DCP's Metadata every rank plans its load with
        metadata_s = time.perf_counter() - t0
        del metadata
        t0 = time.perf_counter()
        q = world // 3  # a rank in the middle
        rows = range(q * -(-job.rows // world), min(job.rows, (q + 1) * -(-job.rows // world)))
        shards = sorted({i // job.piece for i in (rows.start, rows.stop - 1)} | set(range(rows.start // job.piece,
                                                                                           (rows.stop - 1) // job.piece + 1)))
        keys = [fmt.sharding.item_key(fqn, (s * job.piece, 0)) for fqn in job.sharded for s in shards]
        keys += [fmt.sharding.item_key(fqn, ()) for fqn in job.steps]
        sync(store.history.entries(1, keys))
        reads[label] = {"bytes": counting.bytes, "requests": counting.requests, "seconds": time.perf_counter() - t0,
                        "metadata_s": metadata_s}
        store.close()
    return {"index": index, "fragments": fragments, "zarr_json": zarr_json, "metadata": total,
            "plan_s": plan_s, "finish_s": finish_s, "seal_s": sum(seal_s) / len(seal_s), "seal_max_s": max(seal_s),
            "resume": reads}


def dcp_run(job: Job, root: Path) -> dict[str, Any]:
    path = root / "dcp"
    path.mkdir()
    metadata = job.metadata(shared=False)
    results = []
    for r, n in enumerate(job.sizes):
        offset = torch.Size([r * job.piece, 0])
        length = n * job.cols * 4
        rank = [WriteResult(index=MetadataIndex(fqn, offset), size_in_bytes=length,
                            storage_data=_StorageInfo(f"__{r}_0.distcp", i * length, length))
                for i, fqn in enumerate(job.sharded)] if n else []
        rank += [WriteResult(index=MetadataIndex(fqn, torch.Size([])), size_in_bytes=4,
                             storage_data=_StorageInfo(f"__{r}_0.distcp", 10**9 + p, 4))
                 for p, fqn in enumerate(job.steps) if job.writes_step(p, r)]
        results.append(rank)
    writer = FileSystemWriter(str(path))
    writer.set_up_storage_writer(True)
    t0 = time.perf_counter()
    writer.finish(metadata, results)
    finish_s = time.perf_counter() - t0
    del results, metadata
    gc.collect()
    size = (path / ".metadata").stat().st_size
    t0 = time.perf_counter()
    FileSystemReader(str(path)).read_metadata()
    read_s = time.perf_counter() - t0
    return {"metadata": size, "finish_s": finish_s, "read_s": read_s}


def dcp_planning(job: Job) -> float:
    """Seconds of DCP's ``create_global_plan`` on the ranks' local plans (real write items)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem

    planner = DefaultSavePlanner()
    mapping = {fqn: job.path(fqn) for fqn in job.sharded + job.steps}
    plans = []
    for r, n in enumerate(job.sizes):
        offset = torch.Size([r * job.piece, 0])
        props = TensorProperties(dtype=torch.float32)
        chunk = ChunkStorageMetadata(offsets=offset, sizes=torch.Size([n, job.cols]))
        items = [WriteItem(index=MetadataIndex(fqn, offset), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                       size=torch.Size([job.rows, job.cols])))
                 for fqn in job.sharded] if n else []
        scalar = ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))
        items += [WriteItem(index=MetadataIndex(fqn, torch.Size([])), type=WriteItemType.TENSOR,
                            tensor_data=TensorWriteData(chunk=scalar, properties=props, size=torch.Size([])))
                  for fqn in job.steps]  # replicated: every rank has every step; DCP deduplicates
        plans.append(SavePlan(items, planner_data=mapping))
    t0 = time.perf_counter()
    planner.create_global_plan(plans)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--params", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--max-items", type=int, default=40_000_000,
                   help="skip configurations with more items (this machine's memory)")
    p.add_argument("--dcp-planning", action="store_true", help="also time DCP's create_global_plan (real write "
                                                               "items: up to --dcp-planning-items items)")
    p.add_argument("--dcp-planning-items", type=int, default=3_100_000)
    p.add_argument("--lowest", action="store_true",
                   help="replicated items all written by rank 0 (DCP's dedup_save_to_lowest_rank=True), "
                        "not spread over the ranks (DCP's default)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scale_sim.md")
    p.add_argument("--plot", type=Path, default=Path(__file__).parent / "results" / "scale_sim.png")
    p.add_argument("--json", type=Path, help="the raw figures here (default: beside --out)")
    args = p.parse_args()
    rows = []
    for params in args.params:
        for ranks in args.ranks:
            job = Job(ranks, params, args.rows, args.cols, args.lowest)
            if job.items > args.max_items:
                print(f"skipped {ranks} ranks x {params} params: {job.items:,} items > --max-items", flush=True)
                continue
            root = Path(tempfile.mkdtemp(prefix="scale_sim-"))
            try:
                t0 = time.perf_counter()
                ours = amber_run(job, root)
                gc.collect()
                peer = dcp_run(job, root) if job.items <= DCP_MAX_ITEMS else None
                planning = dcp_planning(job) if args.dcp_planning and job.items <= args.dcp_planning_items else None
            finally:
                shutil.rmtree(root, ignore_errors=True)
            row = {"ranks": ranks, "params": params, "items": job.items, "amber": ours, "dcp": peer,
                   "dcp_planning_s": planning}
            rows.append(row)
            print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
            gc.collect()
    report(rows, args)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    # DCP's writer where it did not run: its per-item rates at the largest size measured
    measured = [r for r in rows if r["dcp"] is not None]
    ref = max(measured, key=lambda r: r["items"]) if measured else None
    out = []
    for r in rows:
        a, d = r["amber"], r["dcp"]
        scaled = d is None and ref is not None
        if scaled:
            k = r["items"] / ref["items"]
            d = {key: ref["dcp"][key] * k for key in ("metadata", "finish_s", "read_s")}
        mark = "*" if scaled else ""
        same, half = a["resume"]["same"], a["resume"]["half"]
        out.append([f"{r['ranks']:,}", f"{r['params']:,}", f"{r['items'] / 1e6:.2f}M",
                    _mb(a["index"]), _mb(a["metadata"]), f"{_mb(d['metadata'])}{mark}" if d else "-",
                    f"{a['metadata'] / d['metadata']:.3f}{mark}" if d else "-",
                    f"{a['finish_s']:.2f}", f"{d['finish_s']:.1f}{mark}" if d else "-",
                    f"{a['seal_s'] * 1e3:.0f}",
                    f"{_mb(same['bytes'])} / {same['requests']}", f"{_mb(half['bytes'])} / {half['requests']}",
                    f"{100 * same['bytes'] / a['metadata']:.2f}%",
                    f"{_mb(d['metadata'])}{mark} / 1" if d else "-",
                    f"{same['metadata_s']:.2f} / {d['read_s']:.2f}{mark}" if d else f"{same['metadata_s']:.2f} / -",
                    f"{r['dcp_planning_s']:.1f}" if r.get("dcp_planning_s") else "-"])
    headers = ["ranks", "params", "items", "index", "metadata (amber)", "metadata (DCP)", "ratio",
               "coordinator s (amber)", "coordinator s (DCP)", "per-rank seal ms",
               "resume reads, same world (bytes / GETs)", "resume reads, half world", "share read",
               "resume reads (DCP, every rank)", "read_metadata s (amber / DCP)", "DCP's create_global_plan s"]
    text = "\n".join([
        "# Sharded bookkeeping at scale (benchmarks/scale_sim.py)", "",
        f"Machine: {machine()}. Command: `python benchmarks/scale_sim.py {' '.join(sys.argv[1:])}`".rstrip(), "",
        f"Each parameter {args.rows} x {args.cols} float32 with AdamW, `Shard(0)` over every rank; items = "
        "3 x params x ranks + params (each parameter's replicated `step`, written by "
        f"{'rank 0: dedup_save_to_lowest_rank=True' if args.lowest else 'the ranks in turn, as DCP deduplicates by default'}). amber metadata: the index (commit), the ranks' fragments and the "
        "step's zarr.json objects; DCP: `.metadata`. Coordinator: amber's `finish` (index, group "
        "zarr.json, commit), DCP's `FileSystemWriter.finish`. Resume reads: one rank's metadata reads "
        "(the index, then the fragments holding the items it needs), and how long `read_metadata` takes "
        "(DCP's `Metadata` of every shard, which DCP's load planner needs on every rank). * scaled per "
        "item from the largest size DCP's writer ran at here.", "",
        table(headers, out), ""])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    (args.json or args.out.with_suffix(".json")).write_text(json.dumps(rows, indent=1))
    print(text)
    plot(rows, args.plot)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for params in sorted({r["params"] for r in rows}):
        rs = sorted((r for r in rows if r["params"] == params), key=lambda r: r["ranks"])
        x = [r["ranks"] for r in rs]
        dcp = [r for r in rs if r["dcp"]]
        series = [
            (axes[0], [r["amber"]["metadata"] / 1e6 for r in rs], [r["dcp"]["metadata"] / 1e6 for r in dcp],
             "metadata per step (MB)"),
            (axes[1], [r["amber"]["finish_s"] for r in rs], [r["dcp"]["finish_s"] for r in dcp],
             "coordinator's storage work (s)"),
            (axes[2], [r["amber"]["resume"]["same"]["bytes"] / 1e6 for r in rs], [r["dcp"]["metadata"] / 1e6 for r in dcp],
             "metadata a resuming rank reads (MB)"),
        ]
        for ax, ours, theirs, title in series:
            ax.plot(x, ours, "o-", label=f"amber-store, {params:,} params")
            ax.plot([r["ranks"] for r in dcp], theirs, "s--", label=f"DCP's writer, {params:,} params")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks")
            ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


if __name__ == "__main__":
    main()
