"""Lossy deltas: error bounds that hold along a whole chain, and codecs that round-trip."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from zarr.core.array_spec import ArrayConfig, ArraySpec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.dtype import parse_dtype
from amber_store.runtime import sync

import amber_store as amber
from amber_store import codecs as amber_codecs
from amber_store.codecs import ans as entropy
from amber_store import stepwriter
from amber_store.codecs import ESCAPE, AnsBytesCodec, Pack4BytesCodec, SparseBytesCodec, pack4_decode, pack4_encode
from amber_store.format import chunk_runs, to_bits
from amber_store.runtime import codec_pool
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
def test_sparse_error_stays_within_one_steps_threshold_over_a_50_step_chain(local_store, diff_path):
    threshold = 0.02
    store = local_store(codec=amber.SparseDeltaCodec(threshold=threshold), full_every=1000, chunk_bytes=8192,
                        base_policy="chain")
    worst = 0.0
    for step, w in drift(50):
        info = store.save(step, {"w": w})
        restored = local_store(mode="r").load(step)["w"].materialize()
        err = (restored - w).abs()
        # dropped updates are bounded relative to the restored value; kept ones are exact
        assert bool((err <= threshold * restored.abs() * (1 + 1e-6)).all()), step
        worst = max(worst, float((err / restored.abs().clamp_min(1e-30)).max()))
        if step > 1:
            assert store.manifest(step).tensors["w"].encoding in ("sparse", "same")
            assert info.nbytes_stored < info.nbytes_raw / 3
    assert worst <= threshold * (1 + 1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_error_stays_within_half_a_step_scale_over_a_50_step_chain(local_store, bits, diff_path):
    store = local_store(codec=f"quant{bits}", full_every=1000, chunk_bytes=8192, base_policy="chain")
    for step, w in drift(50):
        store.save(step, {"w": w})
        entry = store.manifest(step).tensors["w"]
        restored = local_store(mode="r").load(step)["w"].materialize()
        if step == 1:
            assert_bit_equal(restored, w)  # full steps are lossless
            continue
        assert entry.encoding == "quant"
        scales = torch.tensor([float.fromhex(s) for s in entry.params["scales"]])
        rows = entry.chunks[0]
        bound = scales.repeat_interleave(rows)[: w.shape[0]].unsqueeze(1) / 2
        err = (restored - w).abs()
        assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), (step, float((err - bound).max()))


def per_block(x: torch.Tensor, chunk_rows: int, block: int, reduce) -> torch.Tensor:
    """``reduce`` of each element's block (``block`` elements of a chunk of ``chunk_rows`` rows,
    the last block of a chunk zero-padded), per element."""
    out = torch.empty(x.numel())
    flat = x.reshape(-1)
    per_chunk = chunk_rows * x.shape[1]
    for lo in range(0, flat.numel(), per_chunk):
        for a in range(lo, min(lo + per_chunk, flat.numel()), block):
            b = min(a + block, lo + per_chunk, flat.numel())
            padded = torch.zeros(block)
            padded[: b - a] = flat[a:b]
            out[a:b] = reduce(padded)
    return out.view_as(x)


@pytest.mark.parametrize("step", [0.01, 0.1, 1.0])
def test_block_delta_error_stays_within_half_a_block_step_over_a_50_step_chain(local_store, step, diff_path):
    codec = amber.BlockDeltaCodec(step=step, block=64)
    store = local_store(codec=codec, full_every=1000, chunk_bytes=8192, base_policy="chain")
    restored = None
    for n, w in drift(50):
        store.save(n, {"w": w})
        entry = store.manifest(n).tensors["w"]
        previous, restored = restored, local_store(mode="r").load(n)["w"].materialize()
        if previous is None:
            assert_bit_equal(restored, w)
            continue
        assert entry.encoding in ("block", "same") and entry.params in ({"block": 64, "sparse_codes": True}, None)
        # the delta is taken against the previous *restored* value; the bound is per block: half
        # of sqrt(2) * step * RMS value, or of the power of two that keeps the largest code in int8
        rows = entry.chunks[0]
        bound = torch.maximum(math.sqrt(2) / 2 * step * per_block(w, rows, 64, lambda x: x.square().mean().sqrt()),
                              per_block(w - previous, rows, 64, lambda x: 2 ** (x.abs().max() / 127).log2().ceil() / 2))
        err = (restored - w).abs()
        assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), (n, float((err - bound).max()))
        assert bool((err > 0).any()), n  # lossy: elements moving less than half a step keep their base


def test_a_block_whose_values_collapse_takes_the_step_its_largest_change_needs(local_store, diff_path):
    # relative to the (now tiny) new values the step would be ~1e-3 and the codes of a change
    # of 40 would overflow int8: the step is raised to fit them, not the codes clipped
    store = local_store(codec=amber.BlockDeltaCodec(step=1.0))
    w = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10
    store.save(1, {"w": w})
    store.save(2, {"w": w * 1e-4})
    err = (store.load(2)["w"].materialize() - w * 1e-4).abs().view(16, 256).amax(1)
    fit = torch.exp2(torch.ceil(torch.log2(w.abs().view(16, 256).amax(1) / 127)))
    assert bool((err <= fit / 2).all())


def test_ratio_delta_keeps_relative_error_within_half_a_step_and_exact_zeros(local_store, diff_path):
    codec = amber.RatioDeltaCodec(step=0.1)
    store = local_store(codec=codec, full_every=1000, chunk_bytes=8192, base_policy="chain")
    for n, w in drift(30):
        v = w.square()
        v[0, :5] = 0.0  # never-updated second moments stay exactly zero
        if n == 20:
            v[1, 0] = 3.0e30  # far beyond the code range: stored exact
        store.save(n, {"v": v})
        restored = local_store(mode="r").load(n)["v"].materialize()
        ratio = restored[v > 0] / v[v > 0]
        assert bool((ratio <= 1.1 ** 0.5 * (1 + 1e-6)).all() and (ratio >= 1.1 ** -0.5 * (1 - 1e-6)).all()), n
        assert_bit_equal(restored[0, :5], v[0, :5])
        if n == 20:
            assert store.manifest(n).tensors["v"].encoding == "ratio" and bool(restored[1, 0] == v[1, 0])
    assert bool((restored != v).any())


@pytest.mark.parametrize("codec", [amber.BlockDeltaCodec(step=0.2), amber.RatioDeltaCodec(step=0.02)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_entropy_coded_deltas_store_non_finite_values_exactly_in_any_float_dtype(local_store, codec, dtype, diff_path):
    store = local_store(codec=codec, chunk_bytes=4096)
    w = (torch.rand(40, 50) + 0.5).to(dtype)
    store.save(1, {"w": w})
    w2 = (w.double() * (1 + 0.05 * torch.randn(40, 50))).to(dtype)
    w2[3, 4], w2[7, 0], w2[39, 49] = float("nan"), float("inf"), -float("inf")
    store.save(2, {"w": w2})
    assert store.manifest(2).tensors["w"].encoding == codec.encoding
    got = local_store(mode="r").load(2, lazy=False)["w"]
    finite = torch.isfinite(w2)
    assert_bit_equal(got[~finite], w2[~finite])
    assert torch.allclose(got[finite].double(), w2[finite].double(), rtol=0.2, atol=0.2)
    assert bool((got[finite] != w2[finite]).any())


def test_infinities_that_stay_put_are_not_escaped_and_come_back_exact(local_store, diff_path):
    # a causal attention mask (-inf above the diagonal) in a tensor whose other values move
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 64, generator=g).masked_fill_(torch.ones(64, 64, dtype=torch.bool).triu(1), -float("inf"))
    w2 = w * (1 + 0.05 * torch.rand(64, 64, generator=g))
    codec = amber.BlockDeltaCodec(step=0.05)
    delta = codec.diff(w2, to_bits(w).clone(), (64, 64))
    assert (delta.data == ESCAPE).sum() == 0 and (delta.data != 0).any()
    w3 = w2.clone()
    w3[0, 5] = 2.0  # an infinity that moves is stored exactly
    assert (codec.diff(w3, to_bits(w).clone(), (64, 64)).data == ESCAPE).sum() == 1
    store = local_store(codec=codec)
    for step, state in enumerate([w, w2, w3], 1):
        store.save(step, {"w": state})
    assert store.manifest(2).tensors["w"].encoding == "block"
    reader = local_store(mode="r")
    for step, state in enumerate([w, w2, w3], 1):
        got = reader.load(step, lazy=False)["w"]
        inf = torch.isinf(state)
        assert_bit_equal(got[inf], state[inf])
        assert torch.allclose(got[~inf], state[~inf], rtol=0.1, atol=0.1)
    assert codec.diff(w, to_bits(w).clone(), (64, 64)) is None  # nothing moved: no delta at all


@pytest.mark.parametrize("codec, dtype, change", [
    # a scale rounded down to a subnormal: the peak would code past qmax (10 and 190 ulps of 2^-149)
    (amber.QuantizedDeltaCodec(bits=4, min_numel=1), torch.float32, 10 * 2.0 ** -149),
    (amber.QuantizedDeltaCodec(bits=8, min_numel=1), torch.float32, 190 * 2.0 ** -149),
    # a block step capped at 2^126: float64 changes far beyond it
    (amber.BlockDeltaCodec(step=0.1, block=64, min_numel=1), torch.float64, 1e300)], ids=["quant4", "quant8", "block"])
def test_codes_stay_within_their_range_where_a_step_cannot_resolve_the_change(local_store, codec, dtype, change,
                                                                              diff_path):
    base = torch.zeros(128, dtype=dtype)
    value = base.clone()
    value[:4] = torch.tensor([1.0, -1.0, 0.25, 0.5], dtype=torch.float64).mul(change).to(dtype)
    assert bool((value[:4] != 0).all())
    delta = codec.diff(value, to_bits(base).clone(), (128,))
    qmax = 127 if codec.encoding == "block" else codec.qmax
    assert int(np.abs(delta.data.astype(np.int64)).max()) == qmax
    store = local_store(codec=codec)
    store.save(1, {"w": base})
    store.save(2, {"w": value})
    assert store.manifest(2).tensors["w"].encoding == codec.encoding
    assert_bit_equal(local_store(mode="r").load(2, lazy=False)["w"], delta.recon.view(dtype))


def test_ratio_deltas_escape_only_the_values_they_cannot_code_that_moved(diff_path):
    base = torch.tensor([1.0, 2.0, 0.0, -3.0, float("inf"), 0.0, 4.0, -1.0] * 40)
    value = base.clone()
    value[0::8] *= 1.5  # coded
    value[5::8] = 2.0  # a zero that moves: escaped (no ratio reaches it)
    value[7::8] = -2.0  # a negative that moves: escaped
    delta = amber.RatioDeltaCodec(step=0.1).diff(value, to_bits(base).clone(), (320,))
    codes = torch.from_numpy(delta.data).view(40, 8)
    assert bool((codes[:, 0] != 0).all()) and bool((codes[:, 1:5] == 0).all()) and bool((codes[:, 6] == 0).all())
    assert bool((codes[:, 5] == ESCAPE).all()) and bool((codes[:, 7] == ESCAPE).all())
    recon = delta.recon.view(torch.float32).view(40, 8)
    assert_bit_equal(recon[:, 1:], value.view(40, 8)[:, 1:])  # uncoded ones stay, escaped ones are exact


def test_a_change_of_exactly_half_a_block_step_is_no_delta_and_one_just_over_it_is(diff_path):
    codec = amber.BlockDeltaCodec(step=0.25, block=4)  # values near 1: a step of 2^-2
    base = torch.ones(8)
    half = base.clone()
    half[5] = 1.125  # rounds (half to even) to code 0 in its block
    assert codec.diff(half, base.view(torch.int32), (8,)) is None
    over = base.clone()
    over[5] = torch.nextafter(torch.tensor(1.125), torch.tensor(2.0))
    delta = codec.diff(over, base.view(torch.int32), (8,))
    assert delta is not None and delta.data.tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    assert_bit_equal(delta.recon.view(torch.float32), torch.tensor([1, 1, 1, 1, 1, 1.25, 1, 1]))


@pytest.mark.parametrize("codec", [amber.BlockDeltaCodec(step=0.05, block=64), amber.RatioDeltaCodec(step=0.02)])
@pytest.mark.parametrize("chunks", [(16, 32), (24, 32)])  # chunks that tile the tensor; a ragged edge chunk
def test_an_entropy_coded_delta_built_in_a_recycled_buffer_is_the_same_delta(codec, chunks, diff_path):
    g = torch.Generator().manual_seed(3)
    base = torch.rand(40, 32, generator=g) + 0.5
    base[0, :3] = torch.tensor([float("nan"), float("inf"), 0.0])  # escaped elements
    value = base * (1 + 0.1 * torch.randn(base.shape, generator=g))
    base_bits = base.view(torch.int32).clone()
    fresh = codec.diff(value, base_bits, chunks)
    buffer = torch.full_like(base_bits, -1)  # a spent base's bits
    recycled = codec.diff(value, base_bits, chunks, out=buffer)
    assert recycled.recon.data_ptr() == buffer.data_ptr()
    assert_bit_equal(recycled.recon, fresh.recon)
    assert np.array_equal(recycled.data, fresh.data) and np.array_equal(recycled.side, fresh.side)


@pytest.mark.parametrize("codec", [amber.QuantizedDeltaCodec(bits=8), amber.QuantizedDeltaCodec(bits=4),
                                   amber.SparseDeltaCodec(threshold=0.05)], ids=["quant8", "quant4", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])  # (readers' kernel; torch code)
@pytest.mark.parametrize("rows", [16, 24])  # chunks that tile the tensor; a ragged edge chunk
def test_quantized_and_sparse_deltas_read_back_as_the_writer_reconstructed_them(local_store, codec, dtype, rows,
                                                                                diff_path):
    # The writer quantizes every chunk at once; readers dequantize chunk by chunk: a reader
    # checks each chunk against the crc32c of the writer's reconstruction, so any disagreement
    # in a single bit fails the load. Step 3 is a delta against step 2's reconstruction.
    store = local_store(codec=codec, chunk_bytes=rows * 64 * dtype.itemsize, pack_threshold=1024, full_every=10)
    states = [s.to(dtype) for _, s in drift(3, shape=(80, 64))]
    for step, w in enumerate(states, 1):
        store.save(step, {"w": w})
    assert store.manifest(3).tensors["w"].encoding == codec.encoding
    assert store.manifest(3).tensors["w"].chunks == [rows, 64]
    reader = local_store(mode="r")
    for step, w in enumerate(states, 1):
        got = reader.load(step, lazy=False)["w"]
        assert torch.allclose(got.double(), w.double(), rtol=0.1, atol=0.1)
    assert_bit_equal(reader.load(3)["w"][rows - 3: rows + 5], reader.load(3, lazy=False)["w"][rows - 3: rows + 5])


@pytest.mark.parametrize("codec", [amber.QuantizedDeltaCodec(bits=8), amber.QuantizedDeltaCodec(bits=4),
                                   amber.BlockDeltaCodec(step=0.1), amber.RatioDeltaCodec(step=0.05), "lossy"],
                         ids=["quant8", "quant4", "block", "ratio", "lossy"])
@pytest.mark.parametrize("pack_threshold", [1024, 1 << 20])  # its own array; packed, diffed in a batch
def test_negative_zeros_that_barely_move_read_back_as_the_writer_reconstructed_them(local_store, codec,
                                                                                    pack_threshold, diff_path):
    # A reader restores a stored chunk as base + code * scale, which turns a -0.0 base under
    # code 0 into +0.0, and an unstored chunk (every code 0, or a chunk that did not change)
    # as its base bits: the writer's reconstruction, whose crc32c every read checks, must
    # agree in both, or the step would not load. Rows 0-15: a chunk that moves, with -0.0
    # elements nudged by less than half a step either way; rows 16-31 keep -0.0 and never move.
    base = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)).abs_().add_(0.5)
    base[:, :8] = -0.0
    value = base * 1.5
    value[:16, :4], value[:16, 4:8] = -1e-30, 1e-30
    value[16:] = base[16:]
    store = local_store(codec=codec, chunk_bytes=16 * 128 * 4, pack_threshold=pack_threshold, full_every=10)
    store.save(1, {"w": base})
    store.save(2, {"w": value})
    assert store.manifest(2).tensors["w"].encoding in ("quant", "block", "ratio")  # (not kept lossless)
    reader = local_store(mode="r")
    got = reader.load(2, lazy=False)["w"]  # (a chunk that disagrees with its crc32c raises)
    if pack_threshold == 1024:  # rows 16-31 are a chunk of their own, not stored
        assert_bit_equal(got[16:], base[16:])
    assert torch.equal(got[16:], base[16:])  # (packed, one chunk: -0.0 may come back as +0.0)
    assert (got[:16, :8] - value[:16, :8]).abs().max() <= 1e-30  # (ratio: stored exact; else 0)


@pytest.mark.parametrize("codec", [amber.BlockDeltaCodec(step=0.01), amber.RatioDeltaCodec(step=0.01)],
                         ids=["block", "ratio"])
def test_fine_steps_store_dense_codes_as_nibbles_that_read_back_as_the_writer_reconstructed_them(
        local_store, monkeypatch, codec, diff_path):
    # Every element moves by a step or two: codes of 2.5-3 bits of entropy, dense, within +-7.
    # A reader checks each chunk against the crc32c of the writer's reconstruction.
    layouts = []
    real = entropy._nibbles

    def spy(row):
        out = real(row)
        layouts.append(out is not None)
        return out

    monkeypatch.setattr(entropy, "_nibbles", spy)
    store = local_store(codec=codec, full_every=10)
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(512, 256, generator=g).abs() + 0.1]  # (positive, for ratio)
    for _ in range(2):
        states.append(states[-1] * (1 + 0.015 * torch.randn(512, 256, generator=g)))
    for step, w in enumerate(states, 1):
        store.save(step, {"w": w})
    assert store.manifest(3).tensors["w"].encoding == codec.encoding and layouts == [True, True]
    reader = local_store(mode="r")
    for step, w in enumerate(states, 1):
        assert torch.allclose(reader.load(step, lazy=False)["w"], w, rtol=0.01, atol=0.01)


@pytest.mark.parametrize("codec", [amber.QuantizedDeltaCodec(bits=8), amber.SparseDeltaCodec(threshold=0.05),
                                   amber.SparseDeltaCodec(topk=0.1)], ids=["quant8", "sparse", "topk"])
def test_a_quantized_or_sparse_delta_built_in_a_recycled_buffer_is_the_same_delta(codec, diff_path):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(80, 64, generator=g)
    value = base * (1 + 0.1 * torch.randn(base.shape, generator=g))
    base_bits = base.view(torch.int32).clone()
    fresh = codec.diff(value, base_bits, (24, 64))
    buffer = torch.full_like(base_bits, -1)  # a spent base's bits
    recycled = codec.diff(value, base_bits, (24, 64), out=buffer)
    assert recycled.recon.data_ptr() == buffer.data_ptr()
    assert_bit_equal(recycled.recon, fresh.recon)
    assert recycled.params == fresh.params
    if fresh.changes is None:
        assert np.array_equal(recycled.data, fresh.data)
    else:
        assert all(map(np.array_equal, recycled.changes, fresh.changes))


@pytest.mark.parametrize("piece", [None, 1000])  # the whole tensor at once; pieces, the last one short
@pytest.mark.parametrize("chunks", [(16, 64), (24, 64)])  # chunks that tile the tensor; a ragged edge chunk
def test_a_sparse_delta_stores_in_each_chunk_the_nonzero_elements_of_its_xor_delta(monkeypatch, piece, chunks,
                                                                                   diff_path):
    if piece:
        monkeypatch.setattr(amber_codecs.device, "PIECE", piece)
    g = torch.Generator().manual_seed(4)
    base = torch.randn(80, 64, generator=g)
    value = base * (1 + 0.05 * torch.randn(base.shape, generator=g))
    value[:24] = base[:24]  # chunks without a change: not stored
    value[70, :3] = torch.tensor([float("nan"), float("inf"), 0.0])  # non-finite, in a later piece
    base_bits = to_bits(base).clone()
    codec = amber.SparseDeltaCodec(threshold=0.05)
    delta = codec.diff(value, base_bits, chunks)
    assert delta.data is None
    dense = (to_bits(delta.recon) ^ base_bits).numpy().reshape(-1)
    assert delta.params == {"kept": int(np.count_nonzero(dense))}
    assert 0 < delta.params["kept"] < value.numel() // 4
    assert_bit_equal(delta.recon.view(-1)[70 * 64: 70 * 64 + 3], to_bits(value).view(-1)[70 * 64: 70 * 64 + 3])
    runs, padded = chunk_runs((80, 64), chunks), math.prod(chunks)
    recon = delta.recon.numpy().reshape(-1)
    stored = codec.serialize_run(delta, 0, runs, padded, [recon[a:b] for a, b in runs])
    expected = [amber_codecs.sparse_encode(np.pad(dense[a:b], (0, padded - (b - a)))) if dense[a:b].any() else None
                for a, b in runs]
    assert stored == expected and stored[0] is None and stored[-1] is not None


def test_sparse_deltas_keep_non_finite_values_and_values_next_to_them_exact(local_store, diff_path):
    store = local_store(codec=amber.SparseDeltaCodec(threshold=0.05))
    w = torch.randn(80, 64)
    w[0, 0] = float("inf")
    store.save(1, {"w": w})
    w2 = w * (1 + 0.01 * torch.randn(80, 64))
    w2[0, 0], w2[1, 1], w2[2, 2] = 1.0, float("nan"), -float("inf")  # from inf; to NaN and -inf
    w2[3, 3] = w[3, 3] * 2  # a significant move
    store.save(2, {"w": w2})
    assert store.manifest(2).tensors["w"].encoding == "sparse"
    got = local_store(mode="r").load(2, lazy=False)["w"]
    for i in range(4):
        assert_bit_equal(got[i, i], w2[i, i])
    assert bool((got != w2).any())  # small moves dropped


def assert_same_delta(got: amber_codecs.Delta, expected: amber_codecs.Delta, shape: tuple[int, ...],
                      chunks: tuple[int, ...]) -> None:
    """The same delta: reconstruction to the bit, params, codes or kept elements, and the side
    codes of every chunk that is stored (the others' do not matter)."""
    assert_bit_equal(got.recon, expected.recon)
    assert got.params == expected.params
    if expected.changes is not None:
        assert all(map(np.array_equal, got.changes, expected.changes))
    else:
        assert np.array_equal(got.data, expected.data)
    if expected.side is not None:
        stored = expected.data.reshape(-1)
        for k, (lo, hi) in enumerate(chunk_runs(shape, chunks)):
            if stored[lo:hi].any():
                assert np.array_equal(got.side[k], expected.side[k])


@pytest.mark.parametrize("codec", [amber.BlockDeltaCodec(step=0.05, block=64), amber.RatioDeltaCodec(step=0.02),
                                   amber.QuantizedDeltaCodec(bits=8, min_numel=1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [(8, 32), (12, 32)])  # chunks that tile the tensor; a ragged edge chunk
def test_a_lossy_delta_taken_piece_by_piece_is_the_delta_taken_whole(monkeypatch, codec, dtype, chunks, diff_path):
    g = torch.Generator().manual_seed(5)
    base = torch.rand(100, 32, generator=g) + 0.5
    value = base * (1 + 0.1 * torch.randn(base.shape, generator=g))
    value[20:44] = base[20:44]  # chunks that do not move: a piece with no codes
    escapes = codec.encoding != "quant"  # (which falls back to an exact delta on them)
    if escapes:
        value[90, :2] = torch.tensor([float("nan"), float("inf")])  # escaped elements in a later piece
    base, value = base.to(dtype), value.to(dtype)
    base_bits = to_bits(base).clone()
    whole = codec.diff(value, base_bits, chunks)
    monkeypatch.setattr(amber_codecs.device, "PIECE_BYTES", 2 * 8 * 32 * dtype.itemsize)  # two or three chunks a piece
    pieces = codec.diff(value, base_bits, chunks, out=torch.full_like(base_bits, -1))
    assert_same_delta(pieces, whole, tuple(base.shape), chunks)
    assert (pieces.data == ESCAPE).sum() == 2 * escapes


@pytest.mark.parametrize("codec", [amber.SparseDeltaCodec(threshold=0.05), amber.QuantizedDeltaCodec(bits=8),
                                   amber.QuantizedDeltaCodec(bits=4), amber.BlockDeltaCodec(step=0.05, block=64),
                                   amber.BlockDeltaCodec(step=0.01, block=48),
                                   amber.BlockDeltaCodec(step=0.05, block=64, drift=0.01),
                                   amber.BlockDeltaCodec(step=0.05, block=64, stochastic=True), amber.RatioDeltaCodec(step=0.02)],
                         ids=["sparse", "quant8", "quant4", "block", "block-fine", "block-drift", "block-stochastic", "ratio"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunks", [(8, 32), (12, 32)])  # chunks that tile the tensor; a ragged edge chunk
def test_the_host_kernels_take_the_delta_the_torch_code_takes(monkeypatch, codec, dtype, chunks, device):
    # What tensors on an accelerator get (torch, on their device) and what CPU tensors get (the
    # kernels, a piece per codec thread) must be the same delta: the same codes, side codes,
    # scales, kept elements and reconstruction, to the bit.
    g = torch.Generator().manual_seed(6)
    base = torch.randn(100, 32, generator=g).to(torch.float64)
    value = base * (1 + 0.05 * torch.randn(base.shape, generator=g))
    value[20:44] = base[20:44]  # chunks that do not move
    value[50, :6] = base[50, :6] * 40  # far beyond a block's values
    base[60, :4], value[60, :4] = -0.0, torch.tensor([-1e-30, 1e-30, 0.0, -0.0], dtype=torch.float64)
    base[61, :3] = torch.tensor([0.0, -2.0, 3.0], dtype=torch.float64)  # (not positive: ratio escapes)
    if codec.encoding != "quant":  # (which falls back to an exact delta on them)
        base[90, :3] = torch.tensor([float("inf"), 1.0, float("nan")], dtype=torch.float64)
        value[90, :4] = torch.tensor([float("inf"), float("nan"), 2.0, -float("inf")], dtype=torch.float64)
    base, value = base.to(dtype), value.to(dtype)
    base_bits = to_bits(base).clone()
    monkeypatch.setattr(amber_codecs.device, "PIECE_BYTES", 2 * 8 * 32 * dtype.itemsize)  # pieces on both threads
    monkeypatch.setattr(amber_codecs.device, "PIECE", 1000)
    host = codec.diff(value, base_bits, chunks)
    monkeypatch.setattr(amber_codecs.device, "HOST_KERNELS", False)
    reference = codec.diff(value.to(device), base_bits, chunks)
    assert_same_delta(host, reference, tuple(base.shape), chunks)
    assert reference.changes is not None or (host.data != 0).sum() > 100


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [64, 48])
def test_the_block_kernel_codes_runs_of_many_blocks_as_the_torch_code_does(monkeypatch, stochastic, dtype, block, device):
    # Chunks of 3,072 elements (48-64 blocks): the kernel codes runs of 16 blocks in one loop,
    # block by block the run holding a non-finite change, and the ragged edge chunk (640
    # elements) as a short run and padding
    g = torch.Generator().manual_seed(11)
    base = torch.randn(250, 64, generator=g, dtype=torch.float64)
    value = base * (1 + 0.02 * torch.randn(base.shape, generator=g, dtype=torch.float64))
    value[48:96] = base[48:96]  # a chunk that does not move
    value[130, 7], value[131, 0] = float("nan"), float("inf")  # mid-run, in the third chunk
    base, value = base.to(dtype), value.to(dtype)
    base_bits = to_bits(base).clone()
    codec = amber.BlockDeltaCodec(step=0.6 if stochastic else 0.05, block=block, stochastic=stochastic)
    chunks = (48, 64)
    host = codec.diff(value, base_bits, chunks)
    monkeypatch.setattr(amber_codecs.device, "HOST_KERNELS", False)
    reference = codec.diff(value.to(device), base_bits, chunks)
    assert_same_delta(host, reference, tuple(base.shape), chunks)
    assert (host.data == ESCAPE).sum() == 2 and (host.data != 0).sum() > 200


@pytest.mark.parametrize("codec", [amber.SparseDeltaCodec(threshold=0.05), amber.QuantizedDeltaCodec(bits=8),
                                   amber.QuantizedDeltaCodec(bits=4), amber.BlockDeltaCodec(step=0.01, block=64),
                                   amber.RatioDeltaCodec(step=0.02)],
                         ids=["sparse", "quant8", "quant4", "block", "ratio"])
@pytest.mark.parametrize("chunks", [(8, 32), (12, 32)])  # chunks that tile the tensor; a ragged edge chunk
def test_chunks_serialized_as_the_diff_takes_each_piece_are_those_serialized_after_it(monkeypatch, codec, chunks):
    g = torch.Generator().manual_seed(7)
    base = torch.rand(100, 32, generator=g) + 0.5
    value = base * (1 + 0.05 * torch.randn(base.shape, generator=g))
    value[20:44] = base[20:44]  # chunks that do not move
    base_bits = to_bits(base).clone()
    monkeypatch.setattr(amber_codecs.device, "PIECE_BYTES", 2 * 8 * 32 * 4)  # pieces on both threads
    monkeypatch.setattr(amber_codecs.device, "PIECE", 2 * 8 * 32)
    runs, padded = chunk_runs((100, 32), chunks), math.prod(chunks)
    compression = amber_codecs.Compression()
    fused = codec.diff(value, base_bits, chunks, finish=functools.partial(stepwriter.piece_chunks, codec, padded,
                                                                           compression, 4))
    assert fused.encoded is not None and len(fused.encoded) > 1
    after = codec.diff(value, base_bits, chunks)
    assert after.encoded is None
    jobs = stepwriter.submit_delta(codec_pool(), codec, after, after.recon.numpy().reshape(-1), runs,
                                       padded, compression, 4)
    assert [c for piece in fused.encoded for c in piece] == [c for job in jobs for c in job.result()]


@pytest.mark.parametrize("codec", [amber.BlockDeltaCodec(step=0.05, block=64), amber.RatioDeltaCodec(step=0.02)])
@pytest.mark.parametrize("batch_bytes", [None, 2048])  # one batch; batches flushed as they fill
def test_small_tensors_diffed_together_store_what_each_diffed_alone_would(monkeypatch, local_store, codec,
                                                                          batch_bytes, diff_path):
    if batch_bytes:
        monkeypatch.setattr(stepwriter, "BATCH_BYTES", batch_bytes)
    g = torch.Generator().manual_seed(8)
    shapes = [(256,), (300,), (100, 3), (513,), (1000,), (4096,), (40,)]  # block-aligned or not; one too small
    base = {f"t{i}": torch.rand(shape, generator=g) + 0.5 for i, shape in enumerate(shapes)}
    value = {k: t * (1 + 0.1 * torch.randn(t.shape, generator=g)) for k, t in base.items()}
    value["t2"] = base["t2"].clone()  # still: stored as "same"
    value["t4"][7] = float("nan")  # escaped
    store = local_store(codec=codec)
    store.save(1, base)
    store.save(2, value)
    m = store.manifest(2)
    assert list(m.tensors) == list(value)  # the step keeps the order of its tensors
    got = local_store(mode="r").load(2, lazy=False)
    for k, t in value.items():
        entry = m.tensors[k]
        assert entry.pack is not None or entry.encoding == "same"
        if t.numel() < codec.min_numel:
            assert_bit_equal(got[k], t)
            continue
        alone = codec.diff(t, to_bits(base[k]).clone(), tuple(t.shape))
        if alone is None:
            assert entry.encoding == "same"
            assert_bit_equal(got[k], base[k])
        else:
            assert entry.encoding == codec.encoding
            assert_bit_equal(to_bits(got[k]), alone.recon)


def test_a_lazy_slice_of_a_block_delta_reads_the_same_bits_as_a_whole_load(local_store):
    store = local_store(codec=amber.BlockDeltaCodec(step=0.01, block=100), chunk_bytes=4096, pack_threshold=1024)
    w = torch.randn(300, 30)
    store.save(1, {"w": w})
    store.save(2, {"w": w + 0.01 * torch.randn(300, 30)})
    whole = store.load(2, lazy=False)["w"]
    assert_bit_equal(store.load(2)["w"][137:171], whole[137:171])
    assert store.manifest(2).tensors["w"].array is not None  # sharded, several chunks


@pytest.mark.parametrize("moved", [0.004, 0.05, 0.3])
def test_a_block_delta_with_drift_codes_a_chunk_coarser_by_the_root_of_how_far_it_moved(tmp_path, moved):
    # two chunks (rows 0-31, 32-63): one barely moves (below drift: its step as without drift),
    # the other moves ``moved`` of its RMS, coded at step * sqrt(its drift / drift), bound to match
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=g)
    new = w.clone()
    new[:32] += 0.002 * torch.randn(32, 64, generator=g)
    new[32:] += moved * torch.randn(32, 64, generator=g)
    restored = {}
    for name, drift in (("plain", None), ("drift", 0.01)):
        store = amber.open(tmp_path / name, mode="w", codec=amber.BlockDeltaCodec(step=0.05, block=64, drift=drift),
                           chunk_bytes=32 * 64 * 4)
        store.save(1, {"w": w})
        store.save(2, {"w": new})
        restored[name] = (store.load(2)["w"].materialize(), store.manifest(2).nbytes_stored)
    (got, stored), (plain, plain_stored) = restored["drift"], restored["plain"]
    d = float((new[32:] - w[32:]).norm() / new[32:].norm())
    factor = torch.tensor([1.0, max(1.0, math.sqrt(d / 0.01))]).repeat_interleave(32 * 64)
    bound = math.sqrt(2) / 2 * 0.05 * per_block(new, 32, 64, lambda x: x.square().mean().sqrt()).reshape(-1) * factor
    err = (got - new).abs().reshape(-1)
    assert bool((err <= bound * (1 + 1e-5)).all()), float((err - bound).max())
    assert_bit_equal(got[:32], plain[:32])  # below drift: the same delta
    coarser = (got[32:] - new[32:]).square().mean() > 2 * (plain[32:] - new[32:]).square().mean()
    assert bool(coarser) == (moved > 0.04)  # (a factor of at least 2: one power of two coarser)
    assert stored <= plain_stored


def test_a_block_delta_rounded_stochastically_loses_no_update_on_average_where_rounding_to_nearest_loses_all(
        tmp_path, diff_path):
    # every element moves by 0.3 of its block's step (a power of two near 0.5 x the block's RMS,
    # the value's magnitude here): rounded to nearest, none moves; rounded stochastically, about
    # 30% move one whole step, so the mean update comes back, and each error stays under a step
    w = torch.full((64, 64), 1.0) * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)
    step = 0.5  # (a block's RMS is 1: its step is 2^-1)
    new = w + 0.3 * step
    restored = {}
    for stochastic in (False, True):
        store = amber.open(tmp_path / str(stochastic), mode="w", chunk_bytes=32 * 64 * 4,
                           codec=amber.BlockDeltaCodec(step=step, block=64, stochastic=stochastic))
        store.save(1, {"w": w})
        store.save(2, {"w": new})
        restored[stochastic] = store.load(2)["w"].materialize()
    assert_bit_equal(restored[False], w)
    moved = restored[True] - w
    assert set(moved.unique().tolist()) == {0.0, step}
    assert abs(float(moved.mean()) - 0.3 * step) < 0.03 * step  # (4096 draws: the standard error is 0.007 step)
    assert float((restored[True] - new).abs().max()) < step


def test_stochastic_rounding_is_the_same_bytes_on_every_save_of_a_state_and_within_a_step_along_a_chain(
        tmp_path, diff_path):
    # The draws are hashed from each value, its base and its place: the same delta is the same
    # bytes; along a chain each delta is taken against the restored state, so errors never
    # pile up beyond one step of their block
    g = torch.Generator().manual_seed(11)
    states = [torch.randn(128, 64, generator=g)]
    for _ in range(12):
        states.append(states[-1] + 0.01 * torch.randn(128, 64, generator=g))
    codec = amber.BlockDeltaCodec(step=0.2, block=64, stochastic=True)
    stores = [amber.open(tmp_path / name, mode="w", codec=codec, chunk_bytes=32 * 64 * 4, full_every=100)
              for name in "ab"]
    for i, w in enumerate(states):
        for store in stores:
            store.save(i, {"w": w})
        got = stores[0].load(i)["w"].materialize()
        bound = 2 ** torch.round(torch.log2(0.2 * per_block(w, 32, 64, lambda x: x.square().mean().sqrt()).reshape(-1)))
        assert bool(((got - w).abs().reshape(-1) < bound).all())
    for i in range(len(states)):
        a, b = (s.manifest(i).tensors["w"] for s in stores)
        assert a.crc32c == b.crc32c and a.stored == b.stored
        assert_bit_equal(stores[0].load(i)["w"].materialize(), stores[1].load(i)["w"].materialize())


def test_drift_and_rounding_are_the_writers_choice_and_stay_out_of_the_arrays_metadata():
    codec = amber.BlockDeltaCodec(step=0.1, drift=0.01, stochastic=True)
    config = codec.to_dict()["configuration"]
    assert "drift" not in config and "stochastic" not in config and config["step"] == 0.1
    assert amber.BlockDeltaCodec.from_dict(codec.to_dict()) == amber.BlockDeltaCodec(step=0.1)
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="drift"):
            amber.BlockDeltaCodec(drift=bad)


def test_the_lossy_preset_uses_ratio_for_second_moments_block_elsewhere_and_keeps_the_rest_exact(make_store):
    store = make_store(codec="lossy")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)  # weights move past the preset's precision
    for step in range(1, 4):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        store.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "seen": torch.arange(300) * step})
        if step == 1:
            first_moment = opt.state_dict()["state"][0]["exp_avg"].clone()
    entries = store.manifest(3).tensors
    assert entries["model/0.weight"].encoding == "block" and entries["optim/state/0/exp_avg_sq"].encoding == "ratio"
    # exp_avg changed wholesale, by less than 32 RMS values of its blocks: kept at its base (step 1)
    assert entries["optim/state/0/exp_avg"].encoding == "same"
    assert entries["model/1.weight"].encoding == "block"  # 128 elements: the preset codes from 64
    assert entries["model/2.bias"].encoding == "diff"  # 8 elements: below the preset's min_numel
    assert entries["optim/state/0/step"].encoding == "diff" and entries["seen"].encoding == "diff"
    got = store.load(3, lazy=False)
    assert_bit_equal(got["optim"]["state"][0]["exp_avg"], first_moment)
    assert_bit_equal(got["optim"]["state"][0]["step"], opt.state_dict()["state"][0]["step"])
    assert_bit_equal(got["model"]["2.bias"], model.state_dict()["2.bias"])


