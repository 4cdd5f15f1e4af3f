"""The step writer: the tensors of one step -> encoded chunks -> a few objects.

A :class:`StepWriter` turns the tensors of one step into stored objects: tensors below the pack
threshold go, whole, into one *pack* stream per step; every larger tensor becomes one *shard*
object holding its chunks and an index (zarr v3 ``sharding_indexed``). Chunks are diffed against
the base, checksummed and compressed on :func:`~amber_store.runtime.codec_pool`'s threads (all
release the GIL), straight from the tensor's memory into reused buffers. Deltas of tensors on an
accelerator, lossless or lossy, are computed there with torch; what crosses to the host (the
delta, and the reconstruction kept as the next save's base) lands in pinned memory
(:func:`~amber_store.codecs.to_host`), at the link's speed. Objects are written on the event loop
while the next tensors encode, at most ``max_inflight_bytes`` of them at once.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import threading
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar, Union

import crc32c
import numpy as np
import torch

from . import format as fmt
from .codecs import DELTA_ENCODINGS, Compression, Delta, DeltaCodec, HostDiff, codec_named, scratch, to_host
from .format import TensorEntry, bits_numpy_dtype, bits_to_numpy, dtype_name, itemsize, to_bits
from .bases import Bits, Keeper, Resident, Spilled
from .options import Options
from .runtime import CODEC_THREADS, codec_pool, event_loop

T = TypeVar("T")


@dataclass
class Base:
    """The materialized value of one tensor, as host bits wherever they are kept
    (:mod:`~amber_store.bases`), and the entry that stores it.

    ``entry`` is never ``same`` and belongs to ``step``: a delta against this base names the
    step whose data actually holds it, so chains skip steps that changed nothing.
    """

    step: int
    entry: TensorEntry
    bits: Bits


@dataclass
class Written:
    """What a step writer produced: manifest entries and packs, each tensor's new materialized
    bits (the next base), the consolidated array metadata and every object key written."""

    entries: dict[str, TensorEntry] = field(default_factory=dict)
    values: dict[str, Bits] = field(default_factory=dict)
    packs: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)


def _padded(data: np.ndarray, length: int) -> np.ndarray:
    """``data`` (flat) zero-padded to ``length`` elements: an edge chunk is stored whole."""
    if data.size == length:
        return data
    out = np.zeros(length, dtype=data.dtype)
    out[: data.size] = data
    return out


@functools.lru_cache(maxsize=64)
def _zeros_crc(nbytes: int) -> int:
    return crc32c.crc32c(bytes(nbytes))


#: a stored chunk: its parts (``None``: not stored) and the crc32c of its materialized bits
_Chunk = tuple[Union[list[bytes], None], int]


def _lossless_chunk(codec: DeltaCodec, value: np.ndarray, base: np.ndarray | None, base_crc: int | None,
                    padded: int, compression: Compression, typesize: int) -> _Chunk:
    """One chunk of a full step (no ``base``) or of a lossless delta (``codec``): (stored
    parts, or ``None`` when all zero; crc32c of the materialized bits). A chunk whose crc32c
    differs from its base's (or, in a full step, from zeros') has changed: only an equal crc32c
    costs a comparison pass."""
    crc = crc32c.crc32c(value)
    if _unchanged(value, base, crc, base_crc):
        return None, crc
    if base is None:
        return compression.compress(_padded(value, padded), typesize, None), crc
    assert isinstance(codec, HostDiff)  # (a delta taken on the host: see StepWriter.add)
    data = scratch(value.nbytes).view(value.dtype)
    codec.encode_into(data, value, base)
    return compression.compress(codec.serialize(_padded(data, padded), None, value), typesize, codec), crc


def _unchanged(value: np.ndarray, base: np.ndarray | None, crc: int, base_crc: int | None) -> bool:
    """Whether ``value`` (crc32c ``crc``) equals ``base`` (``None``: zeros, which a full step
    starts from). Only an equal crc32c costs a comparison pass."""
    if base is None:
        return crc == _zeros_crc(value.nbytes) and not value.any()
    return (base_crc is None or crc == base_crc) and np.array_equal(value, base)


def _delta_chunks(codec: DeltaCodec, delta: Delta, first: int, recon: np.ndarray, runs: list[tuple[int, int]],
                  padded: int, compression: Compression, typesize: int) -> list[_Chunk]:
    """Chunks ``runs`` of a precomputed delta (a lossless one from the device, or a lossy codec's;
    ``first``: the index of the first) serialized together
    (:meth:`~amber_store.codecs.DeltaCodec.serialize_run`): each one's stored parts (``None``:
    all zero, not stored) and the crc32c of its reconstruction."""
    recons = [recon[a:b] for a, b in runs]
    payloads = codec.serialize_run(delta, first, runs, padded, recons)
    return [(None if p is None else compression.compress(p, typesize, codec), crc32c.crc32c(r))
            for p, r in zip(payloads, recons)]


def piece_chunks(codec: DeltaCodec, padded: int, compression: Compression, typesize: int, delta: Delta,
                 runs: list[tuple[int, int]]) -> list[_Chunk]:
    """:func:`_delta_chunks` of a piece of a delta, as a :data:`~amber_store.codecs.Finish`
    (bound to its first four arguments): a host diff serializes each piece on the thread
    that took it, while it is in the CPU's cache, and both cores share the entropy coders
    that hold the GIL with the diff's kernels that do not."""
    return _delta_chunks(codec, delta, 0, bits_to_numpy(delta.recon).reshape(-1), runs, padded, compression, typesize)


