"""Is a lossy codec's resumed-loss change real, or the chaos of training? The same resumes on
several data streams.

lossy.py resumes every store on one data stream (the training run's own) and calls changes
below its noise floor (the exact state perturbed by 1e-5) unresolved; a change above it could
still be that one stream's luck. Here the same 3.2M-parameter run is checkpointed exactly and
with ``codec="lossy"`` at intervals of 1 and 10 steps; the exact state, the same state
perturbed by 1e-5, and each lossy store's last step are then each resumed on ``--seeds`` data
streams (seed 0 is lossy.py's). A codec whose change keeps its sign and size across streams
costs fidelity; one whose change flips sign is within training's own noise.

    python benchmarks/resume_seeds.py --seeds 3     # ~15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from benchmarks.common import machine, table, training_run_args  # noqa: E402
from benchmarks.lossy import Run, _serialized, perturbed  # noqa: E402

INTERVALS = (1, 10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_run_args(p)
    p.add_argument("--seeds", type=int, default=3, help="data streams each state is resumed on")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    run = Run(args)
    last = args.steps
    root = Path(tempfile.mkdtemp(prefix="amber-resume-seeds-"))
    try:
        stores = {every: amber.open(root / str(every), mode="w", codec="lossy", full_every=10) for every in INTERVALS}
        for step in range(1, last + 1):
            run.trainer.step(step)
            for every, store in stores.items():
                if run.checkpoints(step, every):
                    store.save(step, run.trainer.state(step))
        exact = torch.load(_serialized(run.trainer.state(last)), weights_only=False)
        states = {"exact": exact, "exact, perturbed 1e-5": perturbed(exact, 1)}
        states |= {f"lossy preset, every {every}": store.load(last, lazy=False) for every, store in stores.items()}
        for store in stores.values():
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    seeds = list(range(args.seeds))
    losses = {name: [run.resume(state, seed) for seed in seeds] for name, state in states.items()}
    change = {name: [(v / e - 1) * 100 for v, e in zip(vs, losses["exact"])] for name, vs in losses.items()
              if name != "exact"}
    print(f"machine: {machine()}")
    print(f"model: TinyGPT width {args.width}, {args.layers} layers, AdamW; {last} steps, checkpoints as in "
          f"lossy.py; each state resumed {args.resume_steps} more steps on data streams {seeds} (0: the "
          "training run's own, as in lossy.py)\n")
    print(table(["resumed from", *(f"stream {s}" for s in seeds), "mean", "range"],
                [[name, *(f"{c:+.2f}%" for c in cs), f"{statistics.mean(cs):+.2f}%", f"{max(cs) - min(cs):.2f}"]
                 for name, cs in change.items()]))
    print("\nheld-out loss of the exact resume per stream: " + ", ".join(f"{v:.4f}" for v in losses["exact"]))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "seeds": seeds,
                                         "losses": losses, "change_pct": change}, indent=1))


if __name__ == "__main__":
    main()
