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
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.demo import GPTConfig, Trainer, corpus  # noqa: E402
from amber_store.export import flat_tensors  # noqa: E402
from benchmarks.common import eval_loss, machine, table, training_run_args  # noqa: E402
from benchmarks.lossy import _serialized  # noqa: E402

INTERVALS = (1, 10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_run_args(p)
    p.add_argument("--seeds", type=int, default=3, help="data streams each state is resumed on")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(context=args.context, width=args.width, layers=args.layers, heads=4)
    text = corpus(4_000_000)
    split = int(len(text) * 0.95)
    trainer = Trainer(cfg, batch=args.batch, data=text[:split])
    evaluator = Trainer(cfg, batch=args.batch, data=text[split:])
    eval_batches = [evaluator.batch_at(10_000 + i) for i in range(16)]
    last = args.steps
    root = Path(tempfile.mkdtemp(prefix="amber-resume-seeds-"))
    try:
        stores = {every: amber.open(root / str(every), mode="w", codec="lossy", full_every=10) for every in INTERVALS}
        for step in range(1, last + 1):
            trainer.step(step)
            for every, store in stores.items():
                if step % every == 0 and (every > 1 or step > last - 50):  # as lossy.py checkpoints
                    store.save(step, trainer.state(step))
        exact = torch.load(_serialized(trainer.state(last)), weights_only=False)
        noisy = torch.load(_serialized(exact), weights_only=False)
        g = torch.Generator().manual_seed(1)
        for t in flat_tensors(noisy).values():
            if t.is_floating_point() and t.numel() > 1:
                t.mul_(1 + 1e-5 * torch.randn(t.shape, generator=g, dtype=t.dtype))
        states = {"exact": exact, "exact, perturbed 1e-5": noisy}
        states |= {f"lossy preset, every {every}": store.load(last, lazy=False) for every, store in stores.items()}
        for store in stores.values():
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def resume(state: dict[str, Any], seed: int) -> float:
        """Held-out loss after ``--resume-steps`` more steps on data stream ``seed`` (lossy.py's
        figure: the mean of 6 evaluations over the last 100 steps)."""
        t = Trainer(cfg, seed=seed, batch=args.batch, data=text[:split], init_seed=1234)
        t.load(torch.load(_serialized(state), weights_only=False))
        losses = []
        for step in range(last + 1, last + args.resume_steps + 1):
            t.step(step)
            if (last + args.resume_steps - step) % 20 == 0 and last + args.resume_steps - step <= 100:
                losses.append(eval_loss(t.model, eval_batches))
        return statistics.mean(losses)

    seeds = list(range(args.seeds))
    losses = {name: [resume(state, seed) for seed in seeds] for name, state in states.items()}
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
