"""Encode throughput of each delta codec vs a plain copy of the same tensors (the physical limit).

A 64 MB float32 tensor and a perturbed successor, like two checkpoints of an optimizer moment;
encoding is the whole work of a delta save but the writes: the diff, then each chunk
serialized (entropy-coded for block/ratio), compressed and checksummed. Decoding each lossy
codec's chunks, what a load does after its reads: each chunk checked, decompressed and applied
onto the base's bits in place, then the result's checksum checked (the base itself, a full
step's decode, not counted), a chunk per codec thread. Every figure is GB/s
of raw tensor bytes, the median of ``--repeats`` runs, on the CPU here
(the same torch code runs on a GPU's memory when the tensors live there). Lossless deltas of
CPU tensors are taken chunk by chunk on the codec threads, as a save takes them; their torch
``diff()`` (an accelerator's path) is timed too.

Then the same on a real training state: amber_store.demo's TinyGPT (3.2M parameters) trained
with AdamW, the state 10 steps after a saved one saved as a delta step into a ``memory://``
store (the whole save path but the storage), per codec, against a copy of that state's tensors
and ``torch.save`` into memory.

    python benchmarks/codecs_bench.py
"""

from __future__ import annotations

import argparse
import copy
import functools
import io
import json
import math
import statistics
import sys
import time
import uuid
from typing import Any
from pathlib import Path

import crc32c
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.codecs import DELTA_ENCODINGS, Compression, LosslessDeltaCodec, decompress  # noqa: E402
from amber_store.runtime import codec_pool  # noqa: E402
from amber_store.demo import GPTConfig, Trainer  # noqa: E402
from amber_store.export import flat_tensors  # noqa: E402
from amber_store.format import (LOSSY_CHUNK_BYTES, TensorEntry, bits_to_numpy, choose_chunks, chunk_grid,  # noqa: E402
                                chunk_runs, chunk_slices, iter_chunk_indices, to_bits)
