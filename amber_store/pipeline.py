"""Device encoding and the writes behind it: state dict -> encoded host buffers -> zarr store.

:func:`encode` runs on the tensor's own device with torch ops (the XOR delta, the "did anything
change" test), and moves only the encoded bits to host. :class:`Writer` streams those buffers
into zarr from a small thread pool while the caller encodes the next tensor, holding at most
``max_inflight_bytes`` of encoded data so host memory stays bounded.
"""

from __future__ import annotations

import contextvars
import json
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch
from zarr.core.array import AsyncArray
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import StorePath, WrapperStore

from .codecs import XorDeltaCodec, storage_codecs
from .format import (
    TensorEntry,
    array_metadata,
    bits_to_numpy,
    chunk_grid,
    chunk_slices,
    choose_chunks,
    dtype_name,
    iter_chunk_indices,
    to_bits,
)


@dataclass
class Base:
    """The materialized value of one tensor, as host bits, and the entry that stores it.

    ``entry`` is ``full`` or ``xor`` (never ``same``) and belongs to ``step``: a delta against
    this base names the step whose array actually holds the data, so chains skip steps that
    changed nothing (and deleting those steps breaks nothing).
    """

    step: int
    entry: TensorEntry
    bits: torch.Tensor


@dataclass
class Encoded:
    """One tensor ready to write: its manifest entry, the bits to store, and its new base."""

    key: str
    entry: TensorEntry
    data: np.ndarray | None
    value: torch.Tensor
    metadata: dict[str, Any] | None


def chunk_crcs(bits: torch.Tensor, chunks: tuple[int, ...]) -> list[int]:
    """crc32c of each chunk of host ``bits`` (in-bounds part, C order, little-endian)."""
    arr = bits_to_numpy(bits)
    shape = tuple(arr.shape)
    return [
        crc32c.crc32c(np.ascontiguousarray(arr[chunk_slices(i, shape, chunks)]).data)
        for i in iter_chunk_indices(chunk_grid(shape, chunks))
    ]


def encode(
    key: str,
    tensor: torch.Tensor,
    base: Base | None,
    *,
    step: int,
    group: str,
    chunk_bytes: int,
    level: int,
    chunks: tuple[int, ...] | None = None,
) -> Encoded:
    """Encode one tensor of step ``step`` against ``base`` (``None``: write it full).

    A base whose shape or dtype differs is ignored: that tensor is written full, in ``chunks``
    if given, else in chunks of about ``chunk_bytes``.
    """
    tensor = tensor.detach()
    name = dtype_name(tensor.dtype)
    shape = tuple(tensor.shape)
    bits = to_bits(tensor)
    if base is not None and (base.entry.dtype != name or tuple(base.entry.shape) != shape):
        base = None
    array = f"{group}/{key}"
    nbytes = tensor.numel() * tensor.element_size()
    if base is None:
        chunks = chunks or choose_chunks(shape, tensor.element_size(), chunk_bytes)
        value = bits.to("cpu", copy=True)
        entry = TensorEntry(name, list(shape), list(chunks), "full", None, array, chunk_crcs(value, chunks), nbytes)
        codecs = storage_codecs(name, level, None)
        attrs = {"dtype": name, "step": step, "encoding": "full"}
        return Encoded(key, entry, bits_to_numpy(value), value, array_metadata(name, shape, chunks, codecs, attrs))

    chunks = tuple(base.entry.chunks)
    delta = XorDeltaCodec.diff(bits, base.bits)
    if not bool(delta.any()):
        entry = TensorEntry(name, list(shape), list(chunks), "same", base.step, None, base.entry.crc32c, nbytes)
        return Encoded(key, entry, None, base.bits, None)
    delta_host = delta.to("cpu")
    value = torch.bitwise_xor(base.bits, delta_host)
    assert base.entry.array is not None, "a base entry must hold data (full or xor)"
    codec = XorDeltaCodec(base_step=base.step, base_array=base.entry.array)
    entry = TensorEntry(name, list(shape), list(chunks), "xor", base.step, array, chunk_crcs(value, chunks), nbytes)
    attrs = {"dtype": name, "step": step, "encoding": "xor", "base_step": base.step}
    meta = array_metadata(name, shape, chunks, storage_codecs(name, level, codec), attrs)
    return Encoded(key, entry, bits_to_numpy(delta_host), value, meta)


# Bytes written per key, for the write in progress; set inside each write coroutine so every
# task zarr spawns for it inherits the right ledger.
_LEDGER: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("amber_ledger", default=None)


class AccountingStore(WrapperStore[Any]):
    """Passes everything through; records the size of each object written into the ledger."""

    async def set(self, key: str, value: Buffer) -> None:
        await self._store.set(key, value)
        ledger = _LEDGER.get()
        if ledger is not None:
            ledger[key] = len(value)


def json_buffer(obj: Any) -> Buffer:
    return default_buffer_prototype().buffer.from_bytes(json.dumps(obj, indent=1).encode())


async def write_encoded(store: AccountingStore, enc: Encoded) -> int:
    """Write one encoded tensor (metadata, then chunks); returns the bytes stored."""
    ledger: dict[str, int] = {}
    _LEDGER.set(ledger)
    assert enc.metadata is not None and enc.entry.array is not None
    await store.set(f"{enc.entry.array}/zarr.json", json_buffer(enc.metadata))
    arr = AsyncArray(enc.metadata, StorePath(store, enc.entry.array), config={"write_empty_chunks": False})
    await arr.setitem(Ellipsis, enc.data)
    return sum(ledger.values())


class Writer:
    """Writes encoded tensors in the background with bounded in-flight bytes."""

    def __init__(self, store: AccountingStore, *, workers: int = 2, max_inflight_bytes: int = 1 << 30):
        self._store = store
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="amber-write")
        self._max = max_inflight_bytes
        self._pending: dict[Future[int], tuple[Encoded, int]] = {}
        self._inflight = 0
        self._done: list[Encoded] = []

    def submit(self, enc: Encoded) -> None:
        if enc.data is None:
            self._done.append(enc)
            return
        size = enc.data.nbytes
        while self._pending and self._inflight + size > self._max:
            self._reap(FIRST_COMPLETED)
        fut = self._pool.submit(self._write, enc)
        self._pending[fut] = (enc, size)
        self._inflight += size

    def _write(self, enc: Encoded) -> int:
        # The coroutine is made here, in the worker, so a cancelled write leaves none unawaited.
        return sync(write_encoded(self._store, enc))

    def _reap(self, how: str) -> None:
        done, _ = wait(list(self._pending), return_when=how)
        for fut in done:
            enc, size = self._pending.pop(fut)
            self._inflight -= size
            enc.entry.stored = fut.result()
            self._done.append(enc)

    def finish(self) -> list[Encoded]:
        """Wait for every write. On the first failure, writes not started are cancelled, the
        running ones finish, and the failure is raised."""
        try:
            while self._pending:
                self._reap(FIRST_COMPLETED)
            return self._done
        finally:
            self.close()

    def close(self) -> None:
        for fut in self._pending:
            fut.cancel()
        self._pool.shutdown(wait=True)
        self._pending.clear()
