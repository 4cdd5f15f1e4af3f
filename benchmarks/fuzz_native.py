"""Fuzz the native decoder (amber_store/codecs/native) under AddressSanitizer and UBSan.

Builds the decoder's C sources again with ``-fsanitize=address,undefined`` into a scratch
folder, then runs itself in a child process with ASan's runtime preloaded, where it decodes
mutated frames (flipped bytes, cut frames, crafted header fields: a block of 0, sizes that do
not divide) and frames that another thread keeps changing while the decoder runs with the GIL
released. Every call must end in success or ValueError; a read or write out of bounds ends the
child with ASan's report and this script with a non-zero status.

    python benchmarks/fuzz_native.py [--frames 30000] [--seed 0]

Frames of 4- and 2-byte elements; each decode takes one of the paths this CPU runs, at random
(said in the output).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[1] / "amber_store" / "codecs" / "native"


def build(out: Path) -> Path:
    """The sanitized extension module, built into ``out``."""
    so = out / f"_blosc1{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = [os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer",
           "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
           f"-I{sysconfig.get_paths()['include']}", *(str(NATIVE / f) for f in ("blosc1.c", "decode.c", "zigzag.c", "lz4.c")), "-o", str(so)]
    subprocess.run(cmd, check=True)
    return so


def fuzz(frames: int, seed: int) -> None:
    """(In the sanitized child.) Decode ``frames`` mutated frames, then frames mutated during
    the call; print the tallies."""
    import numpy as np

    import _blosc1  # the sanitized build, first on sys.path

    from amber_store.codecs import Compression, DiffDeltaCodec

    rng = np.random.default_rng(seed)
    print(f"paths this CPU runs: {', '.join(_blosc1.paths)}")
    bases = []
    for n in (4096, 1 << 18, 3 << 18):
        weights = (rng.standard_normal(n) * 0.02).astype(np.float32)
        bases.append(b"".join(Compression().compress(weights.view(np.uint8), 4, None))[:-4])  # (less the crc32c)
        moved = (weights + rng.standard_normal(n).astype(np.float32) * 1e-4).view(np.uint32)
        codec, diff = DiffDeltaCodec(), np.empty(n, np.uint32)
        codec.encode_into(diff, moved, weights.view(np.uint32))
        bases.append(b"".join(Compression().compress(diff.view(np.uint8), 4, codec))[:-4])
        half = (weights[: n // 2] if n > 4096 else np.resize(weights, 2 * n)).astype(np.float16)
        bases.append(b"".join(Compression().compress(half.view(np.uint8), 2, None))[:-4])
    tally = {"decoded": 0, "ValueError": 0}

    def attempt(frame: bytes | bytearray, nbytes: int) -> None:
        out = np.zeros(nbytes // 4, np.uint32)
        try:
            _blosc1.decode(frame, out, int(rng.integers(0, 2)), str(rng.choice(_blosc1.paths)))
            tally["decoded"] += 1
        except ValueError:
            tally["ValueError"] += 1

    t0 = time.perf_counter()
    for i in range(frames):
        frame = bytearray(bases[i % len(bases)])
        nbytes = int.from_bytes(frame[4:8], "little")
        kind = i % 4
        if kind == 0:  # flipped bytes anywhere
            for at in rng.integers(0, len(frame), int(rng.integers(1, 8))):
                frame[at] ^= int(rng.integers(1, 256))
        elif kind == 1:  # cut short
            frame = frame[: int(rng.integers(0, len(frame)))]
        elif kind == 2:  # a header field crafted: block size (0 included), size, flags, typesize
            field = int(rng.choice([2, 3, 4, 8]))
            value = int(rng.choice([0, 1, 2048, 4096, 1 << 20, 0xFFFFFFFF, nbytes, nbytes // 2]))
            frame[field: field + (1 if field < 4 else 4)] = value.to_bytes(4, "little")[: 1 if field < 4 else 4]
        else:  # a block offset pointed elsewhere
            at = 16 + 4 * int(rng.integers(0, max(1, (len(frame) - 16) // 4 // 64)))
            frame[at: at + 4] = int(rng.integers(0, 1 << 32)).to_bytes(4, "little")
        attempt(bytes(frame), nbytes)
    print(f"{frames} mutated frames in {time.perf_counter() - t0:.1f} s: {tally}")

    # frames whose header another thread changes while the decoder runs (the GIL released)
    raced = {"decoded": 0, "ValueError": 0}
    for i in range(200):
        frame = bytearray(bases[i % len(bases)])
        nbytes = int.from_bytes(frame[4:8], "little")
        stop = threading.Event()

        block = bytes(frame[8:12])
        other = [b"\0\0\0\0", (int.from_bytes(block, "little") * 4).to_bytes(4, "little")][i % 2]

        def scribble() -> None:  # the block size, flipped between its own and 0 or a larger one
            while not stop.is_set():
                for value in (other, block):  # (each held a while: the decode must start within it)
                    frame[8:12] = value
                    for _ in range(int(rng.integers(1, 400))):
                        pass

        t = threading.Thread(target=scribble)
        t.start()
        for _ in range(20):
            out = np.zeros(nbytes // 4, np.uint32)
            try:
                _blosc1.decode(frame, out, 0, str(rng.choice(_blosc1.paths)))
                raced["decoded"] += 1
            except ValueError:
                raced["ValueError"] += 1
        stop.set()
        t.join()
    print(f"4,000 decodes of frames whose block size changed during the call: {raced}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, args.child)
        fuzz(args.frames, args.seed)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        asan = subprocess.run([os.environ.get("CC", "gcc"), "-print-file-name=libasan.so"], capture_output=True,
                              text=True, check=True).stdout.strip()
        ubsan = subprocess.run([os.environ.get("CC", "gcc"), "-print-file-name=libubsan.so"], capture_output=True,
                               text=True, check=True).stdout.strip()
        env = {**os.environ, "LD_PRELOAD": f"{asan} {ubsan}", "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
               "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run([sys.executable, __file__, "--child", tmp, "--frames", str(args.frames),
                              "--seed", str(args.seed)], env=env)
        print("sanitizers: clean" if run.returncode == 0 else f"sanitizers: FAILED (exit {run.returncode})")
        return run.returncode


if __name__ == "__main__":
    sys.exit(main())
