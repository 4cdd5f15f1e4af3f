"""How save time and stored bytes grow with model size: torch.save vs amber (full and delta).

Model weights of GPT-like shapes from ~5M to ~100M parameters (float32); each is saved with
torch.save, then to amber as a full step and as a delta after a small update of every weight.

    python benchmarks/sweep.py
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
from benchmarks.common import machine, table  # noqa: E402


def weights(params_m: float, seed: int = 0) -> dict[str, torch.Tensor]:
    width = 512 if params_m < 30 else 1024
    layers = max(1, round(params_m * 1e6 / (12 * width * width)))
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        for name, shape in (("qkv", (3 * width, width)), ("proj", (width, width)), ("up", (4 * width, width)),
                            ("down", (width, 4 * width))):
            state[f"blocks.{i}.{name}.weight"] = torch.randn(shape, generator=g) * 0.02
        state[f"blocks.{i}.ln.weight"] = torch.ones(width)
    return state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[5, 12, 25, 50, 100], help="millions of parameters")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows, raw = [], []
    for size in args.sizes:
        state = weights(size)
        n = sum(t.numel() for t in state.values())
        g = torch.Generator().manual_seed(1)
        updated = {k: v + 1e-4 * torch.randn(v.shape, generator=g) * (k.endswith("ln.weight") is False) for k, v in state.items()}
        root = Path(tempfile.mkdtemp(prefix="amber-sweep-"))
        try:
            r = {"params": n, "torch_save_s": [], "full_s": [], "delta_s": []}
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                torch.save(state, root / "s.pt")
                r["torch_save_s"].append(time.perf_counter() - t0)
                r["torch_save_bytes"] = (root / "s.pt").stat().st_size
                store = amber.open(root / "a", mode="w")
                full = store.save(1, state)
                delta = store.save(2, updated)
                r["full_s"].append(full.seconds)
                r["delta_s"].append(delta.seconds)
                r["full_bytes"], r["delta_bytes"] = full.nbytes_stored, delta.nbytes_stored
                store.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
        raw.append(r)
        med = statistics.median
        rows.append([f"{n / 1e6:.1f}M", f"{r['torch_save_bytes'] / 1e6:.0f}", f"{med(r['torch_save_s']):.2f}",
                     f"{r['full_bytes'] / 1e6:.0f}", f"{med(r['full_s']):.2f}", f"{r['delta_bytes'] / 1e6:.0f}",
                     f"{med(r['delta_s']):.2f}", f"{med(r['delta_s']) / med(r['torch_save_s']):.1f}x"])
    print(f"machine: {machine()}; {args.repeats} runs, medians; amber writes to a local directory\n")
    print(table(["params", "torch.save MB", "torch.save s", "amber full MB", "amber full s", "amber delta MB",
                 "amber delta s", "delta s / torch.save s"], rows))
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
