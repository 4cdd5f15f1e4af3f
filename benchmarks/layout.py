"""Save and load speed of the format-3 layout against torch.save / torch.load, and its footprint.

Two workloads: a GPT-like model with AdamW state (``--params`` millions of parameters, ~300
tensors) and ``--small`` small tensors (50 MB in all). For each, a run of ``--full-every``
checkpoints is written with the default bases (``auto``: lossless deltas against the full
step); every method is timed interleaved in one process (torch.save, amber full, amber delta,
then again), medians of ``--repeats``. Full saves are timed apart: a fresh store's first save
(which also allocates the host copy of every tensor kept as the next deltas' base) and the first
step of the next segment (buffers recycled: what a training run pays every ``full_every``
checkpoints); loads of the
full step, a depth-1 step and the deepest step against torch.load of the same state from the page
cache. Footprint: allocated bytes on disk (``du --block-size=1``) and files per step against
torch.save files of every step. Also the ``save_async`` stall against a bare copy into reused
buffers (idle, and right after a parallel torch op), for both and for a model of ``--blocks``
small blocks with its AdamW state, and the cost of ``durable=True`` (fsync before commit).

    python benchmarks/layout.py                 # about 4 minutes on 2 cores
    python benchmarks/layout.py --params 10 --small 500 --repeats 3    # quick
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.format import FORMAT_VERSION  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402


XOR_SAVE = 'amber save delta (codec="xor")'
XOR_LOAD = 'amber load depth 1 (codec="xor")'


def gpt_state(params_m: float, seed: int = 0) -> dict[str, Any]:
    """A GPT-like model's state dict and AdamW state with dense moments (~12 tensors a layer)."""
    g = torch.Generator().manual_seed(seed)
    d = 640
    layers = max(1, round((params_m * 1e6 - 16384 * d) / (12 * d * d)))
    shapes = {"wte": (16384, d), "wpe": (1024, d)}
    for i in range(layers):
        p = f"h.{i}."
        shapes.update({p + "ln1.w": (d,), p + "ln1.b": (d,), p + "qkv.w": (3 * d, d), p + "qkv.b": (3 * d,),
                       p + "proj.w": (d, d), p + "proj.b": (d,), p + "ln2.w": (d,), p + "ln2.b": (d,),
                       p + "fc1.w": (4 * d, d), p + "fc1.b": (4 * d,), p + "fc2.w": (d, 4 * d), p + "fc2.b": (d,)})
    model = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(s, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(s, generator=g) * 1e-6} for i, s in enumerate(shapes.values())}
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 3e-4, "params": list(state)}]}}


