"""A real model + AdamW: resuming from a checkpoint continues bit-identically."""

from __future__ import annotations

import pytest
import torch

from amber_store.demo import GPTConfig, Trainer, corpus
from conftest import assert_tree_bit_equal

CFG = GPTConfig(context=16, width=32, layers=1, heads=2)


@pytest.fixture(scope="module")
def text() -> torch.Tensor:
    return corpus(200_000)


def trainer(text: torch.Tensor, init_seed: int = 0) -> Trainer:
    return Trainer(CFG, seed=0, batch=4, data=text, init_seed=init_seed)


def test_resume_from_a_delta_step_is_bit_identical_to_never_stopping(make_store, text):
    store = make_store(full_every=3)
    reference = trainer(text)
    for step in range(1, 13):
        reference.step(step)
        if step % 2 == 0:
            store.save(step, reference.state(step))
    assert [store.manifest(s).kind for s in store.steps()] == ["full", "delta", "delta", "full", "delta", "delta"]

    resumed = trainer(text, init_seed=123)  # different init: everything must come from the checkpoint
    start = resumed.load(make_store(mode="r").load(6, lazy=False))
    assert start == 6
    for step in range(start + 1, 13):
        resumed.step(step)
    assert_tree_bit_equal(resumed.state(12), reference.state(12))
    assert_tree_bit_equal(store.load(12, lazy=False), reference.state(12))


def test_every_optimizer_state_field_round_trips(make_store, text):
    t = trainer(text)
    for step in range(1, 4):
        t.step(step)
    store = make_store()
    store.save(3, t.state(3))
    t.step(4)
    store.save(4, t.state(4))
    got = make_store(mode="r").load(4, lazy=False)
    assert_tree_bit_equal(got, t.state(4))
    assert got["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert all(isinstance(k, int) for k in got["optim"]["state"])
