"""Lossy codecs on a real training trajectory: bytes per delta step against resumed loss.

A GPT-style model (amber_store.demo.TinyGPT, 3.2M parameters by default) is trained with AdamW
on Python's standard-library sources. Every lossy codec (and preset) checkpoints the same run
into its own store at intervals of 1, 10 and 50 steps (``full_every=10`` checkpoints; the
1-step interval over the last 50 steps only). Each store's last step is then restored into a
fresh model and trained ``--resume-steps`` more steps: its held-out loss against the lossless
resume's is the fidelity figure. The noise floor is the same figure for the exact state with
every float perturbed by one part in 10^5 (two seeds): training is chaotic, so differences
below it are not resolved.

    python benchmarks/lossy.py            # ~20 minutes on 2 cores
    python benchmarks/lossy.py --quick    # ~3 minutes, smaller model, fewer points
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.demo import GPTConfig, TinyGPT, Trainer, corpus  # noqa: E402
from amber_store.export import flat_tensors  # noqa: E402
from benchmarks.common import eval_loss, machine, table, training_run_args  # noqa: E402


def rules(weights: float, exp_avg: float, exp_avg_sq: float, drift: float | None = None,
          stochastic: bool = False, min_numel: int = 256) -> list:
    """A policy of the ``"lossy"`` preset's form at other steps: Adam's ``exp_avg_sq`` by ratio,
    ``exp_avg`` and everything else by blocks (those with ``drift`` and ``stochastic`` rounding,
    if given); tensors under ``min_numel`` elements lossless."""
    return [("*exp_avg_sq", amber.RatioDeltaCodec(step=exp_avg_sq, min_numel=min_numel)),
            ("*exp_avg", amber.BlockDeltaCodec(step=exp_avg, min_numel=min_numel)),
            ("*", amber.BlockDeltaCodec(step=weights, drift=drift, stochastic=stochastic, min_numel=min_numel))]


def policies() -> dict[str, Any]:
    """The codecs on the plot: the preset, finer and coarser variants of it, the older codecs."""
    return {
        "lossy (preset)": "lossy",
        "lossy, finer": rules(0.05, 3.0, 0.1),
        "lossy, coarser": rules(1.2, 64.0, 1.0, stochastic=True),
        "lossy, exp_avg kept (step 1)": rules(0.6, 1.0, 1.0, stochastic=True),
        "the preset before (weights 0.15, rounded to nearest)": rules(0.15, 64.0, 1.0),
        "quant4": "quant4",
        "quant8": "quant8",
        "sparse 2%": "sparse",
    }


#: Which codecs run at the 1- and 50-step intervals (all run at 10): each point costs a resume.
EDGE_INTERVALS = ("lossy (preset)", "lossy, finer", "lossy, coarser", "quant4")


def kind_of(key: str) -> str:
    """weights, exp_avg or exp_avg_sq, from a flat_tensors key such as ``optim.state.3.exp_avg``."""
    last = key.rsplit(".", 1)[-1]
    return last if key.startswith("optim.") and last in ("exp_avg", "exp_avg_sq") else "weights"


def relative_errors(restored: dict, exact: dict) -> dict[str, float]:
    """RMS error over RMS value, per kind of tensor (weights, exp_avg, exp_avg_sq)."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    got = flat_tensors(restored)
    for key, t in flat_tensors(exact).items():
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            continue
        r = got[key]
        k = kind_of(key)
        num[k] = num.get(k, 0.0) + float((r.double() - t.double()).square().sum())
        den[k] = den.get(k, 0.0) + float(t.double().square().sum())
    return {k: (num[k] / den[k]) ** 0.5 if den[k] else 0.0 for k in num}


