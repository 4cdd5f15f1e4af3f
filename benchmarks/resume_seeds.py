"""Is a lossy codec's resumed-loss change real, or the chaos of training? The same resumes on
several data streams.

lossy.py resumes every store on one data stream (the training run's own) and calls changes
below its noise floor (the exact state perturbed by 1e-5) unresolved; a change above it could
still be that one stream's luck. Here the same 3.2M-parameter run is checkpointed exactly and
with each lossy policy (``--policies``: the preset, or benchmarks/regimes.py's named policies)
at intervals of 1 and 10 steps (``--intervals``); the exact state, the same state perturbed by
1e-5, and each lossy store's last step are then each resumed on ``--seeds`` data streams (seed
0 is lossy.py's). A codec whose change keeps its sign and size across streams costs fidelity;
one whose change flips sign is within training's own noise. Means come with their standard
error over the streams; the perturbed state's spread is training's own.

    python benchmarks/resume_seeds.py --seeds 6     # ~25 minutes on 2 cores (make bench)
    python benchmarks/resume_seeds.py --seeds 6 --intervals 10 --policies "lossy (preset)" drift-scaled
    python benchmarks/resume_seeds.py --merge a.json b.json   # other streams (--first-seed) or policies
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
from benchmarks.common import machine, table, training_run_args  # noqa: E402
from benchmarks.lossy import Run, _serialized, perturbed  # noqa: E402
from benchmarks.regimes import POLICIES, VARIANTS  # noqa: E402


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Trains the run, checkpoints it with every policy, resumes every state on every stream."""
    run = Run(args)
    last = args.steps
    root = Path(tempfile.mkdtemp(prefix="amber-resume-seeds-"))
    cases = [(name, every) for name in args.policies for every in args.intervals]
    try:
        stores = {(name, every): amber.open(root / str(i), mode="w", codec=(POLICIES | VARIANTS)[name],
                                            full_every=10) for i, (name, every) in enumerate(cases)}
        deltas: dict[tuple[str, int], list[int]] = {case: [] for case in cases}
        for step in range(1, last + 1):
            run.trainer.step(step)
            for (name, every), store in stores.items():
                if run.checkpoints(step, every):
                    info = store.save(step, run.trainer.state(step))
                    if info.kind == "delta":
                        deltas[(name, every)].append(info.nbytes_stored)
        exact = torch.load(_serialized(run.trainer.state(last)), weights_only=False)
        torch_bytes = len(_serialized(exact).getbuffer())
        states = {"exact": exact, "exact, perturbed 1e-5": perturbed(exact, 1)}
        states |= {f"{name}, every {every}": store.load(last, lazy=False) for (name, every), store in stores.items()}
        ratios = {f"{name}, every {every}": torch_bytes / statistics.median(deltas[(name, every)])
                  for name, every in cases}
        for store in stores.values():
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    return {"args": vars(args) | {"json": str(args.json), "merge": None}, "seeds": seeds,
            "torch_save_bytes": torch_bytes, "ratios": ratios,
            "losses": {name: [run.resume(state, seed) for seed in seeds] for name, state in states.items()}}


def merged(paths: list[Path]) -> dict[str, Any]:
    """The runs of ``paths`` as one: of the same training run, either the same states on other
    data streams, or other states (policies) on the same streams."""
    runs = [json.loads(path.read_text()) for path in paths]
    first = runs[0]
    run_args = ("steps", "resume_steps", "width", "layers", "context", "batch")
    if any({k: r["args"][k] for k in run_args} != {k: first["args"][k] for k in run_args} for r in runs):
        raise SystemExit("--merge: the runs trained or resumed differently")
    out = first | {"merged_from": [str(path) for path in paths]}
    if all(r["seeds"] == first["seeds"] for r in runs):
        if any(r["losses"]["exact"] != first["losses"]["exact"] for r in runs):
            raise SystemExit("--merge: the exact state resumed differently: not the same training run")
        out["losses"] = {name: vs for r in runs for name, vs in r["losses"].items()}
        out["ratios"] = {name: x for r in runs for name, x in r["ratios"].items()}
        out["args"] = first["args"] | {"policies": [n for r in runs for n in r["args"]["policies"]]}
    elif all(r["losses"].keys() == first["losses"].keys() and r["ratios"] == first["ratios"] for r in runs):
        out["seeds"] = [s for r in runs for s in r["seeds"]]
        if len(set(out["seeds"])) != len(out["seeds"]):
            raise SystemExit("--merge: a data stream appears twice")
        out["losses"] = {name: [v for r in runs for v in r["losses"][name]] for name in first["losses"]}
    else:
        raise SystemExit("--merge: the runs differ in both their states and their data streams")
    return out


def changes(data: dict[str, Any]) -> dict[str, list[float]]:
    """Each state's resumed loss against the exact resume's on the same stream, in percent."""
    losses = data["losses"]
    return {name: [(v / e - 1) * 100 for v, e in zip(vs, losses["exact"])] for name, vs in losses.items()
            if name != "exact"}


def report(data: dict[str, Any]) -> None:
    """Each state's resumed-loss change against the exact resume's, per stream and over them."""
    args, seeds, losses = data["args"], data["seeds"], data["losses"]
    change = changes(data)

    def error(cs: list[float]) -> float:
        """Standard error of the mean over the streams."""
        return statistics.stdev(cs) / len(cs) ** 0.5 if len(cs) > 1 else float("nan")

    print(f"machine: {machine()}")
    print(f"model: TinyGPT width {args['width']}, {args['layers']} layers, AdamW; {args['steps']} steps, checkpoints "
          f"as in lossy.py; each state resumed {args['resume_steps']} more steps on data streams {seeds} (0: the "
          "training run's own, as in lossy.py); ratio: the median delta step against torch.save of the state "
          f"({data['torch_save_bytes'] / 1e6:.1f} MB)\n")
    print(table(["resumed from", "ratio", *(f"stream {s}" for s in seeds), "mean +- standard error", "median",
                 "range"],
                [[name, f"{data['ratios'][name]:.1f}x" if name in data["ratios"] else "",
                  *(f"{c:+.2f}%" for c in cs), f"{statistics.mean(cs):+.2f}% +- {error(cs):.2f}",
                  f"{statistics.median(cs):+.2f}%", f"{max(cs) - min(cs):.2f}"]
                 for name, cs in change.items()]))
    print("\nheld-out loss of the exact resume per stream: " + ", ".join(f"{v:.4f}" for v in losses["exact"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_run_args(p)
    p.add_argument("--seeds", type=int, default=3, help="data streams each state is resumed on")
    p.add_argument("--first-seed", type=int, default=0, help="the first of those streams")
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 10], help="checkpoint intervals (steps)")
    p.add_argument("--policies", nargs="+", default=["lossy (preset)"], choices=list(POLICIES | VARIANTS))
    p.add_argument("--json", type=Path)
    p.add_argument("--merge", type=Path, nargs="+",
                   help="report these runs' JSON (other streams, or other policies) as one; no run")
    args = p.parse_args()
    data = merged(args.merge) if args.merge else measure(args)
    report(data)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
