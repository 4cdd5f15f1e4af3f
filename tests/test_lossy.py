"""Lossy deltas: error bounds that hold along a whole chain, and codecs that round-trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from zarr.core.array_spec import ArrayConfig, ArraySpec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.dtype import parse_dtype
from zarr.core.sync import sync

import amber_store as amber
from amber_store.codecs import Pack4BytesCodec, SparseBytesCodec
from conftest import assert_bit_equal


def drift(steps: int, shape=(96, 64), seed: int = 0):
    """A tensor that drifts like an optimizer moment: multiplicative noise plus rare jumps."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    for step in range(1, steps + 1):
        w = w * (1 + 0.01 * torch.randn(shape, generator=g))
        w.view(-1)[step * 7 % w.numel()] += 3.0
        yield step, w.clone()


# The chain tests use one backend: what they check is codec arithmetic, and reading every step of
# a 50-long chain is quadratic in requests.
def test_sparse_error_stays_within_one_steps_threshold_over_a_50_step_chain(local_store):
    threshold = 0.02
    store = local_store(codec=amber.SparseDeltaCodec(threshold=threshold), full_every=1000, chunk_bytes=8192,
                        base_policy="chain")
    reader = local_store(mode="r")
    worst = 0.0
    for step, w in drift(50):
        info = store.save(step, {"w": w})
        restored = reader.load(step)["w"].materialize()
        err = (restored - w).abs()
        # dropped updates are bounded relative to the restored value; kept ones are exact
        assert bool((err <= threshold * restored.abs() * (1 + 1e-6)).all()), step
        worst = max(worst, float((err / restored.abs().clamp_min(1e-30)).max()))
        if step > 1:
            assert store.manifest(step).tensors["w"].encoding in ("sparse", "same")
            assert info.nbytes_stored < info.nbytes_raw / 3
    assert worst <= threshold * (1 + 1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_error_stays_within_half_a_step_scale_over_a_50_step_chain(local_store, bits):
    store = local_store(codec=f"quant{bits}", full_every=1000, chunk_bytes=8192, base_policy="chain")
    reader = local_store(mode="r")
    for step, w in drift(50):
        store.save(step, {"w": w})
        entry = store.manifest(step).tensors["w"]
        restored = reader.load(step)["w"].materialize()
        if step == 1:
            assert_bit_equal(restored, w)  # full steps are lossless
            continue
        assert entry.encoding == "quant"
        scales = torch.tensor([float.fromhex(s) for s in entry.params["scales"]])
        rows = entry.chunks[0]
        bound = scales.repeat_interleave(rows)[: w.shape[0]].unsqueeze(1) / 2
        err = (restored - w).abs()
        assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), (step, float((err - bound).max()))


def test_a_lossy_policy_for_optimizer_state_leaves_model_weights_bit_exact(make_store):
    store = make_store(codec=[("optim/*", "quant8")])
    g = torch.Generator().manual_seed(0)
    model, moment = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    counts = torch.arange(10)
    for step in range(1, 6):
        model += 1e-3 * torch.randn(model.shape, generator=g)
        moment += 1e-2 * torch.randn(moment.shape, generator=g)
        counts += 1
        store.save(step, {"model": {"w": model}, "optim": {"m": moment, "n": counts}})
    entries = store.manifest(5).tensors
    assert entries["model/w"].encoding == "xor" and entries["optim/m"].encoding == "quant"
    assert entries["optim/n"].encoding == "xor"  # integers never go lossy
    got = make_store(mode="r").load(5, lazy=False)
    assert_bit_equal(got["model"]["w"], model)
    assert_bit_equal(got["optim"]["n"], counts)
    assert not torch.equal(got["optim"]["m"], moment) and torch.allclose(got["optim"]["m"], moment, atol=1e-2)


def test_small_tensors_such_as_adam_step_counters_stay_exact_under_a_lossy_policy(local_store):
    store = local_store(codec="quant4")
    model = torch.nn.Linear(64, 128)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(1, 4):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        store.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    entries = store.manifest(3).tensors
    assert entries["optim/state/0/exp_avg"].encoding == "quant"  # 8192 elements
    assert entries["optim/state/1/exp_avg"].encoding == "xor"  # the 128-element bias moment
    assert entries["optim/state/0/step"].encoding == "xor"
    assert_bit_equal(store.load(3)["optim"]["state"][0]["step"].materialize(), opt.state_dict()["state"][0]["step"])


def test_topk_sparse_keeps_the_requested_fraction(local_store):
    store = local_store(codec=amber.SparseDeltaCodec(topk=0.05))
    w = torch.randn(100, 100)
    store.save(1, {"w": w})
    store.save(2, {"w": w + torch.randn(100, 100)})
    assert store.manifest(2).tensors["w"].params == {"kept": 500}


def test_lossy_codecs_fall_back_exactly_on_non_finite_values(local_store):
    store = local_store(codec="quant8")
    w = torch.randn(5000)
    store.save(1, {"w": w})
    w2 = w.clone()
    w2[3] = float("nan")
    store.save(2, {"w": w2})
    assert store.manifest(2).tensors["w"].encoding == "xor"
    assert_bit_equal(store.load(2)["w"].materialize(), w2)


def spec(shape: tuple[int, ...], dtype: str) -> ArraySpec:
    return ArraySpec(shape, parse_dtype(np.dtype(dtype), zarr_format=3), 0, ArrayConfig("C", False),
                     default_buffer_prototype())


@pytest.mark.parametrize(("codec", "dtype", "values"), [
    (SparseBytesCodec(), "uint32", lambda g: np.where(g.random((37, 11)) < 0.05, g.integers(1, 2**32, (37, 11)), 0)),
    (SparseBytesCodec(), "uint16", lambda g: np.zeros((5, 5))),
    (Pack4BytesCodec(), "int8", lambda g: g.integers(-7, 8, (9, 7))),
])
def test_sparse_and_pack4_serializers_round_trip_their_own_encoded_form(codec, dtype, values):
    g = np.random.default_rng(0)
    arr = np.asarray(values(g)).astype(dtype)
    s = spec(arr.shape, dtype)
    nd = default_buffer_prototype().nd_buffer.from_numpy_array(arr)
    encoded = sync(codec._encode_single(nd, s))
    decoded = sync(codec._decode_single(encoded, s)).as_numpy_array()
    assert decoded.dtype == arr.dtype and np.array_equal(decoded, arr)
    assert type(codec).from_dict(codec.to_dict()) == codec
    if isinstance(codec, Pack4BytesCodec):
        assert len(encoded) == (arr.size + 1) // 2


@pytest.mark.parametrize("codec", [amber.XorDeltaCodec(3, "a/b"), amber.SparseDeltaCodec(3, "a/b", 0.05, None),
                                   amber.SparseDeltaCodec(topk=0.1), amber.QuantizedDeltaCodec(1, "x", bits=4)])
def test_delta_codec_metadata_round_trips(codec):
    assert type(codec).from_dict(codec.to_dict()) == codec


def test_unknown_codec_names_are_refused():
    with pytest.raises(ValueError, match="unknown codec"):
        amber.open("memory://x-codec", codec="zip")
    with pytest.raises(ValueError, match="bits"):
        amber.QuantizedDeltaCodec(bits=3)
