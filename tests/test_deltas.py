"""What a delta step costs: unchanged data is never written."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from numcodecs import blosc

import amber_store as amber
from amber_store import format as fmt
from amber_store.codecs import Compression, decompress
from conftest import all_keys, assert_bit_equal, assert_tree_bit_equal, is_data_key, stored_chunk


def test_frozen_tensor_costs_zero_bytes_and_no_array_in_a_delta_step(make_store):
    store = make_store()
    frozen = torch.randn(256, 256)
    live = torch.randn(256)
    store.save(1, {"frozen": frozen, "live": live})
    live += 1
    store.save(2, {"frozen": frozen, "live": live})
    entry = store.manifest(2).tensors["frozen"]
    assert entry.encoding == "same" and entry.stored == 0 and entry.array is None
    assert entry.base == 1
    assert not all_keys(store, f"{store.manifest(2).group}/frozen")
    assert_bit_equal(store.load(2)["frozen"].materialize(), frozen)


def test_a_tensor_that_changes_again_after_unchanged_steps_diffs_against_its_data(make_store):
    store = make_store(base_policy="chain")
    w = torch.randn(32, 32)
    store.save(1, {"w": w})
    store.save(2, {"w": w})  # same as 1
    store.save(3, {"w": w})  # same as 1 (not as 2: no chain through empty steps)
    w2 = w.clone()
    w2[0, 0] = 5.0
    store.save(4, {"w": w2})
    entries = [store.manifest(s).tensors["w"] for s in (2, 3, 4)]
    assert [(e.encoding, e.base) for e in entries] == [("same", 1), ("same", 1), ("diff", 1)]
    assert store.info(4)["chain"] == [1, 4]
    reader = make_store(mode="r")
    assert_bit_equal(reader.load(4)["w"].materialize(), w2)
    reader2 = make_store(base_policy="chain")  # a fresh writer has no cached base: it reads step 4 back to diff against it
    store2_state = w2.clone()
    store2_state[1, 1] = 7.0
    reader2.save(5, {"w": store2_state})
    assert reader2.manifest(5).tensors["w"].base == 4
    assert_bit_equal(make_store(mode="r").load(5)["w"].materialize(), store2_state)


def test_only_changed_chunks_of_a_tensor_are_written_into_its_one_object(make_store):
    # 4 KiB chunks of a (64, 64) float32: one per 16 rows; no packing
    store = make_store(chunk_bytes=4 * 1024, pack_threshold=0)
    w = torch.randn(64, 64)
    store.save(1, {"w": w})
    w[20] += 1.0  # touches chunk 1 of 4
    store.save(2, {"w": w})
    entry = store.manifest(2).tensors["w"]
    assert entry.chunks == [16, 64] and entry.encoding == "diff"
    assert [i for i, where in enumerate(entry.index) if where is not None] == [1]
    assert all_keys(store, entry.array + "/") == [f"{entry.array}/0.0"]
    assert_bit_equal(store.load(2)["w"].materialize(), w)


def test_small_tensors_of_a_step_share_one_pack_object(make_store):
    store = make_store()
    state = {f"t{i}": torch.randn(10, 10) for i in range(50)}
    store.save(1, state)
    m = store.manifest(1)
    assert {e.pack[0] for e in m.tensors.values()} == {"pack"} and all(e.array is None for e in m.tensors.values())
    data = [k for k in all_keys(store, m.group + "/") if is_data_key(k)]
    assert data == [f"{m.group}/pack/0"]
    for i in range(0, 50, 7):
        state[f"t{i}"] += 1
    store.save(2, state)
    m2 = store.manifest(2)
    assert sum(e.encoding == "diff" for e in m2.tensors.values()) == 8
    assert_tree_bit_equal(make_store(mode="r").load(2, lazy=False), state)


@pytest.mark.parametrize("codec", ["lossless", "xor"])
def test_packed_deltas_of_mixed_widths_across_pack_parts_come_back_bit_exact(make_store, codec):
    # parts of 1 KiB: tensors straddle parts, runs of deltas of one width are broken by other
    # widths, by new tensors (stored full) and by unchanged ones (stored nothing)
    store = make_store(chunk_bytes=1024, pack_threshold=4096, codec=codec)
    g = torch.Generator().manual_seed(0)
    state = {f"f{i}": torch.randn(37 + 50 * i, generator=g) for i in range(6)}
    state |= {"h": torch.randn(300, generator=g).bfloat16(), "n": torch.randint(-9, 9, (97,), generator=g),
              "b": torch.rand(33, generator=g) > 0.5, "s": torch.tensor(3.0)}
    store.save(1, state)
    steps = {1: {k: v.clone() for k, v in state.items()}}
    for step in (2, 3):
        for k in ("f0", "f2", "f3", "f5", "h", "n"):
            state[k] = state[k] + 1
        state[f"new{step}"] = torch.randn(61, generator=g)
        store.save(step, state)
        steps[step] = {k: v.clone() for k, v in state.items()}
    m = store.manifest(3)
    assert {e.encoding for e in m.tensors.values()} >= {"same", "full", "diff" if codec == "lossless" else "xor"}
    assert m.packs["pack"]["nbytes"] > 3 * 1024  # several parts
    reader = make_store(mode="r")
    for step, expected in steps.items():
        assert_tree_bit_equal(reader.load(step, lazy=False), expected)


def test_small_update_delta_is_much_smaller_than_a_full_step(make_store):
    store = make_store()
    w = torch.randn(512, 512)
    full = store.save(1, {"w": w})
    w[::50] += 1e-3
    delta = store.save(2, {"w": w})
    assert delta.nbytes_raw == full.nbytes_raw == w.numel() * 4
    assert delta.nbytes_stored * 20 < full.nbytes_stored


def test_chunk_shape_keeps_trailing_dims_whole_and_targets_the_chunk_size():
    assert fmt.choose_chunks((1000, 1024), 4, 1 << 20) == (256, 1024)
    assert fmt.choose_chunks((10, 3, 1 << 20), 4, 1 << 20) == (1, 1, 1 << 18)
    assert fmt.choose_chunks((), 4, 1 << 20) == ()
    assert fmt.choose_chunks((0, 5), 4, 1 << 20) == (1, 5)


@pytest.mark.parametrize("codec, chunk_bytes", [("lossless", fmt.DEFAULT_CHUNK_BYTES), ("xor", fmt.DEFAULT_CHUNK_BYTES),
                                                 ("lossy", fmt.LOSSY_CHUNK_BYTES), ("quant8", fmt.LOSSY_CHUNK_BYTES)])
def test_default_chunks_are_sized_by_the_tensors_codec_and_a_delta_keeps_its_bases(local_store, codec, chunk_bytes):
    w = torch.randn(4096, 1024)  # 16 MiB
    store = local_store(codec=codec)
    for step in (1, 2):
        store.save(step, {"w": w})
        w[::7] *= 1.01
        entry = store.manifest(step).tensors["w"]
        assert math.prod(entry.chunks) * 4 == chunk_bytes, (step, entry.chunks)
    local_store(codec=codec, chunk_bytes=1 << 16).save(3, {"w": w})  # a delta: its base's chunks still
    assert store.manifest(3).tensors["w"].base is not None
    assert store.manifest(3).tensors["w"].chunks == store.manifest(1).tensors["w"].chunks


def test_chunks_hold_a_multiple_of_8_elements_so_full_steps_are_bit_shuffled(local_store):
    assert fmt.choose_chunks((1000, 1001), 4, 1 << 20) == (256, 1001)  # not 261: 8 | 256 * 1001
    assert fmt.choose_chunks((1000, 300), 4, 1 << 20) == (872, 300)  # not 873
    g = torch.Generator().manual_seed(0)
    odd = torch.randn(1000, 1001, generator=g) * 0.02
    small = {f"t{i}": torch.randn(1 + i % 7, 333, generator=g) * 0.02 for i in range(40)}  # odd sizes
    store = local_store()
    info = store.save(1, {"odd": odd, "small": small})
    # blosc stores a block of any other element count unshuffled: 1.00x for these floats
    assert info.ratio > 1.1
    assert_tree_bit_equal(store.load(1, lazy=False), {"odd": odd, "small": small})


def forge_same_crc32c(data: bytes, changed_at: int, fix_at: int) -> bytes:
    """``data`` with one byte changed at ``changed_at`` and four bytes at ``fix_at`` set so
    that its CRC-32C stays the same (a CRC is linear: solve for the fix over GF(2))."""
    n = len(data)
    zeros = crc32c.crc32c(bytes(n))

    def syndrome(at: int, value: bytes) -> int:
        d = bytearray(n)
        d[at: at + len(value)] = value
        return crc32c.crc32c(bytes(d)) ^ zeros

    pivots: dict[int, tuple[int, int]] = {}
    for i in range(32):
        vec, combo = syndrome(fix_at, (1 << i).to_bytes(4, "little")), 1 << i
        while vec and (vec.bit_length() - 1) in pivots:
            pv, pc = pivots[vec.bit_length() - 1]
            vec, combo = vec ^ pv, combo ^ pc
        if vec:
            pivots[vec.bit_length() - 1] = (vec, combo)
    target, fix = syndrome(changed_at, b"\x10"), 0
    while target:
        pv, pc = pivots[target.bit_length() - 1]
        target, fix = target ^ pv, fix ^ pc
    out = bytearray(data)
    out[changed_at] ^= 0x10
    out[fix_at: fix_at + 4] = (int.from_bytes(out[fix_at: fix_at + 4], "little") ^ fix).to_bytes(4, "little")
    assert bytes(out) != data and crc32c.crc32c(bytes(out)) == crc32c.crc32c(data)
    return bytes(out)


@pytest.mark.parametrize("against", ["its base", "zeros in a full step"])
def test_a_changed_chunk_with_the_same_crc32c_as_before_is_still_stored(local_store, against):
    # Writers skip the comparison pass of a chunk whose checksum changed; an equal checksum
    # must still be compared byte by byte, or this chunk would silently read back as before.
    store = local_store(pack_threshold=0, chunk_bytes=4096)
    before = torch.randn(64, 64) if against == "its base" else torch.zeros(64, 64)
    raw = before.numpy().tobytes()
    chunk = forge_same_crc32c(raw[:4096], changed_at=100, fix_at=2000)
    after = torch.frombuffer(bytearray(chunk + raw[4096:]), dtype=torch.float32).reshape(64, 64)
    step = 1
    if against == "its base":
        store.save(step, {"w": before})
        step = 2
    store.save(step, {"w": after})
    e = store.manifest(step).tensors["w"]
    assert e.index[0] is not None and e.crc32c[0] == crc32c.crc32c(raw[:4096])
    assert_bit_equal(local_store(mode="r").load(step)["w"].materialize(), after)


def extreme_values(dtype: torch.dtype, n: int = 1000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two states of a ``dtype`` tensor whose differences cover the edges: wrap-around of
    integers, sign changes, NaN payloads, infinities, signed zeros, subnormals."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5, torch.rand(n, generator=g) > 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        a = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)
        b = a.clone()
        b[:n // 2] = torch.randint(info.min, info.max, (n // 2,), generator=g, dtype=torch.int64).to(dtype)
        a[0], b[0], a[1], b[1] = info.min, info.max, info.max, info.min
        return a, b
    a = torch.randn(n, generator=g).to(dtype)
    b = (a.double() * (1 + 1e-3 * torch.randn(n, generator=g, dtype=torch.float64))).to(dtype)
    b[n // 2:] = -b[n // 2:]
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40]).to(dtype)
    a[: special.numel()] = special
    b[special.numel(): 2 * special.numel()] = special
    return a, b


LOSSLESS_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                   torch.int16, torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("codec", [amber.DiffDeltaCodec(), amber.XorDeltaCodec()], ids=["diff", "xor"])
@pytest.mark.parametrize("dtype", LOSSLESS_DTYPES, ids=str)
def test_lossless_deltas_are_the_same_bits_on_the_device_and_host_paths_and_restore_exactly(codec, dtype):
    a, b = extreme_values(dtype, n=100_003)
    base = fmt.to_bits(a).clone()
    delta = codec.diff(b, base, (b.numel(),))  # the torch path (the tensor's device)
    host = np.empty_like(delta.data)
    codec.encode_into(host, fmt.bits_to_numpy(fmt.to_bits(b)), fmt.bits_to_numpy(base))  # the host path
    assert np.array_equal(host, delta.data)
    assert torch.equal(delta.recon, fmt.to_bits(b))
    restored = fmt.bits_to_numpy(base).copy()
    codec.apply_into(restored, host, fmt.whole((b.numel(),)), None)
    assert_bit_equal(fmt.numpy_to_tensor(restored, fmt.dtype_name(dtype)), b)


@pytest.mark.parametrize("codec", ["lossless", "xor"])
def test_every_dtype_round_trips_bit_exactly_through_lossless_delta_chains(make_store, codec):
    states = [{}, {}, {}]
    for i, dtype in enumerate(LOSSLESS_DTYPES):
        a, b = extreme_values(dtype, n=3000, seed=i)
        c = b.clone()
        c[::7] = a[::7]
        for state, value in zip(states, (a, b, c)):
            state[str(dtype)] = value.reshape(30, 100)
            state["small/" + str(dtype)] = value[:40]
    store = make_store(codec=codec, base_policy="chain", chunk_bytes=2048, pack_threshold=1000, full_above=None)
    for step, state in enumerate(states):
        store.save(step, state)
    encodings = {e.encoding for e in store.manifest(2).tensors.values()}
    assert encodings == {"diff" if codec == "lossless" else "xor"}
    for step, state in enumerate(states):
        assert_tree_bit_equal(store.load(step, lazy=False), state)
    lazy = store.load(2)["torch.float32"]
    assert_bit_equal(lazy[7:19, 3:50], states[2]["torch.float32"][7:19, 3:50])


def test_integer_difference_deltas_of_slowly_moving_floats_are_smaller_than_xor(tmp_path):
    # A small update is a small integer difference of a float's bits; XOR sets every bit a carry
    # flipped. Here every element moves by about 1e-3 of its size, as between checkpoints.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g) * 0.02
    small = {f"b{i}": torch.randn(300, generator=g) for i in range(50)}
    moved = {"w": w * (1 + 1e-3 * torch.randn(w.shape, generator=g)),
             "small": {k: v * (1 + 1e-3 * torch.randn(v.shape, generator=g)) for k, v in small.items()}}
    stored = {}
    for codec in ("lossless", "xor"):
        store = amber.open(tmp_path / codec, codec=codec)
        store.save(1, {"w": w, "small": small})
        store.save(2, moved)
        entries = store.manifest(2).tensors
        stored[codec] = (entries["w"].stored, sum(e.stored for k, e in entries.items() if k != "w"))
    assert stored["lossless"][0] < 0.97 * stored["xor"][0]  # lz4 (large tensors) against XOR with zstd
    assert stored["lossless"][1] < 0.97 * stored["xor"][1]  # zstd (packs) against XOR with zstd


def blosc_frame(root: Path, store: amber.Store, step: int, key: str) -> bytes:
    """The blosc frame of the first stored chunk holding ``key`` at ``step``."""
    path, offset, nbytes = stored_chunk(root, store, step, key)
    return path.read_bytes()[offset: offset + nbytes - 4]  # a chunk ends with its crc32c


def blosc_settings(frame: bytes) -> tuple[str, int]:
    """(compressor library, shuffle: 0 none, 1 byte, 2 bit) named by a blosc frame's header
    (its flags byte: bit 0 byte shuffle, bit 2 bit shuffle)."""
    flags = frame[2]
    return blosc.cbuffer_complib(frame), 1 if flags & 1 else 2 if flags & 4 else 0


def with_crc(frame: bytes) -> bytes:
    """A stored chunk: its blosc frame, then the frame's crc32c."""
    return frame + crc32c.crc32c(frame).to_bytes(4, "little")


