"""Which weight errors a resume tolerates: block steps relative to the values (the lossy preset's
rule) against steps from Adam's second moment (a diagonal-Fisher weighting), or rounded
stochastically (``--compare stochastic``: the preset's rounding), on one delta.

A regimes.py model is trained to ``--end``; the weights' change over the last ``--span`` steps
is quantized per block of 256 by each rule, as one lossy delta would be (the optimizer state
kept exact), and the state is resumed ``--resume-steps`` steps, against the exact state's resume
(held-out loss, as regimes.py). A Fisher-weighted rule (``step ~ c / sqrt(mean exp_avg_sq of the
block)``, the allocation that minimizes sum(v * error^2) for the bits) is run at the value rule's
Fisher-weighted error and at multiples of it. Bits per weight: the codes' empirical entropy per
tensor (what rANS approaches; side codes left out). Steps are powers of two, as the codec's.

``--bits-only`` skips the resumes and measures what predicting the update would save instead: the
residual after the best per-tensor multiple of Adam's direction ``exp_avg / sqrt(exp_avg_sq)`` at
the delta's base (exact here: a reader would have the base's restored moments), coded at the
same steps.

    python benchmarks/sensitivity.py --model mixer --end 200 --span 40
    python benchmarks/sensitivity.py --compare stochastic --seeds 0 1
    python benchmarks/sensitivity.py --bits-only --span 10
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amber_store.demo import GPTConfig  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402
from benchmarks.lossy import HeldOut  # noqa: E402
from benchmarks.regimes import MODELS  # noqa: E402

BLOCK = 256
Rule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (new values, v), blocked -> step per block


def pow2(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.round(torch.log2(x)))


def value_rule(step: float) -> Rule:
    """The ``"lossy"`` preset's: a power of two near ``step`` x the block's RMS value."""
    return lambda w, v: pow2(step * w.square().mean(1, keepdim=True).sqrt())


def fisher_rule(c: float) -> Rule:
    return lambda w, v: pow2(c / v.mean(1, keepdim=True).clamp_min(1e-30).sqrt())


def entropy_bits(q: torch.Tensor) -> float:
    """Total order-0 entropy of ``q`` in bits. (Not :func:`amber_store.codecs.ans.entropy_bits`,
    which counts int8 codes: these are not capped at +-127 as the codec's are.)"""
    _, counts = torch.unique(q, return_counts=True)
    p = counts.double() / counts.sum()
    return float(-(p * torch.log2(p)).sum()) * q.numel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mixer", choices=list(MODELS))
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--end", type=int, default=200, help="steps trained; the delta ends here")
    p.add_argument("--span", type=int, default=40, help="steps the delta spans")
    p.add_argument("--resume-steps", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="data streams of the resumes")
    p.add_argument("--compare", choices=["fisher", "stochastic"], default="fisher",
                   help="what the value rule's rounding to nearest is set against: steps from Adam's second moment, "
                        "or the value rule's steps rounded stochastically (unbiased: no update lost on average)")
    p.add_argument("--bits-only", action="store_true", help="no resumes: bits with and without a predicted update")
    args = p.parse_args()
    held_out = HeldOut(GPTConfig(width=args.width, layers=args.layers, context=64, heads=4), model=MODELS[args.model])
    trainer = held_out.trainer(lr=args.lr, weight_decay=0.1)
    states = {}
    for step in range(1, args.end + 1):
        trainer.step(step)
        if step in (args.end - args.span, args.end):
            states[step] = copy.deepcopy(trainer.state(step))
    base, new = states[args.end - args.span], states[args.end]
    # Adam's bias-corrected second moment of each parameter (optimizer state follows parameter order)
    blocks = {}
    for i, (name, _) in enumerate(trainer.model.named_parameters()):
        w = new["model"][name]
        if w.numel() < 4096 or w.numel() % BLOCK:  # (what the codec leaves lossless or packs)
            continue
        st, st0 = new["optim"]["state"][i], base["optim"]["state"][i]
        v = st["exp_avg_sq"].double() / (1 - 0.999 ** float(st["step"]))
        m0 = st0["exp_avg"].double() / (1 - 0.9 ** float(st0["step"]))
        v0 = st0["exp_avg_sq"].double() / (1 - 0.999 ** float(st0["step"]))
        blocks[name] = tuple(t.double().reshape(-1, BLOCK) for t in (base["model"][name], w, v, m0 / (v0.sqrt() + 1e-8)))
    n = sum(w.numel() for _, w, _, _ in blocks.values())
    print(f"machine: {machine()}")
    print(f"{args.model} width {args.width}, {args.layers} layers, AdamW lr {args.lr:g}: the weights' delta over steps "
          f"{args.end - args.span}-{args.end} ({n} weights in {len(blocks)} tensors)", end="")
    if args.bits_only:
        rows = []
        for step in (0.1, 0.15):
            bits = {False: 0.0, True: 0.0}
            for w0, w1, v, direction in blocks.values():
                change, s = w1 - w0, value_rule(step)(w1, v)
                kappa = float((change * direction).sum() / (direction * direction).sum())
                for predicted in bits:
                    bits[predicted] += entropy_bits(torch.round((change - kappa * direction * predicted) / s))
            rows.append([f"values, step {step}", f"{bits[False] / n:.3f}", f"{bits[True] / n:.3f}",
                         f"{bits[False] / bits[True]:.2f}x"])
        print("\n")
        print(table(["weights' step", "bits per weight", "bits, update predicted from the base's moments",
                     "fewer bits"], rows))
        return

    def apply(rule: Rule, stochastic: bool = False) -> tuple[dict, float, float, float]:
        """The new state with its weights quantized by ``rule`` (rounded to nearest, or
        ``stochastic``: up with the probability of the remainder, so unbiased); bits per weight,
        Fisher-weighted and plain squared error."""
        state, bits, fisher, plain = copy.deepcopy(new), 0.0, 0.0, 0.0
        g = torch.Generator().manual_seed(0)
        for name, (w0, w1, v, _) in blocks.items():
            step = rule(w1, v)
            x = (w1 - w0) / step
            q = torch.floor(x + torch.rand(x.shape, generator=g, dtype=x.dtype)) if stochastic else torch.round(x)
            restored = w0 + q * step
            err = (restored - w1).square()
            bits, fisher, plain = bits + entropy_bits(q), fisher + float((v * err).sum()), plain + float(err.sum())
            state["model"][name] = restored.reshape(new["model"][name].shape).to(new["model"][name].dtype)
        return state, bits / n, fisher, plain

    def fisher_at(target: float) -> Rule:
        lo, hi = 1e-12, 1e2  # (the error grows with c: bisect in log space)
        for _ in range(50):
            c = math.sqrt(lo * hi)
            lo, hi = (c, hi) if apply(fisher_rule(c))[2] < target else (lo, c)
        return fisher_rule(lo)

    def resume(state: dict, seed: int) -> float:
        return held_out.resume(state, args.end, args.resume_steps, seed, lr=args.lr, weight_decay=0.1)

    _, _, preset_fisher, preset_plain = apply(value_rule(0.1))
    rules = {"values, step 0.1": (value_rule(0.1), False),
             "values, step 0.15 (the preset before)": (value_rule(0.15), False),
             "values, step 0.3": (value_rule(0.3), False)}
    if args.compare == "fisher":
        rules |= {f"Fisher-weighted, {k}x step 0.1's Fisher error": (fisher_at(k * preset_fisher), False)
                  for k in (1, 4, 16)}
    else:
        rules |= {f"values, step {s}, rounded stochastically{' (the preset)' if s == 0.6 else ''}": (value_rule(s), True)
                  for s in (0.15, 0.3, 0.6, 1.2)}
    reference = {seed: resume(new, seed) for seed in args.seeds}
    rows = []
    for name, (rule, stochastic) in rules.items():
        state, bits, fisher, plain = apply(rule, stochastic)
        changes = [(resume(state, seed) / reference[seed] - 1) * 100 for seed in args.seeds]
        rows.append([name, f"{bits:.3f}", f"{fisher / preset_fisher:.2f}x", f"{plain / preset_plain:.2f}x",
                     " ".join(f"{c:+.2f}%" for c in changes)])
    print(f" quantized, resumed {args.resume_steps} steps on data streams {args.seeds}\n")
    print(table(["weights' step", "bits per weight", "Fisher-weighted error vs step 0.1", "squared error vs step 0.1",
                 "resumed loss vs the exact state's"], rows))


if __name__ == "__main__":
    main()
