"""torch.distributed.checkpoint: AmberStorageWriter vs DCP's own FileSystemWriter, same state.

Trains the benchmark GPT a few steps, then saves its model + AdamW state (taken with
``get_state_dict``, as with FSDP2) twice through each writer, ``--gap`` training steps apart;
prints stored bytes of both saves and the save times (median of ``--repeats`` runs).

    python benchmarks/dcp_bench.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.dcp import AmberStorageReader, AmberStorageWriter  # noqa: E402
from amber_store.demo import GPTConfig, Trainer, corpus  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--gap", type=int, default=10, help="training steps between the two saves")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=100, help="training steps before the first save")
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args()
    trainer = Trainer(GPTConfig(width=args.width, layers=args.layers), data=corpus(2_000_000))
    for step in range(1, args.warmup + 1):
        trainer.step(step)
    states = []
    for step in (1, 2):
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.opt)
        states.append({"model": {k: v.clone() for k, v in model_sd.items()},
                       "optim": {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in optim_sd["state"].items()},
                                 "param_groups": optim_sd["param_groups"]}})
        for s in range(args.gap):
            trainer.step(10_000 * step + s)
    raw = sum(t.numel() * t.element_size() for t in trainer.model.parameters()) * 3

    results: dict[str, dict[str, list[float]]] = {}
    for name in ("DCP FileSystemWriter", "AmberStorageWriter"):
        r = results.setdefault(name, {"t1": [], "t2": [], "b1": [], "b2": [], "load": []})
        for _ in range(args.repeats):
            root = Path(tempfile.mkdtemp(prefix="amber-dcp-bench-"))
            try:
                for i, state in enumerate(states, 1):
                    t0 = time.perf_counter()
                    if name == "AmberStorageWriter":
                        dcp.save(state, storage_writer=AmberStorageWriter(root / "amber"))
                    else:
                        dcp.save(state, checkpoint_id=str(root / f"fs{i}"))
                    r[f"t{i}"].append(time.perf_counter() - t0)
                if name == "AmberStorageWriter":
                    store = amber.open(root / "amber", mode="r")
                    r["b1"].append(store.manifest(0).nbytes_stored)
                    r["b2"].append(store.manifest(1).nbytes_stored)
                    reader = AmberStorageReader(root / "amber")
                else:
                    r["b1"].append(dir_bytes(root / "fs1"))
                    r["b2"].append(dir_bytes(root / "fs2"))
                    reader = None
                target = {"model": {k: torch.empty_like(v) for k, v in states[1]["model"].items()},
                          "optim": states[1]["optim"]}
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=reader, checkpoint_id=None if reader else str(root / "fs2"))
                r["load"].append(time.perf_counter() - t0)
                assert all(torch.equal(target["model"][k], v) for k, v in states[1]["model"].items())
            finally:
                shutil.rmtree(root, ignore_errors=True)

    med = statistics.median
    print(f"machine: {machine()}")
    print(f"state: model + AdamW of a {raw / 3 / 4e6:.2f}M-parameter GPT ({raw / 1e6:.1f} MB) after {args.warmup} "
          f"training steps; second save {args.gap} steps after the first; {args.repeats} runs, medians\n")
    fs, am = results["DCP FileSystemWriter"], results["AmberStorageWriter"]
    print(table(["writer", "1st save MB", "2nd save MB", "2nd / 1st", "1st save s", "2nd save s", "load 2nd s"],
                [[n, f"{med(r['b1']) / 1e6:.2f}", f"{med(r['b2']) / 1e6:.2f}", f"{med(r['b2']) / med(r['b1']):.3f}",
                  f"{med(r['t1']):.3f}", f"{med(r['t2']):.3f}", f"{med(r['load']):.3f}"] for n, r in results.items()]))
    print(f"\namber 2nd save stores {med(am['b2']) / med(fs['b2']):.3f} of FileSystemWriter's bytes; "
          f"save time ratio amber/FileSystemWriter: 1st {med(am['t1']) / med(fs['t1']):.2f}, "
          f"2nd {med(am['t2']) / med(fs['t2']):.2f}")
    if args.json:
        args.json.write_text(json.dumps({"raw_bytes": raw, "results": results}, indent=1))


if __name__ == "__main__":
    main()
