"""Bit-exact save/load on every backend: dtypes, trees, deltas, chains."""

from __future__ import annotations

import math

import pytest
import torch

import amber_store as amber
from conftest import assert_bit_equal, assert_tree_bit_equal

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        if t.numel() >= 4:  # specials whose bits must survive: NaN, infinities, negative zero
            t.view(-1)[:4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=torch.float64).to(dtype)
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (33, 17), (4, 5, 6)], ids=str)
def test_every_dtype_and_shape_round_trips_bit_exact_through_full_and_delta(make_store, dtype, shape):
    store = make_store(chunk_bytes=64)  # tiny chunks: many chunks, partial edge chunks
    first = sample(dtype, shape, 0)
    second = first.clone()
    if second.numel():
        second.view(-1)[-1:] = sample(dtype, (1,), 1)
    store.save(1, {"t": first})
    info = store.save(2, {"t": second})
    assert info.kind == "delta"
    assert_bit_equal(store.load(1)["t"].materialize(), first)
    assert_bit_equal(store.load(2)["t"].materialize(), second)
    assert_bit_equal(make_store(mode="r").load(2, lazy=False)["t"], second)


def test_nested_state_with_plain_leaves_round_trips_exactly(make_store):
    state = {
        "model": {"layer.0.weight": torch.randn(4, 3), "odd/key with spaces": torch.arange(5)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0], "name": None,
                                    "amsgrad": False, "eps": 1e-8, "weird": float("nan")}]},
        "step": 7,
        "history": [1.5, -0.0, float("inf"), "text", None, True],
        "__dunder": torch.ones(2),
        ".": torch.zeros(1),
    }
    store = make_store()
    store.save(10, state)
    assert_tree_bit_equal(store.load(10, lazy=False), state)
    lazy = store.load(10)
    assert isinstance(lazy, amber.LazyStateDict)
    assert lazy["step"] == 7 and lazy["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(lazy["optim"]["state"]) == [0]


def test_keys_named_like_zarr_metadata_are_stored_as_tensors(make_store):
    state = {"zarr.json": torch.randn(8), "model": {"zarr.json": torch.randn(3)}, ".zattrs": torch.ones(2)}
    store = make_store(pack_threshold=0)  # an array per tensor, named after its key
    store.save(1, state)
    store.save(2, {k: v + 1 if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    assert_tree_bit_equal(make_store(mode="r").load(1, lazy=False), state)


@pytest.mark.parametrize("policy, chain", [("chain", [16, 17, 18, 19]), ("log", [16, 18, 19]), ("full", [16, 19])])
def test_chain_of_twenty_deltas_with_periodic_fulls_reads_every_step_bit_exact(make_store, policy, chain):
    store = make_store(full_every=5, chunk_bytes=1024, base_policy=policy)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 33, generator=g)
    frozen = torch.randn(50, generator=g)
    expected = {}
    for step in range(1, 21):
        w.add_(torch.randn(w.shape, generator=g) * 1e-3)
        if step % 3 == 0:
            w[step] = 0  # a row that changes drastically
        state = {"w": w, "frozen": frozen, "step": step}
        store.save(step, state)
        expected[step] = {"w": w.clone(), "frozen": frozen.clone(), "step": step}
    kinds = [store.manifest(s).kind for s in store.steps()]
    assert kinds == (["full"] + ["delta"] * 4) * 4
    reopened = make_store(mode="r")
    for step, want in expected.items():
        assert_tree_bit_equal(reopened.load(step, lazy=False), want)
    info = reopened.info(19)
    assert info["chain"] == chain
    assert info["tensors"]["frozen"]["chain"] == [16]


def test_log_bases_bound_every_read_to_log2_full_every_plus_one_objects(make_store):
    store = make_store(full_every=16, pack_threshold=0)
    w = torch.randn(256, 256)
    for step in range(16):
        w[step] += 1
        store.save(step, {"w": w})
    depths = [len(store.info(s)["chain"]) for s in range(16)]
    assert depths == [bin(p).count("1") + 1 for p in range(16)] and max(depths) == 5
    assert [store.manifest(s).base for s in (1, 2, 3, 4, 6, 7, 8, 12, 15)] == [0, 0, 2, 0, 4, 6, 0, 8, 14]
    assert_bit_equal(make_store(mode="r").load(15)["w"].materialize(), w)


def test_base_policy_full_diffs_every_delta_against_the_last_full_step(make_store):
    store = make_store(full_every=4, base_policy="full")
    w = torch.zeros(100)
    for step in range(1, 9):
        w[step] = step
        store.save(step, {"w": w})
    assert [store.manifest(s).base for s in store.steps()] == [None, 1, 1, 1, None, 5, 5, 5]
    assert store.info(8)["chain"] == [5, 8]
    assert_bit_equal(make_store(mode="r").load(7)["w"].materialize(), torch.cat([torch.arange(8.0), torch.zeros(92)]))


def test_shape_dtype_changes_and_new_or_removed_keys_are_handled(make_store):
    store = make_store()
    store.save(1, {"a": torch.ones(4), "b": torch.ones(3), "gone": torch.ones(2)})
    state = {"a": torch.ones(5), "b": torch.ones(3, dtype=torch.float64), "new": torch.arange(3)}
    info = store.save(2, state)
    assert info.kind == "delta"
    entries = store.manifest(2).tensors
    assert {k: e.encoding for k, e in entries.items()} == {"a": "full", "b": "full", "new": "full"}
    assert_tree_bit_equal(make_store(mode="r").load(2, lazy=False), state)
    assert_tree_bit_equal(store.load(1, lazy=False), {"a": torch.ones(4), "b": torch.ones(3), "gone": torch.ones(2)})


def test_forced_full_and_forced_delta_override_the_policy(make_store):
    store = make_store(full_every=2)
    t = torch.arange(10.0)
    assert store.save(1, {"t": t}).kind == "full"
    assert store.save(2, {"t": t}, full=True).kind == "full"
    assert store.save(3, {"t": t}).kind == "delta"
    assert store.save(4, {"t": t}, full=False).kind == "delta"
    assert store.save(5, {"t": t}).kind == "full"
