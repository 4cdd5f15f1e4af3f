"""A rank killed mid-save, then a resume on another world size: FSDP2 over gloo ranks.

Runs ``tests/dcp_workers.py``'s jobs at sizes the test suite leaves out (it runs 4 ranks, one
killed, resumed on 3): ``killed`` trains an FSDP2 MLP with AdamW on ``--world`` ranks, saves
step 10, and during step 20's save SIGKILLs rank ``--victim`` after its items are written and
before it seals them; the survivors must fail, and the time each took to is printed. Then
``fsdp_resume`` on ``--resume-world`` ranks resumes the latest committed step (checked bit-exact
against the state gathered at step 10), saves step 20 and runs gc, which removes the killed
save's attempt.

    python benchmarks/dcp_faults.py --world 16 --victim 5 --resume-world 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from amber_store.runtime import sync  # noqa: E402

import amber_store as amber  # noqa: E402
from amber_store.usage import Usage  # noqa: E402
from backends.process import free_port  # noqa: E402
from benchmarks.common import machine  # noqa: E402

WORKER = ROOT / "tests" / "dcp_workers.py"


def run(job: str, world: int, uri: str, options: dict) -> list[tuple[int, str, str]]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), job, uri, json.dumps(options)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    return [(p.returncode, out, err) for p in procs for out, err in [p.communicate(timeout=900)]]


def equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=16)
    p.add_argument("--victim", type=int, default=5)
    p.add_argument("--resume-world", type=int, default=6)
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="amber-dcp-faults-"))
    uri = str(out / "ckpt")
    print(f"machine: {machine()}")
    t0 = time.perf_counter()
    ranks = run("killed", args.world, uri, {"out": str(out), "victim": args.victim})
    print(f"killed job on {args.world} ranks: {time.perf_counter() - t0:.0f} s")
    code, text, _ = ranks[args.victim]
    assert code == -9 and "killed mid-save" in text, (code, text)
    waits = []
    for r, (code, text, err) in enumerate(ranks):
        if r == args.victim:
            continue
        assert code == 0 and "save failed as expected" in text, (r, code, text, err[-2000:])
        waits.append(float(text.split("failed after ")[1].split(" s")[0]))
    first = next(text for r, (_, text, _) in enumerate(ranks) if r != args.victim)
    print(f"rank {args.victim} SIGKILLed mid-save; the {len(waits)} others failed after "
          f"{min(waits):.1f}-{max(waits):.1f} s: {first.split('save failed as expected: ')[1].splitlines()[0][:300]}")
    store = amber.open(uri, mode="r")
    strays = sync(Usage(store.history).stray_attempts(grace_seconds=0))
    print(f"committed: {store.steps()}; the killed save's attempt: {[a.group for a in strays]}")
    assert store.steps() == [10] and len(strays) == 1
    t0 = time.perf_counter()
    ranks = run("fsdp_resume", args.resume_world, uri, {"out": str(out)})
    assert all(code == 0 for code, _, _ in ranks), [err[-2000:] for _, _, err in ranks]
    print(f"resume on {args.resume_world} ranks: {time.perf_counter() - t0:.0f} s; {ranks[0][1].strip()}")
    resumed = torch.load(out / f"resumed_{args.resume_world}.pt", weights_only=True)
    expected = torch.load(out / "expected_10.pt", weights_only=True)
    assert equal(resumed, expected), "resumed state differs"
    store = amber.open(uri, mode="r")
    assert store.steps() == [10, 20] and sync(Usage(store.history).stray_attempts(grace_seconds=0)) == []
    print(f"resumed state (model, AdamW, step) bit-exact against step 10's; committed now {store.steps()}, "
          "no stray attempt left")


if __name__ == "__main__":
    main()