def test_a_frame_claiming_more_bytes_than_its_buffer_is_refused_not_decoded_past_it():
    values = np.arange(4096, dtype=np.float32)
    frame = bytearray(Compression().compress(values.view(np.uint8), 4, None)[0])
    frame[4:8] = (2 * values.nbytes).to_bytes(4, "little")  # the header's uncompressed size
    out = np.zeros(values.nbytes + 4096, np.uint8)  # the chunk's buffer, then a guard
    assert decompress(with_crc(bytes(frame)), out[: values.nbytes]) is None
    assert not out.any()


def test_a_frame_that_passes_its_checksum_but_does_not_decode_is_refused():
    values = np.arange(4096, dtype=np.float32)
    frame = Compression().compress(values.view(np.uint8), 4, None)[0]
    assert np.array_equal(decompress(with_crc(frame), np.empty(values.nbytes, np.uint8)), values.view(np.uint8))
    cut = frame[:-8]  # its header still names the whole frame's size
    assert decompress(with_crc(cut)) is None
    assert decompress(with_crc(cut), np.empty(values.nbytes, np.uint8)) is None


@pytest.mark.parametrize("compressor", ["auto", "zstd", "lz4"])
def test_lossless_deltas_of_large_tensors_default_to_lz4_bit_shuffled_and_packs_to_zstd(local_store, tmp_path,
                                                                                       compressor):
    store = local_store(compressor=compressor, pack_threshold=4096)
    w, b = torch.randn(64, 1024), torch.randn(100)
    store.save(1, {"w": w, "b": b})
    store.save(2, {"w": w + 1e-3, "b": b + 1e-3})
    root = tmp_path / "ckpt"  # local_store's
    large = blosc_settings(blosc_frame(root, store, 2, "w"))
    packed = blosc_settings(blosc_frame(root, store, 2, "b"))
    expected = {"auto": (("LZ4", 2), ("Zstd", 1)), "zstd": (("Zstd", 1), ("Zstd", 1)),
                "lz4": (("LZ4", 2), ("LZ4", 2))}[compressor]
    assert (large, packed) == expected


