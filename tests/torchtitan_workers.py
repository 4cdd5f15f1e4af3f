"""torchtitan's trainer loop around amber-store's torchtitan CheckpointManager, on gloo ranks:
``python tests/torchtitan_workers.py DUMP_FOLDER OPTIONS_JSON``.

The parts of torchtitan's ``Trainer`` that checkpointing touches, as the trainer wires them: an
FSDP2 model, torchtitan's ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer``, its
``ParallelAwareDataloader`` (a StatefulDataLoader: the data position is saved) and a train state,
handed to the manager built from its ``Config`` by ``config.build(...)``; then ``load()``, and
``save(step, last_step=...)`` after each step. (torchtitan's full trainer needs a GPU's attention
kernels: the loop here is its checkpointing, step for step.)

Options: ``steps`` (train up to), ``stop`` (end there without closing, as a killed job would,
once its last save is committed), ``checkpoint`` (the Config's fields). Rank 0 prints one JSON
line per event: ``{"loaded": step, "digest": ...}`` after ``load()``, ``{"step": s, "digest":
...}`` after each training step, and ``{"resume_step": s}`` (what a new run would resume from).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset


class Tokens(IterableDataset):
    """Deterministic batches, different on each data-parallel rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        g = torch.Generator().manual_seed(1000 + self.rank)
        while True:
            yield torch.randn(32, generator=g)


class TrainState:
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def digest(model: torch.nn.Module, optimizers: Any, schedulers: Any, state: TrainState) -> str:
    """A hash of the raw bits of the whole training state (a collective: every rank calls it)."""
    h = hashlib.sha256()

    def add(name: str, value: Any) -> None:
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            h.update(name.encode())
            h.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                add(f"{name}.{k}", value[k])
        else:
            h.update(f"{name}={value!r}".encode())

    add("model", model.state_dict())
    add("optimizer", optimizers.state_dict())
    add("lr_scheduler", schedulers.state_dict())
    add("train_state", state.state_dict())
    return h.hexdigest()


def main() -> None:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    from amber_store.integrations.torchtitan import CheckpointManager

    dump, options = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                      training_steps=options["steps"])
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=4)
    state = TrainState()
    config = CheckpointManager.Config(**options["checkpoint"])
    checkpointer = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
                                base_folder=dump)
    assert type(checkpointer) is CheckpointManager

    def say(**event: Any) -> None:
        if rank == 0:
            print(json.dumps(event), flush=True)

    checkpointer.load(step=config.load_step)
    say(loaded=state.step, digest=digest(model, optimizers, schedulers, state))
    batches = iter(dataloader)
    while state.step < options["steps"]:
        state.step += 1
        batch = next(batches)
        model(batch).square().mean().backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.ntokens_seen += batch.numel()
        say(step=state.step, digest=digest(model, optimizers, schedulers, state))
        checkpointer.save(state.step, last_step=state.step == options["steps"])
        if state.step == options.get("stop"):
            checkpointer.maybe_wait_for_saving()
            dist.barrier()
            os._exit(0)  # killed: nothing closed
    checkpointer.maybe_wait_for_saving()
    if config.enable:
        say(resume_step=checkpointer._find_load_step())
    checkpointer.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (no interpreter teardown: once, in a full suite, a C++ thread's teardown aborted it)


if __name__ == "__main__":
    main()
