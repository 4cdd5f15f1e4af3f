"""The native decoder of full values and lossless diffs (amber_store.codecs._blosc1): by every path
this CPU runs (AVX-512, AVX2, portable), the same bits as c-blosc and numpy's apply for 4- and 2-byte
elements, the frames it does not take left to them, corrupt frames refused without reading or
writing out of bounds; its C core alone, natively and built for aarch64 under qemu-user."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import amber_store as amber
from amber_store.codecs import Compression, DiffDeltaCodec, compression, decompress, fuses
from benchmarks.common import cpu_flags
from conftest import assert_tree_bit_equal, flip_stored_byte

native = compression._blosc1
needs_native = pytest.mark.skipif(native is None, reason="the native decoder is not built (no C compiler at install)")
#: every path this CPU runs (none without the native decoder)
PATHS = list(native.paths) if native is not None else []
NATIVE_SOURCES = Path(__file__).resolve().parents[1] / "amber_store" / "codecs" / "native"


@pytest.fixture
def blosc_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode as a machine without the native decoder does: all through c-blosc and numpy."""
    monkeypatch.setattr(compression, "_blosc1", None)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode by this path (as ``AMBER_DECODE_PATH`` does)."""
    monkeypatch.setattr(compression, "_PATH", request.param)
    return request.param


def values(kind: str, n: int, seed: int = 0, width: int = 4) -> np.ndarray:
    """``n`` float32 (``width`` 2: float16) bits whose bit planes compress (lz4 streams), do not
    (stored raw), or both."""
    rng = np.random.default_rng(seed)
    uint, fp = (np.uint32, np.float32) if width == 4 else (np.uint16, np.float16)
    if kind == "weights":  # sign and exponent planes compress, mantissa planes are stored raw
        return (rng.standard_normal(n) * 0.02).astype(fp).view(uint)
    if kind == "random bits":
        return rng.integers(0, 1 << (8 * width), n, dtype=uint)
    if kind == "runs":
        return np.repeat(rng.integers(0, 1 << (8 * width), n // 1024 + 1, dtype=uint), 1024)[:n]
    return np.zeros(n, uint)


def stored(payload: np.ndarray, delta: DiffDeltaCodec | None = None) -> bytes:
    """A stored chunk of ``payload`` as the writer frames it (blosc frame, then its crc32c)."""
    return b"".join(Compression().compress(payload.view(np.uint8), payload.itemsize, delta))


#: what compresses (random bits do not: c-blosc then copies the whole chunk, which it decodes)
KINDS = ["weights", "runs", "zeros"]
#: 16 KiB (one small block), one 1 MiB block, a 4 MiB chunk, 3 MiB (three blocks) of 4-byte elements
SIZES = [4096, 1 << 18, 1 << 20, 3 << 18]


def test_the_paths_it_runs_are_those_this_cpu_has():
    if native is None:
        pytest.skip("the native decoder is not built (no C compiler at install)")
    flags = cpu_flags()
    want = ["portable"]
    if platform.machine() in ("x86_64", "AMD64"):
        want = (["avx512"] if {"avx512f", "avx512bw", "avx512vbmi", "gfni"} <= flags else []) \
            + (["avx2"] if "avx2" in flags else []) + want
    assert list(native.paths) == want
    assert compression.decode_path() == (compression._PATH or want[0])


def test_the_native_decoder_is_built_where_a_c_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the install leaves the native decoder out")
    assert native is not None, "pip install built no amber_store.codecs._blosc1 although a C compiler is here"


@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_full_values_decode_to_c_bloscs_bits(kind, n, width, path, monkeypatch):
    v = values(kind, n, width=width)
    chunk = stored(v)
    out = np.full(n, 0xBEEF, v.dtype)
    assert fuses(chunk, out)
    assert decompress(chunk, out.view(np.uint8)) is not None
    monkeypatch.setattr(compression, "_blosc1", None)
    ref = np.empty(n, v.dtype)
    assert decompress(chunk, ref.view(np.uint8)) is not None
    assert np.array_equal(out, ref) and np.array_equal(out, v)


@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("step", ["small update", "wraps around"])
def test_a_fused_diff_applies_onto_its_base_as_decode_then_apply_does(step, n, width, path, monkeypatch):
    base = values("weights", n, seed=1, width=width)
    fp = base.view(np.float32 if width == 4 else np.float16)
    if step == "small update":
        new = (fp + fp.dtype.type(1e-2) * values("weights", n, seed=2, width=width).view(fp.dtype)).view(base.dtype)
    else:  # differences across 0 and 2**width, each way
        top = (1 << (8 * width)) - 1
        base = np.resize(np.array([0, top, top // 2 + 1, top // 2], base.dtype), n)
        new = np.resize(np.array([top, 0, top // 2, top // 2 + 1], base.dtype), n)
    codec = DiffDeltaCodec()
    delta = np.empty_like(base)
    codec.encode_into(delta, new, base)
    chunk = stored(delta, codec)
    out = base.copy()
    assert not fuses(chunk, out.view(np.uint8), codec.fused_op)  # an apply needs the chunk's elements
    assert codec.fused_op is not None and fuses(chunk, out, codec.fused_op)
    assert decompress(chunk, out, codec.fused_op) is out
    monkeypatch.setattr(compression, "_blosc1", None)
    raw = decompress(chunk)
    ref = base.copy()
    codec.apply_into(ref, raw.view(base.dtype), (slice(0, n),), None)
    assert np.array_equal(out, ref) and np.array_equal(out, new)


def test_frames_it_does_not_take_are_left_to_c_blosc_and_still_decode(path):
    v = values("weights", 1 << 18)
    cases = {
        "1-byte elements": b"".join(Compression().compress(v.view(np.uint8), 1, None)),
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


def test_corrupt_frames_raise_and_never_write_past_the_output(path):
    rng = np.random.default_rng(7)
    frames = [stored(values(kind, (1 << 18) // width, seed=3, width=width))[:-4]
              for kind in ("weights", "runs") for width in (4, 2)]
    failed = 0
    for i in range(800):
        frame = bytearray(frames[i % 4])
        if i % 3 == 0:  # cut short
            frame = frame[: int(rng.integers(16, len(frame)))]
        else:  # bytes overwritten past the header: block offsets, stream sizes, lz4 tokens
            for at in rng.integers(16, len(frame), int(rng.integers(1, 8))):
                frame[at] = int(rng.integers(0, 256))
        out = np.zeros((1 << 18) + 4096, np.uint8)  # the chunk, then a guard
        try:
            native.decode(bytes(frame), out[: 1 << 18], native.STORE, path)
        except ValueError:
            failed += 1
        assert not out[1 << 18:].any(), "wrote past its output"
    assert failed >= 266  # every cut frame at least


def test_a_store_loads_the_same_bits_through_the_native_decoder_and_c_blosc(tmp_path, path, monkeypatch):
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


def selftest_cases(folder: Path) -> list[str]:
    """Case files for the C self-test (selftest.c's format): frames written by c-blosc, of 4- and
    2-byte elements, values and diffs onto a base, with the bits c-blosc and numpy's apply give."""
    folder.mkdir()
    codec, files = DiffDeltaCodec(), []
    for width in (4, 2):
        for kind in KINDS:
            for n in (4096, 1 << 19):
                v = values(kind, n, seed=n, width=width)
                cases = {"store": (np.full_like(v, 7), v, stored(v))}
                base = values("weights", n, seed=n + 1, width=width)
                delta = np.empty_like(v)
                codec.encode_into(delta, v, base)
                cases["unzigzag_add"] = (base, v, stored(delta, codec))
                for op, (before, after, chunk) in cases.items():
                    frame = chunk[:-4]
                    if frame[2] & 0x2:  # incompressible: c-blosc copied it whole, left to c-blosc
                        continue
                    header = b"AMBC" + b"".join(x.to_bytes(4, "little") for x in (
                        ["store", "unzigzag_add"].index(op), v.nbytes, len(frame)))
                    path = folder / f"{width}-{kind}-{n}-{op}"
                    path.write_bytes(header + frame + before.tobytes() + after.tobytes())
                    files.append(str(path))
    return files


def run_selftest(cc: list[str], run: list[str], tmp_path: Path) -> str:
    exe = tmp_path / "selftest"
    subprocess.run([*cc, "-O2", "-o", str(exe), f"-I{NATIVE_SOURCES}",
                    *(str(NATIVE_SOURCES / f) for f in ("selftest.c", "decode.c", "zigzag.c", "lz4.c"))], check=True)
    cases = selftest_cases(tmp_path / "cases")
    done = subprocess.run([*run, str(exe), *cases], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(cases) >= 20 and done.stdout.endswith(f": {len(cases)} cases, {200 * len(cases)} mutated frames\n")
    return done.stdout.split(":")[0]


def test_the_c_core_alone_decodes_by_every_path_this_cpu_runs(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    ran = run_selftest([cc], [], tmp_path).split(",")
    assert ran == PATHS if native is not None else "portable" in ran


def test_the_c_core_built_for_aarch64_decodes_the_same_bits_under_qemu(tmp_path):
    """aarch64 (its portable path compiles to NEON) under qemu-user: Debian's ``qemu-user`` and
    ``gcc-aarch64-linux-gnu`` (.ci/run installs them where apt-get can)."""
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc is None or qemu is None:
        pytest.skip("no aarch64-linux-gnu-gcc or qemu-aarch64 here (Debian: gcc-aarch64-linux-gnu, qemu-user)")
    assert run_selftest([cc, "-static"], [qemu], tmp_path) == "portable"


@pytest.mark.parametrize("choice", ["c-blosc", "portable", "neon-on-x86"])
def test_amber_decode_path_picks_a_path_or_fails_naming_those_this_machine_has(choice):
    code = ("from amber_store.codecs import compression as c, lossless; "
            "print(c.decode_path(), 'kernels' if lossless.zigzag_diff else 'torch')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "AMBER_DECODE_PATH": choice})
    if choice == "neon-on-x86":
        assert done.returncode != 0
        assert "AMBER_DECODE_PATH='neon-on-x86': this machine decodes by ['c-blosc'" in done.stderr
    elif choice == "portable" and native is None:
        assert done.returncode != 0 and "this machine decodes by ['c-blosc']" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        # (c-blosc: as a machine without the extension, whose diffs torch's ops apply)
        assert done.stdout.split() == [choice, "torch" if choice == "c-blosc" else "kernels"]


@needs_native
@pytest.mark.parametrize("damaged", [1, 2])
def test_stored_chunks_the_decoder_takes_are_checked_only_when_the_result_is_wrong_and_the_damaged_step_is_named(
        tmp_path, damaged, monkeypatch):
    from amber_store import reader

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1024, 1024, generator=g) * 0.02, "half": torch.randn(1024, 512, generator=g).bfloat16()}
    with amber.open(tmp_path / "s", mode="w") as store:
        store.save(1, state)
        for t in state.values():
            t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * 1e-3)
        store.save(2, state)
    checked = []

    def counted(stored) -> bool:
        checked.append(len(stored))
        return compression.crc32c.crc32c(memoryview(stored)[:-4]) == int.from_bytes(memoryview(stored)[-4:], "little")

    monkeypatch.setattr(compression, "intact", counted)
    monkeypatch.setattr(reader, "intact", counted)
    assert_tree_bit_equal(amber.open(tmp_path / "s", mode="r").load(2, lazy=False), state)
    assert checked == []  # (both layers of both tensors: one pass over the result each, none over their frames)
    assert_tree_bit_equal(amber.open(tmp_path / "s", mode="r", verify_checksums=False).load(2, lazy=False), state)
    assert len(checked) == 4  # (unverified results: every frame checked before it is decoded, as before)
    store = amber.open(tmp_path / "s", mode="r")
    flip_stored_byte(tmp_path / "s", store, damaged, "w")
    with pytest.raises(amber.CorruptDataError, match=rf"step {damaged}, tensor 'w', chunk \(0, 0\): stored chunk "
                                                     "failed its checksum or decoding"):
        store.load(2, lazy=False)
    assert torch.equal(store.load(2)["half"][:].view(torch.int16), state["half"].view(torch.int16))  # (the rest loads)
