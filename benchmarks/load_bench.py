"""Load times: the latest step, a historical step, and one tensor (or a slice) read lazily.

``--steps`` checkpoints (a full step, then deltas after small updates) are written to a local
directory; each load is timed as a user runs it (a store opened afresh by its path), rotated
with ``torch.load`` of the same state from a file (median and range of ``--repeats`` rounds),
and the bytes it reads from storage are counted in one more, untimed, pass.

    python benchmarks/load_bench.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from zarr.storage import LocalStore, WrapperStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from benchmarks.common import clock, machine, rotated, table  # noqa: E402
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
    p.add_argument("--repeats", type=int, default=9)
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
        one = state[key].numel() * 4 / 1e6
        # Timed as a user loads (a fresh store opened by path: amber's own local reads), every
        # method once per round in rotating order; the bytes each reads come from one untimed
        # pass through a counting zarr store.
        loads: dict[str, tuple[Callable[[amber.Store], Any], float]] = {
            f"amber, whole latest step {args.steps}": (lambda s: s.load(args.steps, lazy=False), mb),
            f"amber, whole historical step {hist}": (lambda s: s.load(hist, lazy=False), mb),
            f"amber, one tensor ({one:.1f} MB) of step {hist}, lazily": (lambda s: s.load(hist)[key].materialize(), one),
            "amber, 16 rows of that tensor, lazily": (lambda s: s.load(hist)[key][:16],
                                                     16 * state[key].shape[1] * 4 / 1e6),
        }
        runs: dict[str, Callable[[], Any]] = {"torch.load, whole latest state": lambda: torch.load(root / "latest.pt")}
        runs.update({name: (lambda fn=fn: fn(amber.open(root / "amber", mode="r"))) for name, (fn, _) in loads.items()})
        times: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for fn in runs.values():  # warm-up: files in the page cache, kernels compiled
            fn()
        for i in range(args.repeats):
            for name in rotated(names, i):
                times[name].append(clock(runs[name])[0])
        cases: dict[str, tuple[list[float], int, float]] = {
            "torch.load, whole latest state": (times["torch.load, whole latest state"],
                                               (root / "latest.pt").stat().st_size, mb)}
        for name, (fn, returned) in loads.items():
            counter = ReadCounter(LocalStore(root / "amber", read_only=True))
            fn(amber.open(counter, mode="r"))
            cases[name] = (times[name], counter.bytes, returned)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"machine: {machine()}")
    print(f"state: {mb:.0f} MB float32 in {len(state)} tensors; {args.steps} steps (a full one, then deltas against "
          f"it: base_policy='auto'); {args.repeats} rounds, rotated; files in the page cache\n")
    rows = [[name, f"{statistics.median(t) * 1000:.0f} ({min(t) * 1000:.0f}-{max(t) * 1000:.0f})",
             f"{read / 1e6:.2f}", f"{want:.2f}"] for name, (t, read, want) in cases.items()]
    print(table(["load", "ms median (range)", "MB read from storage", "MB of tensor data returned"], rows))
    if args.json:
        args.json.write_text(json.dumps({k: {"seconds": t, "read": r, "returned_mb": w} for k, (t, r, w) in cases.items()},
                                        indent=1))


if __name__ == "__main__":
    main()
