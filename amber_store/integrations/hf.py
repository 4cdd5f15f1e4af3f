"""Hugging Face Trainer: checkpoints into an amber-store instead of ``checkpoint-N`` folders.

    from amber_store.integrations.hf import AmberCallback, resume_checkpoint

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[AmberCallback("s3://bucket/run1")])
    trainer.train()
    ...
    trainer.train(resume_from_checkpoint=resume_checkpoint("s3://bucket/run1"))

On the Trainer's save schedule (``save_strategy="steps"`` or ``"epoch"``) the callback saves the
model, optimizer, LR scheduler, gradient scaler, RNG states (python, numpy, torch CPU and CUDA)
and trainer state in the background, and tells the Trainer not to write its own folder. Storage
stays bounded by ``save_total_limit`` (the latest steps are kept). ``resume_checkpoint`` writes a
step back out in the Trainer's folder layout, which ``resume_from_checkpoint`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..export import flat_tensors, untied
from ..manager import CheckpointManager
from ..store import open as open_store

__all__ = ["AmberCallback", "resume_checkpoint"]


class AmberCallback(TrainerCallback):
    """Save the Trainer's checkpoints into the amber-store at ``uri``, one step per global step.

    ``storage_options`` and ``store_options`` are those of :func:`amber_store.open`; saves run
    in the background (``async_save=False``: in the training loop). Not covered: ``save_strategy
    ="best"`` and ``load_best_model_at_end`` (they need the Trainer's folders), and the state of
    other stateful callbacks (e.g. early stopping), which the Trainer records only in its own
    save path; the RNG states are taken before the evaluation of the saving step.
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
                 async_save: bool = True, **store_options: Any) -> None:
        self.uri = os.fspath(uri)
        self.storage_options = storage_options
        self.async_save = async_save
        self.store_options = store_options
        self.manager: CheckpointManager | None = None
        self._saved: int | None = None  # the last step handed to the manager (maybe still saving)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if args.save_strategy == "best" or args.load_best_model_at_end:
            raise ValueError("AmberCallback saves on the 'steps' and 'epoch' schedules; save_strategy='best' and "
                             "load_best_model_at_end need the Trainer's own checkpoint folders")
        if self.manager is None:
            self.manager = CheckpointManager(self.uri, every=1, keep_last=args.save_total_limit,
                                             storage_options=self.storage_options, async_save=self.async_save,
                                             **self.store_options)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._maybe_save(state, control, **kwargs)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._maybe_save(state, control, **kwargs)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.manager is not None:
            self.manager.wait()

    def _maybe_save(self, state: TrainerState, control: TrainerControl, *, model: torch.nn.Module,
                    optimizer: Any, lr_scheduler: Any, **kwargs: Any) -> None:
        if not control.should_save or self.manager is None:
            return
        if state.global_step == self._saved:  # an epoch that ended on a saved step
            control.should_save = False
            return
        state.stateful_callbacks["TrainerControl"] = control.state()  # what the Trainer records
        scaler = getattr(optimizer, "scaler", None)  # accelerate's optimizer wrapper holds it
        extra = {
            "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": _rng_states(),
            "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n",
        }
        self.manager.maybe_save(state.global_step, model=model, optimizer=optimizer, extra=extra, force=True)
        self._saved = state.global_step
        control.should_save = False  # the Trainer writes no checkpoint folder of its own


def _rng_states() -> dict[str, Any]:
    """The RNG states the Trainer saves, in its ``rng_state.pth`` layout."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def resume_checkpoint(uri: str | os.PathLike[str], step: int | None = None, *,
                      storage_options: dict[str, Any] | None = None,
                      output_dir: str | os.PathLike[str] | None = None) -> str:
    """Write ``step`` (default: the latest) of the store at ``uri`` as a Trainer checkpoint
    folder and return its path, for ``trainer.train(resume_from_checkpoint=...)``.

    The folder (``checkpoint-N`` under ``output_dir``, default a new temporary directory,
    which the caller removes) holds ``model.safetensors``,
    ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (if saved), ``rng_state.pth`` and
    ``trainer_state.json``, bit-identical to what the Trainer would have written.
    """
    from safetensors.torch import save_file

    store = open_store(os.fspath(uri), storage_options, mode="r")
    try:
        state = store.load(step, lazy=False)
    finally:
        store.close()
    extra = state["extra"]
    folder = os.fspath(output_dir) if output_dir is not None else tempfile.mkdtemp(prefix="amber-resume-")
    folder = os.path.join(folder, f"checkpoint-{state['step']}")
    os.makedirs(folder, exist_ok=True)
    save_file(untied(flat_tensors(state["model"])), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    torch.save(state["optim"], os.path.join(folder, "optimizer.pt"))
    if extra["scheduler"] is not None:
        torch.save(extra["scheduler"], os.path.join(folder, "scheduler.pt"))
    if extra["scaler"] is not None:
        torch.save(extra["scaler"], os.path.join(folder, "scaler.pt"))
    torch.save(extra["rng"], os.path.join(folder, "rng_state.pth"))
    with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write(extra["trainer_state"])
    return folder