def test_the_lossy_preset_follows_a_first_moment_block_that_collapses_and_keeps_the_rest_at_the_base(make_store):
    g = torch.Generator().manual_seed(0)
    m = torch.randn(4096, generator=g)
    store = make_store(codec="lossy")
    store.save(1, {"exp_avg": m})
    moved = 0.35 * m + 0.94 * torch.randn(4096, generator=g)  # a new moment of the same scale
    collapsed = moved.clone()
    collapsed[:256] *= 1e-3  # one block's gradients stopped: its moment decays toward zero
    store.save(2, {"exp_avg": moved})
    store.save(3, {"exp_avg": collapsed})
    assert store.manifest(2).tensors["exp_avg"].encoding == "same"
    assert store.manifest(3).tensors["exp_avg"].encoding == "block"
    got = store.load(3, lazy=False)["exp_avg"]
    assert_bit_equal(got[256:], m[256:])
    bound = 2**0.5 * 64 * float(collapsed[:256].square().mean().sqrt()) / 2  # BlockDeltaCodec's, at step 64
    assert float((got[:256] - collapsed[:256]).abs().max()) <= bound < 0.1 * float(m[:256].abs().max())


@pytest.mark.parametrize("sparse_codes", [True, False])  # format 7's layouts; 5 and 6 wrote False's
@pytest.mark.parametrize("rows", [40, 400])  # dense codes, sparse ones
def test_stock_zarr_reads_the_codes_of_an_entropy_coded_chunk(sparse_codes, rows):
    codes = np.zeros((rows, 25), dtype=np.int8)
    codes[3, :7] = [1, -1, 2, ESCAPE, 5, -3, 1]
    codec = amber.BlockDeltaCodec(block=64, sparse_codes=sparse_codes)
    recon = np.arange(codes.size, dtype=np.uint32)
    side = np.array([-3] * -(-codes.size // 64), dtype=np.int8)
    raw = np.frombuffer(codec.serialize(codes, side, recon), np.uint8)
    serializer = AnsBytesCodec.from_dict(codec.serializer("float32"))
    assert serializer == AnsBytesCodec(64, sparse_codes) and AnsBytesCodec.from_dict({"name": "amber.ans", "configuration": {"side": 64}}).sparse_codes is False
    decoded = sync(serializer._decode_single(default_buffer_prototype().buffer.from_bytes(raw.tobytes()),
                                             spec(codes.shape, "int8")))
    assert np.array_equal(decoded.as_numpy_array(), codes)
    got_side, got, escaped, _ = codec._parse(raw, codes.size, np.dtype("uint32"))
    assert np.array_equal(got.reshape(codes.shape), codes) and np.array_equal(got_side, side)
    assert list(escaped) == [recon[3 * 25 + 3]]


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
    assert entries["model/w"].encoding == "diff" and entries["optim/m"].encoding == "quant"
    assert entries["optim/n"].encoding == "diff"  # integers never go lossy
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
    assert entries["optim/state/1/exp_avg"].encoding == "diff"  # the 128-element bias moment
    assert entries["optim/state/0/step"].encoding == "diff"
    assert_bit_equal(store.load(3)["optim"]["state"][0]["step"].materialize(), opt.state_dict()["state"][0]["step"])


def test_topk_sparse_keeps_the_requested_fraction(local_store, diff_path):
    store = local_store(codec=amber.SparseDeltaCodec(topk=0.05))
    w = torch.randn(100, 100)
    store.save(1, {"w": w})
    store.save(2, {"w": w + torch.randn(100, 100)})
    assert store.manifest(2).tensors["w"].params == {"kept": 500}


def test_lossy_codecs_fall_back_exactly_on_non_finite_values(local_store, diff_path):
    store = local_store(codec="quant8")
    w = torch.randn(5000)
    store.save(1, {"w": w})
    w2 = w.clone()
    w2[3] = float("nan")
    store.save(2, {"w": w2})
    assert store.manifest(2).tensors["w"].encoding == "diff"
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


@pytest.mark.parametrize("codec", [amber.BlockDeltaCodec(step=0.05, block=64), amber.RatioDeltaCodec(step=0.02)],
                         ids=["block", "ratio"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_readers_restore_in_one_kernel_pass_the_bits_the_torch_restore_gives(codec, dtype):
    # float32/float64 chunks are restored in place by amber_store.codecs.kernels, others by torch:
    # both must give the writer's bits (code 0 on -0.0, NaN and inf bases included).
    g = torch.Generator().manual_seed(7)
    base = (torch.rand(1000, generator=g) + 0.5).to(dtype)
    base[:3] = torch.tensor([-0.0, float("nan"), float("inf")], dtype=dtype)
    codes = torch.randint(-127, 128, (1000,), generator=g, dtype=torch.int8)
    codes[:3] = 0
    side = np.random.default_rng(7).integers(-30, 6, 16).astype(np.int8) if codec.encoding == "block" else None
    expected = codec._restore(base.clone(), codes, side)
    values = base.clone().numpy()
    codec._restore_on_host(values, codes.numpy(), side)
    assert_bit_equal(torch.from_numpy(values), expected)


def test_quant4_codes_are_stored_as_code_plus_8_two_a_byte_low_nibble_first():
    assert pack4_encode(np.array([-7, 7, 0], np.int8)) == bytes([0xF1, 0x88])  # (an odd count pads code 0)
    assert np.array_equal(pack4_decode(np.array([0xF1, 0x88], np.uint8), (3,)), [-7, 7, 0])


@pytest.mark.parametrize("codec", [amber.XorDeltaCodec(3, "a/b"), amber.DiffDeltaCodec(4, "c"),
                                   amber.SparseDeltaCodec(3, "a/b", 0.05, None), amber.SparseDeltaCodec(topk=0.1),
                                   amber.QuantizedDeltaCodec(1, "x", bits=4), amber.BlockDeltaCodec(2, "w", step=3.0, block=128),
                                   amber.RatioDeltaCodec(2, "v", step=0.07, min_numel=10)])
def test_delta_codec_metadata_round_trips(codec):
    assert type(codec).from_dict(codec.to_dict()) == codec


def test_unknown_codec_names_are_refused():
    with pytest.raises(ValueError, match="unknown codec"):
        amber.open("memory://x-codec", codec="zip")
    with pytest.raises(ValueError, match="bits"):
        amber.QuantizedDeltaCodec(bits=3)
    with pytest.raises(ValueError, match="step"):
        amber.BlockDeltaCodec(step=0.001)
    with pytest.raises(ValueError, match="step"):
        amber.RatioDeltaCodec(step=2.0)