from amber_store.stepwriter import _lossless_chunk, piece_chunks, submit_delta  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=100, help="steps of the real run before its delta step")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    n = args.mb * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n // 1024, 1024, generator=g)
    value = base * (1 + 0.01 * torch.randn(base.shape, generator=g))
    base_bits = to_bits(base).clone()
    # every codec at the lossy codecs' chunk size (a store gives lossless tensors 4 MiB chunks)
    chunks = choose_chunks(tuple(value.shape), 4, LOSSY_CHUNK_BYTES)
    gb = value.numel() * 4 / 1e9
    out = torch.empty_like(value)
    runs = chunk_runs(tuple(value.shape), chunks)
    padded = math.prod(chunks)
    compression = Compression()

    # second moments are positive: the ratio codec gets |base| and the same relative change
    positive = base.abs().add_(1e-3)
    positive_bits = to_bits(positive).clone()
    positive_value = positive * (value / base)

    recycled = torch.empty_like(base_bits)

    def encode(codec: amber.DeltaCodec, value: torch.Tensor = value, base_bits: torch.Tensor = base_bits) -> int:
        """diff on the tensor's device (a lossy one into the spent base's buffer, which a save
        recycles for CPU tensors), then every chunk serialized, compressed and checksummed on the codec threads, as a save
        does; returns the stored bytes."""
        delta = codec.diff(value, base_bits, chunks, out=None if isinstance(codec, LosslessDeltaCodec) else recycled,
                           finish=functools.partial(piece_chunks, codec, padded, compression, 4))
        if delta is None:  # nothing moved past the codec's precision: nothing to write
            return 0
        jobs = submit_delta(codec_pool(), codec, delta, bits_to_numpy(delta.recon).reshape(-1), runs, padded,
                            compression, 4)
        return sum(sum(map(len, parts or [])) for j in jobs for parts, _ in j.result())  # each chunk's stored parts

    host_value, host_base = bits_to_numpy(to_bits(value)).reshape(-1), bits_to_numpy(base_bits).reshape(-1)

    def encode_host(codec: LosslessDeltaCodec) -> int:
        """A lossless delta of CPU tensors as a save takes it: each chunk diffed, compressed
        and checksummed on the codec threads, straight from the tensors' memory."""
        jobs = [codec_pool().submit(_lossless_chunk, codec, host_value[a:b], host_base[a:b], None, None, padded,
                                    compression, 4) for a, b in runs]
        return sum(sum(map(len, j.result()[0] or [])) for j in jobs)

    # (codec, value, base bits) of each lossy codec, encoded and decoded
    lossy: dict[str, tuple[amber.DeltaCodec, torch.Tensor, torch.Tensor]] = {
        "sparse 2%": (amber.SparseDeltaCodec(0, "b"), value, base_bits),
        "quant8": (amber.QuantizedDeltaCodec(0, "b", bits=8), value, base_bits),
        "quant4": (amber.QuantizedDeltaCodec(0, "b", bits=4), value, base_bits),
        # the lossy preset's steps would keep most of a 1% change at its base: finer steps code
        # it at the density of a real 10-step delta (about 1 bit per element)
        "block step 0.01": (amber.BlockDeltaCodec(0, "b", step=0.01), value, base_bits),
        "ratio step 0.01 (positive values)": (amber.RatioDeltaCodec(0, "b", step=0.01), positive_value, positive_bits),
        # the preset's steps for weights and exp_avg_sq: a 1% change is a few codes per block
        # (stochastic rounding: a hash per element picks which);
        # with drift, a pass more per chunk measures how far it moved (1%: just at
        # benchmarks/regimes.py's 0.01)
        "block step 0.6, rounded stochastically (the preset's weights)":
            (amber.BlockDeltaCodec(0, "b", step=0.6, stochastic=True), value, base_bits),
        "block step 0.15 (the preset before's weights)": (amber.BlockDeltaCodec(0, "b", step=0.15), value, base_bits),
        "block step 0.1, drift 0.01 (regimes.py's drift-scaled weights)":
            (amber.BlockDeltaCodec(0, "b", step=0.1, drift=0.01), value, base_bits),
        "ratio step 1.0 (the preset's exp_avg_sq)": (amber.RatioDeltaCodec(0, "b", step=1.0), positive_value, positive_bits),
        # coarser steps leave most codes zero, as in most chunks of the preset's 10-step deltas
        # late in training: those chunks store a nonzero bitmap and the nonzero codes
        "block step 0.05 (sparse codes)": (amber.BlockDeltaCodec(0, "b", step=0.05), value, base_bits),
        "ratio step 0.05 (sparse codes)": (amber.RatioDeltaCodec(0, "b", step=0.05), positive_value, positive_bits),
    }
    cases = {
        "copy (clone, memcpy)": lambda: value.clone(),
        "copy into a reused buffer": lambda: out.copy_(value),
        "diff (lossless, default)": lambda: encode_host(amber.DiffDeltaCodec(0, "b")),
        "xor (lossless)": lambda: encode_host(amber.XorDeltaCodec(0, "b")),
        # an accelerator's path: the delta in torch, then only it crosses to the host
        "diff, torch diff() (the device path)": lambda: encode(amber.DiffDeltaCodec(0, "b")),
        "xor, torch diff() (the device path)": lambda: encode(amber.XorDeltaCodec(0, "b")),
        **{name: functools.partial(encode, *args) for name, args in lossy.items()},
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    stored = {}
    for _ in range(args.repeats):  # interleaved: this machine is shared and noisy
        for name, fn in cases.items():
            t0 = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - t0)
            if isinstance(result, int):
                stored[name] = result
    rates = {name: gb / statistics.median(t) for name, t in times.items()}
    copy = rates["copy (clone, memcpy)"]
    print(f"machine: {machine()}, torch threads {torch.get_num_threads()}")
    print(f"tensor: {args.mb} MB float32 and a successor moved by 1% (multiplicative noise), {args.repeats} runs "
          "(median); encode = the codec's diff() (the delta, the move of encoded bytes to the host and the new "
          "reconstruction) and every chunk serialized, compressed and checksummed on the codec threads\n")
    print(table(["operation", "GB/s", "vs memcpy", "stored MB", "bits per element"],
                [[k, f"{v:.2f}", f"{v / copy:.2f}x", f"{stored[k] / 1e6:.1f}" if k in stored else "",
                  f"{8 * stored[k] / value.numel():.3f}" if k in stored else ""] for k, v in rates.items()]))
    decodes = decode_rates(lossy, chunks, args.repeats, gb)
    print(f"\nDecoding the same chunks (checked, decompressed, applied onto the base's bits in place, the result "
          f"checked) on the codec threads, {args.repeats} runs (median), interleaved with a copy\n")
    decode_copy = decodes["copy (clone, memcpy)"]
    print(table(["operation", "GB/s", "vs memcpy"], [[k, f"{v:.2f}", f"{v / decode_copy:.2f}x"] for k, v in decodes.items()]))
    real = real_state(args.train_steps, args.repeats)
    print(f"\nA real delta step: TinyGPT ({real['params'] / 1e6:.1f}M parameters) with AdamW, the state at step "
          f"{args.train_steps} ({real['mb']:.0f} MB in {real['tensors']} tensors) saved as a delta against step "
          f"{args.train_steps - 10} into memory://, {args.repeats} runs (median), interleaved\n")
    state_copy = real["seconds"]["copy of the state's tensors (clone)"]
    print(table(["method", "ms", "vs the copy", "stored MB"],
                [[k, f"{1e3 * v:.1f}", f"{state_copy / v:.2f}x", f"{real['stored'][k] / 1e6:.2f}" if k in real["stored"] else ""]
                 for k, v in real["seconds"].items()]))
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "gbps": rates, "stored": stored, "decode_gbps": decodes,
                                         "real": real}, indent=1))


