"""Materializing tensors of committed steps: every layer of a chunk decoded in one task.

For one chunk of one tensor the reader fetches that chunk from each step of the tensor's chain
(the full step and its deltas, :meth:`History.chain`), then, on a codec thread, decompresses the
oldest layer straight into the output and applies each delta onto it, and checks the result
against the manifest's crc32c. A lazy read of a slice range-reads only the chunks it touches; a
whole-step read (:class:`ReadSession`) fetches each object once and each pack once.

Steps of format versions 1 and 2 (one zarr array per tensor) are read by
:mod:`amber_store.legacy`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import crc32c
import numpy as np

from . import format as fmt
from .codecs import decompress, delta_codec, fuses, intact, scratch
from .errors import CorruptDataError, StepNotFoundError, UnknownCodecError
from .format import Manifest, TensorEntry, bits_numpy_dtype
from .chains import Chains
from .history import History
from .runtime import codec_pool, gather, in_thread
from .storage import storage_errors

# Chunks below this are decoded on the event loop: a thread hop costs more than the work.
_INLINE_BYTES = 64 << 10
#: Chunks from this size have their output's pages faulted in at once (:func:`format.populate`).
_POPULATE_BYTES = 1 << 20

#: A whole-step read fetches each object up to this size with one request; a bigger one is
#: range-read chunk by chunk, so that its chunks arrive (and decode) concurrently, as s3fs would
#: fetch a big object (:attr:`amber_store.storage.fsspecstore.FsspecObjectStoreBackend.cat_options`).
WHOLE_OBJECT_BYTES = 64 << 20


class ReadSession:
    """Shared state of one multi-tensor read: whole objects instead of ranges, and each
    step's pack stream fetched and decompressed once (with its damaged chunks, if any); with
    ``whole_packs=False`` (a rank reading its part of a resharded step), each part of a pack
    that the read needs, fetched and decompressed once."""

    def __init__(self, whole_packs: bool = True) -> None:
        self.whole_packs = whole_packs
        self.packs: dict[tuple[int, str, int], asyncio.Future[tuple[np.ndarray | None, set[int]]]] = {}


class Reader:
    """Reads materialized raw bits of tensors of committed steps."""

    def __init__(self, history: History, *, verify: bool = True) -> None:
        self.history = history
        self.backend = history.backend
        self.chains = Chains(history)
        self.verify = verify
        self._legacy: Any = None  # (a LegacyReader, made for the first step of format 1-2: it imports zarr)

    def _corrupt(self, step: int, key: str, what: str, chunk: tuple[int, ...] | None = None) -> CorruptDataError:
        return CorruptDataError.at(self.history.uri, step, key, what, chunk)

    async def read(self, step: int, key: str, region: tuple[slice, ...] | None = None, *,
                   session: ReadSession | None = None, check: bool | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
        """Raw bits of ``key`` at ``step`` over a chunk-aligned ``region`` (``None``: all),
        decoded into ``out`` if given (C-contiguous, the region's shape and bits dtype: the
        destination tensor's memory, so that no copy follows), else into a new array.

        A step opened before retention removed or rewrote the steps its data lies in (a lazy
        state dict kept while training's gc runs) is read again from its manifest as committed
        now; one no longer committed raises :class:`StepNotFoundError` saying so."""
        with storage_errors(self.history.uri, f"reading step {step}, tensor {key!r}"):
            try:
                return await self._read(step, key, region, session, check, out)
            except (StepNotFoundError, CorruptDataError):
                if not await self.history.outdated(step):
                    raise
            self.history.forget()
            try:
                await self.history.index(step)
            except StepNotFoundError:
                raise StepNotFoundError(f"{self.history.uri}: step {step} was deleted (by gc or retention) after it "
                                        f"was opened; tensor {key!r} cannot be read") from None
            return await self._read(step, key, region, session, check, out)

    async def _read(self, step: int, key: str, region: tuple[slice, ...] | None, session: ReadSession | None,
                    check: bool | None, out: np.ndarray | None) -> np.ndarray:
        e = await self.history.entry(step, key)
        if e is None:
            raise KeyError(key)
        shape, chunks = tuple(e.shape), tuple(e.chunks)
        region = fmt.whole(shape) if region is None else region
        check = self.verify if check is None else check
        layers = await self.chains.chain(step, key)
        dtype = bits_numpy_dtype(e.dtype)
        rshape = tuple(r.stop - r.start for r in region)
        if out is None:
            out = fmt.host_empty(rshape, dtype)
        elif out.shape != rshape or out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writable C-contiguous {dtype} array of shape {rshape}, "
                             f"not {out.dtype} {out.shape}")
        if any(le.legacy for _, le in layers):  # (a step folded by gc may mix both layouts)
            if self._legacy is None:
                from .legacy import LegacyReader

                self._legacy = LegacyReader(self.history)
            out[...] = await self._legacy.read(step, key, region, check)
            return out
        if out.size == 0:
            return out
        if layers[-1][1].pack is not None:
            payloads = [await self._pack_payload(s, le, key, session) for s, le in layers]
            await self._decode(step, key, e, layers, payloads, out.reshape(-1), (0,) * len(shape), 0, check)
            return out
        whole = session is not None and region == fmt.whole(shape)
        objects = await gather(self._shard(s, le, key) for s, le in layers) if whole else None
        jobs = []
        for flat, idx, local in fmt.region_chunks(region, shape, chunks):
            jobs.append(self._chunk(step, key, e, layers, objects, flat, idx, out[local], check))
        await gather(jobs)
        return out

    async def _shard(self, step: int, entry: TensorEntry, key: str) -> Any:
        """The whole shard object of a layer, or ``None`` if it stores no chunk or is to be
        range-read (above :data:`WHOLE_OBJECT_BYTES`)."""
        if entry.index is None:
            return None
        stored = [loc for loc in entry.index if loc is not None]
        if not stored or sum(n for _, n in stored) > WHOLE_OBJECT_BYTES:
            return None
        assert entry.array is not None
        raw = await self.backend.get(fmt.shard_key(entry.array, len(entry.shape)))
        if raw is None:
            raise self._corrupt(step, key, f"object of array {entry.array} is missing")
        return raw

    async def _chunk(self, step: int, key: str, e: TensorEntry, layers: list[tuple[int, TensorEntry]],
                     objects: list[Any] | None, flat: int, idx: tuple[int, ...], target: np.ndarray,
                     check: bool) -> None:
        async def stored(i: int) -> Any:
            s, le = layers[i]
            assert le.index is not None
            loc = le.index[flat]
            if loc is None:
                return None
            if objects is not None and objects[i] is not None:
                return objects[i][loc[0]: loc[0] + loc[1]]
            assert le.array is not None
            raw = await self.backend.get(fmt.shard_key(le.array, len(le.shape)), (loc[0], loc[0] + loc[1]))
            if raw is None:
                raise self._corrupt(s, key, f"object of array {le.array} is missing", idx)
            return raw

        payloads = await gather(stored(i) for i in range(len(layers)))
        flat_target = target.reshape(-1) if target.flags.c_contiguous else None
        if flat_target is not None:
            await self._decode(step, key, e, layers, payloads, flat_target, idx, flat, check)
        else:
            tmp = fmt.host_empty(target.size, target.dtype)
            await self._decode(step, key, e, layers, payloads, tmp, idx, flat, check)
            target[...] = tmp.reshape(target.shape)

    async def _decode(self, step: int, key: str, e: TensorEntry, layers: list[tuple[int, TensorEntry]],
                      payloads: list[Any], out: np.ndarray, idx: tuple[int, ...], flat: int, check: bool) -> None:
        args = (step, key, e, layers, payloads, out, idx, flat, check)
        if out.nbytes < _INLINE_BYTES:
            self._apply_layers(*args)
        else:
            await in_thread(codec_pool(), self._apply_layers, *args)

    def _apply_layers(self, step: int, key: str, e: TensorEntry, layers: list[tuple[int, TensorEntry]],
                      payloads: list[Any], out: np.ndarray, idx: tuple[int, ...], flat: int, check: bool) -> None:
        """Decode the chunk ``flat`` (grid index ``idx``) of every layer into ``out`` (its
        in-bounds elements, flat), oldest first, then check the materialized crc32c; if it
        differs, the damaged layer is the first whose stored chunk fails its own."""
        packed = layers[-1][1].pack is not None
        if out.nbytes >= _POPULATE_BYTES:
            fmt.populate(out)
        try:
            self._apply(step, key, e, layers, payloads, out, idx, packed, check)
            if check and crc32c.crc32c(out) != e.crc32c[flat]:
                raise self._corrupt(step, key, "checksum mismatch (materialized data differs from what was saved)", idx)
        except CorruptDataError:
            if check and not packed:  # (the frames the native decoder took were not checked first)
                for (s, _), payload in zip(layers, payloads):
                    if payload is not None and not intact(payload):
                        raise self._corrupt(s, key, "stored chunk failed its checksum or decoding", idx) from None
            raise

    def _apply(self, step: int, key: str, e: TensorEntry, layers: list[tuple[int, TensorEntry]],
               payloads: list[Any], out: np.ndarray, idx: tuple[int, ...], packed: bool, check: bool) -> None:
        """Decode every layer's chunk into ``out``, oldest first (``check``: the caller checks the
        result's crc32c, and so each stored chunk's only if that fails)."""
        shape, chunks = tuple(e.shape), tuple(e.chunks)
        padded = out.size if packed else int(np.prod(chunks))
        region = fmt.whole(shape) if packed else fmt.chunk_slices(idx, shape, chunks)
        rshape = tuple(r.stop - r.start for r in region)
        for (s, le), payload in zip(layers, payloads):
            if le.encoding == "full":
                if payload is None:
                    out[...] = 0
                elif packed:
                    out[...] = payload.view(out.dtype)
                elif padded == out.size:
                    self._decompress(payload, out, s, key, idx, checked_after=check)
                else:  # an edge chunk is stored padded to the whole chunk
                    out[...] = self._decompress(payload, None, s, key, idx).view(out.dtype)[: out.size]
                continue
            if payload is None:
                continue  # an unchanged chunk: the delta is zero
            try:
                cls = delta_codec(le.encoding)
            except UnknownCodecError as exc:
                raise UnknownCodecError(f"{self.history.uri}: step {s}, tensor {key!r}: {exc}") from None
            try:
                codec = cls.for_entry(le)
            except (KeyError, TypeError, ValueError, ArithmeticError) as exc:  # a store is untrusted input
                raise self._corrupt(s, key, f"its {le.encoding} parameters are malformed ({exc!r})", idx) from None
            if not packed and padded == out.size and codec.fused_op and fuses(payload, out, codec.fused_op):
                self._decompress(payload, out, s, key, idx, codec.fused_op, checked_after=check)
                continue
            if packed:
                raw = payload
            elif codec.lossless:  # a fixed size: decode into this thread's reused buffer
                raw = self._decompress(payload, scratch(padded * out.itemsize), s, key, idx)
            else:
                raw = self._decompress(payload, None, s, key, idx)
            try:
                codec.decode_into(out.reshape(rshape), raw, padded, region, le)
            except (ValueError, TypeError, KeyError, IndexError, ArithmeticError) as exc:
                raise self._corrupt(s, key, f"stored chunk does not decode: {exc}", idx) from exc

    def _decompress(self, payload: Any, into: np.ndarray | None, step: int, key: str,
                    idx: tuple[int, ...], op: str = "store", checked_after: bool = False) -> np.ndarray:
        """Decompress one stored chunk (into ``into``, which must be its exact size, if given;
        or apply it onto ``into`` with ``op``: :func:`~amber_store.codecs.compression.decompress`)."""
        if into is not None and op == "store":
            into = into.view(np.uint8)
        got = decompress(payload, into, op, checked_after)
        if got is None:
            raise self._corrupt(step, key, "stored chunk failed its checksum or decoding", idx)
        return got

    # --- packs --------------------------------------------------------------------------

    async def _pack_payload(self, step: int, entry: TensorEntry, key: str, session: ReadSession | None) -> Any:
        """The uncompressed payload of a packed tensor's layer (``None``: nothing stored). A
        damaged pack chunk fails only the tensors with bytes in it, each under its own key."""
        if entry.pack is None:
            raise self._corrupt(step, key, "a packed tensor's chain holds an unpacked layer")
        name, offset, length = entry.pack
        if length == 0:
            return None
        m = await self.history.index(step)  # (the entry's fragment, read, brought its packs)
        info = m.packs.get(name)
        if info is None:
            raise self._corrupt(step, key, f"pack {name!r} is not in the manifest")
        size = info["chunk"]
        first, last = offset // size, (offset + length - 1) // size
        if session is not None and session.whole_packs:  # the whole stream, once for all its tensors
            fut = session.packs.get((step, name, -1))
            if fut is None:
                fut = session.packs[(step, name, -1)] = asyncio.ensure_future(
                    self._pack_chunks(m, name, 0, len(info["index"])))
            data, failed = await asyncio.shield(fut)  # (shared: one reader cancelled must not cancel it for all)
            start = offset
        elif session is not None:  # each part once, for all the tensors with bytes in it
            parts = []
            for part in range(first, last + 1):
                fut = session.packs.get((step, name, part))
                if fut is None:
                    fut = session.packs[(step, name, part)] = asyncio.ensure_future(
                        self._pack_chunks(m, name, part, part + 1))
                parts.append(fut)
            got = [await asyncio.shield(f) for f in parts]
            if any(d is None for d, _ in got):
                raise self._corrupt(step, key, f"pack object {info['array']} is missing")
            failed = set().union(*(f for _, f in got))
            data = got[0][0] if len(got) == 1 else np.concatenate([d for d, _ in got])
            start = offset - first * size
        else:
            data, failed = await self._pack_chunks(m, name, first, last + 1)
            start = offset - first * size
        if data is None:
            raise self._corrupt(step, key, f"pack object {info['array']} is missing")
        bad = [i for i in range(first, last + 1) if i in failed]
        if bad:
            raise self._corrupt(step, key, f"pack {name!r} chunk {bad[0]} failed its checksum or decoding")
        return data[start: start + length]

    async def _pack_chunks(self, m: Manifest, name: str, first: int, stop: int) -> tuple[np.ndarray | None, set[int]]:
        """Pack stream bytes of inner chunks ``first..stop-1`` (one ranged read), and which of
        them failed their checksum or decoding (``None``: the pack object is missing)."""
        info = m.packs[name]
        index = info["index"][first:stop]
        lo, hi = index[0][0], index[-1][0] + index[-1][1]
        whole = first == 0 and stop == len(info["index"])
        data = await self.backend.get(fmt.shard_key(info["array"], 1), None if whole else (lo, hi))
        if data is None:
            return None, set()
        size = info["chunk"]
        out = fmt.host_empty((stop - first) * size, np.uint8)
        failed: set[int] = set()

        def one(i: int) -> None:
            o, n = index[i]
            o -= lo
            if decompress(data[o: o + n], out[i * size: (i + 1) * size]) is None:
                failed.add(first + i)

        await gather([in_thread(codec_pool(), one, i) for i in range(len(index))])
        return out, failed
