"""Base policies and ``full_above`` on a real training trajectory: stored bytes against what a
load reads.

Trains the benchmark GPT with AdamW on real text and saves the same checkpoints (every
``--every`` steps, ``--checkpoints`` of them, ``full_every=10``) into one store per variant:
each base policy (with the default ``full_above``), and ``full`` with other ``full_above``
shares (``None``: never store a tensor full in a delta step). Reports each store's bytes
against ``chain`` (the smallest deltas), the bytes a load of a step reads (its tensors' layers,
averaged over every step: a resume's expected cost), the deepest chain a read of one tensor
walks, and the time to load the deepest step against ``torch.load`` of the same state
(interleaved, medians). ``auto`` (the default) equals ``full`` here: every tensor is lossless.
Tensors under the pack threshold (1 MiB) are always diffed: at ``--width 384`` the MLP and
embedding tensors are above it.

    python benchmarks/policies.py             # about 5 minutes on 2 cores
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
from amber_store.runtime import sync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.demo import GPTConfig, Trainer, corpus  # noqa: E402
from amber_store.options import Options  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402

DEFAULT = Options.full_above
#: name -> store options
VARIANTS = {"chain": {"base_policy": "chain"}, "log": {"base_policy": "log"}, "full": {"base_policy": "full"},
            **{f"full, full_above={share}": {"base_policy": "full", "full_above": share} for share in (None, 0.8, 0.7)}}


def read_bytes(store: amber.Store, step: int) -> int:
    """Stored bytes of every layer a load of ``step`` decodes."""
    m = store.manifest(step)
    return sum(e.stored for key in m.tensors for _, e in sync(store.reader.chains.chain(step, key)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--every", type=int, default=10, help="training steps between checkpoints")
    p.add_argument("--checkpoints", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    trainer = Trainer(GPTConfig(width=args.width, layers=args.layers), data=corpus())
    root = Path(tempfile.mkdtemp(prefix="amber-policies-"))
    try:
        paths = {name: root / f"variant{i}" for i, name in enumerate(VARIANTS)}
        stores = {name: amber.open(paths[name], mode="w", durable=False, **opts) for name, opts in VARIANTS.items()}
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
        loads: dict[str, list[float]] = {name: [] for name in ("torch.load", *VARIANTS)}
        deepest = {}
        for name, store in stores.items():
            depths = {s: len(store.info(s)["chain"]) for s in store.steps()[-10:]}
            deepest[name] = max(depths, key=lambda s: (depths[s], s))
            out[name] = {"stored": sum(store.manifest(s).nbytes_stored for s in store.steps()),
                         "read per load": statistics.mean(read_bytes(store, s) for s in store.steps()),
                         "deepest chain": depths[deepest[name]]}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            torch.load(root / "last.pt", weights_only=True)
            loads["torch.load"].append(time.perf_counter() - t0)
            for name in VARIANTS:
                t0 = time.perf_counter()
                amber.open(paths[name], mode="r").load(deepest[name], lazy=False)
                loads[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ts_load = statistics.median(loads["torch.load"])
    for name in VARIANTS:
        out[name]["load s"] = statistics.median(loads[name])
        out[name]["vs torch.load"] = out[name]["load s"] / ts_load
    params = sum(t.numel() for t in trainer.model.parameters())
    print(f"machine: {machine()}")
    print(f"model: TinyGPT width {args.width}, {args.layers} layers: {params / 1e6:.2f}M params, AdamW, real text; "
          f"{args.checkpoints} checkpoints every {args.every} steps, full_every=10; loads: the deepest step of "
          f"the last segment, medians of {args.repeats}, interleaved with torch.load ({ts_load * 1e3:.0f} ms)\n")
    chain, full = out["chain"]["stored"], out["full"]["stored"]
    print(table(["variant", "stored MB", "vs chain", "MB a load reads (mean over steps)", "deepest chain (objects per tensor)",
                 "load deepest ms", "vs torch.load"],
                [[name, f"{r['stored'] / 1e6:.1f}", f"{r['stored'] / chain:.3f}x", f"{r['read per load'] / 1e6:.1f}",
                  f"{r['deepest chain']:.0f}", f"{r['load s'] * 1e3:.0f}", f"{r['vs torch.load']:.2f}x"]
                 for name, r in out.items()]))
    never = out["full, full_above=None"]
    print(f"\nfull stores {full / out['log']['stored'] - 1:+.1%} bytes against log, and loads its "
          f"deepest step {out['log']['load s'] / out['full']['load s']:.2f}x faster")
    print(f"full_above={DEFAULT} (default) against None: {full / never['stored'] - 1:+.1%} bytes stored, "
          f"{out['full']['read per load'] / never['read per load'] - 1:+.1%} bytes read per load, "
          f"deepest step loaded {never['load s'] / out['full']['load s']:.2f}x faster")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "policies": out}, indent=1))


if __name__ == "__main__":
    main()