def small_state(n: int, total_mb: float = 50, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    numel = int(total_mb * 1e6 / 4 / n)
    return {"t": {str(i): torch.randn(numel, generator=g) for i in range(n)}}


def module_states(blocks: int, seed: int = 0) -> Callable[[], dict[str, Any]]:
    """A model of ``blocks`` small blocks (Linear 32x32 + LayerNorm: 4 parameters each) after an
    AdamW step, as a training loop hands it over: ``model.state_dict()`` (new detached tensors
    at every call) and ``optimizer.state_dict()`` made anew for each save."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))
                                  for _ in range(blocks)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    return lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()}


def tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def train_step(state: dict[str, Any], g: torch.Generator) -> None:
    """An AdamW-like update: every weight and both moments move by a small random amount
    (about 1e-3 of their spread), so every element's low mantissa bits change."""
    for t in tensors(state):
        if t.dtype.is_floating_point and t.dim() > 0:
            t.add_(torch.randn(t.shape, generator=g), alpha=1e-3 * float(t.std()))


def nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def allocated(path: Path) -> tuple[int, int]:
    """(allocated bytes as du reports them, number of files) under ``path``."""
    out = subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0]), sum(1 for p in path.rglob("*") if p.is_file())


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(name: str, state: dict[str, Any], full_every: int, repeats: int, root: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    raw = nbytes(state)
    times: dict[str, list[float]] = {k: [] for k in (
        "torch.save", "amber save full (fresh store)", "amber save full", "amber save delta",
        "amber save delta (durable=False)", XOR_SAVE)}
    loads: dict[str, list[float]] = {k: [] for k in ("torch.load", "amber load full", "amber load depth 1",
                                                     "amber load deepest", XOR_LOAD)}
    delta_bytes = {"default": 0, "xor": 0}
    for r in range(repeats):
        run = root / f"{name}-{r}"
        ts_dir = root / f"{name}-{r}-ts"
        ts_dir.mkdir(parents=True)
        store = amber.open(run, full_every=full_every)
        fast = amber.open(root / f"{name}-{r}-nd", full_every=full_every, durable=False)
        xor = amber.open(root / f"{name}-{r}-xor", full_every=full_every, codec="xor")  # format 5's default
        for pos in range(full_every):
            if pos:
                train_step(state, g)
            times["torch.save"].append(timed(lambda: torch.save(state, ts_dir / f"{pos}.pt")))
            key = "amber save full (fresh store)" if pos == 0 else "amber save delta"
            times[key].append(timed(lambda: store.save(pos, state)))
            if pos:
                times["amber save delta (durable=False)"].append(timed(lambda: fast.save(pos, state)))
                times[XOR_SAVE].append(timed(lambda: xor.save(pos, state)))
                delta_bytes["default"] += store.info(pos)["nbytes_stored"]
                delta_bytes["xor"] += xor.info(pos)["nbytes_stored"]
            else:
                fast.save(pos, state)
                xor.save(pos, state)
        depths = {s: len(store.info(s)["chain"]) for s in store.steps()}
        deepest = max(depths, key=lambda s: (depths[s], s))
        # loads from the page cache: one untimed pass first reads back what the ~18 GB written
        # since (torch's files, three stores) may have pushed out of this VM's 24 GB (without
        # it, step 1's loads once took twice the deepest step's, which decodes as many layers)
        cases = {"torch.load": lambda: torch.load(ts_dir / f"{deepest}.pt", weights_only=True)}
        for label, step in (("amber load full", 0), ("amber load depth 1", 1), ("amber load deepest", deepest)):
            cases[label] = lambda step=step: amber.open(run, mode="r").load(step, lazy=False)
        cases[XOR_LOAD] = lambda: amber.open(root / f"{name}-{r}-xor", mode="r").load(1, lazy=False)
        for fn in cases.values():
            fn()
        for _ in range(2):
            for label, fn in cases.items():
                loads[label].append(timed(fn))
        if r == 0:
            alloc, files = allocated(run)
            ts_alloc, ts_files = allocated(ts_dir)
            objects = max(len([p for p in (run / store.manifest(s).group).rglob("*") if p.is_file()])
                          for s in store.steps()) + 1  # + the manifest
            large = sum(1 for e in store.manifest(0).tensors.values() if e.pack is None)
            footprint = {"amber allocated": alloc, "torch.save allocated": ts_alloc, "amber files": files,
                         "torch.save files": ts_files, "objects per step (max)": objects,
                         "large tensors": large, "deepest chain": depths[deepest]}
        for k in (1, 2):  # the next segments' first steps
            # a new file, as each of amber's steps and a training job's checkpoints are
            times["torch.save"].append(timed(lambda: torch.save(state, ts_dir / f"next{k}.pt")))
            times["amber save full"].append(timed(lambda: store.save(k * full_every, state, full=True)))
        shutil.rmtree(run)
        shutil.rmtree(ts_dir)
        shutil.rmtree(root / f"{name}-{r}-nd")
        shutil.rmtree(root / f"{name}-{r}-xor")
    med = {k: statistics.median(v) for k, v in {**times, **loads}.items()}
    return {"raw_bytes": raw, "tensors": len(tensors(state)), "median_s": med, "footprint": footprint,
            "delta_bytes_vs_xor": delta_bytes["default"] / delta_bytes["xor"],
            "ratios": {k: med[k] / med["torch.save"] for k in times} | {k: med[k] / med["torch.load"] for k in loads}}


def stall(make: Callable[[], dict[str, Any]], samples: int, root: Path) -> dict[str, float]:
    """save_async's blocking time for the state ``make()`` returns (made before the clock
    starts) against a bare copy of its tensors into reused buffers, each measured ``samples``
    times, alternately (the order swapped every repeat): with the CPU idle before each, and
    right after a parallel torch op, as when a training step ends (20 ms of matmuls; torch's
    OpenMP workers then spin on the other cores for a few ms)."""
    flat = tensors(make())
    buffers = [torch.empty_like(t) for t in flat]
    store = amber.open(root / "stall", max_pending=2)
    a = torch.randn(256, 256)

    def training_op() -> None:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            a @ a

    out: dict[str, float] = {}
    step = 0
    for after_op in (False, True):
        times: dict[str, list[float]] = {"bare copy": [], "save_async": []}
        for r in range(samples):
            for method in ("bare copy", "save_async") if r % 2 else ("save_async", "bare copy"):
                state = make()
                if after_op:
                    training_op()
                if method == "bare copy":
                    times[method].append(timed(lambda: [b.copy_(t) for b, t in zip(buffers, flat)]))
                else:
                    times[method].append(timed(lambda: store.save_async(step, state)))
                    store.wait()
                    step += 1
        med = {k: statistics.median(v) for k, v in times.items()}
        suffix = " after a parallel op" if after_op else ""
        out |= {k + suffix: v for k, v in med.items()} | {"ratio" + suffix: med["save_async"] / med["bare copy"]}
    store.close()
    shutil.rmtree(root / "stall")
    return out


def policies(state: dict[str, Any], full_every: int, root: Path) -> dict[str, dict[str, float]]:
    """Bytes of one segment and the load time of its deepest step, per base policy (the same
    trajectory for each), against torch.load of that step."""
    out = {}
    start = {k: t.clone() for k, t in enumerate(tensors(state))}
    for policy in ("chain", "log", "full"):
        for k, t in enumerate(tensors(state)):
            t.copy_(start[k])
        g = torch.Generator().manual_seed(2)
        store = amber.open(root / policy, full_every=full_every, base_policy=policy, durable=False)
        for pos in range(full_every):
            if pos:
                train_step(state, g)
            store.save(pos, state)
        torch.save(state, root / "last.pt")
        depths = {s: len(store.info(s)["chain"]) for s in store.steps()}
        deepest = max(depths, key=lambda s: (depths[s], s))
        loads, ts = [], []
        for _ in range(3):
            ts.append(timed(lambda: torch.load(root / "last.pt", weights_only=True)))
            loads.append(timed(lambda: amber.open(root / policy, mode="r").load(deepest, lazy=False)))
        out[policy] = {"stored": sum(store.manifest(s).nbytes_stored for s in store.steps()),
                       "deepest": depths[deepest], "load_s": statistics.median(loads),
                       "load_vs_torch_load": statistics.median(loads) / statistics.median(ts)}
        shutil.rmtree(root / policy)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=50, help="GPT-like model size, millions of parameters")
    p.add_argument("--small", type=int, default=2000, help="number of small tensors (50 MB in all)")
    p.add_argument("--blocks", type=int, default=500, help="blocks of the many-parameter model (stall only)")
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--policy-params", type=float, default=20, help="model size of the base-policy comparison")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stall-samples", type=int, default=30,
                   help="save_async stalls (and bare copies) measured per state; a few ms each, noisy")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="amber-layout-"))
    try:
        results = {}
        for name, state in (("gpt", gpt_state(args.params)), ("small", small_state(args.small))):
            results[name] = bench(name, state, args.full_every, args.repeats, root)
            results[name]["stall"] = stall(lambda: state, args.stall_samples, root)
        make = module_states(args.blocks)
        modules = {"blocks": args.blocks, "tensors": len(tensors(make())), "stall": stall(make, args.stall_samples, root)}
        policy_run = policies(gpt_state(args.policy_params), args.full_every, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# Layout: save/load speed and footprint (format {FORMAT_VERSION})\n\n{machine()}; full_every={args.full_every}, "
          f"base_policy=auto (the default: these lossless tensors diff against the full step), medians of "
          f"{args.repeats} runs, interleaved.\n")
    for name, r in results.items():
        mb = r["raw_bytes"] / 1e6
        print(f"## {name}: {mb:.0f} MB in {r['tensors']} tensors\n")
        rows = [[k, f"{r['median_s'][k]:.3f}", f"{r['ratios'][k]:.2f}x"] for k in r["median_s"]]
        print(table(["method", "median s", "vs torch.save / torch.load"], rows))
        f = r["footprint"]
        print(f"\nAllocated on disk: amber {f['amber allocated'] / 1e6:.0f} MB in {f['amber files']} files vs "
              f"torch.save {f['torch.save allocated'] / 1e6:.0f} MB in {f['torch.save files']} files "
              f"(**{f['amber allocated'] / f['torch.save allocated']:.2f}x**); objects per step "
              f"{f['objects per step (max)']} for {f['large tensors']} tensors above the pack threshold; "
              f"deepest chain {f['deepest chain']} objects. Delta steps store "
              f"{r['delta_bytes_vs_xor']:.3f}x the bytes of `codec=\"xor\"`'s (format 5's default).")
        s = r["stall"]
        print(f"save_async stall {s['save_async']:.4f} s vs bare copy {s['bare copy']:.4f} s "
              f"(**{s['ratio']:.2f}x**); right after a parallel torch op {s['save_async after a parallel op']:.4f} s "
              f"vs {s['bare copy after a parallel op']:.4f} s (**{s['ratio after a parallel op']:.2f}x**); medians of "
              f"{args.stall_samples}, alternating.\n")
    s = modules["stall"]
    print(f"## A model of {args.blocks} small blocks and its AdamW state: {modules['tensors']} tensors\n\n"
          f"`model.state_dict()` and `optimizer.state_dict()` made anew for each save, as a training loop hands them "
          f"over. save_async stall {s['save_async']:.4f} s vs bare copy {s['bare copy']:.4f} s (**{s['ratio']:.2f}x**); "
          f"right after a parallel torch op {s['save_async after a parallel op']:.4f} s vs "
          f"{s['bare copy after a parallel op']:.4f} s (**{s['ratio after a parallel op']:.2f}x**).\n")
    print(f"## Base policies: one segment of {args.full_every} steps, GPT-like {args.policy_params:g}M params\n")
    chain_bytes = policy_run["chain"]["stored"]
    print(table(["base_policy", "stored MB", "vs chain", "objects read per tensor (deepest)",
                 "load deepest, s", "vs torch.load"],
                [[p, f"{r['stored'] / 1e6:.0f}", f"{r['stored'] / chain_bytes:.2f}x", r["deepest"],
                  f"{r['load_s']:.3f}", f"{r['load_vs_torch_load']:.2f}x"] for p, r in policy_run.items()]))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "results": results,
                                         "modules": modules, "policies": policy_run}, indent=1))


if __name__ == "__main__":
    main()
