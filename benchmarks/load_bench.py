"""Load times: the latest step, a historical step, and one tensor (or a slice) read lazily.

A chain of ``--steps`` checkpoints (a full step, then deltas after small updates) is written
to a local directory; each load is timed (median and range of ``--repeats`` runs, fresh store
object each time) with the bytes it read from storage, against ``torch.load`` of the same
state from a file.

    python benchmarks/load_bench.py
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
from typing import Any, Callable

import torch
from zarr.storage import LocalStore, WrapperStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402
from benchmarks.throughput import make_state, nbytes  # noqa: E402


class ReadCounter(WrapperStore):
    """Counts the bytes every read returns."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.bytes = 0

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        buf = await self._store.get(key, prototype, byte_range)
        if buf is not None:
            self.bytes += len(buf)
        return buf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    state = make_state(args.mb)
    mb = nbytes(state) / 1e6
    root = Path(tempfile.mkdtemp(prefix="amber-load-bench-"))
    g = torch.Generator().manual_seed(1)
    try:
        store = amber.open(root / "amber", mode="w", full_every=args.steps + 1)
        for step in range(1, args.steps + 1):
            state = {k: v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in state.items()}
            store.save(step, state)
        torch.save(state, root / "latest.pt")
        key = next(k for k in state if k.endswith("weight"))
        hist = max(1, args.steps // 2)

        def amber_load(fn: Callable[[amber.Store], Any]) -> tuple[list[float], int]:
            times, read = [], 0
            for _ in range(args.repeats):
                counter = ReadCounter(LocalStore(root / "amber", read_only=True))
                s = amber.open(counter, mode="r")
                t0 = time.perf_counter()
                fn(s)
                times.append(time.perf_counter() - t0)
                read = counter.bytes
            return times, read

        cases: dict[str, tuple[list[float], int, float]] = {}
        tl = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            torch.load(root / "latest.pt")
            tl.append(time.perf_counter() - t0)
        cases["torch.load, whole latest state"] = (tl, (root / "latest.pt").stat().st_size, mb)
        t, r = amber_load(lambda s: s.load(args.steps, lazy=False))
        cases[f"amber, whole latest step ({args.steps}, chain of {args.steps})"] = (t, r, mb)
        t, r = amber_load(lambda s: s.load(hist, lazy=False))
        cases[f"amber, whole historical step {hist}"] = (t, r, mb)
        one = state[key].numel() * 4 / 1e6
        t, r = amber_load(lambda s: s.load(hist)[key].materialize())
        cases[f"amber, one tensor ({one:.1f} MB) of step {hist}, lazily"] = (t, r, one)
        t, r = amber_load(lambda s: s.load(hist)[key][:16])
        cases["amber, 16 rows of that tensor, lazily"] = (t, r, 16 * state[key].shape[1] * 4 / 1e6)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"machine: {machine()}")
    print(f"state: {mb:.0f} MB float32 in {len(state)} tensors; a chain of {args.steps} steps (1 full + deltas); "
          f"{args.repeats} runs; files in the page cache\n")
    rows = [[name, f"{statistics.median(t) * 1000:.0f} ({min(t) * 1000:.0f}-{max(t) * 1000:.0f})",
             f"{read / 1e6:.2f}", f"{want:.2f}"] for name, (t, read, want) in cases.items()]
    print(table(["load", "ms median (range)", "MB read from storage", "MB of tensor data returned"], rows))
    if args.json:
        args.json.write_text(json.dumps({k: {"seconds": t, "read": r, "returned_mb": w} for k, (t, r, w) in cases.items()},
                                        indent=1))


if __name__ == "__main__":
    main()
