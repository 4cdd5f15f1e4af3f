"""The demo job: train a small GPT on CPU, checkpoint it with amber-store, check it.

The model is a byte-level GPT; the text is Python's own standard-library source, which every
installation ships, so the demo needs no download. ``amber-store demo`` runs :func:`run`.
"""

from __future__ import annotations

import io
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from .format import round_up


def corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    """Bytes of the standard library's own source files, as a uint8 tensor."""
    root = Path(os.__file__).parent
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


@dataclass
class GPTConfig:
    vocab: int = 256
    context: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = nn.MultiheadAttention(cfg.width, cfg.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-LN blocks, tied output head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.register_buffer("mask", torch.triu(torch.full((cfg.context, cfg.context), float("-inf")), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.ln(x) @ self.tok.weight.T


class Trainer:
    """Model, AdamW and a deterministic batch stream: step ``i`` always sees the same batch."""

    def __init__(self, cfg: GPTConfig | None = None, *, seed: int = 0, batch: int = 16, lr: float = 3e-3,
                 data: torch.Tensor | None = None, init_seed: int | None = None, weight_decay: float = 0.01,
                 model: Callable[[GPTConfig | None], nn.Module] = TinyGPT) -> None:
        torch.manual_seed(seed if init_seed is None else init_seed)
        self.model = model(cfg)  # (any model of byte sequences with a ``cfg`` of this shape)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.data = corpus() if data is None else data
        self.batch = batch
        self.seed = seed

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n = self.model.cfg.context
        starts = torch.randint(0, len(self.data) - n - 1, (self.batch,), generator=g)
        x = torch.stack([self.data[s : s + n] for s in starts.tolist()]).long()
        y = torch.stack([self.data[s + 1 : s + n + 1] for s in starts.tolist()]).long()
        return x, y

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def step(self, step: int) -> float:
        x, y = self.batch_at(step)
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.item()

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": step}

    def load(self, state: dict[str, Any]) -> int:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        return int(state["step"])


def torch_save_bytes(obj: Any) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


#: A leaf every demo checkpoint carries, so a later demo run knows it may wipe the store.
DEMO_MARK = "amber-store demo"


def _refuse_foreign(uri: str) -> None:
    """Raise unless ``uri`` is absent, empty, or a store of earlier demo runs."""
    import amber_store as amber

    try:
        existing = amber.open(uri, mode="r")
    except amber.NotAnAmberStoreError:
        return  # nothing there; a non-empty foreign location is refused by mode "w" itself
    latest = existing.latest()
    if latest is not None:
        state = existing.load(latest)
        if not ("demo" in state and state["demo"] == DEMO_MARK):
            raise amber.AmberError(
                f"{existing.uri}: holds checkpoints that are not the demo's (latest step {latest}); the demo "
                "wipes its location first: choose another --uri, or pass --force to wipe them")


def run(uri: str = "./amber-demo", *, steps: int = 300, every: int = 10, full_every: int = 10,
        out: Callable[[str], None] = print, progress: bool = True, force: bool = False) -> dict[str, Any]:
    """Train, checkpoint every ``every`` steps into ``uri``, then verify a step. ``uri`` is wiped
    first if it holds an earlier demo's store (any other store only with ``force``)."""
    import amber_store as amber

    if not force:
        _refuse_foreign(uri)
    store = amber.open(uri, mode="w", full_every=full_every)
    trainer = Trainer()
    out(f"amber-store demo: TinyGPT {sum(p.numel() for p in trainer.model.parameters()) / 1e6:.2f}M params, "
        f"AdamW, {steps} steps, checkpoint every {every} into {store.uri}")
    kept: dict[int, dict[str, Any]] = {}
    rows = []
    t0 = time.perf_counter()
    loss = math.nan
    for i in tqdm(range(1, steps + 1), desc="train", unit="step", disable=not progress):
        loss = trainer.step(i)
        if i % every == 0:
            state = trainer.state(i)
            info = store.save(i, {**state, "demo": DEMO_MARK})
            rows.append((info, torch_save_bytes(state)))
            if len(rows) == len(range(every, steps + 1, every)) // 2:
                kept[i] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    train_s = time.perf_counter() - t0
    out(f"trained to loss {loss:.3f} in {train_s:.1f}s; {len(rows)} checkpoints")
    out(f"{'step':>6} {'kind':>5} {'stored':>10} {'torch.save':>11} {'ratio':>7} {'save s':>7}")
    for info, ts in rows:
        out(f"{info.step:>6} {info.kind:>5} {info.nbytes_stored:>10,} {ts:>11,} {ts / max(1, info.nbytes_stored):>6.2f}x "
            f"{info.seconds:>7.3f}")
    deltas = [(i.nbytes_stored, ts) for i, ts in rows if i.kind == "delta"]
    total = sum(i.nbytes_stored for i, _ in rows)
    total_ts = sum(ts for _, ts in rows)
    summary = {
        "delta_over_torch_save": sum(s for s, _ in deltas) / max(1, sum(t for _, t in deltas)) if deltas else None,
        "total_over_torch_save": total / max(1, total_ts),
        "stored_bytes": total,
        "torch_save_bytes": total_ts,
    }
    if deltas:
        out(f"delta steps: {summary['delta_over_torch_save']:.3f} of torch.save bytes per step "
            f"({1 / summary['delta_over_torch_save']:.2f}x smaller)")
    out(f"whole run: {total:,} bytes stored vs {total_ts:,} for torch.save of every checkpoint "
        f"({total_ts / max(1, total):.2f}x smaller)")
    disk = store.du()["storage"]
    if "directories" in disk:  # a local store: what it occupies on the disk, metadata included
        block = os.statvfs(store.uri).f_bsize
        ts_disk = sum(round_up(ts, block) for _, ts in rows)
        summary["allocated_over_torch_save"] = disk["allocated"] / ts_disk
        out(f"on disk: {disk['allocated']:,} bytes allocated in {disk['objects']} files and {disk['directories']} "
            f"directories, {summary['allocated_over_torch_save']:.3f}x the {ts_disk:,} that torch.save's "
            f"{len(rows)} files would take in {block}-byte blocks")

    (hist_step, expect), = kept.items()
    reader = amber.open(uri, mode="r")
    lazy = reader.load(hist_step)
    chain = reader.info(hist_step)["chain"]
    ok = all(torch.equal(lazy["model"][k].materialize(), v) for k, v in expect.items())
    out(f"lazy load of historical step {hist_step} (chain {chain}): "
        f"{'bit-exact' if ok else 'MISMATCH'} over {len(expect)} model tensors")
    summary["verified_step"] = hist_step
    summary["verified"] = ok
    return summary
