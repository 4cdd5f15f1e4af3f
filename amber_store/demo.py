"""The demo job: train a small GPT on CPU, checkpoint it with amber-store, check it.

The model is a byte-level GPT; the text is Python's own standard-library source, which every
installation ships, so the demo needs no download. ``amber-store demo`` runs :func:`run`.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm



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


def run(uri: str = "./amber-demo", *, steps: int = 200, every: int = 10, full_every: int = 10,
        out: Callable[[str], None] = print, progress: bool = True, force: bool = False) -> dict[str, Any]:
    """Train, checkpoint every ``every`` steps with the lossless default into ``uri`` and with the
    ``"lossy"`` preset into ``uri + "-lossy"``, compare both with torch.save, open a historical
    step lazily, then resume from a checkpoint of each store and train on: the lossless resume
    retraces the uninterrupted run bit for bit, the lossy one comes close. Each location is
    wiped first if it holds an earlier demo's store (any other store only with ``force``)."""
    import amber_store as amber

    uris = {"lossless": uri, "lossy": f"{uri.rstrip('/')}-lossy"}
    if not force:
        for where in uris.values():
            _refuse_foreign(where)
    stores = {codec: amber.open(where, mode="w", full_every=full_every, codec=codec) for codec, where in uris.items()}
    trainer = Trainer()
    out(f"amber-store demo: TinyGPT {sum(p.numel() for p in trainer.model.parameters()) / 1e6:.2f}M params, "
        f"AdamW, {steps} steps, a checkpoint every {every} steps into {stores['lossless'].uri} (lossless, the "
        f"default) and {stores['lossy'].uri} (codec='lossy')")
    checkpoints = list(range(every, steps + 1, every))
    history_step = checkpoints[len(checkpoints) // 2 - 1] if len(checkpoints) > 1 else checkpoints[-1]
    resume_step = checkpoints[max(0, len(checkpoints) - 1 - max(1, len(checkpoints) // 6))]
    rows: dict[str, list[tuple[Any, int]]] = {codec: [] for codec in stores}
    kept: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    losses: dict[int, float] = {}
    for i in tqdm(range(1, steps + 1), desc="train", unit="step", disable=not progress):
        losses[i] = trainer.step(i)
        if i % every == 0:
            state = trainer.state(i)
            size = torch_save_bytes(state)
            for codec, store in stores.items():
                rows[codec].append((store.save(i, {**state, "demo": DEMO_MARK}), size))
            if i == history_step:
                kept = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out(f"trained to loss {losses[steps]:.3f} in {time.perf_counter() - t0:.1f}s, {len(checkpoints)} checkpoints "
        "each way")
    summary: dict[str, Any] = {}
    out(f"{'':>9} {'stored':>12} {'torch.save':>12} {'whole run':>10} {'per delta step':>15}")
    for codec, got in rows.items():
        total, total_ts = sum(i.nbytes_stored for i, _ in got), sum(ts for _, ts in got)
        deltas = [(i.nbytes_stored, ts) for i, ts in got if i.kind == "delta"]
        per_delta = sum(t for _, t in deltas) / max(1, sum(s for s, _ in deltas)) if deltas else None
        summary[codec] = {"stored_bytes": total, "torch_save_bytes": total_ts, "smaller": total_ts / max(1, total),
                          "delta_smaller": per_delta}
        out(f"{codec:>9} {total:>12,} {total_ts:>12,} {total_ts / max(1, total):>9.1f}x "
            + (f"{per_delta:>14.1f}x" if per_delta else f"{'-':>15}") + "  smaller than torch.save")
    # (the keys of earlier releases' summary: the lossless store's)
    summary["total_over_torch_save"] = 1 / summary["lossless"]["smaller"]
    summary["stored_bytes"] = summary["lossless"]["stored_bytes"]
    summary["torch_save_bytes"] = summary["lossless"]["torch_save_bytes"]

    reader = amber.open(uri, mode="r")
    lazy = reader.load(history_step)
    rows_read = lazy["model"]["tok.weight"][:8]  # one slice: only its chunks are read
    ok = all(torch.equal(lazy["model"][k].materialize(), v) for k, v in kept.items())
    out(f"historical step {history_step}, opened lazily (chain {reader.info(history_step)['chain']}): a slice of "
        f"{tuple(rows_read.shape)} read alone; all {len(kept)} model tensors {'bit-exact' if ok else 'MISMATCH'}")
    summary["verified_step"], summary["verified"] = history_step, ok

    resumed: dict[str, float] = {}
    for codec, where in uris.items():  # a fresh process's resume: a new model, restored, trained on
        again = Trainer()
        start = again.load(amber.open(where, mode="r").load(resume_step, lazy=False))
        for i in range(start + 1, steps + 1):
            resumed[codec] = again.step(i)
        if codec == "lossless":
            summary["resume_bit_identical"] = all(torch.equal(again.model.state_dict()[k], v) for k, v in final.items())
    exact, lossy = resumed["lossless"], resumed["lossy"]
    summary["resumed_loss"] = resumed
    out(f"resumed at step {resume_step} and trained to {steps}: lossless loss {exact:.4f} "
        f"({'bit-identical to' if summary['resume_bit_identical'] else 'DIFFERS from'} the uninterrupted run), "
        f"lossy {lossy:.4f} ({(lossy - exact) / exact:+.2%} against it)")
    return summary