def _resolved(value: T) -> Future[T]:
    done: Future[T] = Future()
    done.set_result(value)
    return done


def submit_delta(pool: ThreadPoolExecutor, codec: DeltaCodec, delta: Delta, recon: np.ndarray,
                 runs: list[tuple[int, int]], padded: int, compression: Compression,
                 typesize: int) -> list[Future[list[_Chunk]]]:
    """:func:`_delta_chunks` of a tensor's chunks (``runs``) on ``pool``, unless the diff did it
    (:attr:`~amber_store.codecs.Delta.encoded`, by :func:`piece_chunks`): a job per run of
    chunks, two runs per thread (serializing, the entropy coding, is mostly per-call overhead
    under the GIL, which a run of chunks shares). An entropy-coded delta of fewer chunks is
    serialized here: its coder holds the GIL, so on a codec thread it would only stall the
    caller's next diff, whose every torch call waits for the GIL (measured on a 3.2M-parameter
    GPT's lossy delta step, one chunk a tensor: 0.94-0.96x the time serialized here)."""
    if delta.encoded is not None:
        return [_resolved(chunks) for chunks in delta.encoded]
    if codec.entropy_coded and len(runs) < 2 * CODEC_THREADS:
        return [_resolved(_delta_chunks(codec, delta, 0, recon, runs, padded, compression, typesize))]
    size = -(-len(runs) // (2 * CODEC_THREADS))
    return [pool.submit(_delta_chunks, codec, delta, k, recon, runs[k: k + size], padded, compression, typesize)
            for k in range(0, len(runs), size)]


def _lossless_chunks(codec: DeltaCodec, src: np.ndarray, ref: Bits | None, crcs: list[int | None],
                     new: Resident | Spilled | None, runs: list[tuple[int, int]], padded: int,
                     compression: Compression, typesize: int) -> list[_Chunk]:
    """:func:`_lossless_chunk` of the chunks ``runs`` of flat ``src`` (``ref``: the base, read by
    chunk; ``new``: where the new base is kept, written by chunk; ``crcs``: the base's crc32c
    per chunk)."""
    out = []
    for (a, b), crc in zip(runs, crcs):
        if new is not None:
            new.fill(a, src[a:b])
        out.append(_lossless_chunk(codec, src[a:b], None if ref is None else ref.chunk(a, b), crc, padded,
                                   compression, typesize))
    return out


def _shard(blobs: list[list[bytes] | None]) -> tuple[list[list[int] | None], list[bytes], int]:
    """A shard object of the stored chunks ``blobs`` (each a list of parts; ``None``: not
    stored): each chunk's ``[offset, nbytes]``, the parts of the object (the chunks end to end,
    then the index) and the chunks' total size."""
    index: list[list[int] | None] = []
    parts: list[bytes] = []
    offset = 0
    for blob in blobs:
        if blob is None:
            index.append(None)
            continue
        size = sum(len(p) for p in blob)
        index.append([offset, size])
        parts += blob
        offset += size
    return index, parts + [fmt.shard_index(index)], offset


#: bytes of small tensors diffed together (:meth:`StepWriter._diff_batch`)
BATCH_BYTES = 4 << 20


@dataclass
class _Small:
    """A small tensor waiting for its batch's diff."""

    key: str
    tensor: torch.Tensor
    base: Base
    chunks: tuple[int, ...]
    keep: bool


@dataclass
class _Batch:
    """Small tensors of one codec and dtype waiting to be diffed together."""

    items: list[_Small] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Pending:
    """A large tensor whose chunks are encoding."""

    key: str
    entry: TensorEntry
    chunks: list[Future[list[_Chunk]]]  # runs of its chunks, in order
    nbytes: int


class _Parts:
    """Pack part buffers to fill again: a fresh one faults in its pages as it is written (for
    2,000 tensors of 25 KB, ~15% of the time spent adding them). Keeps at most ``keep`` idle."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            for i, part in enumerate(self._free):
                if part.size == size:
                    return self._free.pop(i)
        return np.empty(size, np.uint8)

    def give(self, part: np.ndarray, _: object = None) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(part)


_PARTS = _Parts(keep=min(CODEC_THREADS, 6) + 2)  # parts compressing at once, the one filling (8 MiB of default parts)


class _PackStream:
    """A step's small tensors one after the other (the pack array), compressed part by part
    as the parts fill, beside the encoding of the tensors that follow (one thread encodes them).

    Parts are ``size`` bytes, zarr's inner chunks of the pack: the last one is stored whole,
    zero-padded (zstd and lz4 store a zero run almost free), and a stream of a single part is
    stored at its own length rounded up. Each part is compressed as what most of it holds: raw
    values (lz4, bit-shuffled) when all its tensors are full, else as the deltas of the codec
    that stored most of its delta bytes, with the element width of most of its bytes as the
    shuffle's type size (a blosc frame names both, so the pack's metadata records those of the
    whole pack). Each tensor starts at a multiple of
    :data:`~amber_store.format.PACK_ALIGN` bytes, so that no element straddles the shuffle's
    lanes after a tensor of an odd size, and parts are multiples of it (below).
    """

    def __init__(self, size: int, pool: ThreadPoolExecutor, compression: Compression) -> None:
        self.size = fmt.round_up(size, fmt.PACK_ALIGN)
        self.length = 0
        self.entries: list[TensorEntry] = []
        self.widths: Counter[int] = Counter()  # element width -> bytes, over the whole pack
        self.deltas: Counter[str] = Counter()  # delta encoding -> bytes, over the whole pack
        self._pool = pool
        self._compression = compression
        self._jobs: list[Future[list[bytes]]] = []
        self._part: np.ndarray | None = None
        self._fill = 0
        self._part_widths: Counter[int] = Counter()
        self._part_deltas: Counter[str] = Counter()

    def append(self, entry: TensorEntry, data: np.ndarray, width: int) -> int:
        """Add one tensor's stored bytes (uint8); returns their offset in the stream."""
        gap = fmt.round_up(self.length, fmt.PACK_ALIGN) - self.length
        if gap:
            self._write(np.zeros(gap, np.uint8), width, None)
        offset = self.length
        self.entries.append(entry)
        self.widths[width] += data.size
        delta = None if entry.base is None else entry.encoding
        if delta is not None:
            self.deltas[delta] += data.size
        self._write(data, width, delta)
        return offset

    def _write(self, data: np.ndarray, width: int, delta: str | None) -> None:
        self.length += data.size
        done = 0
        while done < data.size:
            if self._part is None:
                self._part, self._fill = _PARTS.take(self.size), 0
                self._part_widths, self._part_deltas = Counter(), Counter()
            n = min(data.size - done, self.size - self._fill)
            self._part[self._fill: self._fill + n] = data[done: done + n]
            self._fill += n
            done += n
            self._part_widths[width] += n
            if delta is not None:
                self._part_deltas[delta] += n
            if self._fill == self.size:
                self._submit(self._part)

    def _submit(self, part: np.ndarray) -> None:
        typesize = _most(self._part_widths)
        kind = _compressed_as(self._part_deltas)
        job = self._pool.submit(self._compression.compress, part, typesize, kind, True)
        job.add_done_callback(functools.partial(_PARTS.give, self._part))  # compressed into new bytes
        self._jobs.append(job)
        self._part = None

    def finish(self) -> tuple[int, list[list[bytes] | None]]:
        """The inner chunk size and every compressed part, in order."""
        if self._part is not None:
            if not self._jobs:
                self.size = fmt.round_up(self._fill, fmt.PACK_ALIGN)
            self._part[self._fill: self.size] = 0
            self._submit(self._part[: self.size])
        return self.size, [job.result() for job in self._jobs]


