"""Device encoding and the writes behind it: state dict -> encoded host buffers -> zarr store.

:func:`encode` runs on the tensor's own device with torch ops (the XOR delta, the "did anything
change" test), and moves only the encoded bits to host. :class:`Writer` streams those buffers
into zarr from a small thread pool while the caller encodes the next tensor, holding at most
``max_inflight_bytes`` of encoded data so host memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from zarr.core.array import AsyncArray
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import StorePath, WrapperStore

from .errors import AsyncSaveError
from .codecs import DeltaCodec, QuantizedDeltaCodec, XorDeltaCodec, storage_codecs
from .format import (
    TensorEntry,
    array_metadata,
    bits_to_numpy,
    choose_chunks,
    dtype_name,
    region_crcs,
    to_bits,
    whole,
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
    return [crc for _, _, crc in region_crcs(arr, whole(shape), shape, chunks)]


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
    codec: DeltaCodec | None = None,
) -> Encoded:
    """Encode one tensor of step ``step`` against ``base`` (``None``: write it full) with
    ``codec`` (default lossless XOR), on the tensor's device.

    A base whose shape or dtype differs is ignored: that tensor is written full, in ``chunks``
    if given, else in chunks of about ``chunk_bytes``.
    """
    tensor = tensor.detach()
    name = dtype_name(tensor.dtype)
    shape = tuple(tensor.shape)
    if base is not None and (base.entry.dtype != name or tuple(base.entry.shape) != shape):
        base = None
    array = f"{group}/{key}"
    nbytes = tensor.numel() * tensor.element_size()
    if base is None:
        chunks = chunks or choose_chunks(shape, tensor.element_size(), chunk_bytes)
        value = to_bits(tensor).to("cpu", copy=True)
        entry = TensorEntry(name, list(shape), list(chunks), "full", None, array, chunk_crcs(value, chunks), nbytes)
        codecs = storage_codecs(name, level, None)
        attrs = {"dtype": name, "step": step, "encoding": "full"}
        return Encoded(key, entry, bits_to_numpy(value), value, array_metadata(name, shape, chunks, codecs, attrs))

    chunks = tuple(base.entry.chunks)
    assert base.entry.array is not None, "a base entry must hold data (full or xor)"
    codec = (codec or XorDeltaCodec()).with_base(base.step, base.entry.array)
    delta = codec.diff(tensor, base.bits, chunks)
    if delta is None:
        entry = TensorEntry(name, list(shape), list(chunks), "same", base.step, None, base.entry.crc32c, nbytes)
        return Encoded(key, entry, None, base.bits, None)
    if isinstance(codec, QuantizedDeltaCodec) and delta.params is None:
        codec = XorDeltaCodec(base.step, base.entry.array)  # fell back: the delta is an XOR
    entry = TensorEntry(name, list(shape), list(chunks), codec.encoding, base.step, array,  # type: ignore[arg-type]
                        chunk_crcs(delta.recon, chunks), nbytes, params=delta.params)
    attrs = {"dtype": name, "step": step, "encoding": codec.encoding, "base_step": base.step}
    meta = array_metadata(name, shape, chunks, storage_codecs(name, level, codec), attrs,
                          data_type=codec.storage_dtype(name).name)
    return Encoded(key, entry, delta.data, delta.recon, meta)


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


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


class Writer:
    """Writes encoded tensors on zarr's event loop while the caller encodes the next ones.

    At most ``concurrency`` tensors and ``max_inflight_bytes`` of encoded data are in flight;
    :meth:`submit` waits beyond that. Writes go straight to zarr's loop rather than through a
    thread per write blocking in ``sync()``: on this 2-core machine those threads only
    contended for the GIL (saves of many small tensors were 10-30% slower, noisily).
    """

    def __init__(self, store: AccountingStore, *, concurrency: int = 64, max_inflight_bytes: int = 1 << 30):
        self._store = store
        self._loop = sync(_running_loop())
        self._concurrency = max(1, concurrency)
        self._max = max_inflight_bytes
        self._pending: dict[Future[int], tuple[Encoded, int]] = {}
        self._inflight = 0
        self._done: list[Encoded] = []
        self._failure: BaseException | None = None

    def submit(self, enc: Encoded) -> None:
        if self._failure is not None:
            raise self._failure
        if enc.data is None:
            self._done.append(enc)
            return
        size = enc.data.nbytes
        while self._pending and (self._inflight + size > self._max or len(self._pending) >= self._concurrency):
            self._reap()
        fut = asyncio.run_coroutine_threadsafe(write_encoded(self._store, enc), self._loop)
        self._pending[fut] = (enc, size)
        self._inflight += size

    def _reap(self) -> None:
        done, _ = wait(list(self._pending), return_when=FIRST_COMPLETED)
        for fut in done:
            enc, size = self._pending.pop(fut)
            self._inflight -= size
            if fut.exception() is not None:
                self._failure = self._failure or fut.exception()
            else:
                enc.entry.stored = fut.result()
                self._done.append(enc)

    def finish(self) -> list[Encoded]:
        """Wait for every write; if any failed, raise the first failure once all settled
        (so no write of this attempt is still running when the save reports its failure)."""
        while self._pending:
            self._reap()
        if self._failure is not None:
            raise self._failure
        return self._done

    def close(self) -> None:
        """Let writes still in flight settle (after an error elsewhere in the save)."""
        wait(list(self._pending))
        self._pending.clear()


class Snapshots:
    """Consistent copies of a state's tensors in reusable buffers, so an async save can return
    while training goes on updating the originals.

    ``where="host"`` (default) copies to host memory (pinned for accelerator tensors): the
    smallest stall and no extra device memory; deltas are then encoded on the host.
    ``where="device"`` copies on the tensor's own device, so deltas are encoded there and only
    encoded bytes cross to the host, at the price of one more copy of the state in device
    memory.
    """

    def __init__(self, where: str = "host") -> None:
        if where not in ("host", "device"):
            raise ValueError(f"snapshot must be 'host' or 'device', not {where!r}")
        self.where = where
        self._free: list[dict[str, torch.Tensor]] = []
        self._lock = threading.Lock()

    def take(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with self._lock:
            buffers = self._free.pop() if self._free else {}
        out = {}
        for key, t in tensors.items():
            t = t.detach()
            buf = buffers.get(key)
            on_device = t.device.type != "cpu"
            device = t.device if self.where == "device" else torch.device("cpu")
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != device:
                pin = on_device and device.type == "cpu"
                buf = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
            buf.copy_(t, non_blocking=on_device)
            out[key] = buf
        for device in {t.device for t in tensors.values() if t.device.type != "cpu"}:
            getattr(torch, device.type).synchronize(device)  # the copies above were asynchronous
        return out

    def give_back(self, buffers: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._free.append(buffers)


class Background:
    """Runs saves one after another on a background thread, at most ``max_pending`` at once.

    A submit blocks while ``max_pending`` saves are unfinished (back-pressure). A failure is
    set on that save's future and kept until :meth:`raise_failure` reports it, so it is never
    silently lost.
    """

    def __init__(self, max_pending: int = 1) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="amber-save")
        self._slots = threading.Semaphore(max_pending)
        self._pending: set[Future[Any]] = set()
        self._failure: tuple[int, BaseException] | None = None
        self._lock = threading.Lock()

    def reserve(self) -> None:
        """Wait for a free slot; call before taking the snapshot a save will own."""
        self._slots.acquire()

    def release(self) -> None:
        self._slots.release()

    def submit(self, step: int, work: Any, cleanup: Any) -> Future[Any]:
        fut = self._pool.submit(work)
        with self._lock:
            self._pending.add(fut)

        def done(f: Future[Any]) -> None:
            cleanup()
            with self._lock:
                self._pending.discard(f)
                if f.exception() is not None and self._failure is None:
                    self._failure = (step, f.exception())  # type: ignore[assignment]
            self._slots.release()

        fut.add_done_callback(done)
        return fut

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            step, err = failure
            raise AsyncSaveError(f"the background save of step {step} failed: {err}", step=step) from err

    def wait(self) -> None:
        """Wait for every submitted save, then raise the first failure not yet reported."""
        with self._lock:
            pending = list(self._pending)
        wait(pending)
        self.raise_failure()

    def close(self) -> None:
        """Stop the thread once queued saves are done (their failures stay on their futures)."""
        self._pool.shutdown(wait=True)
