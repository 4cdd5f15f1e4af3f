"""Host memory of saves and loads, each operation in a fresh process, against torch.save,
safetensors and torch.distributed.checkpoint (DCP) measured in the same run.

The state is a GPT-like model (``--params`` millions of parameters: blocks of width 768, a 16k
vocabulary) and its AdamW state after one step, S bytes (fp32: 12 bytes a parameter), built and
touched before anything is measured. A save operation saves it (a full step), takes one more
AdamW step, and saves again (a delta step for amber-store; a full copy for the peers), waiting
for each save; a load reads the second state back. The figure is the operation's peak RSS
beyond the RSS before it (VmHWM after writing 5 to /proc/self/clear_refs), as a share of S;
"left" is the RSS beyond that baseline once the operation returned (for a store: before it is
closed), "closed" after ``close()``; seconds are the saves' wall time (the second one's apart).
The library a training process has loaded before its first checkpoint (imports; amber-store's
kernels, compiled by a first tiny save) is loaded before the baseline and reported apart
("library"), and the training step between the two saves is left out of the peak.

    python benchmarks/memory.py --params 96 --rounds 3 --s3 --times 12 --plot benchmarks/results/memory.png
    python benchmarks/memory.py --ranks 4 --params 96   # the sharded CheckpointManager per rank
    python benchmarks/memory.py --s3 --only "S3: torch.save + PUT" "S3: save (spill)"   # on SeaweedFS

With ``--ranks N`` the model is FSDP2-sharded over N gloo ranks on this machine and each rank
measures its own peak (beyond its shard of the state, S/N) across two saves: amber-store's
sharded CheckpointManager (``dcp.async_save`` through AmberStorageWriter) against
``dcp.async_save`` to a directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, rotated, table  # noqa: E402

SAVES = ["torch.save", "safetensors", "dcp.save", "dcp.async_save",
         "save (spill)", "save (memory)", "save (none)", "delta save, fresh process (spill)",
         "delta save, fresh process (memory)", "save_async (spill)", "save_async (memory)", "CheckpointManager"]
LOADS = ["torch.load", "dcp.load into", "load(lazy=False)", "load(into=)"]
#: against a SeaweedFS server the benchmark starts (``--s3``): torch.save into memory and one PUT
S3 = ["S3: torch.save + PUT", "S3: save (spill)"]
SHARDED = ["dcp.async_save (per rank)", "CheckpointManager (per rank)"]


def status(field: str) -> int:
    """A /proc/self/status field, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Start a new peak (VmHWM := VmRSS), once the C heap's free memory is back with the kernel
    (what a training step freed is no save's); returns the RSS now."""
    import gc

    from amber_store.runtime import return_free_memory

    gc.collect()
    return_free_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


class Peak:
    """The highest RSS beyond ``base`` over the windows between :meth:`pause` (the training
    step between two saves is no save's) and :meth:`resume`."""

    def __init__(self) -> None:
        self.base = reset_peak()
        self.high = 0

    def pause(self) -> None:
        self.high = max(self.high, status("VmHWM") - self.base)

    def resume(self) -> None:
        reset_peak()

    def peak(self) -> int:
        self.pause()
        return self.high


def build(params_m: float, shard: bool = False):
    """The model and its AdamW state after one step (deterministic), and ``advance()``, one
    more step; with ``shard``, FSDP2 over the process group."""
    import torch

    torch.manual_seed(0)
    width, vocab = 768, 16384
    blocks = max(1, round((params_m * 1e6 - vocab * width) / (12 * width * width + 13 * width)))
    layers: list[torch.nn.Module] = [torch.nn.Embedding(vocab, width)]
    for _ in range(blocks):
        layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width),
                   torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)]
    model = torch.nn.Sequential(*layers)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def advance(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            grad = torch.randn(local.shape, generator=g) * 1e-3
            p.grad = type(p).from_local(grad, p.device_mesh, p.placements) if hasattr(p, "to_local") else grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    advance(1)
    return model, optimizer, advance


def state_bytes(model, optimizer) -> int:
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    n = sum(local(p).nbytes for p in model.parameters())
    n += sum(local(v).nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return n


def child(op: str, root: str) -> dict:
    """One operation in this (fresh) process."""
    import torch

    model, optimizer, advance = build(float(os.environ["MEMORY_PARAMS"]))
    size = state_bytes(model, optimizer)

    def state() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    library = load_library(op, root)
    meter = Peak()
    seconds: list[float] = []
    closer = None
    cleanup = None

    def advance_between(seed: int) -> None:  # a training step between two saves
        meter.pause()
        advance(seed)
        meter.resume()

    def timed(fn) -> None:
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)

    if op.startswith("S3: "):
        import io
        import uuid

        from backends.s3servers import S3Endpoint

        s3 = json.loads(os.environ["MEMORY_S3"])
        prefix = uuid.uuid4().hex
        client = S3Endpoint(s3["endpoint_url"], s3["key"], s3["secret"]).client()
        cleanup = lambda: empty_prefix(client, prefix)  # noqa: E731  # rounds must not fill the server
        if op == "S3: torch.save + PUT":
            def put(step: int) -> None:
                buf = io.BytesIO()
                torch.save(state(), buf)
                buf.seek(0)
                client.put_object(Bucket="amber", Key=f"{prefix}/{step}.pt", Body=buf)
        else:
            import amber_store as amber

            store = amber.open(f"s3://amber/{prefix}", s3["options"], mode="w")
            closer = store.close

            def put(step: int) -> None:
                store.save(step, state())
        for step in (1, 2):
            if step == 2:
                advance_between(2)
            timed(lambda: put(step))
    elif op in LOADS:
        advance(2)  # the state saved by the prepare step
        target = state()
        meter = Peak()
        if op == "torch.load":
            timed(lambda: model.load_state_dict(torch.load(f"{root}/state.pt", weights_only=True)["model"]))
        elif op == "dcp.load into":
            import torch.distributed.checkpoint as dcp

            timed(lambda: dcp.load(target, checkpoint_id=f"{root}/dcp"))
        else:
            import amber_store as amber

            store = amber.open(f"{root}/store", mode="r")
            into = {"into": target} if op == "load(into=)" else {}
            timed(lambda: store.load(2, lazy=False, **into))
            closer = store.close
    elif op in ("torch.save", "safetensors", "dcp.save", "dcp.async_save"):
        for step in (1, 2):
            if step == 2:
                advance_between(2)
            out = f"{root}/{op}-{step}"
            if op == "torch.save":
                timed(lambda: torch.save(state(), out))
            elif op == "safetensors":
                from safetensors.torch import save_file

                flat = {f"model.{k}": v for k, v in model.state_dict().items()}
                flat |= {f"optim.{i}.{k}": v for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()}
                timed(lambda: save_file(flat, out))
            else:
                import torch.distributed as dist
                import torch.distributed.checkpoint as dcp

                if not dist.is_initialized():
                    dist.init_process_group("gloo", init_method=f"file://{root}/pg-{op}", rank=0, world_size=1)
                if op == "dcp.save":
                    timed(lambda: dcp.save(state(), checkpoint_id=out))
                else:
                    timed(lambda: dcp.async_save(state(), checkpoint_id=out).result())
    else:
        import amber_store as amber

        mode = op[op.index("(") + 1: op.index(")")] if "(" in op else "spill"
        options = {"base_cache": mode}
        if op == "CheckpointManager":
            from amber_store import CheckpointManager

            manager = CheckpointManager(f"{root}/store-{op}", every=1, keep_last=2)
            for step in (1, 2):
                if step == 2:
                    advance_between(2)
                timed(lambda: (manager.maybe_save(step, model=model, optimizer=optimizer), manager.wait()))
            closer = manager.close
        elif op.startswith("delta save, fresh process"):
            store = amber.open(f"{root}/fresh-{mode}", **options)  # step 1 saved by another process
            advance_between(2)
            timed(lambda: store.save(2, state()))
            closer = store.close
        else:
            store = amber.open(f"{root}/store-{mode}-{op.split()[0]}", mode="w", **options)
            for step in (1, 2):
                if step == 2:
                    advance_between(2)
                if op.startswith("save_async"):
                    timed(lambda: store.save_async(step, state()).result())
                else:
                    timed(lambda: store.save(step, state()))
            closer = store.close
    peak = meter.peak()
    left = status("VmRSS") - meter.base
    closed = None
    if closer is not None:
        closer()
        import gc

        gc.collect()
        closed = status("VmRSS") - meter.base
    if cleanup is not None:
        cleanup()
    return {"op": op, "state": size, "peak": peak, "left": left, "closed": closed, "seconds": seconds,
            "library": library}


def empty_prefix(client, prefix: str) -> None:
    """Delete every object under ``prefix`` in the benchmark's bucket."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="amber", Prefix=f"{prefix}/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket="amber", Delete={"Objects": keys})


def load_library(op: str, root: str) -> int:
    """What a training process holds of the operation's library before its first checkpoint
    (imports; for amber-store also a first tiny save and delta in a store of its own, which
    compile its CPU kernels): RSS bytes, measured apart from the operations."""
    import torch

    before = reset_peak()
    if op in ("safetensors",):
        import safetensors.torch  # noqa: F401
    elif op.startswith("dcp"):
        import torch.distributed.checkpoint  # noqa: F401
    elif op != "torch.save" and op != "torch.load":
        import amber_store as amber

        with amber.open(f"{root}/library-{os.getpid()}", mode="w") as store:
            for step in range(2):
                store.save(step, {"w": torch.full((1 << 20,), float(step)), "b": torch.full((64,), float(step))})
        shutil.rmtree(f"{root}/library-{os.getpid()}")
    return reset_peak() - before


def prepare(root: Path) -> None:
    """The files the loads read and the step-1 stores the fresh-process delta saves extend."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import amber_store as amber

    model, optimizer, advance = build(float(os.environ["MEMORY_PARAMS"]))
    with amber.open(root / "fresh-pristine", mode="w") as store:
        store.save(1, {"model": model.state_dict(), "optim": optimizer.state_dict()})
    with amber.open(root / "store", mode="w") as store:
        store.save(1, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        advance(2)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        store.save(2, state)
    torch.save(state, root / "state.pt")
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-prepare", rank=0, world_size=1)
    dcp.save(state, checkpoint_id=root / "dcp")
    dist.destroy_process_group()


def sharded_saves(op: str, root: str, model, optimizer, advance, meter: Peak | None = None) -> list[float]:
    """Two saves by ``op`` on every rank (a training step between them); their seconds."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    seconds: list[float] = []
    manager = None
    if op.startswith("CheckpointManager"):
        from amber_store import CheckpointManager

        manager = CheckpointManager(f"{root}/store", every=1, keep_last=2)
    else:
        group = dist.new_group(backend="gloo")
    for step in (1, 2):
        if step == 2:
            if meter is not None:
                meter.pause()
            advance(2)
            if meter is not None:
                meter.resume()
        t0 = time.perf_counter()
        if manager is not None:
            manager.maybe_save(step, model=model, optimizer=optimizer)
            manager.wait()
        else:
            msd, osd = get_state_dict(model, optimizer)
            dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp-{step}",
                           process_group=group).result()
        seconds.append(time.perf_counter() - t0)
    return seconds


def sharded_child(op: str, root: str) -> dict:
    """One rank of ``op`` (torch.distributed's environment set by the parent)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    # the library as the first checkpoint of a job leaves it: the same two saves of a small model
    before = reset_peak()
    small = build(1, shard=True)
    sharded_saves(op, f"{root}/library", *small)
    del small
    library = reset_peak() - before
    model, optimizer, advance = build(float(os.environ["MEMORY_PARAMS"]), shard=True)
    size = state_bytes(model, optimizer)
    meter = Peak()
    seconds = sharded_saves(op, f"{root}/state", model, optimizer, advance, meter)
    left = status("VmRSS") - meter.base
    peak = meter.peak()
    dist.barrier()
    dist.destroy_process_group()
    return {"op": op, "state": size, "peak": peak, "left": left, "closed": None, "seconds": seconds,
            "library": library}


def save_times(params: float, saves: int, root: Path) -> str:
    """What each ``base_cache`` costs a save: one process saving the same states into a store of
    each kind in turn (every 4th save full), beside torch.save of them, the order rotated from
    save to save; medians of the full and of the delta saves."""
    import torch

    import amber_store as amber

    model, optimizer, advance = build(params)
    modes = ["spill", "memory", "none"]
    stores = {m: amber.open(root / f"times-{m}", mode="w", base_cache=m, full_every=4) for m in modes}
    times: dict[str, dict[str, list[float]]] = {m: {"full": [], "delta": []} for m in [*modes, "torch.save"]}
    for step in range(saves):
        if step:
            advance(step + 10)
        kind = "full" if step % 4 == 0 else "delta"
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        for who in rotated([*modes, "torch.save"], step):
            t0 = time.perf_counter()
            if who == "torch.save":
                torch.save(state, root / "times.pt")
            else:
                stores[who].save(step, state)
            times[who][kind].append(time.perf_counter() - t0)
    for store in stores.values():
        store.close()
    base = {k: statistics.median(times["torch.save"][k]) for k in ("full", "delta")}
    rows = [[who, *(f"{statistics.median(t[k]):.2f} s ({statistics.median(t[k]) / base[k]:.2f}x)"
                    for k in ("full", "delta"))] for who, t in times.items()]
    return (f"Save time by `base_cache` ({saves} saves in one process, every 4th full; x: against torch.save of the "
            "same state in the same rounds):\n\n" + table(["base_cache", "full save", "delta save"], rows))


def run(op: str, root: Path, params: float, ranks: int = 0) -> list[dict]:
    env = {**os.environ, "MEMORY_PARAMS": str(params)}
    if not ranks:
        proc = subprocess.run([sys.executable, __file__, "--child", op, str(root)], env=env, capture_output=True,
                              text=True)
        if proc.returncode:
            raise SystemExit(f"{op}:\n{proc.stderr[-3000:]}")
        return [json.loads(proc.stdout.splitlines()[-1])]
    from backends.process import free_port

    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks))
    procs = [subprocess.Popen([sys.executable, __file__, "--sharded-child", op, str(root)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode:
            raise SystemExit(f"{op}:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.splitlines()[-1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=96, help="millions of model parameters")
    p.add_argument("--rounds", type=int, default=1, help="each operation this many times (medians)")
    p.add_argument("--ranks", type=int, default=0, help="the sharded CheckpointManager on this many gloo ranks")
    p.add_argument("--only", nargs="*", help="these operations only (none: with --times, the save times alone)")
    p.add_argument("--s3", action="store_true", help="also save to a SeaweedFS server started here")
    p.add_argument("--times", type=int, metavar="SAVES", help="also time SAVES saves by each base_cache, warm")
    p.add_argument("--json", type=Path, help="write the raw figures here")
    p.add_argument("--plot", type=Path, help="draw the peaks here (png)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--sharded-child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    if args.sharded_child:
        print(json.dumps(sharded_child(*args.sharded_child)))
        return
    ops = SHARDED if args.ranks else SAVES + LOADS + (S3 if args.s3 else [])
    ops = [op for op in ops if args.only is None or op in args.only]
    results: dict[str, list[dict]] = {op: [] for op in ops}
    with tempfile.TemporaryDirectory(dir=os.environ.get("MEMORY_DIR")) as tmp, contextlib.ExitStack() as stack:
        if args.s3:
            from backends.s3servers import SeaweedFS

            server = stack.enter_context(SeaweedFS())
            server.create_bucket("amber")
            os.environ["MEMORY_S3"] = json.dumps({"endpoint_url": server.endpoint, "key": server.key,
                                                  "secret": server.secret, "options": server.storage_options()})
        root = Path(tmp)
        if not args.ranks and ops:
            subprocess.run([sys.executable, __file__, "--prepare", str(root)],
                           env={**os.environ, "MEMORY_PARAMS": str(args.params)}, check=True)
        for r in range(args.rounds):
            for op in (ops if r % 2 == 0 else ops[::-1]):
                for d in root.glob("store-*"):  # each round saves into new stores
                    shutil.rmtree(d)
                if op.startswith("delta save, fresh process"):  # a store holding step 1 alone
                    mode = op[op.index("(") + 1: op.index(")")]
                    shutil.rmtree(root / f"fresh-{mode}", ignore_errors=True)
                    shutil.copytree(root / "fresh-pristine", root / f"fresh-{mode}")
                rows = run(op, root, args.params, args.ranks)
                results[op].extend(rows)
                print(op, [f"{row['peak'] / row['state']:.2f} S" for row in rows], file=sys.stderr, flush=True)
        times = save_times(args.params, args.times, root) if args.times else None
    if ops:
        report(results, args)
    if times:
        print(f"\n{times}")


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    def med(rows: list[dict], key: str) -> float | None:
        vals = [r[key] / r["state"] for r in rows if r[key] is not None]
        return statistics.median(vals) if vals else None

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} S"

    state = statistics.median(r["state"] for rows in results.values() for r in rows)
    rows = []
    for op, rs in results.items():
        secs = [r["seconds"] for r in rs]
        first = statistics.median(s[0] for s in secs)
        second = statistics.median(s[1] for s in secs) if all(len(s) > 1 for s in secs) else None
        rows.append([op, share(med(rs, "peak")), share(med(rs, "left")), share(med(rs, "closed")),
                     f"{first:.2f}" + ("" if second is None else f" / {second:.2f}"),
                     f"{statistics.median(r['library'] for r in rs) / 2**20:.0f}"])
    who = f"per rank, {args.ranks} gloo ranks (S = each rank's shard)" if args.ranks else "one process"
    text = (f"Host memory, {who}; S = {state / 1e9:.2f} GB ({args.params:g}M-parameter GPT + AdamW), "
            f"{machine()}, {args.rounds} round(s), medians.\n\n"
            + table(["operation", "peak beyond the state", "left after", "after close", "seconds (1st / 2nd)",
                     "library, MiB"], rows))
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot, who)


def plot(results: dict[str, list[dict]], path: Path, who: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(results)
    peaks = [statistics.median(r["peak"] / r["state"] for r in results[op]) for op in ops]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(ops) + 1.2))
    colors = ["#888" if op.startswith(("torch.", "safetensors", "dcp.", "S3: torch.")) else "#c60" for op in ops]
    ax.barh(ops[::-1], peaks[::-1], color=colors[::-1])
    ax.set_xlabel("peak RSS beyond the state (x S)")
    ax.set_title(f"Host memory, {who} (grey: the peers)")
    for x in (0.35, 1.2):
        ax.axvline(x, color="k", lw=0.5, ls=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