class HeldOut:
    """The lossy benchmarks' resume protocol, one for all of them: models train on the first 95%
    of the corpus and are judged by their held-out loss on 16 batches of the last 5% (the batches
    at steps 10,000-10,015); a resume loads a state into a trainer whose own initialization
    (seed 1234) it overwrites, trains on data stream ``seed`` (0: the training run's own) and
    reports the mean of its evaluations every ``every`` steps over the last 100."""

    def __init__(self, cfg: GPTConfig, *, batch: int = 16, model: Callable[[GPTConfig | None], nn.Module] = TinyGPT,
                 every: int = 25) -> None:
        self.cfg, self.batch, self.model, self.every = cfg, batch, model, every
        text = corpus(4_000_000)
        split = int(len(text) * 0.95)
        self.train = text[:split]
        evaluator = Trainer(cfg, batch=batch, data=text[split:], model=model)
        self.batches = [evaluator.batch_at(10_000 + i) for i in range(16)]

    def trainer(self, **kwargs: Any) -> Trainer:
        """A trainer of this model on the training text (``kwargs``: Trainer's)."""
        return Trainer(self.cfg, batch=self.batch, data=self.train, model=self.model, **kwargs)

    def resume(self, state: dict, last: int, more: int, seed: int = 0, **kwargs: Any) -> float:
        """Held-out loss after resuming from (a copy of) ``state``, saved at step ``last``, and
        training ``more`` steps (``kwargs``: the trainer's, such as its learning rate)."""
        t = self.trainer(seed=seed, init_seed=1234, **kwargs)
        t.load(torch.load(_serialized(state), weights_only=False))
        losses = []
        for step in range(last + 1, last + more + 1):
            t.step(step)
            if (last + more - step) % self.every == 0 and last + more - step <= 100:
                losses.append(eval_loss(t.model, self.batches))
        return statistics.mean(losses)


