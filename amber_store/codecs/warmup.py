"""The compiled kernels' first call in a process, taken off a resume's path.

A fresh process pays ~0.6 s at its first call of a numba kernel (numba's import, then the
kernel loaded from numba's on-disk cache and linked), and a resume is a fresh process. Saves
call :func:`ready`, which starts warming the lossless diff's kernels on a thread of their own;
until they are warm, the diff takes numpy's ufuncs, which give the same bits. Loads only ask
:func:`warm` and never start it: applying a delta is a small share of a load beside
decompressing and unshuffling its layers, and a warm-up thread beside them competed for both
cores and the GIL (a 256 MB delta step loaded in a fresh process: 0.54 s with the warm-up
started by the load, 0.26 s by numpy alone, 0.22 s with kernels warmed before the load).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from .compression import scratch

_WARM = threading.Event()
_STARTED = threading.Lock()


def warm() -> bool:
    """Whether the lossless diff's kernels are warm."""
    return _WARM.is_set()


def ready() -> bool:
    """Whether the lossless diff's kernels are warm; starts warming them if nobody has."""
    if _WARM.is_set():
        return True
    if _STARTED.acquire(blocking=False):  # (never released: once per process)
        threading.Thread(target=_warm, name="amber-kernels-warmup", daemon=True).start()
    return False


def _warm() -> None:
    try:
        from . import kernels

        for width in (1, 2, 4, 8):
            a = np.zeros(8, f"i{width}")
            kernels.zigzag_diff(a, a, a, 64 - 8 * width)
            kernels.unzigzag_add(a, a, (1 << (8 * width - 1)) - 1)
    except Exception:  # noqa: BLE001 (no numba: numpy's path stays, slower and the same)
        return
    _WARM.set()


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

#: numpy's passes run over pieces of this many bytes, so that each pass reads what the previous
#: one wrote from the core's cache rather than from memory (measured, 4 MiB of int32 on this CPU:
#: unzigzag_add 1.52 ms over the whole chunk, 0.83 ms by 128 KiB pieces, 0.92 by 64 KiB)
PIECE_BYTES = 128 << 10


def _pieces(n: int, itemsize: int) -> Iterator[slice]:
    step = PIECE_BYTES // itemsize
    return (slice(a, a + step) for a in range(0, n, step))


def zigzag_diff(out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
    """numpy's :func:`amber_store.codecs.kernels.zigzag_diff` on flat signed ints of one width:
    ufuncs wrap modulo 2**width as the kernel's truncating stores do. Its temporary is a scratch
    buffer of the calling thread (a fresh one per chunk faults its pages in: most of the time,
    cold)."""
    signs = scratch(min(out.nbytes, PIECE_BYTES), 1).view(out.dtype)
    for piece in _pieces(out.size, out.itemsize):
        o = out[piece]
        sign = signs[: o.size]
        np.subtract(value[piece], base[piece], out=o)
        np.right_shift(o, 8 * out.itemsize - 1, out=sign)
        np.left_shift(o, 1, out=o)
        np.bitwise_xor(o, sign, out=o)


def unzigzag_add(out: np.ndarray, stored: np.ndarray) -> None:
    """numpy's :func:`amber_store.codecs.kernels.unzigzag_add` on flat signed ints of one width:
    ``out += (stored >>> 1) ^ -(stored & 1)``, on the unsigned view (a logical shift), in
    scratch buffers."""
    u = stored.view(_UNSIGNED[stored.itemsize])
    nbytes = min(u.nbytes, PIECE_BYTES)
    halves, negs = scratch(nbytes, 1).view(u.dtype), scratch(nbytes, 2).view(u.dtype)
    for piece in _pieces(u.size, u.itemsize):
        z = u[piece]
        half, neg = halves[: z.size], negs[: z.size]
        np.right_shift(z, 1, out=half)
        np.bitwise_and(z, 1, out=neg)
        np.negative(neg, out=neg)
        np.bitwise_xor(half, neg, out=half)
        o = out[piece]
        np.add(o, half.view(out.dtype), out=o)
