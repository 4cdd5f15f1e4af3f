"""Decode speed of one stored 4 MiB chunk by each path the native decoder runs on this CPU, and
by c-blosc (with numpy's apply of a diff): the raw values of a full step, and a lossless diff
applied onto its base, for fp32, bf16 and fp16 weights-like values (a delta: one update of a
fine-tuning step's scale). GB/s of output, the median of ``--repeats`` runs in this process, the paths interleaved;
each decode checks the chunk's crc32c first, as a load does.

    python benchmarks/decode_paths.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, rotated, table  # noqa: E402
from amber_store.codecs import Compression, DiffDeltaCodec, compression, decompress  # noqa: E402

CHUNK = 4 << 20


def frames(dtype: torch.dtype, update: float) -> dict[str, tuple[bytes, np.ndarray, np.ndarray, str]]:
    """(stored chunk, buffer before, bits after, op) of a full step's values and of a diff."""
    g = torch.Generator().manual_seed(0)
    n = CHUNK // dtype.itemsize
    base = (torch.randn(n, generator=g) * 0.02).to(dtype)
    new = (base.float() + torch.randn(n, generator=g) * update).to(dtype)
    uint = np.uint32 if dtype.itemsize == 4 else np.uint16
    b, v = base.view(torch.int32 if dtype.itemsize == 4 else torch.int16).numpy().view(uint), \
        new.view(torch.int32 if dtype.itemsize == 4 else torch.int16).numpy().view(uint)
    codec, delta = DiffDeltaCodec(), np.empty_like(b)
    codec.encode_into(delta, v, b)

    def stored(x: np.ndarray, c: DiffDeltaCodec | None) -> bytes:
        return b"".join(Compression().compress(x.view(np.uint8), x.itemsize, c))
    return {"full values": (stored(v, None), np.empty_like(v), v, "store"),
            "diff applied onto its base": (stored(delta, codec), b, v, codec.fused_op)}


def decode_once(chunk: bytes, out: np.ndarray, before: np.ndarray, op: str) -> float:
    """Seconds to decode ``chunk`` into ``out`` (reset to ``before``) as a load does by the path set."""
    np.copyto(out, before)
    t0 = time.perf_counter()
    if compression.fuses(chunk, out, op):
        decompress(chunk, out, op)
    elif op == "store":
        decompress(chunk, out.view(np.uint8))
    else:  # c-blosc, then numpy's apply: what a load does without the native decoder
        raw = decompress(chunk)
        DiffDeltaCodec().apply_into(out, raw.view(out.dtype), (slice(0, out.size),), None)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args()
    paths = [*(compression._blosc1.paths if compression._blosc1 else ()), "c-blosc"]
    native = compression._blosc1
    rows, gbps = [], {}
    for name, dtype, update in (("fp32", torch.float32, 1e-4), ("bf16", torch.bfloat16, 1e-3),
                                ("fp16", torch.float16, 1e-4)):
        for kind, (chunk, before, after, op) in frames(dtype, update).items():
            out, times = before.copy(), {path: [] for path in paths}
            for r in range(args.repeats + 1):  # paths interleaved, in an order rotated each round
                for path in rotated(paths, r):
                    compression._blosc1, compression._PATH = (None, None) if path == "c-blosc" else (native, path)
                    t = decode_once(chunk, out, before, op)
                    assert np.array_equal(out, after), f"{path} decoded to other bits"
                    if r:  # (the first round warms up)
                        times[path].append(t)
            gbps[f"{name} {kind}"] = {p: CHUNK / statistics.median(times[p]) / 1e9 for p in paths}
            rows.append([f"{name} {kind}", f"{len(chunk) / CHUNK:.2f}", *(f"{gbps[f'{name} {kind}'][p]:.1f}" for p in paths)])
    compression._blosc1, compression._PATH = native, None
    print(f"`python benchmarks/decode_paths.py`; {machine()}\n")
    print(table(["chunk", "stored / raw", *paths], rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "gbps": gbps}, indent=1))


if __name__ == "__main__":
    main()