class Run:
    """The training run the lossy benchmarks checkpoint and resume: TinyGPT with AdamW on
    Python's standard-library sources (:class:`HeldOut`'s protocol, evaluated every 20 steps)."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.args = args
        self.cfg = GPTConfig(context=args.context, width=args.width, layers=args.layers, heads=4)
        self.held_out = HeldOut(self.cfg, batch=args.batch, every=20)
        self.trainer = self.held_out.trainer()

    def checkpoints(self, step: int, every: int) -> bool:
        """Whether a store checkpointing ``every`` steps saves ``step`` (the 1-step interval:
        the last 50 steps only)."""
        return step % every == 0 and (every > 1 or step > self.args.steps - 50)

    def resume(self, state: dict, seed: int = 0) -> float:
        """Held-out loss after resuming from (a copy of) ``state`` at the run's last step and
        training ``--resume-steps`` more on data stream ``seed`` (0: the run's own), averaged
        over the last 100 steps (6 evaluations): one loss spike at the very end would otherwise
        decide the figure."""
        return self.held_out.resume(state, self.args.steps, self.args.resume_steps, seed)


def perturbed(state: dict, seed: int) -> dict:
    """A copy of ``state`` with every float multiplied by 1 + 1e-5 noise: the noise floor."""
    g = torch.Generator().manual_seed(seed)
    noisy = torch.load(_serialized(state), weights_only=False)
    for t in flat_tensors(noisy).values():
        if t.is_floating_point() and t.numel() > 1:
            t.mul_(1 + 1e-5 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    return noisy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_run_args(p)
    p.add_argument("--quick", action="store_true", help="small model, 100+60 steps, interval 10 only")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    intervals = [1, 10, 50]
    if args.quick:
        args.steps, args.resume_steps, args.width, args.layers, intervals = 100, 60, 128, 2, [10]
    run = Run(args)
    trainer = run.trainer
    grid = [(name, policy, every) for every in intervals for name, policy in policies().items()
            if every == 10 or name in EDGE_INTERVALS]
    root = Path(tempfile.mkdtemp(prefix="amber-lossy-bench-"))
    stores: dict[tuple[str, int], amber.Store] = {}
    saved: dict[tuple[str, int], list[tuple[str, int, float]]] = {}
    last = args.steps
    try:
        for name, policy, every in grid + [("lossless", "lossless", 10)]:
            stores[(name, every)] = amber.open(root / f"{len(stores)}", mode="w", codec=policy, full_every=10)
            saved[(name, every)] = []
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            trainer.step(step)
            for (name, every), store in stores.items():
                if run.checkpoints(step, every):
                    started = time.perf_counter()
                    info = store.save(step, trainer.state(step))
                    saved[(name, every)].append((store.manifest(step).kind, info.nbytes_stored,
                                                 time.perf_counter() - started))
        train_s = time.perf_counter() - t0
        exact = torch.load(_serialized(trainer.state(last)), weights_only=False)  # a deep, detached copy
        torch_save_bytes = len(_serialized(exact).getbuffer())
        reference = run.resume(exact)
        floor = [(run.resume(perturbed(exact, seed)) / reference - 1) * 100 for seed in (1, 2)]
        rows, points = [], []
        for (name, every), store in stores.items():
            deltas = [(n, s) for kind, n, s in saved[(name, every)] if kind == "delta"]
            per_delta = statistics.median(n for n, _ in deltas)
            point = {"codec": name, "interval": every, "delta_bytes": per_delta,
                     "ratio": torch_save_bytes / per_delta, "save_s": statistics.median(s for _, s in deltas)}
            if name != "lossless":
                restored = store.load(last, lazy=False)
                point["errors"] = relative_errors(restored, exact)
                point["loss"] = run.resume(restored)
                point["loss_change_pct"] = (point["loss"] / reference - 1) * 100
            points.append(point)
    finally:
        for s in stores.values():
            s.close()
        shutil.rmtree(root, ignore_errors=True)

    noise = max(abs(f) for f in floor)
    for pt in points:
        err = pt.get("errors", {})
        rows.append([pt["codec"], pt["interval"], f"{pt['delta_bytes'] / 1e3:.0f}", f"{pt['ratio']:.1f}x",
                     " / ".join(f"{err.get(k, 0):.3f}" for k in ("weights", "exp_avg", "exp_avg_sq")) if err else "exact",
                     f"{pt['loss']:.4f}" if "loss" in pt else "(reference)",
                     f"{pt['loss_change_pct']:+.2f}%" if "loss" in pt else "",
                     f"{pt['save_s'] * 1000:.0f}"])
    n_params = sum(p.numel() for p in trainer.model.parameters())
    print(f"machine: {machine()}")
    print(f"model: TinyGPT width {args.width}, {args.layers} layers: {n_params / 1e6:.2f}M params, AdamW; "
          f"torch.save of the state {torch_save_bytes / 1e6:.1f} MB; {args.steps} steps "
          f"({train_s:.0f} s with every store's saves), then {args.resume_steps} more from step {last}\n")
    print("KB per delta step: median over the delta steps of each store (full steps, every 10th "
          "checkpoint, are lossless and not counted); errors: RMS error / RMS value of the restored "
          f"step {last} per kind of tensor; loss: held-out (16 batches), after resuming from the store's step "
          f"{last}, mean of 6 evaluations over the last 100 of {args.resume_steps} more steps, against the exact "
          f"resume ({reference:.4f}).\n")
    print(table(["codec", "interval (steps)", "KB per delta step", "smaller than torch.save",
                 "rel. error weights / exp_avg / exp_avg_sq", "resumed loss", "vs exact resume",
                 "save ms (sync)"], rows))
    print(f"\nnoise floor (exact state, every float perturbed by 1e-5 relative, two seeds): "
          f"{', '.join(f'{f:+.2f}%' for f in floor)}; changes within +-{noise:.2f}% are not resolved.")
    for every in intervals:
        ok = [pt for pt in points if pt["interval"] == every and "loss" in pt]
        for bound in (1.0, 0.1):
            within = [pt for pt in ok if abs(pt["loss_change_pct"]) <= bound]
            best = max(within, key=lambda pt: pt["ratio"], default=None)
            print(f"interval {every}: best ratio within {bound}% of the exact resume: "
                  + (f"{best['ratio']:.1f}x ({best['codec']})" if best else "none"))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "params": n_params,
                                         "torch_save_bytes": torch_save_bytes, "reference_loss": reference,
                                         "noise_floor_pct": floor, "points": points}, indent=1))


def _serialized(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


if __name__ == "__main__":
    main()
