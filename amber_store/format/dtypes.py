"""Dtypes as stored (raw bits in same-width unsigned arrays) and host memory for them."""

from __future__ import annotations

import functools
import mmap
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from ..errors import UnsupportedStateError

if TYPE_CHECKING:
    import torch


# Tensors are stored as their raw bits in an unsigned integer array of the same width, which
# is what XOR deltas work on and what lets bfloat16 (no zarr dtype) live in plain zarr.
_BITS_NUMPY = {1: np.dtype("uint8"), 2: np.dtype("uint16"), 4: np.dtype("uint32"), 8: np.dtype("uint64")}
# numpy dtypes torch.from_numpy accepts, per width (torch lacks full uint16/32/64 support)
_TORCHABLE_NUMPY = {1: np.dtype("uint8"), 2: np.dtype("int16"), 4: np.dtype("int32"), 8: np.dtype("int64")}
# Bytes per element of every dtype name the format knows (torch's names), so that reading a
# store's metadata needs no torch import.
ITEMSIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
             "float8_e5m2": 1}


class _TorchDtypes(NamedTuple):
    by_name: dict[str, torch.dtype]
    by_dtype: dict[torch.dtype, str]
    bits: dict[int, torch.dtype]  # the same-width integer dtype raw bits are viewed as


@functools.cache
def _torch_dtypes() -> _TorchDtypes:
    import torch

    by_name = {n: getattr(torch, n) for n in ITEMSIZES if hasattr(torch, n)}
    return _TorchDtypes(by_name, {v: k for k, v in by_name.items()},
                        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # {dtype name: torch.dtype}, built on first use (it imports torch)
        return _torch_dtypes().by_name
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _torch_dtypes().by_dtype[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"dtype {dtype} is not supported; supported: {', '.join(_torch_dtypes().by_name)}"
        ) from None


def itemsize(name: str) -> int:
    return ITEMSIZES[name]


def bits_numpy_dtype(name: str) -> np.dtype:
    """The unsigned dtype of the zarr array that stores ``name``'s raw bits."""
    return _BITS_NUMPY[itemsize(name)]


def to_bits(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s raw bits as a same-width integer tensor (no copy)."""
    return t.contiguous().view(_torch_dtypes().bits[t.element_size()])


def bits_to_numpy(bits: torch.Tensor) -> np.ndarray:
    """Host bits tensor -> unsigned numpy view (no copy)."""
    return bits.numpy().view(_BITS_NUMPY[bits.element_size()])


def numpy_to_tensor(bits: np.ndarray, name: str) -> torch.Tensor:
    """Unsigned numpy bits -> tensor of dtype ``name`` sharing its memory."""
    # (np.ascontiguousarray would turn a 0-d array into 1-d)
    import torch

    signed = (bits if bits.flags.c_contiguous else bits.copy()).view(_TORCHABLE_NUMPY[bits.dtype.itemsize])
    return torch.from_numpy(signed).view(_torch_dtypes().by_name[name])


def host_empty(shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
    """An uninitialized host array in memory from torch's allocator: what reads decode into,
    and the codec threads' scratch buffers.

    numpy asks the kernel for huge pages for arrays of 4 MiB and up; on a VM that hands freed
    memory back to its host, their first touch in a fresh process (a resume) cost 3x the time
    of small pages, which torch's tensors, torch.load's included, get (measured, a 1 GiB state
    loaded in a fresh process on this project's 2-core VM: full step 2.0 s, 0.83 s; torch.load
    1.0 s). Where huge pages are cheap, ``THP_MEM_ALLOC_ENABLE=1`` asks them of torch, for
    these buffers as for every tensor."""
    import torch

    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    return torch.empty(n * dtype.itemsize, dtype=torch.uint8).numpy().view(dtype).reshape(shape)


#: Linux's ``madvise(MADV_POPULATE_WRITE)`` (5.14 and later)
_POPULATE_WRITE = 23
_madvise: Any = None  # (libc's, once looked up; False where there is none or the kernel refuses)


def populate(a: np.ndarray) -> None:
    """Fault in the pages of ``a`` (contiguous, about to be written whole) with one call, rather
    than one trap per page as a decoder first writes each: a fresh process's load writes into
    fresh memory (measured, 512 MiB of fresh tensor memory on this project's 2-core VM: 0.13-0.17
    s of system time populated, 0.19-0.25 s faulted page by page). Does nothing where the
    platform or the kernel has no such call."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            import ctypes

            f = ctypes.CDLL(None, use_errno=True).madvise
            f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _madvise = f
    if not _madvise:
        return
    start = -(-a.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE  # (whole pages of ``a`` only)
    end = (a.ctypes.data + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and _madvise(start, end - start, _POPULATE_WRITE) != 0:
        _madvise = False  # (an older kernel: EINVAL)


