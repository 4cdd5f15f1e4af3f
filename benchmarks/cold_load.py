"""Loads the way a resume runs them: each in a fresh process, beside ``torch.load`` of the same
state in a fresh process, with the imports timed apart; and the same loads warm (the second to
fifth loads of one process, pooled: single loads there swing by seconds on this VM), which is
what the other benchmarks time.

A local store (page cache warm: every file was just written) holds a full step and a delta step
of a GPT-like fp32 state; torch.save wrote the delta step's state to one file. Each round runs
every case once in its own process, in an order rotated from round to round; figures are
medians (and ranges) over rounds. Two more cases load into the tensors of a model built (and
touched) before the clock, as a resume does: torch.load, then a copy into them as
``load_state_dict`` makes, against ``load(into=...)``, which decodes straight into them; their
ratios are against the first. ``--before DIR`` adds the same loads by the amber_store of
another checkout (``git worktree add DIR REV``), interleaved: a change's effect, same minutes.
``--paths avx2 portable c-blosc`` adds the amber-store loads decoded by those paths
(``AMBER_DECODE_PATH``), so that one machine also times the paths of CPUs it is faster than;
``--dtype bfloat16`` stores a bf16 state. A fresh process also imports what the load needs beyond
torch (timed apart: "imports s"; "with imports" adds them to the load's time).

    python benchmarks/cold_load.py --mb 1024 --rounds 5 --paths avx2 portable c-blosc
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
kind, root, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()  # what a load needs beyond torch: amber-store and what it imports
if not kind.startswith("torch.load"):
    import amber_store as amber
    from amber_store import store  # (amber_store imports its modules lazily)
imports = time.perf_counter() - t0
into = {}
if kind.endswith(" into a model"):  # the model a resume builds first: its tensors made and touched
    shapes = torch.load(f"{root}/state.pt", weights_only=True, mmap=True)
    into = {"into": {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in shapes.items()}}
    del shapes
out = []
for _ in range(repeats):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if kind.startswith("torch.load"):
        state = torch.load(f"{root}/state.pt", weights_only=True)
        for k, t in into.get("into", {}).items():  # what model.load_state_dict(state) does
            t.copy_(state[k])
    else:
        state = amber.open(f"{root}/store", mode="r").load(1 if kind == "full step" else 2, lazy=False, **into)
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    out.append({"seconds": t1 - t0, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime})
    del state
print(json.dumps({"imports": imports, "loads": out}))
"""
CASES = ["torch.load", "full step", "delta step"]
#: loads into the tensors of a model built before them (``load(into=...)``; torch.load, then copied)
INTO = ["torch.load into a model", "delta step into a model"]


def prepare(root: Path, mb: int, dtype) -> None:
    import torch

    import amber_store as amber

    g = torch.Generator().manual_seed(0)
    width = 2048
    n = max(1, (mb << 20) // (dtype.itemsize * width * width))
    state = {f"layer{i}": (torch.randn(width, width, generator=g) * 0.02).to(dtype) for i in range(n)}
    with amber.open(root / "store", mode="w") as store:
        store.save(1, state)
        for t in state.values():  # (bf16: a step of the learning rate's scale moves some of them)
            t.add_((torch.randn(t.shape, generator=g) * (1e-4 if dtype == torch.float32 else 1e-3)).to(dtype))
        store.save(2, state)
    torch.save(state, root / "state.pt")


def child(kind: str, root: Path, repeats: int, before: Path | None = None) -> dict:
    """``kind``'s loads in a fresh process; a kind ending in " (before)" by ``before``'s amber_store
    (found first on the path: the child runs from the store's directory, not from a checkout); one
    ending in " [PATH]" decoding by that path (``AMBER_DECODE_PATH``)."""
    env = {}
    if kind.endswith("]"):
        kind, path = kind[:-1].split(" [")
        env["AMBER_DECODE_PATH"] = path
    return fresh_process(CHILD, kind.removesuffix(BEFORE), root, repeats, env=env, cwd=root,
                         before=before if kind.endswith(BEFORE) else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=1024, help="state size in MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    p.add_argument("--before", type=Path, help="a checkout whose amber_store loads the same steps too")
    p.add_argument("--paths", nargs="*", default=[], metavar="PATH",
                   help="also decode by these paths (AMBER_DECODE_PATH: avx512, avx2, portable, c-blosc)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    cases = (CASES + INTO + ([f"full step{BEFORE}", f"delta step{BEFORE}"] if args.before else [])
             + [f"{kind} [{path}]" for path in args.paths for kind in CASES[1:]])
    compiled(Path(__file__).resolve().parents[1], *([args.before] if args.before else []))
    root = Path(tempfile.mkdtemp(prefix="amber-cold-"))
    cold: dict[str, list[dict]] = {k: [] for k in cases}
    imports: dict[str, list[float]] = {k: [] for k in cases}
    warm: dict[str, list[dict]] = {k: [] for k in cases}
    try:
        prepare(root, args.mb, getattr(__import__("torch"), args.dtype))
        for r in range(args.rounds):
            for kind in rotated(cases, r):
                got = child(kind, root, 1, args.before)
                cold[kind].append(got["loads"][0])
                imports[kind].append(got["imports"])
        for r in range(max(1, args.rounds // 2)):  # warm: the second to fifth loads of one process
            for kind in rotated(cases, r):
                warm[kind] += child(kind, root, 5, args.before)["loads"][1:]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def peer(kind: str) -> str:
        return INTO[0] if kind in INTO else CASES[0]

    flags = ((f" --before {args.before}" if args.before else "")
             + (f" --paths {' '.join(args.paths)}" if args.paths else "")
             + (f" --dtype {args.dtype}" if args.dtype != "float32" else ""))
    print(f"`python benchmarks/cold_load.py --mb {args.mb} --rounds {args.rounds}{flags}`; machine: {machine()}; "
          f"state {args.mb} MiB {args.dtype} (a full step and a delta step apart by a step's update); page cache "
          "warm. \"imports s\": what a load imports beyond torch (amber-store, zarr, ...), paid once by a "
          "fresh process; \"with imports\": the fresh process's load and those imports against torch.load's\n")
    rows = []
    for kind in cases:
        secs = [x["seconds"] for x in cold[kind]]
        base = statistics.median(x["seconds"] for x in cold[peer(kind)])
        base_warm = statistics.median(x["seconds"] for x in warm[peer(kind)])
        with_imports = statistics.median(x["seconds"] + i for x, i in zip(cold[kind], imports[kind]))
        rows.append([kind, spread(secs), f"{statistics.median(secs) / base:.2f}x", f"{with_imports / base:.2f}x",
                     f"{statistics.median(x['user'] for x in cold[kind]):.2f}",
                     f"{statistics.median(x['sys'] for x in cold[kind]):.2f}", spread(imports[kind]),
                     spread([x["seconds"] for x in warm[kind]]),
                     f"{statistics.median(x['seconds'] for x in warm[kind]) / base_warm:.2f}x"])
    print(table(["load", "fresh process s", "vs torch.load", "with imports", "user s", "sys s", "imports s", "warm s",
                 "warm vs torch.load"], rows))
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "cold": cold, "imports": imports, "warm": warm}, indent=1))


if __name__ == "__main__":
    main()
