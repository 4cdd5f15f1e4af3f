"""A state that lives on an accelerator: deltas taken on the device against copying it to the host.

Amber's premise: a delta computed where the tensors live means only encoded bytes cross to the
host. Two parts, every method timed interleaved in one process (medians of ``--repeats``), the
device synchronized before each clock read:

1. One ``--mb`` MB float32 tensor and a successor moved by 1%: each codec's ``diff()`` on the
   device (the base's bits from the host, where a save keeps them pinned, then the delta, its
   move to the host and the new reconstruction; the base's copy is timed alone too) against a copy of the
   tensor to pinned and to pageable host memory.
2. A GPT-like model with AdamW state (``--params`` millions) on the device, a step after a
   saved one: ``store.save`` of a lossless and a lossy delta step and the ``save_async`` stall
   (snapshot on the host or on the device) against ``torch.save`` of the same state and a bare
   copy into reused pinned buffers; ``load(lazy=False, device=...)`` against ``torch.load``
   with ``map_location``.

    python benchmarks/device.py                       # the CUDA device if there is one
    python benchmarks/device.py --device cpu --params 5 --mb 16 --repeats 2    # a quick look here
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.format import LOSSY_CHUNK_BYTES, choose_chunks, to_bits  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402
from benchmarks.layout import gpt_state, nbytes, tensors  # noqa: E402


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    def timed(fn: Callable[[], Any]) -> float:
        if device.type != "cpu":
            getattr(torch, device.type).synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type != "cpu":
            getattr(torch, device.type).synchronize(device)
        return time.perf_counter() - t0
    return timed


def interleaved(cases: dict[str, Callable[[], Any]], repeats: int, timed: Callable) -> dict[str, float]:
    for fn in cases.values():  # warm-up: kernels compiled, pinned pools and device caches filled
        timed(fn)
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            seconds[name].append(timed(fn))
    return {name: statistics.median(s) for name, s in seconds.items()}


def codecs_on(device: torch.device, mb: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(mb * (1 << 20) // 4 // 1024, 1024, generator=g).abs_().add_(1e-3)
    value = (base * (1 + 0.01 * torch.randn(base.shape, generator=g))).to(device)
    host_bits = to_bits(base).clone()
    if device.type != "cpu":
        host_bits = host_bits.pin_memory()  # (a save keeps an accelerator's bases pinned: codecs.to_host)
    # every codec at the lossy codecs' chunk size (a store gives lossless tensors 4 MiB chunks)
    chunks = choose_chunks(tuple(base.shape), 4, LOSSY_CHUNK_BYTES)
    pinned = torch.empty(base.shape, pin_memory=device.type != "cpu")
    cases: dict[str, Callable[[], Any]] = {
        "copy to pinned host memory": lambda: pinned.copy_(value),
        "copy to pageable host memory (.cpu())": lambda: value.to("cpu", copy=True),
        "the base's bits to the device (each diff's first step)": lambda: host_bits.to(device, non_blocking=True),
    }
    codecs = {"diff (lossless)": amber.DiffDeltaCodec(0, "b"), "xor (lossless)": amber.XorDeltaCodec(0, "b"),
              "sparse 2%": amber.SparseDeltaCodec(0, "b"), "quant8": amber.QuantizedDeltaCodec(0, "b", bits=8),
              "quant4": amber.QuantizedDeltaCodec(0, "b", bits=4), "block 0.01": amber.BlockDeltaCodec(0, "b", step=0.01),
              "ratio 0.01": amber.RatioDeltaCodec(0, "b", step=0.01)}
    for name, codec in codecs.items():
        cases[name] = lambda c=codec: c.diff(value, host_bits, chunks)
    return interleaved(cases, repeats, timer(device))


def train_step(state: dict[str, Any]) -> None:
    for t in tensors(state):
        if t.dtype.is_floating_point and t.dim() > 0:
            t.add_(torch.randn_like(t), alpha=1e-3 * float(t.std()))


def store_on(device: torch.device, params_m: float, repeats: int, root: Path) -> tuple[dict[str, float], int]:
    state = gpt_state(params_m)
    for t in tensors(state):  # (moved in place: the state dict's structure stays)
        t.data = t.data.to(device)
    flat = tensors(state)
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type != "cpu") for t in flat]
    stores = {name: amber.open(root / name, full_every=1000, **options) for name, options in {
        "lossless": {}, "lossy": {"codec": "lossy"}, "host": {"snapshot": "host"}, "device": {"snapshot": "device"}}.items()}
    for name, store in stores.items():
        if name in ("host", "device"):  # through save_async: its snapshot buffers made before the clock
            store.save_async(0, state).result()
        else:
            store.save(0, state)
    step = 0

    def stall(store: amber.Store) -> None:
        store.save_async(step, state)

    cases: dict[str, Callable[[], Any]] = {
        "torch.save": lambda: torch.save(state, root / "state.pt"),
        "amber save, delta step (lossless)": lambda: stores["lossless"].save(step, state),
        "amber save, delta step (codec='lossy')": lambda: stores["lossy"].save(step, state),
        "bare copy into reused pinned host buffers": lambda: [b.copy_(t, non_blocking=True) for b, t in zip(buffers, flat)],
        "save_async stall (snapshot='host')": lambda: stall(stores["host"]),
        "save_async stall (snapshot='device')": lambda: stall(stores["device"]),
        "torch.load (map_location=device)": lambda: torch.load(root / "state.pt", map_location=device, weights_only=True),
        "amber load, delta step (lossless)": lambda: stores["lossless"].load(step, lazy=False, device=device),
    }
    timed = timer(device)
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        step += 1
        train_step(state)
        for name, fn in cases.items():
            seconds[name].append(timed(fn))
            if "stall" in name:
                stores["host" if "host" in name else "device"].wait()
    for store in stores.values():
        store.close()
    return {name: statistics.median(s) for name, s in seconds.items()}, nbytes(state)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--params", type=float, default=50, help="millions of parameters of the GPT-like state")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    print(f"{datetime.date.today()}, machine: {machine()}; device: {device} ({name}); {args.repeats} runs, medians, "
          "interleaved\n")
    codecs = codecs_on(device, args.mb, args.repeats)
    pinned = codecs["copy to pinned host memory"]
    print(f"1. {args.mb} MB float32, moved by 1%: diff() on {device} (the delta, its move to the host, the new "
          "reconstruction)\n")
    print(table(["operation", "ms", "GB/s", "vs the copy to pinned memory"],
                [[k, f"{1e3 * v:.2f}", f"{args.mb * (1 << 20) / 1e9 / v:.1f}", f"{v / pinned:.2f}x"]
                 for k, v in codecs.items()]))
    with tempfile.TemporaryDirectory() as tmp:
        saves, raw = store_on(device, args.params, args.repeats, Path(tmp))
    print(f"\n2. A GPT-like state on {device}: {raw / 1e6:.0f} MB, a delta step after a saved one, to a local "
          "disk (page cache)\n")
    peers = {"save": saves["torch.save"], "stall": saves["bare copy into reused pinned host buffers"],
             "load": saves["torch.load (map_location=device)"]}
    print(table(["method", "s", "vs its peer"],
                [[k, f"{v:.3f}", "" if v in peers.values() else
                  f"{v / peers['stall' if 'stall' in k else 'load' if 'load' in k else 'save']:.2f}x"]
                 for k, v in saves.items()]))
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "name": name, "mb": args.mb, "codecs_s": codecs,
                                         "state_bytes": raw, "state_s": saves}, indent=1))


if __name__ == "__main__":
    main()
