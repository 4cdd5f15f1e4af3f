"""Where a process keeps the values its next saves diff against (``base_cache``).

A delta save diffs each tensor against its value at the base step. Keeping those values saves
reading them back from the store, but they are as large as the state, so the store option
``base_cache`` picks where they live:

- ``"spill"`` (default): in a local spill file (an unnamed temporary file under ``spill_dir``,
  default ``$TMPDIR``: gone with the process), written as a save encodes each chunk and read
  back by chunk with ``pread``, never mapped. The kernel's page cache holds what fits and gives
  it back under memory pressure; the process itself holds a few chunks. Costs a write and a read
  of the state through the page cache per save, and the state's size on the spill disk per kept
  base (two during a delta save).
- ``"memory"``: in host memory, in buffers reused from save to save: the fastest saves, and
  the state's size resident for as long as the store is open.
- ``"none"``: nothing kept; a delta save reads each base back from the store, a tensor at a
  time, as it reaches that tensor.

A value is a tensor's raw bits (:func:`~amber_store.format.to_bits`) held as :class:`Bits`:
:class:`Resident` (a host tensor), :class:`Spilled` (a region of a spill file) or
:class:`Stored` (read from the store when asked). A save writes its tensors' new bits through a
:class:`Keeper` (one a save) that the :class:`BaseCache` hands out; the values of a committed
step join the cache while a later save may diff against them.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import numpy as np
import torch

from .codecs import scratch
from .errors import warn
from .format import TensorEntry, bits_to_numpy, host_empty

BaseCacheMode = Literal["spill", "memory", "none"]
BASE_CACHES = ("spill", "memory", "none")

_SPILL_SLOT = 4  # this module's scratch slot (codecs' temporaries take 1-3, stored chunks 0)
_ALIGN = 4096


class Bits(Protocol):
    """A tensor's raw bits, held somewhere: whole, or flat elements ``[a, b)`` at a time."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def whole(self) -> torch.Tensor:
        """The bits as a host tensor (a spilled or stored one is read now, into a new tensor)."""
        ...

    def chunk(self, a: int, b: int) -> np.ndarray:
        """Flat elements ``[a, b)``; a spilled one's are valid until this thread's next chunk."""
        ...


@dataclass(frozen=True)
class Resident:
    """Bits in host memory."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def whole(self) -> torch.Tensor:
        return self.tensor

    def chunk(self, a: int, b: int) -> np.ndarray:
        return bits_to_numpy(self.tensor).reshape(-1)[a:b]

    def fill(self, a: int, values: np.ndarray) -> None:
        np.copyto(bits_to_numpy(self.tensor).reshape(-1)[a: a + values.size], values)


class SpillFile:
    """An unnamed temporary file (unlinked: the kernel frees it with the last reference) whose
    regions are handed out in order; closed when no :class:`Spilled` refers to it any more.
    ``failed``: a write to it failed (a full disk): what it holds is no base."""

    def __init__(self, directory: str | None) -> None:
        self._file = tempfile.TemporaryFile(dir=directory)
        self.fd = self._file.fileno()
        self.failed: OSError | None = None
        self._end = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> int:
        with self._lock:
            at = self._end
            self._end += -(-nbytes // _ALIGN) * _ALIGN
            return at

    def reuse(self) -> SpillFile:
        """This file, to be filled from its start again: its pages are still the kernel's to
        overwrite, where a new file's would be found anew (as slow as fresh memory on a VM)."""
        self._end, self.failed = 0, None
        return self


@dataclass(frozen=True)
class Spilled:
    """Bits in a region of a spill file, read and written by element ranges."""

    file: SpillFile
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def whole(self) -> torch.Tensor:
        out = host_empty(self.shape, _unsigned(self.dtype))
        _read_into(self.file.fd, memoryview(out.reshape(-1).view(np.uint8)), self.offset)
        return torch.from_numpy(out).view(self.dtype)

    def chunk(self, a: int, b: int) -> np.ndarray:
        width = self.dtype.itemsize
        buf = scratch((b - a) * width, _SPILL_SLOT)
        _read_into(self.file.fd, memoryview(buf), self.offset + a * width)
        return buf.view(_unsigned(self.dtype))

    def fill(self, a: int, values: np.ndarray) -> None:
        # A spill file is a cache: a failed write costs the next save a read of its bases, not
        # this save (the cache refuses the values of a failed file, see BaseCache.put).
        if self.file.failed is None:
            try:
                _write_from(self.file.fd, memoryview(np.ascontiguousarray(values)).cast("B"),
                            self.offset + a * self.dtype.itemsize)
            except OSError as e:
                self.file.failed = e


@dataclass(frozen=True)
class Stored:
    """Bits read back from the store when asked (``read()``: the whole tensor)."""

    entry: TensorEntry
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]

    def whole(self) -> torch.Tensor:
        return self.read()

    def chunk(self, a: int, b: int) -> np.ndarray:  # (the step writer reads a stored base whole)
        raise NotImplementedError("a stored base is read whole")


