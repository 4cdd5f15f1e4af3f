"""A job's first checkpoints the way it takes them: in a fresh process (the state built first),
a full step and then a delta step into a local store, beside ``torch.save`` of the same state in
a fresh process. Each round runs every case once in its own process, in an order rotated from
round to round; figures are medians (and ranges) over rounds, with the process's peak resident
memory. ``--before DIR`` adds the same saves by the amber_store of another checkout (``git
worktree add DIR REV``), interleaved; ``--codec`` picks the store's codec.

    python benchmarks/cold_save.py --mb 240 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import BEFORE, compiled, fresh_process, machine, rotated, spread, table  # noqa: E402

CHILD = r"""
import json, resource, sys, time
import torch
kind, root, mb, codec = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
g = torch.Generator().manual_seed(0)
width = 2048
state = {f"layer{i}": torch.randn(width, width, generator=g) * 0.02 for i in range(max(1, (mb << 20) // (4 * width * width)))}
update = {k: torch.randn(t.shape, generator=g) * 1e-4 for k, t in state.items()}
t0 = time.perf_counter()
if kind == "torch.save":
    torch.save(state, f"{root}/1.pt")
else:
    import amber_store as amber
    store = amber.open(f"{root}/store", mode="w", codec=codec)
    store.save(1, state)
first = time.perf_counter() - t0
for k, t in state.items():
    t.add_(update[k])
t0 = time.perf_counter()
if kind == "torch.save":
    torch.save(state, f"{root}/2.pt")
else:
    store.save(2, state)
    store.close()
second = time.perf_counter() - t0
print(json.dumps({"first": first, "second": second, "numba": "numba" in sys.modules,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
CASES = ["torch.save", "amber"]


def child(kind: str, root: Path, mb: int, codec: str, before: Path | None) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    return fresh_process(CHILD, kind.removesuffix(BEFORE), root, mb, codec, cwd=root,
                         before=before if kind.endswith(BEFORE) else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=240, help="state size in MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--codec", default="lossless")
    p.add_argument("--before", type=Path, help="a checkout whose amber_store saves the same steps too")
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args()
    cases = CASES + ([f"amber{BEFORE}"] if args.before else [])
    compiled(Path(__file__).resolve().parents[1], *([args.before] if args.before else []))
    scratch = Path(tempfile.mkdtemp(prefix="amber-cold-save-"))
    got: dict[str, list[dict]] = {k: [] for k in cases}
    try:
        for r in range(args.rounds):
            for kind in rotated(cases, r):
                got[kind].append(child(kind, scratch / "run", args.mb, args.codec, args.before))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    flags = (f" --before {args.before}" if args.before else "") + (f" --codec {args.codec}" if args.codec != "lossless" else "")
    print(f"`python benchmarks/cold_save.py --mb {args.mb} --rounds {args.rounds}{flags}`; machine: {machine()}; "
          f"state {args.mb} MiB float32, a full step then a delta step (one update apart), each process fresh\n")
    base = {s: statistics.median(x[s] for x in got["torch.save"]) for s in ("first", "second")}
    rows = [[kind, spread([x["first"] for x in got[kind]]), f"{statistics.median(x['first'] for x in got[kind]) / base['first']:.2f}x",
             spread([x["second"] for x in got[kind]]), f"{statistics.median(x['second'] for x in got[kind]) / base['second']:.2f}x",
             spread([x["peak_mb"] for x in got[kind]], ".0f"), "yes" if any(x["numba"] for x in got[kind]) else "no"]
            for kind in cases]
    print(table(["saves", "first s", "vs torch.save", "second s", "vs torch.save", "peak RSS MB", "imported numba"], rows))
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "results": got}, indent=1))


if __name__ == "__main__":
    main()