def stored_chunks(codec: amber.DeltaCodec, value: torch.Tensor, base_bits: torch.Tensor,
                  chunks: tuple[int, ...]) -> tuple[TensorEntry, list[bytes | None]] | None:
    """A delta of ``value`` as a save stores it: the tensor's manifest entry and each chunk's
    stored bytes (``None``: not stored); ``None`` if nothing moved past the codec's precision."""
    runs, padded = chunk_runs(tuple(value.shape), chunks), math.prod(chunks)
    delta = codec.diff(value, base_bits, chunks)
    if delta is None:
        return None
    stored_as = codec.stored_as(delta)
    jobs = submit_delta(codec_pool(), stored_as, delta, bits_to_numpy(delta.recon).reshape(-1), runs, padded,
                        Compression(), 4)
    parts = [part for j in jobs for part in j.result()]
    entry = TensorEntry("float32", list(value.shape), list(chunks), stored_as.encoding, 0, "b",
                        [crc for _, crc in parts], value.numel() * 4, params=delta.params)
    return entry, [None if p is None else b"".join(p) for p, _ in parts]


def decode_rates(lossy: dict[str, tuple[amber.DeltaCodec, torch.Tensor, torch.Tensor]], chunks: tuple[int, ...],
                 repeats: int, gb: float) -> dict[str, float]:
    """GB/s of each codec's decode of its stored chunks onto the base's bits, as a load applies
    a delta step's layer (:meth:`~amber_store.reader.Reader._apply_layers`), beside a copy."""
    shape = tuple(next(iter(lossy.values()))[1].shape)
    runs = chunk_runs(shape, chunks)
    regions = [chunk_slices(idx, shape, chunks) for idx in iter_chunk_indices(chunk_grid(shape, chunks))]
    stored = {name: stored_chunks(codec, value, base, chunks) for name, (codec, value, base) in lossy.items()}
    prepared = {name: (s, bits_to_numpy(lossy[name][2]).reshape(-1)) for name, s in stored.items() if s is not None}
    out = np.empty(math.prod(shape), np.uint32)

    def decode(entry: TensorEntry, payloads: list[bytes | None]) -> None:
        codec = DELTA_ENCODINGS[entry.encoding].for_entry(entry)

        def chunk(k: int) -> None:
            (a, b), region = runs[k], regions[k]
            if payloads[k] is not None:
                raw = decompress(payloads[k])
                codec.decode_into(out[a:b].reshape([r.stop - r.start for r in region]), raw, math.prod(chunks),
                                  region, entry)
            if crc32c.crc32c(out[a:b]) != entry.crc32c[k]:
                raise AssertionError("a decoded chunk is not what the encoder reconstructed")

        list(codec_pool().map(chunk, range(len(runs))))

    source = torch.from_numpy(out.view(np.float32))
    seconds: dict[str, list[float]] = {"copy (clone, memcpy)": [], **{name: [] for name in prepared}}
    for _ in range(repeats):
        t0 = time.perf_counter()
        source.clone()
        seconds["copy (clone, memcpy)"].append(time.perf_counter() - t0)
        for name, ((entry, payloads), base) in prepared.items():
            np.copyto(out, base)  # (the base's bits, as the layer below left them: not timed)
            t0 = time.perf_counter()
            decode(entry, payloads)
            seconds[name].append(time.perf_counter() - t0)
    return {name: gb / statistics.median(t) for name, t in seconds.items()}


def real_state(steps: int, repeats: int) -> dict:
    """Delta saves of a real training state into ``memory://`` per codec, against a copy of it."""
    trainer = Trainer(GPTConfig(context=64, width=256, layers=4, heads=4), batch=16)
    states = {}
    for step in range(1, steps + 1):
        trainer.step(step)
        if step in (steps - 10, steps):
            states[step] = copy.deepcopy(trainer.state(step))  # (state dicts hold the live tensors)
    before, after = states[steps - 10], states[steps]
    tensors = list(flat_tensors(after).values())

    def save(codec: str) -> tuple[float, int]:
        with amber.open(f"memory://codecs-bench-{uuid.uuid4().hex}", mode="w", codec=codec) as store:
            store.save(steps - 10, before)
            t0 = time.perf_counter()
            info = store.save(steps, after)
            return time.perf_counter() - t0, info.nbytes_stored

    def timed(fn: Any) -> tuple[float, None]:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, None

    methods = {
        "copy of the state's tensors (clone)": lambda: timed(lambda: [t.clone() for t in tensors]),
        "torch.save into memory": lambda: timed(lambda: torch.save(after, io.BytesIO())),
        **{f"amber save, codec={c!r}": (lambda c=c: save(c)) for c in ("lossless", "lossy", "quant8", "quant4", "sparse")},
    }
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    stored = {}
    for _ in range(repeats):
        for name, fn in methods.items():
            t, nbytes = fn()
            seconds[name].append(t)
            if nbytes is not None:
                stored[name] = nbytes
    return {"params": sum(p.numel() for p in trainer.model.parameters()), "tensors": len(tensors),
            "mb": sum(t.numel() * t.element_size() for t in tensors) / 1e6,
            "seconds": {k: statistics.median(v) for k, v in seconds.items()}, "stored": stored}


if __name__ == "__main__":
    main()
