"""torch.distributed.checkpoint on 2 to 16 gloo ranks: AmberStorageWriter/Reader against DCP's own
writers in the same run (beyond: benchmarks/scale_sim.py).

Each run starts W gloo ranks on this machine. Every rank holds a model of ``--tensors``
parameters (``--rows`` x ``--cols`` float32, DTensor ``Shard(0)``, as FSDP2 shards them) and its
AdamW state (``exp_avg``, ``exp_avg_sq`` sharded alike, ``step`` replicated), updated by real
AdamW steps on random gradients between saves. ``--saves`` saves (a full step, then deltas
``--gap`` optimizer steps apart) go through amber-store and through the peer (DCP's
``FileSystemWriter`` on a local directory, ``FsspecWriter`` on S3: one directory per step, as DCP
users keep them), the order alternating per save; each is timed between barriers (``--still``:
no optimizer step before the last save, a delta step in which nothing changed). Then each
reader resumes the last step onto the same ranks (``Shard(0)``), counting the metadata each
rank reads, and loads it *resharded* (into ``Shard(1)``), checked bit-exact on a sample.

Per save it records: wall time, the storage layer's coordinator time (the writer's
``prepare_global_plan`` + ``finish`` on rank 0; DCP's own planning is the same for both),
objects and bytes written, and the bytes of per-step metadata (amber: the commit index, the
ranks' fragments and the zarr.json objects; the peer: ``.metadata``).

    python benchmarks/dcp_scale.py                       # 2, 4, 8 ranks; local and SeaweedFS
    python benchmarks/dcp_scale.py --worlds 4 8 16 --locations local --tensors 500 --rows 64 --cols 64 --still
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# --- one rank ------------------------------------------------------------------------------

def timed(cls: type, profile: Any = None) -> type:
    """``cls`` with its coordinator's storage work timed (rank 0 calls both methods), and run
    under ``profile`` (a cProfile.Profile) if given."""

    class Timed(cls):  # type: ignore[misc, valid-type]
        coordinator = 0.0

        def prepare_global_plan(self, plans: Any) -> Any:
            return self._timed(super().prepare_global_plan, plans)

        def finish(self, metadata: Any, results: Any) -> None:
            self._timed(super().finish, metadata, results)

        def _timed(self, work: Any, *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return work(*args) if profile is None else profile.runcall(work, *args)
            finally:
                Timed.coordinator += time.perf_counter() - t0

    return Timed


def listing(fs: Any, root: str) -> dict[str, int]:
    try:
        return {path: info["size"] for path, info in fs.find(root, detail=True).items()}
    except FileNotFoundError:
        return {}


def is_metadata(path: str) -> bool:
    return path.endswith((".json", "/dcp.metadata", "/.metadata")) or "/fragment-r" in path


def rank_main(cfg: dict[str, Any]) -> None:
    import fsspec
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import amber_store as amber
    from amber_store.dcp import AmberSavePlanner, AmberStorageReader, AmberStorageWriter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows, cols, n = cfg["rows"], cfg["cols"], cfg["tensors"]
    opts = cfg["storage_options"]

    def sharded(full: torch.Tensor, dim: int) -> DTensor:
        local = full.chunk(world, dim)[rank].contiguous()
        return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(sharded(torch.randn(rows, cols, generator=g) * 0.02, 0)) for _ in range(n)]
    names = [f"layers.{i // 4}.{('wq', 'wk', 'wv', 'wo')[i % 4]}.weight" for i in range(n)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    gg = torch.Generator().manual_seed(1)

    def train(steps: int) -> None:
        for _ in range(steps):
            for p in params:
                p.grad = sharded(torch.randn(rows, cols, generator=gg) * 1e-2, 0)
            optimizer.step()

    def state() -> dict[str, Any]:
        return {"model": dict(zip(names, params)),
                "optim": {"state": {name: optimizer.state[p] for name, p in zip(names, params)},
                          "param_groups": [{k: v for k, v in group.items() if k != "params"} | {"params": names}
                                           for group in optimizer.param_groups]}}

    train(1)  # AdamW's moments exist from here
    fs, _ = fsspec.url_to_fs(cfg["root"], **(opts or {}))
    amber_uri, peer_root = f"{cfg['root']}/amber", f"{cfg['root']}/peer"
    PeerWriter, PeerReader = peer(cfg["peer"])
    profile = None
    if cfg.get("profile") and rank == 0:
        import cProfile

        profile = cProfile.Profile()
    Amber, Peer = timed(AmberStorageWriter, profile), timed(PeerWriter)
    records: list[dict[str, Any]] = []
    for s in range(cfg["saves"]):
        if s:
            train(0 if cfg["still"] and s == cfg["saves"] - 1 else cfg["gap"])
        order = ["amber", "peer"] if s % 2 == 0 else ["peer", "amber"]
        for name in order:
            root = amber_uri if name == "amber" else f"{peer_root}/step_{s}"
            before = listing(fs, root) if rank == 0 else {}
            writer = (Amber(amber_uri, opts, step=s) if name == "amber"
                      else Peer(root, **({} if cfg["peer"] == "FileSystemWriter" else opts)))
            cls = Amber if name == "amber" else Peer
            cls.coordinator = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            # amber-store as its docs advise: replicated items on the lowest rank (AmberSavePlanner)
            dcp.save(state(), storage_writer=writer, **({"planner": AmberSavePlanner()} if name == "amber" else {}))
            dist.barrier()
            seconds = time.perf_counter() - t0
            if rank == 0:
                after = listing(fs, root)
                new = {p: b for p, b in after.items() if before.get(p) != b}
                records.append({"writer": name, "save": s, "seconds": seconds, "coordinator": cls.coordinator,
                                "objects": len(new), "bytes": sum(new.values()),
                                "metadata": sum(b for p, b in new.items() if is_metadata(p))})

    last = cfg["saves"] - 1
    source = state()
    # a resume onto the same ranks (Shard(0)): the metadata each rank reads
    for name in ["amber", "peer"] if cfg["saves"] % 2 else ["peer", "amber"]:
        target = {"model": {k: sharded(torch.zeros(rows, cols), 0) for k in names},
                  "optim": {"state": {k: {"step": torch.zeros(()), "exp_avg": sharded(torch.zeros(rows, cols), 0),
                                          "exp_avg_sq": sharded(torch.zeros(rows, cols), 0)} for k in names}}}
        if name == "amber":
            reader = AmberStorageReader(amber_uri, opts, step=last)
            reader._store = amber.open(amber_uri, opts, mode="r")
            counted = count_metadata_reads(reader._store.history.backend)
        else:
            reader = PeerReader(f"{peer_root}/step_{last}", **({} if cfg["peer"] == "FileSystemWriter" else opts))
            counted = None
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        dist.barrier()
        seconds = time.perf_counter() - t0
        read = counted[0] if counted else fs.size(f"{peer_root}/step_{last}/.metadata")
        reads: list[int] = [0] * world
        dist.all_gather_object(reads, read)
        if rank == 0:
            records.append({"writer": name, "resume": last, "seconds": seconds, "metadata_read": reads})

    # a resharded load of the last step: Shard(0) -> Shard(1)
    for i, name in enumerate(["amber", "peer"] if cfg["saves"] % 2 else ["peer", "amber"]):
        target = {"model": {k: sharded(torch.zeros(rows, cols), 1) for k in names},
                  "optim": {"state": {k: {"step": torch.zeros(()), "exp_avg": sharded(torch.zeros(rows, cols), 1),
                                          "exp_avg_sq": sharded(torch.zeros(rows, cols), 1)} for k in names}}}
        reader = (AmberStorageReader(amber_uri, opts, step=last) if name == "amber"
                  else PeerReader(f"{peer_root}/step_{last}", **({} if cfg["peer"] == "FileSystemWriter" else opts)))
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        dist.barrier()
        seconds = time.perf_counter() - t0
        for k in names[:: max(1, n // 16)]:  # a sample, each against the source resharded
            want = source["model"][k].redistribute(mesh, [Shard(1)]).to_local()
            assert torch.equal(target["model"][k].to_local().view(torch.int32), want.view(torch.int32)), (name, k)
            want = source["optim"]["state"][k]["exp_avg_sq"].redistribute(mesh, [Shard(1)]).to_local()
            got = target["optim"]["state"][k]["exp_avg_sq"].to_local()
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, k)
        if rank == 0:
            records.append({"writer": name, "load": last, "seconds": seconds})
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(records))
        if profile is not None:
            profile.dump_stats(cfg["profile"])
    dist.barrier()
    dist.destroy_process_group()


def count_metadata_reads(backend: Any) -> list[int]:
    """A one-item list that sums the bytes ``backend`` returns for metadata keys (the commit
    index, fragments, zarr.json)."""
    total = [0]
    real = backend.get

    async def get(key: str, byte_range: Any = None) -> Any:
        got = await real(key, byte_range)
        if got is not None and (key.startswith("commits/") or is_metadata(key)):
            total[0] += got.nbytes
        return got

    backend.get = get
    return total


def peer(name: str) -> tuple[type, type]:
    """DCP's own writer and reader classes: for a local directory, or fsspec's (S3)."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return {"FileSystemWriter": (FileSystemWriter, FileSystemReader), "FsspecWriter": (FsspecWriter, FsspecReader)}[name]