def _most(tally: Counter[Any]) -> Any:
    """The key with the most bytes (the first such, on a tie)."""
    return tally.most_common(1)[0][0]


def _compressed_as(deltas: Counter[str]) -> DeltaCodec | None:
    """The codec whose compression settings suit a pack part with ``deltas`` (encoding ->
    bytes; none: raw values): the one with the most bytes, leaving out entropy-coded payloads
    unless the part holds nothing else (a compressor neither gains nor loses on them, while
    only framing the part would store its other deltas raw)."""
    if not deltas:
        return None
    plain = Counter({k: n for k, n in deltas.items() if not DELTA_ENCODINGS[k].entropy_coded}) or deltas
    return DELTA_ENCODINGS[_most(plain)]()


class StepWriter:
    """Encodes and writes the tensors of one step into the attempt group ``group``.

    ``put(key, parts)`` writes one object (its parts laid end to end, e.g.
    :meth:`~amber_store.storage.Backend.put_object`). ``add`` each tensor, then ``finish``; ``close``
    always (it lets writes in flight settle). ``options`` give the chunk size (``None`` picks by
    codec: :data:`~amber_store.format.DEFAULT_CHUNK_BYTES`, lossy: ``LOSSY_CHUNK_BYTES``; a
    pack's parts: ``PACK_CHUNK_BYTES``), the pack threshold, the compression and the bound on
    bytes in flight. ``keeper`` keeps each tensor's new bits as a later save's base (``None``:
    none are kept). Past ``deadline`` (``time.monotonic()``), waiting for
    writes raises :class:`TimeoutError` and ``close`` cancels the writes still in flight. Once
    ``stop`` is set (the save was interrupted), adding a tensor raises :class:`SaveStopped`.
    ``put_holds_copy``: ``put`` holds a copy of an object's parts until it is written (counted
    in flight too).
    """

    def __init__(self, put: Callable[[str, list[bytes]], Awaitable[None]], group: str, options: Options, *,
                 pack_name: str = fmt.PACK_PREFIX,
                 keeper: Keeper | None = None, deadline: float | None = None,
                 stop: threading.Event | None = None, put_holds_copy: bool = False) -> None:
        self._put_object = put
        self._put_holds_copy = put_holds_copy
        self._deadline = deadline
        self._stop = stop
        self._group = group
        self._chunk_bytes = options.chunk_bytes
        self._pack_threshold = options.pack_threshold
        self._compression = options.compression
        self._pack_name = pack_name
        self._max_inflight = options.max_inflight_bytes
        self._keeper = keeper
        self._loop = event_loop()
        self._pool = codec_pool()
        self._out = Written()
        self._pack = _PackStream(self._chunk_bytes or fmt.PACK_CHUNK_BYTES, self._pool, self._compression)
        self._encoding: deque[_Pending] = deque()
        self._writes: dict[Future[None], int] = {}
        self._inflight = 0
        self._batches: dict[tuple[DeltaCodec, torch.dtype], _Batch] = {}
        self._order: list[str] = []  # the tensors as added: batched ones are written later

    # --- adding tensors -------------------------------------------------------------------

    def add(self, key: str, tensor: torch.Tensor, base: Base | None, codec: DeltaCodec | None = None,
            layout: TensorEntry | None = None, keep: bool = True) -> None:
        """Encode ``tensor`` as ``key`` against ``base`` (``None``: full) with ``codec``
        (default: the lossless :class:`~amber_store.codecs.DiffDeltaCodec`). A base of another
        shape or dtype, or a format-2 base, is ignored: the tensor is then stored full.
        ``layout``: a format-3 entry whose chunking and packing to keep (retention rewrites
        steps that later deltas build on). ``keep``: whether the tensor's materialized value is
        returned (:attr:`Written.values`) as a later save's base; without it, a lossless tensor
        on the host is not copied at all."""
        if self._stop is not None and self._stop.is_set():
            raise SaveStopped(f"{self._group}: the save was given up before {key!r} was written")
        keep = keep and self._keeper is not None
        tensor = tensor.detach()
        name = dtype_name(tensor.dtype)
        shape = tuple(tensor.shape)
        if base is not None and (base.entry.dtype != name or tuple(base.entry.shape) != shape or base.entry.legacy):
            base = None
        layout = base.entry if base is not None else layout if layout is not None and not layout.legacy else None
        nbytes = tensor.numel() * tensor.element_size()
        packed = layout.pack is not None if layout is not None else (nbytes < self._pack_threshold or not shape)
        codec = codec or codec_named("lossless")
        if packed:
            chunks = tuple(max(1, s) for s in shape)
        elif layout is not None:
            chunks = tuple(layout.chunks)
        else:
            target = self._chunk_bytes or (fmt.DEFAULT_CHUNK_BYTES if codec.lossless else fmt.LOSSY_CHUNK_BYTES)
            chunks = fmt.choose_chunks(shape, tensor.element_size(), target)
        if base is not None:
            codec = codec.with_base(base.step, base.entry.array or "")
        self._order.append(key)
        if packed and base is not None and codec.batch_align and tensor.device.type == "cpu":
            # diffed with the other small tensors of its codec: a small tensor's diff is ~25
            # calls whose cost hardly depends on its size (a 3.2M-parameter GPT's 88 small
            # block-coded tensors: 28 ms alone, 11 ms together)
            batch = self._batches.setdefault((codec, tensor.dtype), _Batch())
            batch.items.append(_Small(key, tensor, base, chunks, keep))
            batch.nbytes += nbytes
            if batch.nbytes >= BATCH_BYTES:
                self._diff_batch(codec, tensor.dtype)
            return
        delta = None
        if base is not None and (tensor.device.type != "cpu" or not isinstance(codec, HostDiff)):
            out = self._keeper.buffer(key, to_bits(tensor)) if keep and tensor.device.type == "cpu" else None
            finish = None if packed else functools.partial(piece_chunks, codec, math.prod(chunks), self._compression,
                                                           tensor.element_size())
            delta = codec.diff(tensor, base.bits.whole(), chunks, out=out, finish=finish)
            if delta is None:
                self._same(key, name, shape, chunks, base, nbytes)
                return
        self._add_encoded(key, tensor, base, codec, chunks, packed, delta, keep)

    def _diff_batch(self, codec: DeltaCodec, dtype: torch.dtype) -> None:
        """Diff a batch of small tensors as one: concatenated, each zero-padded to the codec's
        :attr:`~amber_store.codecs.DeltaCodec.batch_align`, so each one's codes, side codes
        and reconstruction are what diffing it alone gives (but for a ``BlockDeltaCodec``'s
        ``drift``, which the batch, one chunk, is measured by: small tensors are few bytes)."""
        batch = self._batches.pop((codec, dtype)).items
        align = codec.batch_align
        spans = [fmt.round_up(item.tensor.numel(), align) for item in batch]
        starts = [0, *itertools.accumulate(spans)]
        values = torch.zeros(starts[-1], dtype=dtype)
        bases = torch.zeros(starts[-1], dtype=batch[0].base.bits.dtype)
        for item, at in zip(batch, starts):
            values[at: at + item.tensor.numel()] = item.tensor.reshape(-1)
            bases[at: at + item.tensor.numel()] = item.base.bits.whole().reshape(-1)
        delta = codec.diff(values, bases, (starts[-1],))
        for item, at, span in zip(batch, starts, spans):
            shape, n = tuple(item.tensor.shape), item.tensor.numel()
            codes = None if delta is None else delta.data[at: at + n]
            if codes is None or not codes.any():
                self._same(item.key, dtype_name(dtype), shape, item.chunks, item.base, n * item.tensor.element_size())
                continue
            side = None if delta.side is None else delta.side[:, at // align: (at + span) // align]
            own = Delta(codes.reshape(shape), delta.recon[at: at + n].view(shape), delta.params, side)
            self._add_encoded(item.key, item.tensor, item.base, codec, item.chunks, True, own, item.keep)

    def _add_encoded(self, key: str, tensor: torch.Tensor, base: Base | None, codec: DeltaCodec,
                     chunks: tuple[int, ...], packed: bool, delta: Delta | None, keep: bool) -> None:
        """A tensor's entry and its stored data: ``delta`` precomputed, or ``None`` (its raw bits
        on the host: diffed here, chunk by chunk)."""
        name, shape = dtype_name(tensor.dtype), tuple(tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
        if base is not None and delta is not None:
            codec = codec.stored_as(delta)
        encoding = "full" if base is None else codec.encoding
        array = None if packed else f"{self._group}/{fmt.array_name(key)}"
        entry = TensorEntry(name, list(shape), list(chunks), encoding, None if base is None else base.step,  # type: ignore[arg-type]
                            array, [], nbytes, params=None if delta is None else delta.params)
        host = sink = None
        if delta is not None:
            if keep:
                assert self._keeper is not None
                self._out.values[key] = self._keeper.hold(key, delta.recon)
        else:  # the raw bits on the host (a view for CPU tensors): diffed there, chunk by chunk
            bits = to_bits(tensor)
            copied = to_host(bits)
            host = bits_to_numpy(copied).reshape(-1)
            if keep:
                assert self._keeper is not None
                # (an accelerator's raw bits: a private host copy already, kept as it is)
                kept = self._keeper.new(key, bits) if tensor.is_cpu else self._keeper.hold(key, copied)
                sink = kept if tensor.is_cpu else None
                self._out.values[key] = kept
        if packed:
            self._add_packed(key, entry, host, sink, delta, base, codec)
        else:
            self._add_sharded(key, entry, host, sink, delta, base, codec)

    def _same(self, key: str, name: str, shape: tuple[int, ...], chunks: tuple[int, ...], base: Base,
              nbytes: int) -> None:
        self._out.entries[key] = TensorEntry(name, list(shape), list(chunks), "same", base.step, None,
                                             base.entry.crc32c, nbytes)
        if self._keeper is not None:
            self._out.values[key] = self._keeper.again(key, base.bits)

    def _add_packed(self, key: str, entry: TensorEntry, host: np.ndarray | None, sink: Resident | Spilled | None,
                    delta: Delta | None, base: Base | None, codec: DeltaCodec) -> None:
        """A small tensor: its whole serialized delta (or value) joins the step's pack stream.
        Either ``host`` (its raw bits, to diff here; ``sink``, if given, keeps them) or
        ``delta`` (precomputed, with its reconstruction) is given."""
        if host is not None:  # lossless on the host: the delta is taken here
            if sink is not None:
                sink.fill(0, host)
            crc = crc32c.crc32c(host)
            entry.crc32c = [crc]
            old = None if base is None else bits_to_numpy(base.bits.whole()).reshape(-1)
            base_crc = base.entry.crc32c[0] if base is not None and len(base.entry.crc32c) == 1 else None
            if _unchanged(host, old, crc, base_crc):
                payload = None
            elif old is None:
                payload = host.view(np.uint8)
            else:
                assert isinstance(codec, HostDiff)  # (a delta taken on the host: see add)
                stored = np.empty_like(host)
                codec.encode_into(stored, host, old)
                payload = codec.serialize(stored, None, host)
        else:
            assert delta is not None
            recon = bits_to_numpy(delta.recon).reshape(-1)
            entry.crc32c = [crc32c.crc32c(recon)]
            payload = codec.serialize_run(delta, 0, [(0, recon.size)], recon.size, [recon])[0]
        if payload is None and base is not None:
            self._same(key, entry.dtype, tuple(entry.shape), tuple(entry.chunks), base, entry.nbytes)
            return
        if payload is None:  # a zero tensor of a full step: nothing stored
            entry.pack = [self._pack_name, self._pack.length, 0]
        else:
            data = np.frombuffer(memoryview(payload).cast("B"), np.uint8)
            entry.pack = [self._pack_name, self._pack.append(entry, data, itemsize(entry.dtype)), data.size]
        self._out.entries[key] = entry

    def _add_sharded(self, key: str, entry: TensorEntry, host: np.ndarray | None, sink: Resident | Spilled | None,
                     delta: Delta | None, base: Base | None, codec: DeltaCodec) -> None:
        shape, chunks = tuple(entry.shape), tuple(entry.chunks)
        runs = fmt.chunk_runs(shape, chunks)
        padded = int(np.prod(chunks))
        width = itemsize(entry.dtype)
        if host is not None:
            src = host
            ref = None if base is None else base.bits if isinstance(base.bits, (Resident, Spilled)) \
                else Resident(base.bits.whole())  # (one read back from the store: whole)
            crcs = base.entry.crc32c if base is not None and len(base.entry.crc32c) == len(runs) else [None] * len(runs)
            # one job a chunk: the work is in calls that release the GIL, spread over the threads
            jobs = [self._pool.submit(_lossless_chunks, codec, src, ref, [crc], sink, [run], padded, self._compression,
                                      width) for run, crc in zip(runs, crcs)]
        else:
            assert delta is not None
            jobs = submit_delta(self._pool, codec, delta, bits_to_numpy(delta.recon).reshape(-1), runs, padded,
                                self._compression, width)
        inner = self._compression.inner_codecs(entry.dtype, None if base is None else codec)
        data_type = (bits_numpy_dtype(entry.dtype) if base is None else codec.storage_dtype(entry.dtype)).name
        attrs = {"dtype": entry.dtype, "encoding": entry.encoding, "base_step": entry.base}
        self._out.arrays[fmt.array_name(key)] = fmt.sharded_array_metadata(shape, chunks, data_type, inner, attrs)
        self._encoding.append(_Pending(key, entry, jobs, entry.nbytes))
        self._inflight += entry.nbytes
        self._drain(block=self._inflight > self._max_inflight)

    # --- writing --------------------------------------------------------------------------

    def _drain(self, block: bool) -> None:
        """Write every tensor whose chunks are encoded (in order); with ``block``, wait until
        the bytes in flight fit the bound."""
        while self._encoding and (all(f.done() for f in self._encoding[0].chunks)
                                  or (block and self._inflight > self._max_inflight)):
            p = self._encoding.popleft()
            results = [chunk for f in p.chunks for chunk in f.result()]
            p.entry.crc32c = [crc for _, crc in results]
            self._write_shard(p, [blob for blob, _ in results])
        self._reap(block=block)

    def _write_shard(self, p: _Pending, blobs: list[list[bytes] | None]) -> None:
        index, parts, offset = _shard(blobs)
        if p.entry.base is not None and offset == 0:  # nothing changed after all
            p.entry.encoding, p.entry.array, p.entry.params = "same", None, None
            self._out.arrays.pop(fmt.array_name(p.key), None)
            self._out.entries[p.key] = p.entry
            self._inflight -= p.nbytes
            return
        p.entry.index = index
        self._out.entries[p.key] = p.entry
        if offset == 0:  # all-zero full tensor: no object at all (absent chunks read as zero)
            self._inflight -= p.nbytes
            return
        p.entry.stored = sum(len(part) for part in parts)
        assert p.entry.array is not None
        self._put(fmt.shard_key(p.entry.array, len(p.entry.shape)), parts, p.nbytes)

    def _put(self, key: str, parts: list[bytes], weight: int) -> None:
        if self._put_holds_copy:
            copy = sum(len(part) for part in parts)
            self._inflight += copy
            weight += copy
        fut = asyncio.run_coroutine_threadsafe(self._put_object(key, parts), self._loop)
        self._writes[fut] = weight
        self._out.keys.append(key)

    def _reap(self, block: bool) -> None:
        """Collect finished writes; with ``block``, wait while the bytes in flight exceed the
        bound."""
        while self._writes:
            done = {f for f in self._writes if f.done()}
            if not done:
                if not (block and self._inflight > self._max_inflight):
                    return
                done, _ = wait(list(self._writes), timeout=self._time_left(), return_when=FIRST_COMPLETED)
                if not done:
                    n = len(self._writes)
                    raise TimeoutError(f"{n} write{'s' if n > 1 else ''} still unanswered at the save's deadline")
            for f in done:
                self._inflight -= self._writes.pop(f)
                f.result()

    def _write_pack(self) -> None:
        pack = self._pack
        if not pack.entries:
            return
        size, blobs = pack.finish()
        index, payload, _ = _shard(blobs)
        typesize = _most(pack.widths)
        kind = _compressed_as(pack.deltas)  # raw values when every packed tensor is (a full step)
        name = self._pack_name
        array = f"{self._group}/{name}"
        self._out.packs[name] = {"array": array, "chunk": size, "nbytes": pack.length, "index": index}
        inner = [{"name": "bytes", "configuration": {}}, self._compression.config(typesize, kind, packed=True),
                 {"name": "crc32c"}]
        self._out.arrays[name] = fmt.sharded_array_metadata((pack.length,), (size,), "uint8", inner,
                                                            {"pack": True})
        # Each packed tensor is charged its share of the compressed pack.
        stored = sum(len(part) for part in payload)
        for entry in pack.entries:
            entry.stored = stored * entry.pack[2] // max(1, pack.length)  # type: ignore[index]
        self._inflight += pack.length
        self._put(fmt.shard_key(array, 1), payload, pack.length)

    def finish(self) -> Written:
        """Write what is left and wait for every write."""
        for codec, dtype in list(self._batches):
            self._diff_batch(codec, dtype)
        self._max_inflight = -1  # from here on, wait for everything
        self._drain(block=True)
        self._write_pack()
        self._reap(block=True)
        assert not self._writes and not self._encoding
        self._out.entries = {key: self._out.entries[key] for key in self._order}
        return self._out

    def close(self) -> None:
        """Let chunk jobs and writes still in flight settle (after an error elsewhere); cancel
        the writes past the deadline."""
        wait([f for p in self._encoding for f in p.chunks])
        _, late = wait(list(self._writes), timeout=self._time_left())
        for f in late:
            f.cancel()
        self._encoding.clear()
        self._writes.clear()

    @property
    def keys(self) -> list[str]:
        """Every object written, or being written, so far."""
        return self._out.keys

    def _time_left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


class SaveStopped(Exception):
    """A step writer was told to stop: its save was interrupted or ran out of time."""
