"""Writes the small reference store of the on-disk format (docs/FORMAT.md).

``python tests/make_format_fixture.py tests/data/format-v10`` made the newest committed copy
(``format-v1`` to ``-v9`` were made by the code of their versions, with ``expected(1)`` to
``expected(8)``, and ``format-v9``'s sharded steps as its index recorded them); the tests read every
committed copy back with the current code, so a change that breaks old stores fails CI, and
also read back what this script writes today. Never edit a committed copy by hand; when the
format version changes, add a new ``format-vN`` directory and keep the old ones.
"""

from __future__ import annotations

import os
import pathlib
import socket
import sys
from collections import OrderedDict

import numpy as np
import torch


# Version 2 added lossy deltas: the keys of lossy_policy() are saved with lossy codecs (their
# restored values are checked against the codec's bound, and against what today's code restores).
# Version 6 made the integer-difference delta the lossless default; XOR stays for the "xor/" keys.
# Version 7 stores entropy-coded codes sparse where few are nonzero ("lossy/few").
# Version 8 stores dense codes of a fine step as nibbles ("lossy/fine", "lossy/odd").
def lossy_policy() -> list:
    import amber_store as amber

    return [("xor/*", "xor"), ("lossy/q", amber.QuantizedDeltaCodec(bits=4, min_numel=1)),
            ("lossy/s", amber.SparseDeltaCodec(min_numel=1)),
            ("lossy/p", amber.QuantizedDeltaCodec(bits=8, min_numel=1)),
            ("lossy/blk", amber.BlockDeltaCodec(step=0.2, block=16, min_numel=1)),
            ("lossy/few", amber.BlockDeltaCodec(step=0.2, block=16, min_numel=1)),
            ("lossy/ratio", amber.RatioDeltaCodec(step=0.05, min_numel=1)),
            ("lossy/fine", amber.BlockDeltaCodec(step=0.01, block=16, min_numel=1)),
            ("lossy/odd", amber.BlockDeltaCodec(step=0.01, block=13, min_numel=1))]


def expected(version: int = 8) -> dict[int, dict]:
    """The state saved at each step: full, xor delta, then same/new/shape-change/removed; from
    version 2 on also a quantized and a sparse tensor; from version 3 on a packed tensor that
    changes every step and a packed quantized one; from version 4 on the newer leaf kinds and
    a tensor tied to model/w; from version 5 on a block-quantized sharded tensor (with a NaN
    at step 3) and a packed ratio-coded one (with a zero); from version 6 on (lossless deltas
    are integer differences) a sharded and a packed tensor kept as XOR deltas, and a tensor
    whose elements move both ways across zero and across powers of two; from version 7 on a
    block-coded tensor of which few elements move (its codes stored sparse); from version 8 on
    block-coded tensors whose every element moves by -7 to 7 steps (their codes stored as
    nibbles, restored exactly), one of them with an odd count of codes and one code beyond."""
    w = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 7
    model = OrderedDict(w=w, b=torch.linspace(-1, 1, 5).to(torch.bfloat16), mask=torch.tensor([True, False, True]))
    model._metadata = {"": {"version": 1}}  # as nn.Module.state_dict() returns
    s1 = {
        "model": model,
        "optim": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.full((6, 8), 0.5)}},
                  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}]},
        "step": 1,
        "ids": torch.tensor([1, -2, 3], dtype=torch.int64),
        "gone": torch.ones(2, dtype=torch.float16),
    }
    s2 = {**s1, "model": {**model, "w": w.clone().index_fill_(0, torch.tensor([2]), -3.25)}, "step": 2}
    s3 = {
        "model": {**s2["model"], "b": torch.linspace(-1, 1, 6).to(torch.bfloat16)},
        "optim": s2["optim"],
        "step": 3,
        "ids": s2["ids"],
        "new": torch.tensor(7, dtype=torch.int32),
    }
    states = {1: s1, 2: s2, 3: s3}
    if version >= 2:
        q = torch.linspace(-2, 2, 40).reshape(5, 8)
        for step, state in states.items():
            state["lossy"] = {"q": q * (1 + 0.1 * step), "s": q + 0.5 * (step == 3) * (q > 1)}
    if version >= 3:
        for step, state in states.items():
            state["small"] = torch.arange(4, dtype=torch.float64) * step
            state["lossy"]["p"] = torch.linspace(-1, 1, 5) * (1 + 0.05 * step)
    if version >= 4:
        for step, state in states.items():
            state["tied"] = state["model"]["w"]
            state["leaves"] = {
                "rng": np.arange(6, dtype=np.uint32) * step, "names": np.array(["a", "bc"]), "np": np.float64(step),
                "path": pathlib.PurePosixPath(f"/data/{step}"), "dtype": torch.bfloat16, "device": torch.device("cpu"),
                "size": torch.Size([step, 2]), "bytes": bytes([step]), "set": {step, "s"}, "frozenset": frozenset({1}),
                (step, "tuple key"): bytearray(b"x"),
            }
    if version >= 5:
        blk = torch.sin(torch.arange(60, dtype=torch.float32)).reshape(6, 10)
        for step, state in states.items():
            state["lossy"]["blk"] = blk + 0.1 * step * torch.cos(blk * step)
            state["lossy"]["ratio"] = torch.linspace(0, 3, 9) ** 2 * (1 + 0.07 * step)
        states[3]["lossy"]["blk"][2, 3] = float("nan")
    if version >= 6:
        for step, state in states.items():
            moving = torch.linspace(-2, 2, 40) * (1 - 0.3 * step)
            state["xor"] = {"big": moving.reshape(5, 8) + step, "small": torch.arange(3, dtype=torch.int16) * step}
            state["signs"] = moving.to(torch.float16)
    if version >= 7:
        for step, state in states.items():
            few = torch.linspace(1, 2, 64).reshape(4, 16)
            # each step moves its row and restores the last one: 2 of a chunk's 16 codes (the
            # row moved at step 1, restored at 2) are stored sparse, 3 (every other) dense
            few[step, :: 9 - step] += step
            state["lossy"]["few"] = few
    if version >= 8:
        # step=0.01 of values near 1.5: a step of 2^-6, so moves of k / 64 code to k exactly
        k = {step: (torch.arange(64) * 7 + 3 * step) % 15 - 7 for step in states}  # 15 codes, spread
        for step, state in states.items():
            moved = sum(k[s] for s in range(1, step + 1)) / 64
            state["lossy"]["fine"] = 1.5 + moved.reshape(4, 16)
            state["lossy"]["odd"] = 1.5 + moved[:39]
            state["lossy"]["odd"][5] += 20 / 64 * (step - 1)  # code k + 20: escaped from the nibbles
    return states