# --- the driver ----------------------------------------------------------------------------

def run_world(world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from backends.process import free_port

    out = Path(tempfile.mkstemp(suffix=".json")[1])
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-config", json.dumps({**cfg, "out": str(out)})],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=3600)
        if p.returncode:
            raise SystemExit(f"a rank failed at world {world}:\n{err[-4000:]}")
    records = json.loads(out.read_text())
    out.unlink()
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    def pick(writer: str, key: str, full: bool | None = None) -> list[float]:
        return [r[key] for r in records if r["writer"] == writer and "save" in r
                and (full is None or (r["save"] == 0) == full)]

    out: dict[str, Any] = {}
    for w in ("amber", "peer"):
        out[w] = {"full_s": pick(w, "seconds", True)[0], "delta_s": statistics.median(pick(w, "seconds", False)),
                  "coordinator_ms": 1e3 * statistics.median(pick(w, "coordinator")),
                  "metadata_bytes": statistics.median(pick(w, "metadata")),
                  "objects": statistics.median(pick(w, "objects")),
                  "full_bytes": pick(w, "bytes", True)[0], "delta_bytes": statistics.median(pick(w, "bytes", False)),
                  "metadata_full": pick(w, "metadata", True)[0], "metadata_last": pick(w, "metadata", False)[-1],
                  "load_s": next(r["seconds"] for r in records if r["writer"] == w and "load" in r)}
        resume = next(r for r in records if r["writer"] == w and "resume" in r)
        out[w]["resume_s"] = resume["seconds"]
        out[w]["resume_read"] = statistics.mean(resume["metadata_read"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-config", help=argparse.SUPPRESS)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--locations", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    p.add_argument("--tensors", type=int, default=1000, help="parameter tensors (each with 2 AdamW moments)")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--cols", type=int, default=64)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--gap", type=int, default=3, help="AdamW steps between saves")
    p.add_argument("--still", action="store_true", help="no AdamW step before the last save (a delta in which "
                                                        "nothing changed)")
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    p.add_argument("--profile", type=Path, help="cProfile stats of amber-store's coordinator work (rank 0) here")
    args = p.parse_args()
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        os._exit(0)  # (gloo's threads sometimes abort at interpreter teardown)

    from backends.s3servers import SeaweedFS

    mb = args.tensors * args.rows * args.cols * 4 * 3 / 1e6
    base = {"tensors": args.tensors, "rows": args.rows, "cols": args.cols, "saves": args.saves, "gap": args.gap,
            "still": args.still,
            "profile": str(args.profile) if args.profile else None}
    measured: dict[tuple[str, int], dict[str, Any]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="amber-dcp-scale-"))
    try:
        for location in args.locations:
            server = SeaweedFS() if location == "s3" else None
            if server is not None:
                server.__enter__()
                server.create_bucket("bench")
            try:
                for world in args.worlds:
                    run = uuid.uuid4().hex[:8]
                    cfg = {**base, "root": f"s3://bench/{run}" if server else str(tmp / run),
                           "storage_options": server.storage_options() if server else None,
                           "peer": "FsspecWriter" if server else "FileSystemWriter"}
                    t0 = time.perf_counter()
                    measured[(location, world)] = summarize(run_world(world, cfg))
                    print(f"{location}, {world} ranks: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            finally:
                if server is not None:
                    server.__exit__(None, None, None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"machine: {machine()}")
    print(f"state: {args.tensors} parameters of {args.rows}x{args.cols} float32 + AdamW ({mb:.0f} MB), DTensor "
          f"Shard(0) over the ranks; {args.saves} saves {args.gap} AdamW steps apart"
          f"{' (none before the last: nothing changed)' if args.still else ''}, order alternating; resume: the last "
          "step onto the same ranks (metadata each rank reads, mean); load: the last step resharded into Shard(1); "
          "peer: FileSystemWriter (local), FsspecWriter (SeaweedFS S3)\n")
    rows = []
    for (location, world), m in measured.items():
        a, b = m["amber"], m["peer"]
        rows.append([location, world, f"{a['full_s']:.2f} / {b['full_s']:.2f} ({a['full_s'] / b['full_s']:.2f}x)",
                     f"{a['delta_s']:.2f} / {b['delta_s']:.2f} ({a['delta_s'] / b['delta_s']:.2f}x)",
                     f"{a['load_s']:.2f} / {b['load_s']:.2f} ({a['load_s'] / b['load_s']:.2f}x)",
                     f"{a['delta_bytes'] / b['delta_bytes']:.2f}x",
                     f"{a['coordinator_ms']:.0f} / {b['coordinator_ms']:.0f}",
                     f"{a['metadata_full'] / 1e3:.0f} / {b['metadata_full'] / 1e3:.0f}",
                     f"{a['metadata_last'] / 1e3:.0f} / {b['metadata_last'] / 1e3:.0f}",
                     f"{a['resume_read'] / 1e3:.0f} / {b['resume_read'] / 1e3:.0f}",
                     f"{a['resume_s']:.2f} / {b['resume_s']:.2f}",
                     f"{a['objects']:.0f} / {b['objects']:.0f}"])
    print(table(["storage", "ranks", "save full s (amber / peer)", "save delta s", "resharded load s",
                 "delta bytes vs peer", "coordinator ms", "metadata KB, full step", "metadata KB, last step",
                 "metadata KB a resuming rank reads", "resume s", "objects per step"], rows))
    print("\nAt 1,024 ranks and beyond: benchmarks/scale_sim.py (docs/SCALE.md).")
    if args.json:
        args.json.write_text(json.dumps({f"{k[0]}-{k[1]}": v for k, v in measured.items()}, indent=1))


if __name__ == "__main__":
    main()
