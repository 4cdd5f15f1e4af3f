"""Fuzz the stored chunks of a real store: every load of a damaged store names the damaged step.

Saves a full step and a delta step (fp32 and bf16 tensors of one chunk each, a tensor with edge
chunks), then, one case at a time, flips one random bit at a random place in one of the steps'
shard objects (a frame, its crc32c, the shard index) and loads the delta step whole. The outcome
must be :class:`amber_store.CorruptDataError` naming the step whose object was damaged (or, for
a bit no read depends on, the saved bits); never wrong bits, another exception, or a crash. The
bit is flipped in place, as a bad sector would; ``--rewrite`` writes the damaged file anew
instead (truncated, then written): a read still running from a failed load would then meet a
file shorter than its mapping and end the process with SIGBUS (how a decode that outlived its
failed load was found).

    python benchmarks/fuzz_chunks.py [--flips 400] [--seed 0] [--rewrite]
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import amber_store as amber  # noqa: E402


def store_with_two_steps(root: Path) -> tuple[dict[str, torch.Tensor], dict[Path, int]]:
    """A store at ``root`` with a full and a delta step; the delta step's state, and each shard
    object with the step that wrote it."""
    g = torch.Generator().manual_seed(0)
    state = {"fp32": torch.randn(1024, 1024, generator=g) * 0.02,
             "bf16": (torch.randn(1024, 1024, generator=g) * 0.02).bfloat16(),
             "edges": torch.randn(1000, 1100, generator=g)}
    with amber.open(root, mode="w") as store:
        store.save(1, state)
        for t in state.values():
            t.add_((torch.randn(t.shape, generator=g) * 1e-3).to(t.dtype))
        store.save(2, state)
        objects = {f: step for step in (1, 2) for e in store.manifest(step).tensors.values() if e.array
                   for f in (root / e.array).rglob("*") if f.is_file() and f.name != "zarr.json"}
    return state, objects


def flip(path: Path, at: int, bit: int, rewrite: bool) -> None:
    if rewrite:
        data = bytearray(path.read_bytes())
        data[at] ^= 1 << bit
        path.write_bytes(bytes(data))
        return
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << bit)]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flips", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rewrite", action="store_true", help="write a damaged file anew instead of in place")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="amber-fuzz-chunks-"))
    try:
        state, objects = store_with_two_steps(root / "store")
        rng, outcomes = random.Random(args.seed), collections.Counter()
        for _ in range(args.flips):
            path = rng.choice(sorted(objects))
            at, bit = rng.randrange(path.stat().st_size), rng.randrange(8)
            flip(path, at, bit, args.rewrite)
            try:
                got = amber.open(root / "store", mode="r").load(2, lazy=False)
                same = all(torch.equal(got[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state)
                outcomes["the saved bits" if same else "WRONG BITS"] += 1
            except amber.CorruptDataError as e:
                outcomes["CorruptDataError, the damaged step" if e.step == objects[path]
                         else f"CorruptDataError, step {e.step} for step {objects[path]}'s object"] += 1
            except Exception as e:  # noqa: BLE001 (what the fuzz is for)
                outcomes[f"OTHER {type(e).__name__}: {e}"] += 1
            flip(path, at, bit, args.rewrite)  # (undone)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.flips} flips ({'files rewritten' if args.rewrite else 'in place'}, seed {args.seed}):")
    for outcome, n in outcomes.most_common():
        print(f"  {n:5d}  {outcome}")
    good = {"CorruptDataError, the damaged step", "the saved bits"}
    sys.exit(0 if set(outcomes) <= good else 1)


if __name__ == "__main__":
    main()
