"""Hugging Face Trainer with AmberCallback: saves on schedule, save_total_limit, bit-exact resume."""

from __future__ import annotations

import pathlib

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import amber_store as amber
from amber_store.integrations.hf import AmberCallback, resume_checkpoint
from conftest import assert_bit_equal

# saving every 3 steps of a tiny model keeps the back-pressure warning busy; it is tested elsewhere
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::RuntimeWarning")


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # dropout stays on (0.1): the resumed run must restore the RNG states too
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def train(out: pathlib.Path, uri: pathlib.Path, *callbacks: TrainerCallback, resume: str | None = None,
          limit: int | None = 2) -> Trainer:
    args = TrainingArguments(output_dir=str(out), max_steps=12, save_steps=3, save_total_limit=limit,
                             per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="linear",
                             warmup_steps=2, report_to=[], use_cpu=True, seed=0, logging_steps=100,
                             disable_tqdm=True)
    trainer = Trainer(gpt2(), args, train_dataset=Tokens(), callbacks=[AmberCallback(uri), *callbacks])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_the_callback_saves_on_schedule_into_the_store_within_save_total_limit(tmp_path):
    trainer = train(tmp_path / "out", tmp_path / "store")
    store = amber.open(tmp_path / "store", mode="r")
    assert store.steps() == [9, 12]
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "out").glob("*"))  # no folders written
    model = store.load(12)["model"]
    assert "lm_head.weight" not in store.manifest(12).tensors  # tied to the embedding: stored once
    assert model["lm_head.weight"] is model["transformer.wte.weight"]
    for k, v in trainer.model.state_dict().items():
        assert_bit_equal(model[k].materialize(), v)


def test_a_run_resumed_from_the_store_ends_bit_identical_to_an_uninterrupted_one(tmp_path):
    straight = train(tmp_path / "a", tmp_path / "sa")
    train(tmp_path / "b", tmp_path / "sb", StopAt(6), limit=None)
    assert amber.open(tmp_path / "sb", mode="r").steps() == [3, 6]
    folder = resume_checkpoint(tmp_path / "sb", output_dir=tmp_path / "resume")
    assert pathlib.Path(folder).name == "checkpoint-6"
    resumed = train(tmp_path / "b", tmp_path / "sb", resume=folder, limit=None)
    assert resumed.state.global_step == 12
    assert amber.open(tmp_path / "sb", mode="r").steps() == [3, 6, 9, 12]
    for (k, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert_bit_equal(b, a)
    assert [h["loss"] for h in straight.state.log_history if "loss" in h] == \
           [h["loss"] for h in resumed.state.log_history if "loss" in h]


def test_save_strategy_best_is_refused_with_the_reason(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, save_strategy="best",
                             eval_strategy="steps", eval_steps=1, metric_for_best_model="loss",
                             per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(gpt2(), args, train_dataset=Tokens(), eval_dataset=Tokens(),
                      callbacks=[AmberCallback(tmp_path / "store")])
    with pytest.raises(ValueError, match="need the Trainer's own checkpoint folders"):
        trainer.train()
