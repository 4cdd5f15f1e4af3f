"""Retention on an object store: ``gc(keep_last=...)`` of a store of many steps on a real S3
server (SeaweedFS) behind a proxy that holds each request back ``--latency`` seconds, as a
distant object store's round trips do. Each trial saves a fresh store (``--steps`` steps of a
small state, a full step every ``--full-every``), then times a dry run and the gc itself, in a
process of its own; ``--before DIR`` runs the same trials with the amber_store of another
checkout (``git worktree add DIR REV``), interleaved. Medians (and ranges) over trials.

    python benchmarks/gc_bench.py --steps 40 --trials 3 --latency 0.02
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import distant_args, distant_trials, fresh_process, machine, spread, table  # noqa: E402

BUCKET = "amber-gc"
CHILD = r"""
import json, sys, time
import torch
import amber_store as amber
uri, opts, steps, full_every, keep = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:6])
g = torch.Generator().manual_seed(0)
state = {f"t{i}": torch.randn(256, 256, generator=g) for i in range(8)}
store = amber.open(uri, opts, full_every=full_every, pack_threshold=0)
for step in range(1, steps + 1):
    for t in state.values():
        t.add_(1e-3 * torch.randn(t.shape, generator=g))
    store.save(step, state)
store.close()
out = {}
for what, dry in (("dry run", True), ("gc", False)):
    store = amber.open(uri, opts)  # (a fresh process's view: no manifest cached)
    t0 = time.perf_counter()
    report = store.gc(keep_last=keep, dry_run=dry)
    out[what] = time.perf_counter() - t0
    out[what + " deleted"] = len(report.delete)
    store.close()
left = amber.open(uri, opts, mode="r")
assert left.steps() == list(range(steps - keep + 1, steps + 1)), left.steps()
assert torch.equal(left.load(steps, lazy=False)["t0"], state["t0"])
print(json.dumps(out))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=4, help="keep_last")
    distant_args(p, trials=3)
    args = p.parse_args()
    cases, got = distant_trials(args, BUCKET, lambda uri, opts, before: fresh_process(
        CHILD, uri, opts, args.steps, args.full_every, args.keep, cwd="/", before=before))
    flags = f" --before {args.before}" if args.before else ""
    print(f"`python benchmarks/gc_bench.py --steps {args.steps} --full-every {args.full_every} --keep {args.keep} "
          f"--trials {args.trials} --latency {args.latency}{flags}`; machine: {machine()}; SeaweedFS on loopback, "
          f"each request held back {args.latency * 1000:.0f} ms; {args.steps} steps of 8 fp32 256x256 tensors, "
          f"gc keeping the last {args.keep}\n")
    print(table(["code", "dry run s", "gc s", "steps deleted"],
                [[k, spread([x["dry run"] for x in got[k]], ".2f"), spread([x["gc"] for x in got[k]], ".2f"),
                  str(got[k][0]["gc deleted"])] for k in cases]))


if __name__ == "__main__":
    main()
