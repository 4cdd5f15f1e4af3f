"""The compiled kernels' first call in a process, taken off a resume's path.

A fresh process pays ~0.6 s at its first call of a numba kernel (numba's import, then the
kernel loaded from numba's on-disk cache and linked), and a resume is a fresh process: a 64 MiB
delta step loaded in 0.60 s in a new process and in 0.13 s once warm. :func:`ready` starts
warming the lossless diff's kernels on a thread of their own at its first call; until they are
warm, callers take numpy's ufuncs, which give the same bits at about a third of the speed.
"""

from __future__ import annotations

import threading

import numpy as np

_WARM = threading.Event()
_STARTED = threading.Lock()


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


def zigzag_diff(out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
    """numpy's :func:`amber_store.codecs.kernels.zigzag_diff` on signed ints of one width: ufuncs
    wrap modulo 2**width as the kernel's truncating stores do."""
    np.subtract(value, base, out=out)
    sign = np.right_shift(out, 8 * out.itemsize - 1)
    np.left_shift(out, 1, out=out)
    np.bitwise_xor(out, sign, out=out)


def unzigzag_add(out: np.ndarray, stored: np.ndarray, low: int) -> None:
    """numpy's :func:`amber_store.codecs.kernels.unzigzag_add`."""
    half = np.right_shift(stored, 1)
    np.bitwise_and(half, low, out=half)
    neg = np.bitwise_and(stored, 1)
    np.negative(neg, out=neg)
    np.bitwise_xor(half, neg, out=half)
    np.add(out, half, out=out)
