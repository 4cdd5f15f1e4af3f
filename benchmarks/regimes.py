"""The lossy preset on runs nobody tuned it on: three phases of training, two model shapes.

Each trajectory is a model shape (the benchmark GPT, or a causal MLP-mixer), AdamW with a
learning rate and weight decay, and a phase: the model is trained (uncheckpointed) up to the
phase's start, then checkpointed every 10 steps for ``--window`` steps into a lossless store and
one store per lossy policy (``full_every=10``). Each store's last step, and the last step whose
lossy delta spans the most checkpoints (where drift-scaled steps are coarsest), is
restored and trained ``--resume-steps`` more steps; the held-out loss against the lossless
resume's from the same step is the fidelity figure (the larger of the two), and the noise floor
is the same figure for the exact last state with every float perturbed by one part in 10^5 (two
seeds). The size figure is the median delta step's bytes against torch.save of the state; each
delta step's ratio is also plotted against the weights' drift from the step it diffs against
(RMS change over RMS value; lossy tensors diff by skip list, ``log``, lossless ones against the
segment's full step). The preset's fixed steps are compared with steps that grow with the drift.

    python benchmarks/regimes.py            # ~12 minutes on 2 cores
    python benchmarks/regimes.py --width 256 --layers 2 --scale 150 --lr-scale 2   # other runs
    python benchmarks/regimes.py --merge a.json b.json   # runs of other policies, reported as one
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.demo import GPTConfig, TinyGPT  # noqa: E402
from amber_store.chains import AUTO, PARENTS  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402
from benchmarks.lossy import HeldOut, _serialized, kind_of, perturbed, rules  # noqa: E402

#: name -> codec policy (the lossless store is the reference); rules(weights, exp_avg, exp_avg_sq, drift)
POLICIES: dict[str, Any] = {
    "lossy (preset)": "lossy",
    # steps picked on these six trajectories: exp_avg_sq coarser (its error hardly moved the
    # resumed loss), weights coarser where a chunk drifted beyond 1% of its RMS since its base
    "drift-scaled": rules(0.1, 64.0, 1.0, drift=0.01),
    # for the best ratio within 0.1%: weights at 0.025 of their blocks' RMS, drift-scaled, rounded to nearest
    "lossy, finer": rules(0.025, 1.0, 0.2, drift=0.01),
}
#: Variants (run them with --policies): the presets before (weights 0.15 rounded to nearest;
#: before that 0.1 and exp_avg_sq 0.2; before that exp_avg coded at step 6), drift-scaled with
#: exp_avg coded at step 12 and its two changes apart, the finer policy with exp_avg at its base,
#: the weights rounded stochastically at a finer and a coarser step than the preset's, and the
#: preset before it coded tensors of 64 to 255 elements too (norms and biases of narrow models)
#: (RESULTS.md)
VARIANTS: dict[str, Any] = {
    "preset, exp_avg step 6": rules(0.1, 6.0, 0.2),
    "drift-scaled, exp_avg step 12": rules(0.1, 12.0, 1.0, drift=0.01),
    "drift-scaled weights only": rules(0.1, 6.0, 0.2, drift=0.01),
    "coarser moments only": rules(0.1, 12.0, 1.0),
    "finer, exp_avg at its base": rules(0.025, 64.0, 0.2, drift=0.01),
    "the preset before (weights 0.1, exp_avg_sq 0.2)": rules(0.1, 64.0, 0.2),
    "the preset before (weights 0.15, rounded to nearest)": rules(0.15, 64.0, 1.0),
    "weights rounded stochastically, step 0.3": rules(0.3, 64.0, 1.0, stochastic=True),
    "weights rounded stochastically, step 1.2": rules(1.2, 64.0, 1.0, stochastic=True),
    "the preset before (tensors from 256 elements)": rules(0.6, 64.0, 1.0, stochastic=True),
}


class MixerBlock(nn.Module):
    """Pre-norm MLP-mixer block over a causal sequence: token mixing by a lower-triangular
    linear map over positions, then a channel MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.tokens = nn.Linear(cfg.context, cfg.context)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))
        self.register_buffer("causal", torch.tril(torch.ones(cfg.context, cfg.context)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mixing = (self.tokens.weight * self.causal)[:t, :t]
        x = x + nn.functional.linear(self.ln1(x).transpose(1, 2), mixing, self.tokens.bias[:t]).transpose(1, 2)
        return x + self.mlp(self.ln2(x))


class Mixer(nn.Module):
    """A byte-level causal MLP-mixer language model (the second model shape)."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.blocks = nn.ModuleList(MixerBlock(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


MODELS: dict[str, Callable[[GPTConfig | None], nn.Module]] = {"GPT": TinyGPT, "mixer": Mixer}


@dataclass(frozen=True)
class Trajectory:
    model: str
    phase: str
    #: steps trained before the window (at ``warmup_lr``), and the window's learning rate
    start: int
    lr: float
    weight_decay: float = 0.1
    warmup_lr: float = 1e-3

    @property
    def name(self) -> str:
        return f"{self.model}, {self.phase} (lr {self.lr:g})"


def trajectories(model: str, scale: int, lr_scale: float = 1.0) -> list[Trajectory]:
    """Early training at a high learning rate from scratch (the issue's case), mid training, and a
    late fine-tune at a low learning rate; ``scale`` multiplies the steps trained before,
    ``lr_scale`` every learning rate."""
    return [Trajectory(model, "early", 0, 1e-3 * lr_scale, warmup_lr=1e-3 * lr_scale),
            Trajectory(model, "mid", 3 * scale, 3e-4 * lr_scale, warmup_lr=1e-3 * lr_scale),
            Trajectory(model, "late fine-tune", 4 * scale, 3e-5 * lr_scale, warmup_lr=1e-3 * lr_scale)]


def drift(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    """RMS change of the model's parameters over their RMS value."""
    num = sum(float((new[k].double() - old[k].double()).square().sum()) for k in new)
    den = sum(float(old[k].double().square().sum()) for k in new)
    return (num / den) ** 0.5


def run_trajectory(traj: Trajectory, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    held_out = HeldOut(GPTConfig(width=args.width, layers=args.layers, context=64, heads=4), model=MODELS[traj.model])
    trainer = held_out.trainer(lr=traj.warmup_lr, weight_decay=traj.weight_decay)
    for step in range(1, traj.start + 1):
        trainer.step(step)
    trainer.set_lr(traj.lr)
    policies = {"lossless": "lossless", **{name: (POLICIES | VARIANTS)[name] for name in args.policies}}
    stores = {name: amber.open(root / f"{len(list(root.iterdir()))}", mode="w", codec=policy, full_every=10,
                               durable=False) for name, policy in policies.items()}
    sizes: dict[str, list[tuple[float, int]]] = {name: [] for name in stores}  # (drift, bytes) per delta step
    kinds: dict[str, dict[str, int]] = {name: {} for name in stores}  # delta steps' bytes per kind of tensor
    weights: dict[int, dict[str, torch.Tensor]] = {}  # at each checkpoint of the window
    # The exact state at the last step whose lossy delta spans the most checkpoints (its error
    # is the largest the drift-scaled steps allow; every lossy store has the same chains),
    # resumed beside the last step
    deepest: tuple[int, int, dict] = (-1, -1, {})
    t0 = time.perf_counter()
    end = traj.start + args.window
    for step in range(traj.start + 1, end + 1):
        trainer.step(step)
        if step % 10:
            continue
        state = trainer.state(step)
        weights[step] = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        for name, store in stores.items():
            info = store.save(step, state)
            if info.kind == "delta":
                m = store.manifest(step)
                parent = PARENTS[AUTO[name == "lossless"]](m.depth)
                sizes[name].append((drift(weights[step], weights[m.segment[parent]]), info.nbytes_stored))
                for key, entry in m.tensors.items():
                    kind = kind_of(key.replace("/", "."))
                    kinds[name][kind] = kinds[name].get(kind, 0) + entry.stored
                if name != "lossless" and m.depth - parent >= deepest[0]:
                    deepest = (m.depth - parent, step, torch.load(_serialized(state), weights_only=False))
    train_s = time.perf_counter() - t0
    exact = torch.load(_serialized(trainer.state(end)), weights_only=False)
    torch_bytes = len(_serialized(exact).getbuffer())

    def resume(state: dict, at: int = end, seed: int = 0) -> float:
        """Held-out loss after ``--resume-steps`` more steps from ``state``, saved at step ``at``
        (mean of the last evaluations, every 25 steps over the last 100)."""
        return held_out.resume(state, at, args.resume_steps, seed, lr=traj.lr, weight_decay=traj.weight_decay)

    span, deep, deep_exact = deepest
    reference, deep_reference = resume(exact), resume(deep_exact, deep)
    floor = [(resume(perturbed(exact, seed)) / reference - 1) * 100 for seed in (1, 2)]
    out: dict[str, Any] = {"trajectory": traj.name, "params": sum(p.numel() for p in trainer.model.parameters()),
                           "torch_save_bytes": torch_bytes, "reference_loss": reference, "noise_floor_pct": floor,
                           "deepest": {"step": deep, "span": span}, "window_start": traj.start, "train_s": train_s,
                           "codecs": {}}
    for name, store in stores.items():
        per_step = sizes[name]
        row: dict[str, Any] = {"ratio": torch_bytes / statistics.median(n for _, n in per_step),
                               "points": [(d, torch_bytes / n) for d, n in per_step],
                               "bytes_by_kind": {k: n / sum(kinds[name].values()) for k, n in kinds[name].items()}}
        if name != "lossless":
            last = (resume(store.load(end, lazy=False)) / reference - 1) * 100
            spanning = (resume(store.load(deep, lazy=False), deep) / deep_reference - 1) * 100
            row |= {"loss_change_pct": max(last, spanning, key=abs), "loss_last_pct": last,
                    "loss_deepest_pct": spanning}
        out["codecs"][name] = row
        store.close()
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Ratio against drift, one panel per trajectory, one series per codec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True, sharey=True)
    for ax, r in zip(axes.flat, results):
        for name, row in r["codecs"].items():
            xs, ys = zip(*row["points"])
            ax.plot(xs, ys, "o", ms=3, label=name)
        ax.set_title(r["trajectory"], fontsize=9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(50, color="grey", lw=0.5, ls="--")
        ax.set_xlabel("weights' drift from the delta's base (RMS change / RMS)", fontsize=7)
    axes[0][0].set_ylabel("delta step: smaller than torch.save (x)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merged(paths: list[Path]) -> dict[str, Any]:
    """Runs of the same trajectories with other policies, as one: each trajectory's codecs from
    every run (the first run's name wins), their lossless references checked to agree."""
    runs = [json.loads(path.read_text()) for path in paths]
    out = runs[0]
    for run in runs[1:]:
        for mine, theirs in zip(out["results"], run["results"], strict=True):
            if (mine["trajectory"], mine["reference_loss"]) != (theirs["trajectory"], theirs["reference_loss"]):
                raise SystemExit(f"{mine['trajectory']}: not the same run ({theirs['trajectory']}, "
                                 f"reference loss {theirs['reference_loss']} against {mine['reference_loss']})")
            mine["codecs"] |= {k: v for k, v in theirs["codecs"].items() if k not in mine["codecs"]}
        out["args"]["policies"] += [p for p in run["args"]["policies"] if p not in out["args"]["policies"]]
    return out


def report(data: dict[str, Any]) -> None:
    args, results = data["args"], data["results"]
    print(f"machine: {machine()}")
    sizes = ", ".join(f"{m} {r['params'] / 1e6:.2f}M" for m, r in zip(args["models"], results[::3]))
    minutes = f"; {data['minutes']:.0f} minutes" if "minutes" in data else ""
    print(f"models: width {args['width']}, {args['layers']} layers ({sizes} params), AdamW weight decay 0.1, trained "
          f"at lr {1e-3 * args['lr_scale']:g} before the window; checkpoints every 10 steps for {args['window']} steps "
          f"(full_every=10), then {args['resume_steps']} steps resumed from the last and from the one spanning most "
          f"(step {results[0]['deepest']['step'] - results[0]['window_start']} of the window){minutes}\n")
    rows = []
    for r in results:
        noise = max(abs(f) for f in r["noise_floor_pct"])
        for name, row in r["codecs"].items():
            drifts = [d for d, _ in row["points"]]
            resumed = (f"{row['loss_last_pct']:+.2f}% / {row['loss_deepest_pct']:+.2f}%" if "loss_change_pct" in row
                       else "(reference)")
            shares = " / ".join(f"{row['bytes_by_kind'].get(k, 0) * 100:.0f}"
                                for k in ("weights", "exp_avg", "exp_avg_sq"))
            rows.append([r["trajectory"], name, f"{row['ratio']:.1f}x", shares, resumed, f"+-{noise:.1e}%",
                         f"{statistics.median(drifts):.2e}"])
    print(table(["trajectory", "codec", "median delta step, smaller than torch.save",
                 "delta bytes, % weights / exp_avg / exp_avg_sq",
                 "resumed loss vs lossless (last step / spanning most)", "noise floor", "median drift from the base"],
                rows))
    print()
    for name in args["policies"]:
        held = [r for r in results
                if r["codecs"][name]["ratio"] >= 50 and abs(r["codecs"][name]["loss_change_pct"]) <= 1]
        print(f"{name} holds >= 50x at <= 1% on {len(held)} of {len(results)} trajectories")
    for r in results:
        within = [(row["ratio"], name) for name, row in r["codecs"].items()
                  if name != "lossless" and abs(row["loss_change_pct"]) <= 0.1]
        top = max(within, key=lambda x: x[0]) if within else None  # (a tie: the first listed)
        best = f"{top[0]:.1f}x ({top[1]})" if top else "none"
        print(f"{r['trajectory']}: best ratio within 0.1% of the lossless resume: {best}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--window", type=int, default=200, help="steps checkpointed, every 10")
    p.add_argument("--resume-steps", type=int, default=150)
    p.add_argument("--scale", type=int, default=100, help="mid starts at 3x, the fine-tune at 4x this many steps")
    p.add_argument("--lr-scale", type=float, default=1.0, help="multiplies every learning rate")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES | VARIANTS),
                   help="lossy policies beside the lossless reference (default: %(default)s)")
    p.add_argument("--plot", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--merge", type=Path, nargs="+",
                   help="report these runs' JSON (the same trajectories, other policies) as one; no run")
    args = p.parse_args()
    if args.merge:
        data = merged(args.merge)
    else:
        root = Path(tempfile.mkdtemp(prefix="amber-regimes-"))
        started = time.perf_counter()
        try:
            results = [run_trajectory(t, args, root)
                       for m in args.models for t in trajectories(m, args.scale, args.lr_scale)]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        data = {"args": vars(args) | {"json": None, "plot": None, "merge": None}, "results": results,
                "minutes": (time.perf_counter() - started) / 60}
    report(data)
    if args.plot:
        plot(data["results"], args.plot)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