def _unsigned(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of bits of ``dtype``'s width (as :func:`~amber_store.format.bits_to_numpy`)."""
    return np.dtype(f"<u{dtype.itemsize}")


def _read_into(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"spill file: short read at {offset + done}")
        done += n


def _write_from(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwritev(fd, [buf[done:]], offset + done)


class Keeper:
    """Where one save puts its tensors' new bits: reused host buffers, or regions of a new spill
    file (created on first use, so a save that keeps nothing creates none)."""

    def __init__(self, cache: BaseCache) -> None:
        self._cache = cache
        self._file: SpillFile | None = None

    @property
    def spills(self) -> bool:
        return self._cache.mode == "spill"

    def new(self, key: str, like: torch.Tensor) -> Resident | Spilled:
        """A place for ``like``'s bits (shape, bits dtype), to be filled by element ranges."""
        if not self.spills:
            free = self.buffer(key, like)
            return Resident(free if free is not None else torch.empty(like.shape, dtype=like.dtype))
        file = self._spill()
        return Spilled(file, file.reserve(like.numel() * like.element_size()), tuple(like.shape), like.dtype)

    def buffer(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        """A free host buffer for ``like``'s bits to be computed into, when kept in memory."""
        return None if self.spills else self._cache.recycle(key, like)

    def hold(self, key: str, bits: torch.Tensor) -> Resident | Spilled:
        """``bits`` (a host tensor of its own, or one a later save may not change) kept."""
        if not self.spills:
            return Resident(bits)
        place = self.new(key, bits)
        place.fill(0, bits_to_numpy(bits).reshape(-1))
        return place

    def again(self, key: str, bits: Bits) -> Bits:
        """A base's bits kept again for this save (a tensor that did not change): a spilled one
        is copied into this save's file (by the kernel), so that old files do not stay alive
        for a few tensors each."""
        if not (self.spills and isinstance(bits, Spilled)):
            return bits
        to = self._spill()
        at = to.reserve(bits.nbytes)
        done = 0
        try:
            while done < bits.nbytes:
                n = os.copy_file_range(bits.file.fd, to.fd, bits.nbytes - done, bits.offset + done, at + done)
                if n <= 0:
                    raise OSError("spill file: short copy")
                done += n
        except OSError as e:
            to.failed = e
        return Spilled(to, at, bits.shape, bits.dtype)

    def _spill(self) -> SpillFile:
        if self._file is None:
            self._file = self._cache.spill_file()
        return self._file


class BaseCache:
    """The values of the steps later saves may diff against, held as ``mode`` says (see the
    module); host buffers of steps that can no longer be a base are reused by the next save."""

    def __init__(self, mode: BaseCacheMode = "spill", spill_dir: str | None = None) -> None:
        if mode not in BASE_CACHES:
            raise ValueError(f"base_cache must be one of {', '.join(BASE_CACHES)}, not {mode!r}")
        self.mode = mode
        self.spill_dir = spill_dir
        self._steps: dict[int, dict[str, Bits]] = {}
        self._free: dict[str, list[torch.Tensor]] = {}
        self._free_files: list[SpillFile] = []
        self._lock = threading.Lock()

    def keeper(self) -> Keeper | None:
        """Where a save keeps its values (``None``: it keeps none)."""
        return None if self.mode == "none" else Keeper(self)

    def get(self, step: int, key: str) -> Bits | None:
        with self._lock:
            return self._steps.get(step, {}).get(key)

    def put(self, step: int, values: dict[str, Bits]) -> None:
        if self.mode == "none":
            return
        failed = next((b.file.failed for b in values.values() if isinstance(b, Spilled) and b.file.failed), None)
        if failed is not None:
            warn(f"the values of step {step} could not be spilled ({failed}): the next save reads its bases back "
                 "from the store")
            return
        with self._lock:
            self._steps[step] = values

    def keep(self, steps: set[int]) -> None:
        """Forget every other step; reuse the host buffers and spill files no kept step shares.
        (Saves of one store run one at a time: a step dropped here is no base of a save still
        running.)"""
        with self._lock:
            kept = [b for s in steps for b in self._steps.get(s, {}).values()]
            live = {id(b.tensor) for b in kept if isinstance(b, Resident)}
            live |= {id(b.file) for b in kept if isinstance(b, Spilled)}
            for step in [s for s in self._steps if s not in steps]:
                for key, b in self._steps.pop(step).items():
                    if isinstance(b, Resident) and id(b.tensor) not in live and b.tensor.is_cpu:
                        live.add(id(b.tensor))
                        self._free.setdefault(key, []).append(b.tensor)
                    elif isinstance(b, Spilled) and id(b.file) not in live:
                        live.add(id(b.file))
                        self._free_files.append(b.file)

    def spill_file(self) -> SpillFile:
        """A spill file for a save: one no kept step uses any more, else a new one."""
        with self._lock:
            if self._free_files:
                return self._free_files.pop().reuse()
        return SpillFile(self.spill_dir)

    def recycle(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        """A free host buffer of ``like``'s shape and dtype for ``key``'s new bits, if any."""
        with self._lock:
            free = self._free.get(key, [])
            for i, t in enumerate(free):
                if t.shape == like.shape and t.dtype == like.dtype:
                    return free.pop(i)
        return None

    def clear(self) -> None:
        """Drop every value and buffer (their memory, or spill files, go back)."""
        with self._lock:
            self._steps.clear()
            self._free.clear()
            self._free_files.clear()
