"""Base policies on a real training trajectory: stored bytes against the read depth.

Trains the benchmark GPT with AdamW on real text and saves the same checkpoints (every
``--every`` steps, ``--checkpoints`` of them, ``full_every=10``) into one store per base policy;
reports each store's bytes against ``chain`` (the smallest deltas), the deepest chain a read of
one tensor walks, and the time to load the deepest step against ``torch.load`` of the same
state (interleaved, medians). ``auto`` (the default) equals ``full`` here: every tensor is
lossless.

    python benchmarks/policies.py             # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.demo import GPTConfig, Trainer, corpus  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402

POLICIES = ("chain", "log", "full")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--every", type=int, default=10, help="training steps between checkpoints")
    p.add_argument("--checkpoints", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    trainer = Trainer(GPTConfig(width=args.width, layers=args.layers), data=corpus())
    root = Path(tempfile.mkdtemp(prefix="amber-policies-"))
    try:
        stores = {name: amber.open(root / name, mode="w", base_policy=name, durable=False) for name in POLICIES}
        step = 0
        for _ in range(args.checkpoints):
            for _ in range(args.every):
                step += 1
                trainer.step(step)
            state = trainer.state(step)
            for store in stores.values():
                store.save(step, state)
        torch.save(state, root / "last.pt")
        out: dict[str, dict[str, float]] = {}
        loads: dict[str, list[float]] = {name: [] for name in ("torch.load", *POLICIES)}
        deepest = {}
        for name, store in stores.items():
            depths = {s: len(store.info(s)["chain"]) for s in store.steps()[-10:]}
            deepest[name] = max(depths, key=lambda s: (depths[s], s))
            out[name] = {"stored": sum(store.manifest(s).nbytes_stored for s in store.steps()),
                         "deepest chain": depths[deepest[name]]}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            torch.load(root / "last.pt", weights_only=True)
            loads["torch.load"].append(time.perf_counter() - t0)
            for name in POLICIES:
                t0 = time.perf_counter()
                amber.open(root / name, mode="r").load(deepest[name], lazy=False)
                loads[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ts_load = statistics.median(loads["torch.load"])
    for name in POLICIES:
        out[name]["load s"] = statistics.median(loads[name])
        out[name]["vs torch.load"] = out[name]["load s"] / ts_load
    params = sum(t.numel() for t in trainer.model.parameters())
    print(f"machine: {machine()}")
    print(f"model: TinyGPT width {args.width}, {args.layers} layers: {params / 1e6:.2f}M params, AdamW, real text; "
          f"{args.checkpoints} checkpoints every {args.every} steps, full_every=10; loads: the deepest step of "
          f"the last segment, medians of {args.repeats}, interleaved with torch.load ({ts_load * 1e3:.0f} ms)\n")
    chain = out["chain"]["stored"]
    print(table(["base_policy", "stored MB", "vs chain", "deepest chain (objects per tensor)", "load deepest ms",
                 "vs torch.load"],
                [[name, f"{r['stored'] / 1e6:.1f}", f"{r['stored'] / chain:.3f}x", f"{r['deepest chain']:.0f}",
                  f"{r['load s'] * 1e3:.0f}", f"{r['vs torch.load']:.2f}x"] for name, r in out.items()]))
    print(f"\nfull stores {out['full']['stored'] / out['log']['stored'] - 1:+.1%} bytes against log, and loads its "
          f"deepest step {out['log']['load s'] / out['full']['load s']:.2f}x faster")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "policies": out}, indent=1))


if __name__ == "__main__":
    main()
