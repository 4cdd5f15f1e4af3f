"""A resumed job's first save on an object store: a fresh process loads the latest step of a
store on a real S3 server (SeaweedFS), behind a proxy that holds each request back ``--latency``
seconds as a distant store's round trips do, and saves the next step. That save diffs against
the step it resumed from, whose values it reads back from the store (the load's are the
model's, not the store's bases). Each trial saves a fresh store, then times the load and the
save in a process of its own; ``--before DIR`` runs the same trials with the amber_store of
another checkout (``git worktree add DIR REV``), interleaved. Medians (and ranges) over trials.

    python benchmarks/resume_save.py --tensors 64 --mb 64 --trials 5 --latency 0.02
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import distant_args, distant_trials, fresh_process, machine, spread, table  # noqa: E402

BUCKET = "amber-resume"
SAVE = r"""
import sys, torch, amber_store as amber
uri, opts, tensors, mb = sys.argv[1], __import__("json").loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
n = max(1, (mb << 20) // (4 * tensors))
store = amber.open(uri, opts)
store.save(1, {f"t{i}": torch.randn(n, generator=g) for i in range(tensors)})
store.close()
print("{}")
"""
RESUME = r"""
import json, sys, time
import torch
import amber_store as amber
uri, opts = sys.argv[1], json.loads(sys.argv[2])
store = amber.open(uri, opts)
t0 = time.perf_counter()
state = store.load(1, lazy=False)
loaded = time.perf_counter()
for t in state.values():
    t.add_(1e-3)
info = store.save(2, state)
saved = time.perf_counter()
store.close()
assert info.kind == "delta", info
print(json.dumps({"load": loaded - t0, "save": saved - loaded}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--mb", type=int, default=64, help="MiB of fp32 state, split evenly over the tensors")
    distant_args(p, trials=5)
    args = p.parse_args()

    def trial(uri: str, opts: str, before: Path | None) -> dict:
        fresh_process(SAVE, uri, opts, args.tensors, args.mb, cwd="/", before=before)
        return fresh_process(RESUME, uri, opts, cwd="/", before=before)

    cases, got = distant_trials(args, BUCKET, trial)
    flags = f" --before {args.before}" if args.before else ""
    print(f"`python benchmarks/resume_save.py --tensors {args.tensors} --mb {args.mb} --trials {args.trials} "
          f"--latency {args.latency}{flags}`; machine: {machine()}; SeaweedFS on loopback, each request held back "
          f"{args.latency * 1000:.0f} ms; a fresh process loads step 1 ({args.mb} MiB of fp32 in {args.tensors} "
          "tensors) and saves step 2 against it\n")
    print(table(["code", "load s", "first save s"],
                [[k, spread([x["load"] for x in got[k]], ".2f"), spread([x["save"] for x in got[k]], ".2f")]
                 for k in cases]))


if __name__ == "__main__":
    main()