def sharded_expected() -> dict[int, dict]:
    """Version 9: steps 4 and 5, saved through torch.distributed.checkpoint from 2 ranks (its
    layout recorded as JSON; from version 10 on, as grids, the items' records in one fragment
    per rank): tensors sharded by rows and by columns, a replicated one, an
    optimizer state, a list of tensors, values; step 5 changes only rank 1's rows of model/w."""
    w = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 7
    states = {}
    for step in (4, 5):
        w = w.clone()
        if step == 5:
            w[4] = -1.5
        states[step] = {
            "model": {"w": w, "emb": torch.linspace(-3, 3, 24).reshape(4, 6).to(torch.bfloat16),
                      "bias": torch.ones(5)},
            "optim": {"state": {"w": {"step": torch.tensor(float(step)), "exp_avg": w / 10}},
                      "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["w"]}]},
            "layers": [torch.full((3,), 2.0), torch.arange(4)],
            "step": step,
        }
    return states


def _sharded_saves(rank: int, path: str, port: int) -> None:
    """One of the 2 ranks that save :func:`sharded_expected` (``torch.multiprocessing.spawn``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from amber_store.dcp import AmberStorageWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for step, state in sharded_expected().items():
        placed = {**state, "model": {"w": distribute_tensor(state["model"]["w"], mesh, [Shard(0)]),
                                     "emb": distribute_tensor(state["model"]["emb"], mesh, [Shard(1)]),
                                     "bias": distribute_tensor(state["model"]["bias"], mesh, [Replicate()])},
                  "optim": {**state["optim"], "state": {"w": {
                      "step": state["optim"]["state"]["w"]["step"],
                      "exp_avg": distribute_tensor(state["optim"]["state"]["w"]["exp_avg"], mesh, [Shard(0)])}}}}
        dcp.save(placed, storage_writer=AmberStorageWriter(path, step=step, chunk_bytes=64, pack_threshold=160,
                                                            codec=lossy_policy(), base_policy="chain",
                                                            full_above=None))
    dist.destroy_process_group()


def write(path: str) -> None:
    import amber_store as amber
    from amber_store.codecs import ans as entropy

    # Version 3 packs small tensors: the threshold puts model/w and the lossy tensors in shards
    # of several chunks and the rest in the pack. "chain" bases keep step 3 "same" as step 2;
    # tensors this small store deltas about as large as their values: keep diffing them.
    store = amber.open(path, mode="w", chunk_bytes=64, pack_threshold=160, codec=lossy_policy(),
                       base_policy="chain", full_above=None)
    # Readers take every layout of codes at any size; writers store a few codes dense (the
    # gaps' model costs more than it saves), which would leave this tiny store all dense.
    floor, entropy._LAYOUT_MIN_CODES = entropy._LAYOUT_MIN_CODES, 0
    try:
        for step, state in expected().items():
            store.save(step, state)
    finally:
        entropy._LAYOUT_MIN_CODES = floor
    store.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_sharded_saves, args=(path, port), nprocs=2)


if __name__ == "__main__":
    write(sys.argv[1])
