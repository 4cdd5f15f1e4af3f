"""A real training run, checkpointed by every peer on the same states, in one process.

A GPT-style model (amber_store.demo.TinyGPT, sized by the flags) is trained with AdamW on
Python's standard-library sources; every ``--every`` steps the same state dict is checkpointed
by each method below, one after the other, and for each we record the stored bytes and the
training stall (how long the call blocks the training loop; async methods are then waited for,
so methods never compete for the 2 cores). Then each amber variant is restored from its latest
checkpoint into a fresh model and trained ``--resume-steps`` more steps: the fidelity figure is
its held-out loss against the lossless resume's.

    python benchmarks/training.py                 # ~4 minutes on 2 cores
    python benchmarks/training.py --quick         # ~1 minute, smaller model
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store.demo import GPTConfig, Trainer, corpus  # noqa: E402
from amber_store.export import flat_tensors  # noqa: E402
from benchmarks.common import eval_loss, machine, table, training_run_args  # noqa: E402


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Method:
    """One checkpointing method: ``save(step, state) -> stored bytes``, timed for its stall."""

    def __init__(self, name: str, stall: Callable[[int, dict], Callable[[], int]], incremental: bool = False):
        self.name = name
        self._stall = stall
        self.incremental = incremental
        self.bytes: list[int] = []
        self.stalls: list[float] = []
        self.kinds: list[str] = []

    def checkpoint(self, step: int, state: dict) -> None:
        t0 = time.perf_counter()
        finish = self._stall(step, state)  # what blocks training
        self.stalls.append(time.perf_counter() - t0)
        self.bytes.append(finish())  # waiting for async work is not stall


def make_methods(root: Path, codecs: dict[str, Any], full_every: int) -> tuple[list[Method], dict[str, amber.Store]]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    def torch_save(step: int, state: dict) -> Callable[[], int]:
        path = root / f"torch-{step}.pt"
        torch.save(state, path)
        return lambda: _size_and_remove(path)

    def torch_save_zstd(step: int, state: dict) -> Callable[[], int]:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = zstandard.ZstdCompressor(level=3, threads=-1).compress(buf.getbuffer())
        return lambda: len(data)

    def safetensors(step: int, state: dict) -> Callable[[], int]:
        path = root / f"st-{step}.safetensors"
        save_file(flat_tensors(state), str(path))
        return lambda: _size_and_remove(path)

    def dcp_sync(step: int, state: dict) -> Callable[[], int]:
        path = root / f"dcp-{step}"
        dcp.save(dcp_state(state), checkpoint_id=str(path))
        return lambda: _size_and_remove(path)

    def dcp_async(step: int, state: dict) -> Callable[[], int]:
        path = root / f"dcpa-{step}"
        fut = dcp.async_save(dcp_state(state), checkpoint_id=str(path))
        return lambda: (fut.result(), _size_and_remove(path))[1]

    def bare_copy(step: int, state: dict) -> Callable[[], int]:
        copies = {k: v.clone() for k, v in flat_tensors(state).items()}
        return lambda: sum(t.numel() * t.element_size() for t in copies.values())

    methods = [
        Method("bare host copy (clone)", bare_copy),
        Method("torch.save", torch_save),
        Method("torch.save + zstd-3", torch_save_zstd),
        Method("safetensors", safetensors),
        Method("DCP save", dcp_sync),
        Method("DCP async_save", dcp_async),
    ]
    stores: dict[str, amber.Store] = {}

    def amber_method(name: str, *, asynchronous: bool, **options: Any) -> Method:
        store = amber.open(root / name.replace(" ", "-"), mode="w", **options)
        stores[name] = store

        def run(step: int, state: dict) -> Callable[[], int]:
            if asynchronous:
                fut = store.save_async(step, state)
                return lambda: fut.result().nbytes_stored
            info = store.save(step, state)
            return lambda: info.nbytes_stored

        return Method(name, run, incremental=options.get("full_every", full_every) > 1)

    methods.append(amber_method("zarr+blosc-zstd, no deltas", asynchronous=False, full_every=1))
    methods.append(amber_method("amber lossless save", asynchronous=False, full_every=full_every))
    for name, codec in codecs.items():
        methods.append(amber_method(f"amber {name} save_async", asynchronous=True, full_every=full_every, codec=codec))
    return methods, stores


def dcp_state(state: dict) -> dict:
    return {"model": state["model"], "optim": state["optim_fqn"]}


def _size_and_remove(path: Path) -> int:
    size = dir_bytes(path) if path.is_dir() else path.stat().st_size
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    return size


def make_trainer(cfg: GPTConfig, args: argparse.Namespace, text: torch.Tensor, init_seed: int | None = None) -> Trainer:
    trainer = Trainer(cfg, batch=args.batch, data=text, init_seed=init_seed)
    if args.freeze:
        last = f"blocks.{cfg.layers - 1}."
        for name, param in trainer.model.named_parameters():
            if not name.startswith(last):
                param.requires_grad_(False)  # AdamW then keeps no state for it and never moves it
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    training_run_args(p)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small model, 100+60 steps")
    p.add_argument("--freeze", action="store_true",
                   help="fine-tuning-like: freeze the embeddings and every block but the last")
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args()
    if args.quick:
        args.steps, args.resume_steps, args.width, args.layers = 100, 60, 128, 2
    torch.manual_seed(0)
    cfg = GPTConfig(context=args.context, width=args.width, layers=args.layers, heads=4)
    text = corpus(4_000_000)
    split = int(len(text) * 0.95)
    train_text, held_out = text[:split], text[split:]
    trainer = make_trainer(cfg, args, train_text)
    evaluator = Trainer(cfg, batch=args.batch, data=held_out)
    eval_batches = [evaluator.batch_at(10_000 + i) for i in range(8)]
    # every lossy codec, at three checkpoint intervals, is on benchmarks/lossy.py's Pareto plot
    codecs = {"lossless": "lossless", "lossy": "lossy", "quant4": "quant4"}
    root = Path(tempfile.mkdtemp(prefix="amber-train-bench-"))
    from torch.distributed.checkpoint.state_dict import get_state_dict

    try:
        methods, stores = make_methods(root, codecs, args.full_every)
        n_params = sum(p.numel() for p in trainer.model.parameters())
        t_train = 0.0
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            trainer.step(step)
            t_train += time.perf_counter() - t0
            if step % args.every == 0:
                state = trainer.state(step)
                state["optim_fqn"] = get_state_dict(trainer.model, trainer.opt)[1]
                for m in methods:
                    payload = state if m.name.startswith("DCP") else {k: v for k, v in state.items() if k != "optim_fqn"}
                    m.checkpoint(step, payload)
        step_time = t_train / args.steps

        # fidelity: resume each amber variant from its latest checkpoint
        reference_final = None
        resumed: dict[str, float] = {}
        latest = args.steps - args.steps % args.every
        for name in ["amber lossless save"] + [f"amber {n} save_async" for n in codecs if n != "lossless"]:
            t = make_trainer(cfg, args, train_text, init_seed=1234)
            t.load(stores[name].load(latest, lazy=False))
            for step in range(latest + 1, latest + args.resume_steps + 1):
                t.step(step)
            resumed[name] = eval_loss(t.model, eval_batches)
            if name == "amber lossless save":
                reference_final = {k: v.clone() for k, v in t.model.state_dict().items()}
        for step in range(args.steps + 1, latest + args.resume_steps + 1):
            trainer.step(step)
        never_stopped = eval_loss(trainer.model, eval_batches)
        uninterrupted_equal = reference_final is not None and all(
            torch.equal(reference_final[k], v) for k, v in trainer.model.state_dict().items()) and latest == args.steps
    finally:
        for s in stores.values() if "stores" in locals() else []:
            s.close()
        shutil.rmtree(root, ignore_errors=True)

    raw_bytes = methods[0].bytes[0]
    ts = next(m for m in methods if m.name == "torch.save")
    copy = methods[0]
    full_positions = [i for i in range(len(ts.bytes)) if (i % args.full_every) == 0]
    inc_positions = [i for i in range(len(ts.bytes)) if i not in full_positions]

    def med(xs: list[float], pos: list[int]) -> float:
        return statistics.median([xs[i] for i in pos]) if pos else float("nan")

    print(f"machine: {machine()}")
    frozen = sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad)
    if frozen:
        print(f"fine-tuning: {frozen / n_params:.0%} of the parameters frozen (embeddings and all blocks but the last)")
    print(f"model: TinyGPT width {args.width}, {args.layers} layers, context {args.context}: {n_params / 1e6:.2f}M "
          f"params; AdamW; state {raw_bytes / 1e6:.1f} MB (fp32 weights + 2 moments); {args.steps} steps "
          f"({step_time * 1000:.0f} ms/step), checkpoint every {args.every}, amber full every {args.full_every}\n")
    rows = []
    for m in methods:
        pos = inc_positions if m.incremental else list(range(len(m.bytes)))
        b = med(m.bytes, pos)
        rows.append([m.name, f"{b / 1e6:.2f}", f"{med(ts.bytes, pos) / b:.2f}x", f"{sum(m.bytes) / 1e6:.1f}",
                     f"{statistics.median(m.stalls) * 1000:.0f} ({min(m.stalls) * 1000:.0f}-{max(m.stalls) * 1000:.0f})",
                     f"{statistics.median(m.stalls) / statistics.median(copy.stalls):.2f}x"])
    print("Bytes: median per incremental checkpoint for delta methods (the full ones are in the total), per "
          "checkpoint otherwise. Stall: median (range) ms the call blocked training.\n")
    print(table(["method", "MB per checkpoint", "smaller than torch.save", "total MB", "stall ms",
                 "stall / bare copy"], rows))
    print()
    base_loss = resumed["amber lossless save"]
    print(table(["resumed from", f"held-out loss after {args.resume_steps} more steps", "vs lossless resume"],
                [[n, f"{v:.4f}", f"{(v / base_loss - 1) * 100:+.2f}%"] for n, v in resumed.items()]
                + [["never stopped (same run)", f"{never_stopped:.4f}", f"{(never_stopped / base_loss - 1) * 100:+.2f}%"]]))
    print(f"\nlossless resume bit-identical to never stopping: {uninterrupted_equal}")
    if args.json:
        args.json.write_text(json.dumps({
            "args": vars(args) | {"json": str(args.json)}, "params": n_params, "raw_bytes": raw_bytes,
            "methods": {m.name: {"bytes": m.bytes, "stalls": m.stalls} for m in methods},
            "resumed_loss": resumed, "never_stopped_loss": never_stopped, "bit_identical": uninterrupted_equal,
        }, indent=1))


if __name__ == "__main__":
    main()
