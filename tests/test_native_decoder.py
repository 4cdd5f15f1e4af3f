"""The native decoder of full values and lossless diffs (amber_store.codecs._blosc1): the same
bits as c-blosc and numpy's apply, the frames it does not take left to them, corrupt frames
refused without reading or writing out of bounds."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import amber_store as amber
from amber_store.codecs import Compression, DiffDeltaCodec, compression, decompress, fuses
from conftest import assert_tree_bit_equal

native = compression._blosc1
needs_kernel = pytest.mark.skipif(native is None or not native.fast,
                                  reason="the native decoder is not built, or this CPU lacks AVX-512 VBMI and GFNI")


@pytest.fixture
def blosc_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode as a machine without the native decoder does: all through c-blosc and numpy."""
    monkeypatch.setattr(compression, "_blosc1", None)


def values(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """``n`` float32 bits whose bit planes compress (lz4 streams), do not (stored raw), or both."""
    rng = np.random.default_rng(seed)
    if kind == "weights":  # sign and exponent planes compress, mantissa planes are stored raw
        return (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)
    if kind == "random bits":
        return rng.integers(0, 1 << 32, n, dtype=np.uint32)
    if kind == "runs":
        return np.repeat(rng.integers(0, 1 << 32, n // 1024 + 1, dtype=np.uint32), 1024)[:n]
    return np.zeros(n, np.uint32)


def stored(payload: np.ndarray, delta: DiffDeltaCodec | None = None) -> bytes:
    """A stored chunk of ``payload`` as the writer frames it (blosc frame, then its crc32c)."""
    return b"".join(Compression().compress(payload.view(np.uint8), 4, delta))


#: what compresses (random bits do not: c-blosc then copies the whole chunk, which it decodes)
KINDS = ["weights", "runs", "zeros"]
#: 16 KiB (one small block), one 1 MiB block, a 4 MiB chunk, 3 MiB (three blocks)
SIZES = [4096, 1 << 18, 1 << 20, 3 << 18]


def test_the_native_decoder_is_built_where_a_c_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the install leaves the native decoder out")
    assert native is not None, "pip install built no amber_store.codecs._blosc1 although a C compiler is here"


@needs_kernel
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_full_values_decode_to_c_bloscs_bits(kind, n, monkeypatch):
    v = values(kind, n)
    chunk = stored(v)
    out = np.full(n, 0xDEADBEEF, np.uint32)
    assert fuses(chunk, out)
    assert decompress(chunk, out.view(np.uint8)) is not None
    monkeypatch.setattr(compression, "_blosc1", None)
    ref = np.empty(n, np.uint32)
    assert decompress(chunk, ref.view(np.uint8)) is not None
    assert np.array_equal(out, ref) and np.array_equal(out, v)


@needs_kernel
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("step", ["small update", "wraps around"])
def test_a_fused_diff_applies_onto_its_base_as_decode_then_apply_does(step, n, monkeypatch):
    base = values("weights", n, seed=1)
    if step == "small update":
        new = (base.view(np.float32) + np.float32(1e-4) * values("weights", n, seed=2).view(np.float32)).view(np.uint32)
    else:  # differences across 0 and 2**32, each way
        base = np.resize(np.array([0, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF], np.uint32), n)
        new = np.resize(np.array([0xFFFFFFFF, 0, 0x7FFFFFFF, 0x80000000], np.uint32), n)
    codec = DiffDeltaCodec()
    delta = np.empty_like(base)
    codec.encode_into(delta, new, base)
    chunk = stored(delta, codec)
    out = base.copy()
    assert codec.fused_op is not None and fuses(chunk, out, codec.fused_op)
    assert decompress(chunk, out, codec.fused_op) is out
    monkeypatch.setattr(compression, "_blosc1", None)
    raw = decompress(chunk)
    ref = base.copy()
    codec.apply_into(ref, raw.view(np.uint32), (slice(0, n),), None)
    assert np.array_equal(out, ref) and np.array_equal(out, new)


@needs_kernel
def test_frames_it_does_not_take_are_left_to_c_blosc_and_still_decode():
    v = values("weights", 1 << 18)
    cases = {
        "2-byte elements": b"".join(Compression().compress(v.view(np.uint8), 2, None)),
        "zstd": b"".join(Compression(compressor="zstd").compress(v.view(np.uint8), 4, None)),
        "byte-shuffled": stored(v, amber.codecs.XorDeltaCodec()),
        "a block that is not a whole number of 512 elements": stored(v[:1000]),
        "incompressible (copied whole by c-blosc)": stored(values("random bits", 1 << 18)),
    }
    for what, chunk in cases.items():
        out = np.empty(v.nbytes if "block" not in what else 4000, np.uint8)
        assert not fuses(chunk, out), what
        assert decompress(chunk, out) is not None, what
        with pytest.raises(ValueError, match="does not take this chunk"):  # no apply of the wrong elements
            decompress(chunk, out.view(np.uint32), "unzigzag_add")
    bigger = np.empty(v.nbytes + 64, np.uint8)  # a buffer larger than the chunk: c-blosc fills its front
    assert not fuses(stored(v), bigger)
    assert np.array_equal(decompress(stored(v), bigger)[: v.nbytes].view(np.uint32), v)


@needs_kernel
def test_corrupt_frames_raise_and_never_write_past_the_output():
    rng = np.random.default_rng(7)
    frames = [stored(values(kind, 1 << 16, seed=3))[:-4] for kind in ("weights", "runs")]
    failed = 0
    for i in range(600):
        frame = bytearray(frames[i % 2])
        if i % 3 == 0:  # cut short
            frame = frame[: int(rng.integers(16, len(frame)))]
        else:  # bytes overwritten past the header: block offsets, stream sizes, lz4 tokens
            for at in rng.integers(16, len(frame), int(rng.integers(1, 8))):
                frame[at] = int(rng.integers(0, 256))
        out = np.zeros((1 << 18) + 4096, np.uint8)  # the chunk, then a guard
        try:
            native.decode(bytes(frame), out[: 1 << 18], native.STORE)
        except ValueError:
            failed += 1
        assert not out[1 << 18:].any(), "wrote past its output"
    assert failed >= 200  # every cut frame at least


@needs_kernel
def test_a_store_loads_the_same_bits_through_the_native_decoder_and_c_blosc(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1024, 1024, generator=g) * 0.02, "edge": torch.randn(1000, 333, generator=g),
             "half": torch.randn(512, 512, generator=g).bfloat16(), "small": torch.randn(10, generator=g)}
    with amber.open(tmp_path / "s", mode="w") as store:
        store.save(1, state)
        for t in state.values():
            t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * 1e-3)
        store.save(2, state)
    native_load = amber.open(tmp_path / "s", mode="r").load(2, lazy=False)
    assert_tree_bit_equal(native_load, state)
    monkeypatch.setattr(compression, "_blosc1", None)
    assert_tree_bit_equal(amber.open(tmp_path / "s", mode="r").load(2, lazy=False), native_load)


def test_a_store_loads_bit_exactly_without_the_native_decoder(tmp_path, blosc_only):
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(1024, generator=g)}
    with amber.open(tmp_path / "s", mode="w") as store:
        store.save(1, state)
        state["w"].add_(1e-3)
        store.save(2, state)
    assert not fuses(b"\0" * 64, np.empty(16, np.uint8))
    assert_tree_bit_equal(amber.open(tmp_path / "s", mode="r").load(2, lazy=False), state)
