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


def zigzag_diff(out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
    """numpy's :func:`amber_store.codecs.kernels.zigzag_diff` on signed ints of one width: ufuncs
    wrap modulo 2**width as the kernel's truncating stores do. Its temporary is a scratch buffer
    of the calling thread (a fresh one per chunk faults its pages in: most of the time, cold)."""
    np.subtract(value, base, out=out)
    sign = scratch(out.nbytes, 1).view(out.dtype)
    np.right_shift(out, 8 * out.itemsize - 1, out=sign)
    np.left_shift(out, 1, out=out)
    np.bitwise_xor(out, sign, out=out)


def unzigzag_add(out: np.ndarray, stored: np.ndarray) -> None:
    """numpy's :func:`amber_store.codecs.kernels.unzigzag_add`: ``out += (stored >>> 1) ^
    -(stored & 1)``, on the unsigned view (a logical shift), in scratch buffers."""
    u = stored.view(_UNSIGNED[stored.itemsize])
    half = scratch(u.nbytes, 1).view(u.dtype)
    neg = scratch(u.nbytes, 2).view(u.dtype)
    np.right_shift(u, 1, out=half)
    np.bitwise_and(u, 1, out=neg)
    np.negative(neg, out=neg)
    np.bitwise_xor(half, neg, out=half)
    np.add(out, half.view(out.dtype), out=out)