@pytest.mark.parametrize("policy", ["auto", "chain"])
def test_only_steps_a_later_save_diffs_against_keep_a_copy_of_their_values(local_store, policy):
    store = local_store(base_policy=policy, full_every=10, base_cache="memory")
    w = torch.randn(300, 1024)
    for step in range(3):
        w += 1e-3
        store.save(step, {"w": w, "b": w[0, :100].clone()})
    # Under "auto" lossless deltas diff against the full step: a delta step's values are never
    # a base, so a save does not copy them; "chain" diffs against the previous step.
    base = {"auto": 0, "chain": 2}[policy]
    assert [step for step in range(3) if store.writer.bases.get(step, "w") is not None] == [base]
    if policy == "chain":
        assert torch.equal(store.writer.bases.get(2, "w").whole(), fmt.to_bits(w))
    else:  # no buffer was filled for steps 1 and 2 (a copied one would be free for reuse now)
        assert store.writer.bases.recycle("w", fmt.to_bits(w)) is None
    store.save(3, {"w": w + 1, "b": w[0, :100] + 1})
    assert_bit_equal(store.load(3, lazy=False)["w"], w + 1)


def test_a_pack_mixing_entropy_coded_and_lossless_deltas_still_compresses_the_lossless_ones(local_store, tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {f"coded{i}": torch.randn(20000, generator=g) for i in range(10)}  # packed, block-coded
    state.update({f"exact{i}": torch.randn(50, generator=g) for i in range(30)})  # below min_numel: lossless
    store = local_store(codec="lossy")
    store.save(1, state)
    store.save(2, {k: v * (1 + (0.3 if k.startswith("coded") else 1e-3) * torch.randn(v.shape, generator=g))
                   for k, v in state.items()})
    m = store.manifest(2)
    assert {m.tensors[k].encoding for k in state} == {"block", "diff"}
    frame = blosc_frame(tmp_path / "ckpt", store, 2, "exact0")
    # Most of this part is entropy-coded, which blosc would only frame (level 0, lz4 named):
    # that would store the lossless deltas raw. zstd codes them and costs the codes nothing.
    assert blosc_settings(frame)[0] == "Zstd" and frame[2] >> 5 == 4


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_lossless_diffs_by_the_c_kernels_are_the_torch_codes_bits(width, monkeypatch):
    from amber_store.codecs import lossless

    if lossless.zigzag_diff is None:
        pytest.skip("the native decoder is not built (no C compiler at install)")
    rng = np.random.default_rng(width)
    info = np.iinfo(f"i{width}")
    n = (1 << 16) + 5  # (a ragged end past the vectors)
    value, base = (rng.integers(info.min, info.max, n, dtype=f"i{width}", endpoint=True).view(f"u{width}")
                   for _ in range(2))
    value[:4] = np.array([info.min, info.max, 0, -1], f"i{width}").view(f"u{width}")  # wraps both ways
    base[:4] = np.array([info.max, info.min, info.min, info.max], f"i{width}").view(f"u{width}")
    codec, by = amber.DiffDeltaCodec(), {}
    for path in ("C", "torch"):
        if path == "torch":
            monkeypatch.setattr(lossless, "zigzag_diff", None)
            monkeypatch.setattr(lossless, "unzigzag_add", None)
        delta = np.empty_like(value)
        codec.encode_into(delta, value, base)
        restored = base.copy()
        codec.apply_into(restored, delta, (slice(0, n),), None)
        assert np.array_equal(restored, value)
        by[path] = delta
    assert np.array_equal(by["C"], by["torch"])
    # unaligned elements (a view one byte into a buffer) go to torch: the same bits
    if width > 1:
        raw = np.empty(n * width + 1, np.uint8)[1:].view(f"u{width}")
        raw[:] = base
        assert not raw.flags.aligned
        monkeypatch.undo()
        codec.apply_into(raw, by["C"], (slice(0, n),), None)
        assert np.array_equal(raw, value)


def test_steps_saved_or_loaded_without_the_c_kernels_are_the_same_bytes_and_bits(tmp_path, monkeypatch):
    from amber_store.codecs import compression, lossless

    g = torch.Generator().manual_seed(0)
    s1 = {"w": torch.randn(512, 512, generator=g), "h": torch.randn(512, 256, generator=g).half()}
    s2 = {k: v + 1e-3 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in s1.items()}
    kernels = {"C": (lossless.zigzag_diff, lossless.unzigzag_add), "torch": (None, None)}

    def by(path: str) -> None:
        monkeypatch.setattr(lossless, "zigzag_diff", kernels[path][0])
        monkeypatch.setattr(lossless, "unzigzag_add", kernels[path][1])

    stored = {}
    for path in ("torch", "C"):
        by(path)
        store = amber.open(tmp_path / path, pack_threshold=0, chunk_bytes=1 << 18)
        store.save(1, s1)
        store.save(2, s2)
        stored[path] = {k: stored_chunk(tmp_path / path, store, 2, k)[0].read_bytes() for k in s2}
    assert stored["torch"] == stored["C"]  # one format, whichever path wrote it
    monkeypatch.setattr(compression, "_blosc1", None)  # (else the decoder applies these diffs itself)
    for writer, reader in (("torch", "C"), ("C", "torch")):
        by(reader)
        assert_tree_bit_equal(amber.open(tmp_path / writer, mode="r").load(2, lazy=False), s2)


def test_a_lossless_save_and_load_in_a_fresh_process_import_no_numba(tmp_path):
    # (numba's import and its kernels' first call cost a fresh process ~0.6 s and ~100 MB)
    code = ("import sys, torch, amber_store as amber\n"
            "g = torch.Generator().manual_seed(0)\n"
            "state = {'w': torch.randn(1024, 1024, generator=g), 'b': torch.randn(1000, generator=g).double()}\n"
            "store = amber.open(sys.argv[1])\n"
            "store.save(1, state)\n"
            "new = {k: v + 1e-3 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in state.items()}\n"
            "store.save(2, new)\n"
            "got = amber.open(sys.argv[1], mode='r').load(2, lazy=False)\n"
            "assert all(torch.equal(got[k].view(torch.int8), new[k].view(torch.int8)) for k in new)\n"
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


def test_a_tensor_whose_delta_stopped_paying_is_stored_full_for_the_rest_of_its_segment(local_store):
    store = local_store()
    slow, noisy = torch.randn(1024, 512), torch.randn(1024, 512)  # (not packed: 2 MiB each)
    saved = {}
    for step in range(1, 6):
        saved[step] = {"slow": slow, "noisy": noisy, "packed": torch.randn(512)}
        store.save(step, saved[step])
        slow = slow + 1e-4 * torch.randn_like(slow)  # (a delta much smaller than the value)
        noisy = torch.randn_like(noisy)  # (a delta as large as the value: it never pays)
    first = store.manifest(2).tensors["noisy"]
    assert first.encoding == "diff" and first.stored > 0.9 * store.manifest(1).tensors["noisy"].stored
    for step in (3, 4, 5):  # known from step 2: diffing against step 1 no longer pays
        info = store.info(step)["tensors"]
        assert info["noisy"]["encoding"] == "full" and info["noisy"]["chain"] == [step]
        assert "no longer paid" in info["noisy"]["note"]
        assert info["slow"]["encoding"] == "diff" and info["slow"]["chain"] == [1, step]
        assert info["packed"]["encoding"] == "diff"  # (its pack is read whole either way)
    assert store.manifest(5).depth == 4
    for step in range(1, 6):
        assert_tree_bit_equal(store.load(step, lazy=False), saved[step])


def test_under_the_chain_rule_the_step_after_a_full_store_diffs_against_it(local_store):
    store = local_store(base_policy="chain")
    w = torch.randn(1024, 512)
    store.save(1, {"w": w})
    store.save(2, {"w": torch.randn_like(w)})  # a delta that does not pay: the next step is full...
    w = torch.randn_like(w)
    store.save(3, {"w": w})
    store.save(4, {"w": w + 1e-4})  # ...and the one after diffs against it
    encodings = [(store.manifest(s).tensors["w"].encoding, store.manifest(s).tensors["w"].base) for s in range(1, 5)]
    assert encodings == [("full", None), ("diff", 1), ("full", None), ("diff", 3)]
    assert store.info(4)["tensors"]["w"]["chain"] == [3, 4]
    assert_bit_equal(store.load(4, lazy=False)["w"], w + 1e-4)


def test_full_above_none_keeps_diffing_whatever_the_delta_costs(local_store):
    store = local_store(full_above=None)
    for step in range(1, 5):
        store.save(step, {"noisy": torch.randn(1024, 512)})
    assert [store.manifest(s).tensors["noisy"].encoding for s in range(1, 5)] == ["full", "diff", "diff", "diff"]
