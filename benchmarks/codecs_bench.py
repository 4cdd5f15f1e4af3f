"""Encode throughput of each delta codec vs a plain copy of the same tensors (the physical limit).

A 64 MB float32 tensor and a perturbed successor, like two checkpoints of an optimizer moment;
every figure is GB/s of raw tensor bytes, the median of ``--repeats`` runs, on the CPU here
(the same torch code runs on a GPU's memory when the tensors live there).

    python benchmarks/codecs_bench.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.format import choose_chunks, to_bits  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    n = args.mb * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n // 1024, 1024, generator=g)
    value = base * (1 + 0.01 * torch.randn(base.shape, generator=g))
    base_bits = to_bits(base).clone()
    chunks = choose_chunks(tuple(value.shape), 4)
    gb = value.numel() * 4 / 1e9
    out = torch.empty_like(value)
    cases = {
        "copy (clone, memcpy)": lambda: value.clone(),
        "copy into a reused buffer": lambda: out.copy_(value),
        "xor (lossless)": lambda: amber.XorDeltaCodec(0, "b").diff(value, base_bits, chunks),
        "sparse 2%": lambda: amber.SparseDeltaCodec(0, "b").diff(value, base_bits, chunks),
        "quant8": lambda: amber.QuantizedDeltaCodec(0, "b", bits=8).diff(value, base_bits, chunks),
    }
    rates = {}
    for name, fn in cases.items():
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        rates[name] = gb / statistics.median(times)
    copy = rates["copy (clone, memcpy)"]
    print(f"machine: {machine()}, torch threads {torch.get_num_threads()}")
    print(f"tensor: {args.mb} MB float32, {args.repeats} runs (median); encode = the codec's diff(), including the "
          "move of encoded bytes to host and the new reconstruction\n")
    print(table(["operation", "GB/s", "vs memcpy"], [[k, f"{v:.2f}", f"{v / copy:.2f}x"] for k, v in rates.items()]))
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "gbps": rates}, indent=1))


if __name__ == "__main__":
    main()
