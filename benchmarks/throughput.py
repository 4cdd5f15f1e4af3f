"""Save and load throughput of amber-store: local directory vs loopback S3, vs torch.save.

The same state dict (float32 tensors shaped like a transformer's weights and Adam moments) is
saved full, then as a delta after a small update to every element, then the delta step is
loaded back, on each backend; each figure is the median (and range) of ``--repeats`` runs.
MB/s counts raw tensor bytes (what the training job hands over), not stored bytes.

    python benchmarks/throughput.py --mb 256 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from backends.loopback_s3 import LoopbackS3  # noqa: E402
from benchmarks.common import clock, machine, median_rate, rate, table  # noqa: E402


def make_state(total_mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = 1024
    state = {}
    for i in range(max(1, total_mb * (1 << 20) // (4 * width * width * 3))):
        state[f"layer{i}.weight"] = torch.randn(width, width, generator=g) * 0.02
        state[f"layer{i}.exp_avg"] = torch.randn(width, width, generator=g) * 1e-3
        state[f"layer{i}.exp_avg_sq"] = torch.rand(width, width, generator=g) * 1e-6
        state[f"layer{i}.bias"] = torch.zeros(width)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def bench_amber(uri: str, opts: dict | None, state: dict, updated: dict, repeats: int) -> dict:
    full, delta, load = [], [], []
    for _ in range(repeats):
        with amber.open(uri, opts, mode="w") as store:
            t, full_info = clock(lambda: store.save(1, state))
            full.append(t)
            t, delta_info = clock(lambda: store.save(2, updated))
            delta.append(t)
        with amber.open(uri, opts, mode="r") as reader:
            load.append(clock(lambda: reader.load(2, lazy=False))[0])
    return {"full": full, "delta": delta, "load": load, "full_ratio": full_info.ratio, "delta_ratio": delta_info.ratio}


def bench_torch_save(path: Path, state: dict, repeats: int) -> dict:
    save = [clock(lambda: torch.save(state, path))[0] for _ in range(repeats)]
    load = [clock(lambda: torch.load(path))[0] for _ in range(repeats)]
    return {"full": save, "delta": save, "load": load, "full_ratio": 1.0, "delta_ratio": 1.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=128, help="approximate state size in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args()
    state = make_state(args.mb)
    g = torch.Generator().manual_seed(1)
    updated = {k: v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in state.items()}
    mb = nbytes(state) / 1e6
    tmp = Path(tempfile.mkdtemp(prefix="amber-bench-"))
    results = {}
    try:
        results["torch.save, local file"] = bench_torch_save(tmp / "state.pt", state, args.repeats)
        results["amber, local directory"] = bench_amber(str(tmp / "local"), None, state, updated, args.repeats)
        with LoopbackS3() as s3:
            s3.create_bucket("bench")
            results["amber, loopback S3 (moto)"] = bench_amber(
                f"s3://bench/{uuid.uuid4().hex}", s3.storage_options(), state, updated, args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"machine: {machine()}")
    print(f"state: {mb:.0f} MB float32 in {len(state)} tensors; {args.repeats} runs, MB/s median (range)\n")
    print(table(["backend", "full save MB/s", "delta save MB/s", "load delta step MB/s", "full size ratio",
                 "delta size ratio"],
                [[name, rate(mb, r["full"]), rate(mb, r["delta"]), rate(mb, r["load"]),
                  f"{r['full_ratio']:.2f}x", f"{r['delta_ratio']:.2f}x"] for name, r in results.items()]))
    local, s3r, ts = (results[k] for k in ("amber, local directory", "amber, loopback S3 (moto)",
                                           "torch.save, local file"))
    print()
    for what in ("full", "delta", "load"):
        print(f"{what:>5}: loopback S3 / local dir = {median_rate(mb, s3r[what]) / median_rate(mb, local[what]):.2f}; "
              f"amber local / torch.save = {median_rate(mb, local[what]) / median_rate(mb, ts[what]):.2f}")
    if args.json:
        args.json.write_text(json.dumps({"mb": mb, "results": results}, indent=1))


if __name__ == "__main__":
    main()
