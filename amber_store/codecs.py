"""Delta and compression codecs, as zarr v3 codecs recorded in every array's metadata.

A delta codec has two faces. On the writer's side, :meth:`DeltaCodec.diff` turns a tensor and
the *reconstructed* value of its base into the stored delta with torch ops on the tensor's
device (a lossy delta of a CPU tensor: fused kernels, :mod:`amber_store.kernels`, with the same
result), and returns the new reconstruction (what a reader will materialize), which becomes the
next base: lossy error therefore never accumulates along a chain. On the reader's side,
:meth:`DeltaCodec.apply` combines a stored region with the base region.

Inside zarr's codec pipeline the chunk already *is* the delta (zarr codecs see one chunk
without its coordinates, so they cannot fetch the base chunk). There a delta codec passes data
through unchanged; its configuration names the base array, so the array is self-describing
(docs/FORMAT.md). The serializers :class:`SparseBytesCodec` and :class:`Pack4BytesCodec` do
real per-chunk work: they store a mostly-zero chunk as indices and values, and 4-bit codes two
per byte.

Codecs per dtype and delta kind:

==============  ================  =============================================================
``diff``        lossless          ``zigzag(bits(value) - bits(base))`` (the default)
``xor``         lossless          ``bits(value) XOR bits(base)``; unchanged chunks are zero
``sparse``      lossy, floats     XOR kept only where ``|value - base| > threshold * |base|``
                                  (or the ``topk`` largest updates); the rest keep the base
``quant8/4``    lossy, floats     ``round((value - base) / scale)``, one scale per chunk
==============  ================  =============================================================
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Literal, Sequence, TypeVar, Union

import blosc
import crc32c
import numpy as np
import torch
from blosc.blosc_extension import error as BloscError
from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec
from zarr.core.common import parse_named_configuration
from zarr.registry import register_codec

from .entropy import ans_decode, ans_encode, decode_codes, encode_codes_many
from .format import (
    DTYPES,
    chunk_runs,
    TensorEntry,
    bits_numpy_dtype,
    bits_to_numpy,
    itemsize,
    numpy_to_tensor,
    region_chunks,
    round_up,
    to_bits,
)

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer


T = TypeVar("T")

# blosc's shuffles (zarr's names): none, bytes of one significance together, bits likewise.
Shuffle = Literal["noshuffle", "shuffle", "bitshuffle"]


@dataclass
class Delta:
    """What a delta codec produced for one tensor: the array to store (host; ``None`` for a
    sparse delta, see :attr:`changes`), the bits a reader will materialize, and per-tensor
    parameters for the manifest."""

    data: np.ndarray | None
    recon: torch.Tensor
    params: dict[str, Any] | None = None
    #: per-chunk data a codec's :meth:`DeltaCodec.serialize` stores next to the chunk's codes
    #: (one row per chunk, C order), e.g. block exponents
    side: np.ndarray | None = None
    #: a sparse delta's stored elements instead of a mostly-zero ``data``: their flat positions
    #: (ascending) and values (host)
    changes: tuple[np.ndarray, np.ndarray] | None = None
    #: what ``diff``'s ``finish`` returned for each piece, in order (``None``: it was not called)
    encoded: list[Any] | None = None


#: Serializes a piece of a delta on the codec thread that took it, while the piece is in the
#: CPU's cache: given the piece as a :class:`Delta` whose arrays index as the whole tensor's
#: (but ``side``: the piece's own rows) and the piece's chunk runs. Host diffs only.
Finish = Callable[[Delta, list[tuple[int, int]]], Any]


@dataclass(frozen=True)
class DeltaCodec(ArrayArrayCodec):
    """Base of the delta codecs: configuration round-trips, pass-through inside zarr."""

    name: ClassVar[str]
    encoding: ClassVar[str]
    lossless: ClassVar[bool] = False
    is_fixed_size = True
    base_step: int = -1
    base_array: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        _, config = parse_named_configuration(data, cls.name)
        return cls(**config)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {f.name: getattr(self, f.name) for f in fields(self)}}

    def with_base(self, step: int, array: str) -> Self:
        return _with_base(self, step, array)

    @classmethod
    def for_entry(cls, entry: TensorEntry) -> DeltaCodec:
        """The codec that decodes ``entry``'s stored chunks (format 3 keeps what decoding
        needs in the entry's ``params``)."""
        return cls()

    def applies_to(self, dtype: str, numel: int) -> bool:
        return True

    @property
    def batch_align(self) -> int:
        """Whether small tensors of this codec may be diffed together, concatenated, each
        zero-padded to a multiple of this many elements, with the same result as alone (0:
        no; the quantizer has a scale per chunk, or a count per tensor)."""
        return 0

    def storage_dtype(self, dtype: str) -> np.dtype:
        """dtype of the zarr array holding this codec's deltas."""
        return bits_numpy_dtype(dtype)

    def serializer(self, dtype: str) -> dict[str, Any]:
        return {"name": "bytes", "configuration": {"endian": "little"}}

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...],
             out: torch.Tensor | None = None, finish: Finish | None = None) -> Delta | None:
        """Delta of ``value`` (on its device) against host ``base`` bits; ``None`` if a reader
        would materialize exactly ``base`` (the tensor is then stored as ``same``). ``out``: a
        free buffer of ``value``'s raw bits (shape, bits dtype, device) that the codec may
        build the reconstruction in (a fresh one costs page faults: 64 MB in 20 ms here).
        ``finish``: see :data:`Finish`; a codec that takes the delta on the host in pieces
        calls it (:attr:`Delta.encoded`), others ignore it."""
        raise NotImplementedError

    def apply(self, stored: np.ndarray, base: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> np.ndarray:
        """Materialized bits of ``region`` of ``entry``'s tensor from its stored delta and base bits."""
        return np.bitwise_xor(stored, base, out=stored)

    def apply_into(self, out: np.ndarray, stored: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> None:
        """Like :meth:`apply`, in place: ``out`` holds the base bits of ``region`` and gets the result."""
        np.bitwise_xor(out, stored, out=out)

    def decode_into(self, out: np.ndarray, raw: np.ndarray, padded: int, region: tuple[slice, ...],
                    entry: TensorEntry) -> None:
        """Apply one stored chunk (``raw``: its serialized bytes, ``padded`` elements) to ``out``,
        which holds the base bits of the chunk's ``region`` and gets the materialized bits."""
        delta = self.deserialize(raw, (padded,), self.storage_dtype(entry.dtype))[: out.size]
        self.apply_into(out, delta.reshape(out.shape), region, entry)

    # Per-chunk serialization (the array-to-bytes step); the default stores the raw elements.
    # blosc's shuffle of the serialized chunk before compression: bytes of one significance
    # together (an XOR delta's zero high bytes make long runs)
    shuffle: ClassVar[Shuffle] = "shuffle"
    # whether serialize() already entropy-codes its output: blosc then only frames it
    entropy_coded: ClassVar[bool] = False

    def serialize(self, chunk: np.ndarray, side: np.ndarray | None = None, recon: np.ndarray | None = None) -> Any:
        """Bytes-like of one chunk of the stored array (chunk-shaped, C-contiguous), given the
        chunk's row of :attr:`Delta.side` and its materialized bits ``recon`` (unpadded)."""
        return chunk.reshape(-1).view(np.uint8)

    def serialize_run(self, delta: Delta, first: int, runs: list[tuple[int, int]], padded: int,
                      recons: list[np.ndarray]) -> list[Any]:
        """:meth:`serialize_chunks` of the chunks of ``delta`` at the flat ``runs`` (adjacent;
        ``first``: the index of the first chunk, ``padded``: elements per chunk), given their
        materialized bits."""
        assert delta.data is not None
        data = delta.data.reshape(-1)
        if all(b - a == padded for a, b in runs):
            rows = data[runs[0][0]: runs[-1][1]].reshape(len(runs), padded)
        else:
            rows = np.zeros((len(runs), padded), dtype=data.dtype)
            for r, (a, b) in enumerate(runs):
                rows[r, : b - a] = data[a:b]
        return self.serialize_chunks(rows, None if delta.side is None else delta.side[first: first + len(runs)], recons)

    def serialize_chunks(self, rows: np.ndarray, sides: np.ndarray | None, recons: list[np.ndarray]) -> list[Any]:
        """:meth:`serialize` of each chunk of a run of one tensor's chunks: ``rows`` (one a row,
        zero-padded), their rows of :attr:`Delta.side` and their materialized bits; ``None``
        for a chunk of zeros (not stored)."""
        return [self.serialize(row, None if sides is None else sides[r], recons[r]) if row.any() else None
                for r, row in enumerate(rows)]

    def deserialize(self, raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The chunk back from :meth:`serialize`'s bytes (``raw``: uint8)."""
        return raw.view(dtype).reshape(shape)

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> NDBuffer:
        return chunk_array

    async def _decode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> NDBuffer:
        return chunk_array

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return input_byte_length


@functools.lru_cache(maxsize=1 << 12)  # every small tensor of a save asks for the same one
def _with_base(codec: Any, step: int, array: str) -> Any:
    return replace(codec, base_step=step, base_array=array)


@dataclass(frozen=True)
class LosslessDeltaCodec(DeltaCodec):
    """Base of the bit-exact deltas: a reversible map of (value bits, base bits) to stored
    bits, computed with torch on the tensor's device (:meth:`diff`) or with numpy on host
    chunks (:meth:`encode_into`, the writer's CPU path), and undone by :meth:`apply_into`."""

    lossless: ClassVar[bool] = True
    #: the blosc compressor of ``Compression(compressor="auto")`` for the chunks of large
    #: tensors (packs of small ones: zstd, see :meth:`Compression.blosc`)
    auto_compressor: ClassVar[str]

    def shuffle_for(self, cname: str) -> Shuffle:
        """blosc's shuffle of this codec's deltas before the compressor ``cname``."""
        return self.shuffle

    def encode_into(self, out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
        """``out`` gets the stored delta of the bits ``value`` against ``base`` (same shape and
        unsigned dtype). Uses the calling thread's scratch slots 1 and up, never slot 0."""
        raise NotImplementedError

    def _delta(self, bits: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _restore(self, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...],
             out: torch.Tensor | None = None, finish: Finish | None = None) -> Delta | None:
        bits = to_bits(value)
        delta = self._delta(bits, base.to(bits.device, non_blocking=True))
        if not bool(delta.any()):
            return None
        host = to_host(delta)
        # from an accelerator, the value itself crosses too (a copy at the link's speed, not a
        # host pass over base and delta); a CPU tensor's is restored into a private copy
        return Delta(bits_to_numpy(host), self._restore(base, host) if bits.is_cpu else to_host(bits))


@dataclass(frozen=True)
class XorDeltaCodec(LosslessDeltaCodec):
    """Bit-exact delta: the chunk holds ``raw_bits(value) XOR raw_bits(base)``."""

    name: ClassVar[str] = "amber.xor_delta"
    encoding: ClassVar[str] = "xor"
    auto_compressor: ClassVar[str] = "zstd"

    def encode_into(self, out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
        np.bitwise_xor(value, base, out=out)

    def _delta(self, bits: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        return torch.bitwise_xor(bits, base)

    def _restore(self, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return torch.bitwise_xor(base, delta)


_SIGNED_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as flat signed ints of their width (a copy only if ``a`` is strided)."""
    return a.reshape(-1).view(f"i{a.itemsize}")


def _into(out: np.ndarray) -> np.ndarray:
    """:func:`_signed` of an array a kernel writes into (a flat copy would lose the writes)."""
    if not out.flags.c_contiguous:
        raise ValueError("a diff is written into a C-contiguous array")
    return _signed(out)


@dataclass(frozen=True)
class DiffDeltaCodec(LosslessDeltaCodec):
    """Bit-exact delta (the default): the chunk holds ``zigzag(raw_bits(value) -
    raw_bits(base))``, the difference of the raw bits as integers (modulo 2**width), mapped so
    that a small change either way has zero high bits (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...).

    A float's bits are sign, exponent, mantissa, so a small update is a small integer
    difference, while XOR sets every bit from the highest one a carry flipped. Measured on the
    demo's AdamW checkpoints (2 cores): bit-shuffled and lz4-compressed, these deltas are 1.29x
    smaller than the raw values, XOR deltas 1.22x; byte-shuffled with zstd, 1.32x and XOR's
    1.28x, at a third of lz4's speed. On a synthetic state whose every element moves by 1e-3
    of its spread: 1.63x (lz4), 1.78x (zstd); XOR 1.71x (zstd). So large tensors' chunks take
    lz4 (the throughput of a save) and packs of small tensors zstd (:class:`Compression`).
    On the host both directions are one compiled pass per chunk (:mod:`amber_store.kernels`),
    a fraction of compression's time.
    """

    name: ClassVar[str] = "amber.diff_delta"
    encoding: ClassVar[str] = "diff"
    auto_compressor: ClassVar[str] = "lz4"

    def shuffle_for(self, cname: str) -> Shuffle:
        # lz4 has no entropy stage: bit planes give it runs; zstd codes byte planes better
        return "bitshuffle" if cname == "lz4" else "shuffle"

    def encode_into(self, out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
        from . import kernels
        kernels.zigzag_diff(_into(out), _signed(value), _signed(base), 64 - 8 * out.itemsize)

    def apply(self, stored: np.ndarray, base: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> np.ndarray:
        out = np.array(base, copy=True)
        self.apply_into(out, stored, region, entry)
        return out

    def apply_into(self, out: np.ndarray, stored: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> None:
        from . import kernels
        kernels.unzigzag_add(_into(out), _signed(stored), (1 << (8 * out.itemsize - 1)) - 1)

    def _delta(self, bits: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        d = (bits - base).view(_SIGNED_TORCH[bits.element_size()])
        sign = d >> (8 * d.element_size() - 1)
        return d.bitwise_left_shift_(1).bitwise_xor_(sign).view(bits.dtype)

    def _restore(self, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        z = delta.view(_SIGNED_TORCH[delta.element_size()])
        half = (z >> 1).bitwise_and_((1 << (8 * z.element_size() - 1)) - 1)  # a logical shift
        half.bitwise_xor_((z & 1).neg_())
        return half.view(base.dtype).add_(base)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


#: elements per piece where a temporary of a whole large tensor would cost its page faults
_PIECE = 1 << 20
#: bytes of values a lossy encode takes at a time (whole chunks): its ~10 passes stay in the
#: CPU's cache (measured: 1.4x faster than passes over a whole 64 MB tensor; 1 MiB is too small)
_PIECE_BYTES = 4 << 20
#: the same on an accelerator, where a piece only bounds the temporaries: each costs a few
#: dozen kernel launches and synchronizations (an H200's lossy diffs of 256 MB: 35-55 ms in
#: 4 MiB pieces, 21 ms in these)
_DEVICE_PIECE_BYTES = 64 << 20


def _piece_numel(t: torch.Tensor) -> int:
    """Elements of ``t`` that a sparse delta takes at a time."""
    return _PIECE if t.is_cpu else _DEVICE_PIECE_BYTES // t.element_size()


class _NonFinite(Exception):
    """A quantizer met a NaN or infinite change."""


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: a CPU tensor as it is, an accelerator's copied into pinned memory,
    which torch's host allocator caches and hands out again once freed. (Into fresh pageable
    memory the copy ran at 1.2 GB/s on an H200 VM, page faults included; pinned: 54 GB/s.)
    Pinned, it also crosses back fast when it is the base of the next delta."""
    return t if t.is_cpu else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def _flat_pair(value: torch.Tensor, base: torch.Tensor, ct: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` and ``base`` (its bits) flat, in the compute dtype ``ct``, on value's device."""
    b = base.to(value.device, non_blocking=True).view(value.dtype).reshape(-1)
    return value.reshape(-1).to(ct), b.to(ct)


def _scratch(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor | None:
    """The caller's recycled buffer as flat values of ``value``'s dtype, when it can hold a
    temporary of the compute dtype on value's device (else ``None``: ops allocate)."""
    if out is None or _compute_dtype(value.dtype) != value.dtype or out.device != value.device:
        return None
    return out.view(value.dtype).reshape(-1)


def _recon_buffer(out: torch.Tensor | None, base: torch.Tensor) -> torch.Tensor:
    """A flat CPU buffer for the bits of a reconstruction: the caller's recycled one if given."""
    if out is not None and out.device.type == "cpu":
        return out.view(base.dtype).reshape(-1)
    return torch.empty(base.numel(), dtype=base.dtype)


def _by_chunk(x: torch.Tensor, runs: list[tuple[int, int]], width: int) -> tuple[torch.Tensor, bool]:
    """Flat ``x`` as one row of ``width`` per chunk (``runs``), and whether that is a view:
    when the chunks do not tile it exactly, a copy with each row zero-padded."""
    if all(hi - lo == width for lo, hi in runs):
        return x.view(len(runs), width), True
    rows = x.new_zeros(len(runs), width)
    for k, (lo, hi) in enumerate(runs):
        rows[k, : hi - lo] = x[lo:hi]
    return rows, False


def _unchunk(rows: torch.Tensor, runs: list[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_by_chunk`'s copy, into flat ``out``."""
    for k, (lo, hi) in enumerate(runs):
        out[lo:hi] = rows[k, : hi - lo]
    return out


#: what a quantizer returns besides its codes and restored values: its per-chunk side data
#: and the mask of the escaped elements (each ``None`` if there are none)
_Quantized = tuple[Any, Union[torch.Tensor, None]]
#: A quantizer of a piece of whole chunks (:func:`_quantize_in_pieces`): given flat values and
#: base (compute dtype), the chunks' runs within them, the padded chunk size, and flat buffers
#: for the restored values (compute dtype; its scratch until then) and the int8 codes, it
#: writes both and returns :data:`_Quantized`, or ``None`` when every code would be 0 (the
#: buffers then hold nothing).
_Quantizer = Callable[[torch.Tensor, torch.Tensor, list[tuple[int, int]], int, torch.Tensor, torch.Tensor],
                      Union[_Quantized, None]]


def _quantize_in_pieces(value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...], out: torch.Tensor | None,
                        quantize: _Quantizer, host: _Quantizer | None = None, finish: Finish | None = None,
                        sided: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, Any]], list[Any] | None] | None:
    """A lossy delta of ``value`` against ``base`` (its bits), :data:`_PIECE_BYTES` of whole
    chunks at a time: (int8 codes, bits of the reconstruction, in ``out`` when it is on value's
    device, each piece's chunk count and side data, ``None`` if it has none or its codes are
    all 0, and what ``finish`` returned for each piece), or ``None`` when every code is 0.
    Escaped elements keep their exact bits. ``host``: the quantizer of a CPU tensor when
    :func:`_on_host`, whose pieces then run on the codec threads, each then passed to
    ``finish`` (host only) with its side data as :attr:`Delta.side` when ``sided`` (rows of
    side codes, not a quantizer's own data)."""
    on_host = host is not None and _on_host(value)
    quantize = host if on_host else quantize
    finish = finish if on_host else None
    ct = _compute_dtype(value.dtype)
    flat = value.detach().reshape(-1)
    base_values = base.to(value.device, non_blocking=True).view(value.dtype).reshape(-1)
    recon = out.view(value.dtype).reshape(-1) if out is not None and out.device == value.device else torch.empty_like(flat)
    bits, value_bits = to_bits(recon), to_bits(flat)
    codes = torch.empty(flat.shape, dtype=torch.int8, device=flat.device)
    runs, padded = chunk_runs(tuple(value.shape), chunks), math.prod(chunks)
    per = max(1, (_PIECE_BYTES if flat.is_cpu else _DEVICE_PIECE_BYTES) // (padded * flat.element_size()))

    def piece(part: list[tuple[int, int]]) -> tuple[_Quantized | None, Any]:
        lo, hi = part[0][0], part[-1][1]
        restored = recon[lo:hi] if ct == value.dtype else _staging(hi - lo, ct, flat.device)
        if len(part) == len(runs):  # one piece (most tensors): no slices, whose cost is per call
            quantized = quantize(flat.to(ct), base_values.to(ct), runs, padded, restored, codes)
        else:
            quantized = quantize(flat[lo:hi].to(ct), base_values[lo:hi].to(ct), [(a - lo, z - lo) for a, z in part],
                                 padded, restored, codes[lo:hi])
        if quantized is None:  # nothing in these chunks moved past half a step: they keep their base
            codes[lo:hi] = 0
            recon[lo:hi] = base_values[lo:hi]
        else:
            if ct != value.dtype:
                recon[lo:hi] = restored
            # A chunk whose codes are all 0 is not stored: readers take its base bits (which
            # -0.0 + 0.0 would not give). The kernels see to that themselves (ratio's code 0
            # restores b * 1, b's bits: a NaN base never codes).
            counts = [] if on_host else torch.stack([torch.count_nonzero(codes[a:z]) for a, z in part]).tolist()
            for (a, z), n in zip(part, counts):  # (counted at once: one synchronization)
                if not n:
                    recon[a:z] = base_values[a:z]
            if quantized[1] is not None:
                at = quantized[1].nonzero().view(-1) + lo
                bits[at] = value_bits[at]
        if finish is None:
            return quantized, None
        side = quantized[0].numpy() if sided and quantized is not None and quantized[0] is not None else None
        return quantized, finish(Delta(codes.numpy(), bits, side=side), part)

    parts = [runs[k: k + per] for k in range(0, len(runs), per)]
    done = list(_map_pieces(piece, parts) if on_host else map(piece, parts))
    if all(quantized is None for quantized, _ in done):
        return None
    sides = [(len(part), None if quantized is None else quantized[0]) for part, (quantized, _) in zip(parts, done)]
    return codes, bits, sides, None if finish is None else [encoded for _, encoded in done]


#: Whether lossy diffs of CPU tensors run the fused kernels of :mod:`amber_store.kernels` on
#: the codec threads (off: the torch code, an accelerator's path, which tests run on the CPU)
HOST_KERNELS = True


def _on_host(value: torch.Tensor) -> bool:
    return HOST_KERNELS and value.device.type == "cpu"


def _map_pieces(fn: Callable[[Any], T], items: list[Any]) -> Iterator[T]:
    """``fn`` over ``items``, on the codec threads when there are several and the caller is not
    one of them (it would wait on itself)."""
    if len(items) < 2 or threading.current_thread().name.startswith(_POOL_NAME):
        return map(fn, items)
    return codec_pool().map(fn, items)


def _staging(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements of scratch on ``device``: the calling thread's reused buffer on the CPU."""
    if device.type == "cpu":
        return torch.from_numpy(scratch(n * dtype.itemsize, 3)).view(dtype)
    return torch.empty(n, dtype=dtype, device=device)


@dataclass(frozen=True)
class SparseDeltaCodec(DeltaCodec):
    """Amber's significant-update delta: keep an element's new bits only where it moved by more
    than ``threshold`` relative to the reconstructed base (or, with ``topk``, the largest
    ``topk`` fraction of updates); every other element keeps its base value.

    Error bound, at every step of a chain: each element is exact, or within
    ``threshold * |restored|`` of the truth (``topk``: no fixed bound). Tensors smaller than
    ``min_numel`` (step counters, norms, biases: they cost little) stay lossless.
    """

    name: ClassVar[str] = "amber.sparse_delta"
    encoding: ClassVar[str] = "sparse"
    threshold: float = 0.02
    topk: float | None = None
    min_numel: int = 4096

    def applies_to(self, dtype: str, numel: int) -> bool:
        return DTYPES[dtype].is_floating_point and numel >= self.min_numel

    def serializer(self, dtype: str) -> dict[str, Any]:
        return SparseBytesCodec().to_dict()

    def serialize(self, chunk: np.ndarray, side: np.ndarray | None = None, recon: np.ndarray | None = None) -> Any:
        return sparse_encode(chunk)

    def deserialize(self, raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return sparse_decode(raw, shape, dtype)

    def serialize_run(self, delta: Delta, first: int, runs: list[tuple[int, int]], padded: int,
                      recons: list[np.ndarray]) -> list[Any]:
        assert delta.changes is not None
        at, values = delta.changes
        cuts = np.searchsorted(at, np.asarray(runs).reshape(-1)).reshape(-1, 2)
        return [sparse_pack(at[i:j] - lo, values[i:j]) if j > i else None for (lo, _), (i, j) in zip(runs, cuts)]

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...],
             out: torch.Tensor | None = None, finish: Finish | None = None) -> Delta | None:
        bits, base_bits = to_bits(value).reshape(-1), base.to(value.device, non_blocking=True).reshape(-1)
        ct = _compute_dtype(value.dtype)
        recon = _recon_buffer(out, base)
        encoded = None
        if self.topk is None and _on_host(value):
            changes, encoded = self._changes_on_host(value.detach().reshape(-1), bits, base_bits, ct, recon,
                                                     chunk_runs(tuple(value.shape), chunks), finish)
        else:
            changes = self._changes(self._keep(value, bits, base_bits, ct, out), bits, base_bits, base.reshape(-1),
                                    recon)
        if changes[0].size == 0:
            return None
        return Delta(None, recon.view(base.shape), {"kept": int(changes[0].size)}, changes=changes, encoded=encoded)

    def _keep(self, value: torch.Tensor, bits: torch.Tensor, base_bits: torch.Tensor, ct: torch.dtype,
              out: torch.Tensor | None) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
        """The torch test of which elements of ``bits[lo:hi]`` a delta keeps (:meth:`_changes`)."""
        if self.topk is not None:
            v, b = _flat_pair(value, base_bits, ct)
            moved = torch.sub(v, b, out=_scratch(out, value)).abs_()
            k = max(1, math.ceil(self.topk * moved.numel())) if moved.numel() else 0
            chosen = torch.zeros_like(moved, dtype=torch.bool)
            if k:
                chosen[moved.nan_to_num(math.inf).topk(k).indices] = True

            def keep(lo: int, hi: int, into: torch.Tensor) -> torch.Tensor:
                return torch.ne(bits[lo:hi], base_bits[lo:hi], out=into).logical_and_(chosen[lo:hi])
        else:
            size = min(value.numel(), _piece_numel(value))
            moved, limit = (torch.empty(size, dtype=ct, device=value.device) for _ in range(2))
            v, b = value.reshape(-1), base_bits.view(value.dtype)

            def keep(lo: int, hi: int, into: torch.Tensor) -> torch.Tensor:
                vp, bp = v[lo:hi].to(ct), b[lo:hi].to(ct)
                d = torch.sub(vp, bp, out=moved[: hi - lo]).abs_()
                torch.gt(d, torch.abs(bp, out=limit[: hi - lo]).mul_(self.threshold), out=into)
                if not bool(torch.isfinite(d.amax())):  # NaN/inf never compare: keep them exact
                    into |= ~torch.isfinite(vp) | ~torch.isfinite(bp)
                    into &= bits[lo:hi] != base_bits[lo:hi]
                return into  # (otherwise a kept element moved by more than 0: its bits differ)
        return keep

    def _changes_on_host(self, value: torch.Tensor, bits: torch.Tensor, base_bits: torch.Tensor, ct: torch.dtype,
                         recon: torch.Tensor, runs: list[tuple[int, int]], finish: Finish | None
                         ) -> tuple[tuple[np.ndarray, np.ndarray], list[Any] | None]:
        """:meth:`_changes` of the threshold test for a CPU tensor, and what ``finish`` returned
        for each piece: a fused kernel (:mod:`amber_store.kernels`) over whole chunks of about
        :data:`_PIECE` elements at a time, on the codec threads."""
        from . import kernels

        threshold = torch.tensor(self.threshold, dtype=ct).numpy()[()]  # (as torch's multiply by it rounds it)
        bits_np, base_np, recon_np = bits_to_numpy(bits), bits_to_numpy(base_bits), bits_to_numpy(recon)
        base_values = base_bits.view(value.dtype)
        per = max(1, _PIECE // max(1, runs[0][1] - runs[0][0]))

        def piece(part: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, Any]:
            lo, hi = part[0][0], part[-1][1]
            at, xor = np.empty(hi - lo, dtype=np.int64), np.empty(hi - lo, dtype=bits_np.dtype)
            kept = kernels.sparse(value[lo:hi].to(ct).numpy(), base_values[lo:hi].to(ct).numpy(), bits_np[lo:hi],
                                  base_np[lo:hi], threshold, recon_np[lo:hi], scratch(hi - lo, 3).view(np.bool_), at,
                                  xor)
            changes = (at[:kept] + lo, xor[:kept].copy())
            return (*changes, None if finish is None else finish(Delta(None, recon, changes=changes), part))

        done = list(_map_pieces(piece, [runs[k: k + per] for k in range(0, len(runs), per)]))
        changes = (np.concatenate([at for at, _, _ in done]), np.concatenate([xor for _, xor, _ in done]))
        return changes, None if finish is None else [encoded for _, _, encoded in done]

    @staticmethod
    def _changes(keep: Callable[[int, int, torch.Tensor], torch.Tensor], bits: torch.Tensor, base_bits: torch.Tensor,
                 host_base: torch.Tensor, recon: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(flat positions, XOR against the base) of the elements ``keep(lo, hi, into)`` marks
        among ``bits[lo:hi]``, on the host, with their new bits set in ``recon`` (a host buffer
        that gets the base's bits, ``host_base``, for the rest). A piece at a time: the kept
        elements are gathered while their piece is in the CPU's cache, only they leave the
        device, and no mostly-zero array of the tensor's size is made (its page faults cost as
        much as the arithmetic)."""
        piece = _piece_numel(bits)
        mask = torch.empty(min(bits.numel(), piece), dtype=torch.bool, device=bits.device)
        positions, values = [], []
        for lo in range(0, bits.numel(), piece):
            hi = min(lo + piece, bits.numel())
            at = keep(lo, hi, mask[: hi - lo]).nonzero().view(-1)
            kept = torch.index_select(bits[lo:hi], 0, at)  # (half the time of bits[lo:hi][at])
            host_at, host_kept = to_host(at), to_host(kept)
            values.append(bits_to_numpy(to_host(kept ^ torch.index_select(base_bits[lo:hi], 0, at))))
            recon[lo:hi].copy_(host_base[lo:hi]).index_copy_(0, host_at, host_kept)
            positions.append(host_at.add_(lo).numpy())
        if not positions:
            return np.empty(0, np.int64), bits_to_numpy(to_host(bits[:0]))
        return np.concatenate(positions), np.concatenate(values)


@dataclass(frozen=True)
class QuantizedDeltaCodec(DeltaCodec):
    """Check-N-Run style quantized delta: ``q = round((value - base) / scale)`` in
    ``[-(2^(bits-1)-1), 2^(bits-1)-1]``, one ``scale = max|value - base| / qmax`` per chunk.

    Error bound, at every step of a chain: ``|restored - value| <= scale / 2`` per element of a
    chunk (plus the rounding of the result to the tensor's dtype). Tensors smaller than
    ``min_numel`` stay lossless.
    """

    name: ClassVar[str] = "amber.quantized_delta"
    encoding: ClassVar[str] = "quant"
    bits: int = 8
    min_numel: int = 4096

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError("QuantizedDeltaCodec supports bits=8 or bits=4")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def applies_to(self, dtype: str, numel: int) -> bool:
        return DTYPES[dtype].is_floating_point and numel >= self.min_numel

    def storage_dtype(self, dtype: str) -> np.dtype:
        return np.dtype("int8")

    shuffle: ClassVar[Shuffle] = "noshuffle"

    def serializer(self, dtype: str) -> dict[str, Any]:
        return Pack4BytesCodec().to_dict() if self.bits == 4 else {"name": "bytes", "configuration": {}}

    @classmethod
    def for_entry(cls, entry: TensorEntry) -> DeltaCodec:
        return cls(bits=(entry.params or {}).get("bits", 8))

    def serialize(self, chunk: np.ndarray, side: np.ndarray | None = None, recon: np.ndarray | None = None) -> Any:
        return pack4_encode(chunk) if self.bits == 4 else super().serialize(chunk)

    def deserialize(self, raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return pack4_decode(raw, shape) if self.bits == 4 else super().deserialize(raw, shape, dtype)

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...],
             out: torch.Tensor | None = None, finish: Finish | None = None) -> Delta | None:
        try:
            delta = _quantize_in_pieces(value, base, chunks, out, self._quantize, self._quantize_on_host, finish)
        except _NonFinite:
            return DiffDeltaCodec().diff(value, base, chunks)  # never quantize NaN/inf
        if delta is None:
            return None
        codes, bits, sides, encoded = delta
        scales = [scale for n, piece in sides for scale in (piece if piece is not None else [0.0] * n)]
        return Delta(to_host(codes).numpy().reshape(tuple(value.shape)), to_host(bits).reshape(base.shape),
                     {"scales": [s.hex() for s in scales], "bits": self.bits}, encoded=encoded)

    def _quantize(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                  restored: torch.Tensor, codes: torch.Tensor) -> tuple[list[float], None] | None:
        rows, tiled = _by_chunk(torch.sub(v, b, out=restored), runs, padded)
        peak = torch.maximum(rows.amax(-1), rows.amin(-1).neg_())  # NaN or inf if any change is
        if not bool(torch.isfinite(peak).all()):
            raise _NonFinite
        scales = [p / self.qmax for p in peak.double().tolist()]  # float(peak) / qmax, on the host (_divided)
        # Every chunk at once, with the same single IEEE operations as dequantize's per chunk
        # (the scale rounded to the compute dtype, q * scale, then + base), so readers agree.
        scale = torch.tensor(scales, dtype=torch.float64).to(device=v.device, dtype=v.dtype).unsqueeze(-1)
        positive = scale > 0
        if not bool(positive.any()):  # (a chunk's peak change codes to at least qmax / 2)
            return None
        divisor = torch.where(positive, scale, 1)
        q = rows.div_(divisor).round_()
        # |code| <= qmax but where a scale is subnormal (float32 changes below ~1e-36): decided per chunk,
        # by its peak (division is monotonic), without a full pass
        if bool((peak.unsqueeze(-1) / divisor).ge(self.qmax + 0.5).any()):
            q.clamp_(-self.qmax, self.qmax)
        if tiled:
            codes.view_as(q).copy_(q)
        else:
            _unchunk(q.to(torch.int8), runs, codes)
        moved = q.add_(0.0).mul_(scale)  # (code 0 is +0.0 to readers, not -0.0)
        if not tiled:
            _unchunk(moved, runs, restored)
        restored.add_(b)
        return scales, None

    def _quantize_on_host(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                          restored: torch.Tensor, codes: torch.Tensor) -> tuple[list[float], None] | None:
        from . import kernels

        scales = np.empty(len(runs))
        starts, ends = np.asarray(runs, dtype=np.int64).T
        moved = kernels.quantized(v.numpy(), b.numpy(), starts, ends, self.qmax, codes.numpy(), restored.numpy(),
                                  scales)
        if moved < 0:
            raise _NonFinite
        return (scales.tolist(), None) if moved else None

    def apply(self, stored: np.ndarray, base: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> np.ndarray:
        assert entry.params is not None
        scales = [float.fromhex(s) for s in entry.params["scales"]]
        return dequantize(to_bits(numpy_to_tensor(base, entry.dtype)), stored, region, entry.dtype,
                          tuple(entry.shape), tuple(entry.chunks), scales)

    def apply_into(self, out: np.ndarray, stored: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> None:
        out[...] = self.apply(stored, out, region, entry)


def dequantize(base: torch.Tensor, q: np.ndarray, region: tuple[slice, ...], dtype: str, shape: tuple[int, ...],
               chunks: tuple[int, ...], scales: list[float]) -> np.ndarray:
    """Bits of ``base + q * scale`` over a chunk-aligned ``region`` of a tensor of ``shape``
    (``scales``: one per chunk of the whole tensor, C order), computed on the CPU: the one
    function both the writer (for its next base) and every reader run, so they agree to the bit."""
    torch_dtype = DTYPES[dtype]
    ct = _compute_dtype(torch_dtype)
    out = base.view(torch_dtype).to(ct, copy=True)  # never write into the caller's base
    # (a copy of read-only codes: torch warns on them; ascontiguousarray would make 0-d 1-d)
    qt = torch.from_numpy(q if q.flags.c_contiguous and q.flags.writeable else q.copy()).to(ct)
    for flat, _, local in region_chunks(region, shape, chunks):
        if scales[flat]:
            out[local] += qt[local] * scales[flat]
    return to_bits(out.to(torch_dtype)).numpy().view(bits_numpy_dtype(dtype))


#: The code that stands for "this element's exact bits follow the codes" in the entropy-coded
#: lossy deltas: non-finite values, and changes their code range cannot reach.
ESCAPE = -128


def _coded_chunk(raw: np.ndarray, n: int, side: int, sparse_codes: bool) -> tuple[np.ndarray | None, np.ndarray, int]:
    """(side codes or ``None``, the ``n`` element codes, bytes read) of a stored chunk of an
    entropy-coded delta: one side code per ``side`` elements (0: none), the element codes
    behind a layout byte when ``sparse_codes`` (format 7)."""
    at, side_codes = 0, None
    if side:
        side_codes, at = ans_decode(raw, -(-n // side))
    codes, used = (decode_codes if sparse_codes else ans_decode)(raw[at:], n)
    return side_codes, codes, at + used


@dataclass(frozen=True)
class _CodedDelta(DeltaCodec):
    """Shared by the entropy-coded lossy deltas: one int8 code per element, rANS-coded per chunk
    with the chunk's own histogram (:mod:`amber_store.entropy`), escaped elements stored exact.

    A stored chunk is ``[side codes][element codes][escaped elements' raw bits]``: the side block
    (only for codecs with per-block data) in :func:`~amber_store.entropy.ans_encode`'s form, the
    element codes in :func:`~amber_store.entropy.encode_codes`'s (dense; or the gaps between the
    nonzero codes and those codes; or, from format 8, zstd-compressed nibbles; ``sparse_codes=False``:
    one dense block with no layout byte, as format 5 and 6 wrote), escapes in the order of their
    ``-128`` codes. Writer and readers
    compute the materialized value with the same single IEEE operations on the codes (a
    multiply and an add, or one multiply), so every device agrees to the bit.
    """

    min_numel: int = 256
    sparse_codes: bool = True
    shuffle: ClassVar[Shuffle] = "noshuffle"
    entropy_coded: ClassVar[bool] = True

    def applies_to(self, dtype: str, numel: int) -> bool:
        return DTYPES[dtype].is_floating_point and numel >= self.min_numel

    def storage_dtype(self, dtype: str) -> np.dtype:
        return np.dtype("int8")

    def serializer(self, dtype: str) -> dict[str, Any]:
        return AnsBytesCodec(self.side_width, self.sparse_codes).to_dict()

    @property
    def side_width(self) -> int:
        """Elements per side code (0: no side block)."""
        return 0

    def serialize(self, chunk: np.ndarray, side: np.ndarray | None = None, recon: np.ndarray | None = None) -> Any:
        assert recon is not None
        stored = self.serialize_chunks(chunk.reshape(1, -1), None if side is None else side[None], [recon])[0]
        assert stored is not None, "a chunk of zeros is not stored"
        return stored

    def serialize_chunks(self, rows: np.ndarray, sides: np.ndarray | None, recons: list[np.ndarray]) -> list[Any]:
        if self.sparse_codes:
            coded, escapes = encode_codes_many(rows, find=ESCAPE)
        else:
            coded = [ans_encode(r) if r.any() else None for r in rows]
            escapes = [np.flatnonzero(r == ESCAPE) for r in rows]
        out: list[Any] = []
        for codes, escaped, side, recon in zip(coded, escapes, [None] * len(rows) if sides is None else sides, recons):
            if codes is None:
                out.append(None)
                continue
            parts = [codes] if side is None else [ans_encode(side), codes]
            if escaped.size:  # (in the padding of an edge chunk every code is 0)
                parts.append(recon.reshape(-1)[escaped].astype(recon.dtype.newbyteorder("<")).tobytes())
            out.append(b"".join(parts))
        return out

    def _parse(self, raw: np.ndarray, n: int, bits: np.dtype
               ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
        """(side codes, element codes, escaped bits, the mask of the escaped codes) of one
        stored chunk of ``n`` elements."""
        side, codes, at = _coded_chunk(raw, n, self.side_width, self.sparse_codes)
        escaped = raw[at:].view(bits.newbyteorder("<"))
        mask = codes == ESCAPE
        if escaped.size != int(np.count_nonzero(mask)):
            raise ValueError("escaped values do not match their codes")
        return side, codes, escaped, mask

    def decode_into(self, out: np.ndarray, raw: np.ndarray, padded: int, region: tuple[slice, ...],
                    entry: TensorEntry) -> None:
        side, codes, escaped, mask = self._parse(raw, padded, out.dtype)
        codes, flat = codes[: out.size], out.reshape(-1)
        dtype = DTYPES[entry.dtype]
        if _compute_dtype(dtype) == dtype:  # (float32, float64) in place, in one pass
            self._restore_on_host(flat.view(np.float32 if dtype == torch.float32 else np.float64), codes, side)
        else:
            base = numpy_to_tensor(flat, entry.dtype).to(_compute_dtype(dtype))
            flat[...] = to_bits(self._restore(base, torch.from_numpy(codes), side).to(dtype)).numpy().view(out.dtype)
        flat[mask[: out.size]] = escaped

    def _restore(self, base: torch.Tensor, codes: torch.Tensor, side: np.ndarray | None) -> torch.Tensor:
        """``base`` (compute dtype, flat, one chunk) moved by ``codes``; escaped elements arbitrary."""
        raise NotImplementedError

    def _restore_on_host(self, values: np.ndarray, codes: np.ndarray, side: np.ndarray | None) -> None:
        """:meth:`_restore` in place, of values in their own compute dtype, by a kernel
        (:mod:`amber_store.kernels`): the same bits in one pass instead of torch's several."""
        raise NotImplementedError

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...],
             out: torch.Tensor | None = None, finish: Finish | None = None) -> Delta | None:
        delta = _quantize_in_pieces(value, base, chunks, out, self._quantize, self._quantize_on_host, finish,
                                    sided=bool(self.side_width))
        if delta is None:
            return None
        codes, bits, sides, encoded = delta
        side_codes = None
        present = [side for _, side in sides if side is not None]
        if present:  # (a piece that did not move has no side codes: its chunks are not stored)
            rows = [side if side is not None else present[0].new_zeros(n, present[0].shape[1]) for n, side in sides]
            side_codes = to_host(rows[0] if len(rows) == 1 else torch.cat(rows)).numpy()
        return Delta(to_host(codes).numpy().reshape(tuple(value.shape)), to_host(bits).reshape(base.shape),
                     self.params(), side_codes, encoded=encoded)

    def _quantize(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                  restored: torch.Tensor, codes: torch.Tensor) -> _Quantized | None:
        """A :data:`_Quantizer`: the side codes are one row per chunk."""
        raise NotImplementedError

    def _quantize_on_host(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                          restored: torch.Tensor, codes: torch.Tensor) -> _Quantized | None:
        """:meth:`_quantize` of CPU tensors by a fused kernel (:mod:`amber_store.kernels`)."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """What a reader needs to decode (the entry's ``params``)."""
        raise NotImplementedError


def _block_norms(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's 2-norm, non-finite elements counted as zero. Only when a norm is not finite
    (a non-finite element, or squares overflowing) are they masked and the norms taken in
    float64."""
    norm = torch.linalg.vector_norm(blocks, dim=-1)
    if bool(torch.isfinite(norm).all()):
        return norm
    finite = blocks.where(torch.isfinite(blocks), 0)
    return torch.linalg.vector_norm(finite.to(torch.float64), dim=-1).to(blocks.dtype)


def _divided(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` in place, correctly rounded on every device: CUDA divides by a Python
    number as a multiply by its reciprocal (an ulp off), so it goes as a tensor on x's device."""
    return x.div_(divisor if x.device.type == "cpu" else torch.tensor(divisor, dtype=x.dtype, device=x.device))


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2 ** e`` built from its exponent bits: exact on every device."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


@dataclass(frozen=True)
class BlockDeltaCodec(_CodedDelta):
    """Block-scaled quantized delta: each chunk is cut into blocks of ``block`` elements; a
    block's step is the power of two nearest ``step`` times the RMS of the block's new values,
    and each element stores ``q = round((value - base) / 2^e)``. The codes, which cluster near
    zero, and the blocks' exponents are entropy-coded. An element that moved less than half a
    step keeps its base value; the rest of its update is carried into the next delta, which is
    taken against this reconstruction (Amber's significant updates, quantized).

    The precision is relative to the values, not to the change: a step relative to the change
    lets the residual it leaves grow with the change, step after step (measured on AdamW
    weights over a 10-step chain, 4 RMS changes left 3x a step's update behind: 2.6x the error
    of ``step=0.1``, for no fewer bytes), and blocks of equal changes, such as Adam's first
    ``+-lr`` updates, would never move at all.

    Error bound, at every step of a chain: ``|restored - value| <= 2^e / 2`` per element of a
    block, with ``2^e <= sqrt(2) * step * rms(block's values)``, unless a larger power of two
    is needed to keep ``|q| <= 127`` (the smallest that does: a change of more than ``127 /
    sqrt(2) / step`` RMS values, e.g. a block whose values collapse), plus the rounding of the
    result to the tensor's dtype; non-finite values are exact. Signs are not preserved: a
    second moment near zero may come back negative, so use :class:`RatioDeltaCodec` for those
    (the ``"lossy"`` preset does).
    """

    name: ClassVar[str] = "amber.block_delta"
    encoding: ClassVar[str] = "block"
    step: float = 0.1
    block: int = 256

    def __post_init__(self) -> None:
        if not 0.001 < self.step <= 64:
            raise ValueError("BlockDeltaCodec step (a fraction of a block's RMS value) must be within (0.001, 64]")
        if not 1 <= self.block <= 1 << 16:
            raise ValueError("BlockDeltaCodec block must be within [1, 65536]")

    @property
    def side_width(self) -> int:
        return self.block

    @property
    def batch_align(self) -> int:
        return self.block  # (blocks count from each tensor's start)

    @classmethod
    def for_entry(cls, entry: TensorEntry) -> DeltaCodec:
        params = entry.params or {}
        return cls(block=params["block"], sparse_codes=params.get("sparse_codes", False))

    def params(self) -> dict[str, Any]:
        return {"block": self.block, "sparse_codes": self.sparse_codes}

    def _quantize(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                  restored: torch.Tensor, codes: torch.Tensor) -> _Quantized | None:
        width = round_up(padded, self.block)

        def blocked(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
            # blocks are counted from each chunk's start: (chunks, blocks, block)
            rows, tiled = _by_chunk(x, runs, width)
            return rows.view(len(runs), -1, self.block), tiled

        # Few passes and no fresh buffers beyond the change itself: this runs on the training
        # host's CPU when there is no accelerator. The change's peak (NaN or inf if any element
        # of it is) sizes the fit rule and detects the elements to escape.
        changes, whole = blocked(torch.sub(v, b, out=restored))
        # (amax and amin: a third of the time of aminmax along a short last dimension)
        peak = torch.maximum(changes.amax(-1), changes.amin(-1).neg_())
        exact = None
        if not bool(torch.isfinite(peak).all()):
            unknown = ~torch.isfinite(changes)
            changes.masked_fill_(unknown, 0)  # (an infinity that stays, as in a causal mask, is a change of 0)
            exact = unknown & blocked(v != b)[0]
            exact = exact if bool(exact.any()) else None
            peak = changes.abs().amax(-1)
        rms = _divided(_block_norms(blocked(v)[0]), math.sqrt(self.block))
        e = torch.log2(rms.mul_(self.step)).round_().nan_to_num_(0, posinf=126, neginf=-126)
        # never so fine that a code leaves +-127 (a change far above the block's RMS value)
        fit = torch.log2(_divided(peak.clone(), 127)).ceil_().nan_to_num_(0, posinf=126, neginf=-126)
        e = torch.maximum(e, fit).clamp_(-126, 126)  # 2^e and 2^-e normal: multiplying by them is exact
        inverse = _pow2(-e, v.dtype)
        # A code is nonzero iff its change is over half a step (0.5 rounds to even, 0), and
        # leaves +-127 only where e hit its cap (float64 changes beyond 1e40): both decided per
        # block (the scaled peak is exactly the largest scaled change), without a full pass.
        scaled = peak.mul_(inverse)
        if exact is None and not bool(scaled.gt(0.5).any()):
            return None
        q = changes.mul_(inverse.unsqueeze(-1)).round_()
        if bool(scaled.ge(127.5).any()):
            q.clamp_(-127, 127)
        if whole:
            codes.view_as(q).copy_(q)
        else:
            _unchunk(q.to(torch.int8).view(len(runs), -1), runs, codes)
        moved = q.add_(0.0).mul_(_pow2(e, v.dtype).unsqueeze(-1))  # (code 0 is +0.0 to readers, not -0.0)
        if not whole:
            _unchunk(moved.view(len(runs), -1), runs, restored)
        restored.add_(b)
        if exact is not None:
            exact = exact.view(-1) if whole else _unchunk(exact.view(len(runs), -1), runs, torch.empty_like(codes, dtype=torch.bool))
            codes.masked_fill_(exact, ESCAPE)
        return e.to(torch.int8), exact

    def _quantize_on_host(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                          restored: torch.Tensor, codes: torch.Tensor) -> _Quantized | None:
        from . import kernels

        width = round_up(padded, self.block)
        side = np.empty((len(runs), width // self.block), dtype=np.int8)
        starts, ends = np.asarray(runs, dtype=np.int64).T
        moved, escapes = kernels.block(v.numpy(), b.numpy(), starts, ends, width, self.block, self.step,
                                       codes.numpy(), restored.numpy(), side)
        if not moved:
            return None
        return torch.from_numpy(side), (codes == ESCAPE) if escapes else None

    def _restore(self, base: torch.Tensor, codes: torch.Tensor, side: np.ndarray | None) -> torch.Tensor:
        assert side is not None
        scale = _pow2(torch.from_numpy(side), base.dtype).repeat_interleave(self.block)[: base.numel()]
        return base + codes.to(base.dtype) * scale

    def _restore_on_host(self, values: np.ndarray, codes: np.ndarray, side: np.ndarray | None) -> None:
        from . import kernels

        assert side is not None
        kernels.unblock(values, codes, side, self.block)


@dataclass(frozen=True)
class RatioDeltaCodec(_CodedDelta):
    """Multiplicative delta for positive tensors such as Adam's ``exp_avg_sq``: each element
    stores ``q = round(log(value / base) / log(1 + step))`` and is restored as
    ``base * (1 + step)^q``, so small and large elements keep the same relative precision (an
    absolute step would zero the small second moments that divide Adam's update). Elements
    that are not positive, non-finite, or beyond ``|q| <= 127`` are stored exact.

    Error bound, at every step of a chain: ``restored / value`` is within
    ``(1 + step)^(+-1/2)`` (plus the rounding of the result to the tensor's dtype).
    """

    name: ClassVar[str] = "amber.ratio_delta"
    encoding: ClassVar[str] = "ratio"
    step: float = 0.05

    def __post_init__(self) -> None:
        if not 1e-4 <= self.step <= 1:
            raise ValueError("RatioDeltaCodec step (relative) must be within [1e-4, 1]")

    @classmethod
    def for_entry(cls, entry: TensorEntry) -> DeltaCodec:
        params = entry.params or {}
        return cls(step=params["step"], sparse_codes=params.get("sparse_codes", False))

    @property
    def batch_align(self) -> int:
        return 1  # (element by element)

    def params(self) -> dict[str, Any]:
        return {"step": self.step, "sparse_codes": self.sparse_codes}

    @functools.lru_cache(maxsize=16)  # (per codec, dtype and device: a lossy save asks per piece)
    def _factors(self, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """``(1 + step)^q`` for q = -128..127 by repeated IEEE double products (no libm, so
        every reader computes the same table); index 0 (the escape) is unused."""
        up, down = [1.0], [1.0]
        for _ in range(127):
            up.append(up[-1] * (1 + self.step))
            down.append(down[-1] / (1 + self.step))
        return torch.tensor([1.0] + down[:0:-1] + up, dtype=torch.float64).to(dtype).to(device)

    def _quantize(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                  restored: torch.Tensor, codes: torch.Tensor) -> _Quantized | None:
        # NaN, infinities and signs all surface as a non-finite or out-of-range q (or v <= 0)
        # (log2: half the time of log here; the code is the writer's choice, readers use the table)
        q = torch.div(v, b, out=restored).log2_().mul_(1 / math.log2(1 + self.step)).round_()
        low, high = torch.aminmax(q)  # NaN if any element is
        exact = None
        if bool(low >= -127) and bool(high <= 127) and bool(v.amin() > 0):  # every element codes
            if not (bool(low) or bool(high)):
                return None
            codes.copy_(q)
        else:
            ok = (q.abs() <= 127) & (v > 0)
            codes.copy_(q.nan_to_num_(0).clamp_(-127, 127))
            # (an element equal to its base has q = 0, or NaN for 0/0 and inf/inf: code 0 already)
            exact = ~ok & (v != b)
            codes.masked_fill_(exact, ESCAPE)
            if not int(torch.count_nonzero(codes)):  # (a third of the time of any() on int8)
                return None
        self._restore(b, codes, None, out=restored)  # (q is spent: its buffer is free)
        return None, exact

    @functools.cached_property
    def _bounds(self) -> np.ndarray:
        """Where the host kernel's codes change: ``(1 + step)^(q + 1/2)`` for q = -128..127."""
        return np.power(1 + self.step, np.arange(256) - 127.5)

    def _quantize_on_host(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                          restored: torch.Tensor, codes: torch.Tensor) -> _Quantized | None:
        from . import kernels

        nonzero, escapes = kernels.ratio(v.numpy(), b.numpy(), self._factors(v.dtype).numpy(), self._bounds,
                                         1 / math.log(1 + self.step), codes.numpy(), restored.numpy())
        if not (nonzero or escapes):
            return None
        return None, (codes == ESCAPE) if escapes else None

    def _restore(self, base: torch.Tensor, codes: torch.Tensor, side: np.ndarray | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        factors = self._factors(base.dtype, base.device)
        out = torch.empty_like(base) if out is None else out
        # index_select with int32 indices: half the time of advanced indexing. In pieces: the
        # indices of a whole large tensor would be a fresh buffer 4x the codes (page faults).
        index = torch.empty(min(_PIECE, codes.numel()), dtype=torch.int32, device=codes.device)
        for lo in range(0, codes.numel(), _PIECE):
            hi = min(lo + _PIECE, codes.numel())
            torch.index_select(factors, 0, index[: hi - lo].copy_(codes[lo:hi]).add_(128), out=out[lo:hi])
        return out.mul_(base)

    def _restore_on_host(self, values: np.ndarray, codes: np.ndarray, side: np.ndarray | None) -> None:
        from . import kernels

        kernels.unratio(values, codes, self._factors(torch.from_numpy(values).dtype).numpy())


@dataclass(frozen=True)
class _Serializer(ArrayBytesCodec):
    """An array-to-bytes codec without configuration."""

    name: ClassVar[str]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        parse_named_configuration(data, cls.name, require_configuration=False)
        return cls()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name}


def sparse_encode(chunk: np.ndarray) -> bytes:
    """A mostly-zero chunk as ``[n: u32][n index gaps: u32][n values]``, little-endian."""
    flat = chunk.reshape(-1)
    idx = np.flatnonzero(flat != 0)  # (of a mask: a fifth of the time on a u32 chunk)
    return sparse_pack(idx, flat[idx])


def sparse_pack(positions: np.ndarray, values: np.ndarray) -> bytes:
    """:func:`sparse_encode` of a chunk whose nonzero elements are ``values`` at ``positions``
    (ascending)."""
    gaps = np.diff(positions, prepend=0).astype("<u4")
    return b"".join([np.uint32(len(positions)).astype("<u4").tobytes(), gaps.tobytes(),
                     values.astype(values.dtype.newbyteorder("<")).tobytes()])


def sparse_decode(raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    n = int(raw[:4].view("<u4")[0])
    idx = np.cumsum(raw[4 : 4 + 4 * n].view("<u4"), dtype=np.uint64)
    out = np.zeros(int(np.prod(shape)), dtype=dtype)
    out[idx] = raw[4 + 4 * n :].view(dtype.newbyteorder("<"))
    return out.reshape(shape)


def pack4_encode(chunk: np.ndarray) -> bytes:
    """int8 codes in [-7, 7] as nibbles ``code + 8``, two per byte (low nibble first; an odd
    count pads code 0), in one pass that releases the GIL (:func:`amber_store.kernels.pack4`)."""
    from . import kernels

    codes = np.ascontiguousarray(chunk).reshape(-1)
    packed = np.empty((codes.size + 1) // 2, np.uint8)
    kernels.pack4(codes, packed)
    return packed.tobytes()


def pack4_decode(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    codes = np.empty(raw.size * 2, dtype=np.int8)
    codes[0::2] = (raw & 0x0F).astype(np.int8) - 8
    codes[1::2] = (raw >> 4).astype(np.int8) - 8
    return codes[:n].reshape(shape)


@dataclass(frozen=True)
class SparseBytesCodec(_Serializer):
    """zarr serializer of :func:`sparse_encode`."""

    name: ClassVar[str] = "amber.sparse"

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return chunk_spec.prototype.buffer.from_bytes(sparse_encode(np.ascontiguousarray(chunk_array.as_numpy_array())))

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        out = sparse_decode(chunk_bytes.as_numpy_array().view(np.uint8), chunk_spec.shape,
                            chunk_spec.dtype.to_native_dtype())
        return chunk_spec.prototype.nd_buffer.from_numpy_array(out)

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError  # variable size


@dataclass(frozen=True)
class Pack4BytesCodec(_Serializer):
    """zarr serializer of :func:`pack4_encode`."""

    name: ClassVar[str] = "amber.pack4"

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return chunk_spec.prototype.buffer.from_bytes(pack4_encode(np.ascontiguousarray(chunk_array.as_numpy_array())))

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        out = pack4_decode(chunk_bytes.as_numpy_array().view(np.uint8), chunk_spec.shape)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(out)

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return (input_byte_length + 1) // 2


@dataclass(frozen=True)
class AnsBytesCodec(ArrayBytesCodec):
    """zarr serializer of the entropy-coded lossy deltas (:class:`BlockDeltaCodec`,
    :class:`RatioDeltaCodec`): decodes a chunk to its int8 codes. ``side``: elements per side
    code (a block's exponent), 0 for none. ``sparse_codes``: the element codes start with a
    layout byte (format 7, a third layout in 8; absent from older metadata). Encoding needs the codec's base, so
    only amber-store writes these chunks."""

    name: ClassVar[str] = "amber.ans"
    side: int = 0
    sparse_codes: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        _, config = parse_named_configuration(data, cls.name)
        return cls(**config)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"side": self.side, "sparse_codes": self.sparse_codes}}

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        raise NotImplementedError("amber.ans chunks are written by amber-store, which has the base")

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        raw = chunk_bytes.as_numpy_array().view(np.uint8)
        codes = _coded_chunk(raw, int(np.prod(chunk_spec.shape)), self.side, self.sparse_codes)[1]
        return chunk_spec.prototype.nd_buffer.from_numpy_array(codes.reshape(chunk_spec.shape))

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError  # variable size


_DELTA_CODECS = (XorDeltaCodec, DiffDeltaCodec, SparseDeltaCodec, QuantizedDeltaCodec, BlockDeltaCodec,
                 RatioDeltaCodec)
for _codec in (*_DELTA_CODECS, SparseBytesCodec, Pack4BytesCodec, AnsBytesCodec):
    register_codec(_codec.name, _codec)

DELTA_ENCODINGS = {c.encoding: c for c in _DELTA_CODECS}

CodecLike = Union[str, DeltaCodec]
CodecPolicy = Union[CodecLike, Sequence[tuple[str, CodecLike]]]
_NAMED: dict[str, DeltaCodec] = {
    "lossless": DiffDeltaCodec(),
    "diff": DiffDeltaCodec(),
    "xor": XorDeltaCodec(),
    "sparse": SparseDeltaCodec(),
    "quant8": QuantizedDeltaCodec(bits=8),
    "quant4": QuantizedDeltaCodec(bits=4),
    "block": BlockDeltaCodec(),
    "ratio": RatioDeltaCodec(),
}

#: Named policies. ``"lossy"``, the recommended lossy preset: Adam's second moments (positive,
#: dividing the update) by ratio within 10%; weights (and every other float tensor) by blocks
#: to 7% of a block's RMS value; Adam's first moment, which changes wholesale between
#: checkpoints and costs the most to keep, coarsely (its error fades within a few dozen steps).
#: benchmarks/lossy.py measures it against finer and coarser settings.
PRESETS: dict[str, list[tuple[str, DeltaCodec]]] = {
    "lossy": [("*exp_avg_sq", RatioDeltaCodec(step=0.2)), ("*exp_avg", BlockDeltaCodec(step=6.0)),
              ("*", BlockDeltaCodec(step=0.1))],
}


def codec_named(codec: CodecLike) -> DeltaCodec:
    if isinstance(codec, DeltaCodec):
        return codec
    try:
        return _NAMED[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; use one of {sorted(_NAMED)} or a DeltaCodec (or, for a whole "
                         f"store, a preset: {sorted(PRESETS)})") from None


class Policy:
    """Which delta codec each tensor gets: one codec for all (default ``"lossless"``, the
    :class:`DiffDeltaCodec`), or rules ``[(pattern, codec), ...]`` matched in order against the
    tensor key with :mod:`fnmatch` (e.g. ``[("optim/*", "sparse"), ("*", "lossless")]``), or a
    preset's name (:data:`PRESETS`). Unmatched tensors, and tensors a lossy codec does not apply
    to (integers, bool, fewer than its ``min_numel`` elements, such as Adam's step counters),
    stay lossless."""

    def __init__(self, policy: CodecPolicy = "lossless") -> None:
        if isinstance(policy, str) and policy in PRESETS:
            policy = PRESETS[policy]
        rules = [("*", policy)] if isinstance(policy, (str, DeltaCodec)) else list(policy)
        self.rules = [(pattern, codec_named(c)) for pattern, c in rules]

    def for_tensor(self, key: str, dtype: str, numel: int) -> DeltaCodec:
        for pattern, codec in self.rules:
            if fnmatch.fnmatchcase(key, pattern):
                return codec if codec.applies_to(dtype, numel) else _NAMED["lossless"]
        return _NAMED["lossless"]


BLOSC_BLOCK = 1 << 20

# Chunks are framed by python-blosc, the Blosc project's binding of c-blosc 1.x: the frames zarr's
# "blosc" codec (numcodecs) reads, but with c-blosc's AVX2 shuffles, which numcodecs' wheels
# compile out (measured, 2 codec threads, 4 MiB of fp32 values: bit-unshuffle + lz4 0.72 vs
# 1.07 ms, compression 1.31 vs 1.61 ms). Its settings are process-wide, so set once here: calls
# release the GIL and run one thread each (the codec pools run them in parallel), blocks of
# BLOSC_BLOCK. Another setting (a user's own) changes only speed; frames name their own block.
blosc.set_releasegil(True)
blosc.set_nthreads(1)
blosc.set_blocksize(BLOSC_BLOCK)


@dataclass(frozen=True)
class Compression:
    """How stored chunks are compressed: blosc, with a compressor and shuffle chosen by what
    the chunk holds (:meth:`blosc`), at ``level``, then a crc32c (the zarr codecs ``blosc``,
    ``crc32c``). Decompression needs no configuration: a blosc header names its compressor and
    shuffle.

    ``compressor``: ``"auto"`` (default) compresses the raw values of full steps with lz4, the
    lossless deltas of large tensors with their codec's choice (:class:`DiffDeltaCodec`: lz4,
    bit-shuffled; :class:`XorDeltaCodec`: zstd) and packs of small tensors' deltas with zstd
    (a small share of a large model's bytes, where the ratio is worth more than the speed: the
    pack compresses beside the encoding of the next tensors); ``"lz4"`` or ``"zstd"`` use that
    one for all. Measured on fp32 AdamW state (2 cores): raw values bit-shuffled compress 1.15x
    with lz4 at 0.97 GB/s a core, 1.17-1.20x with zstd at 0.34-0.67 GB/s; XOR deltas
    byte-shuffled 1.75x with zstd at 0.30 GB/s, 1.56x with lz4 at 0.64 GB/s; integer-difference
    deltas 1.63x with lz4 (bit-shuffled) at 0.9 GB/s, 1.78x with zstd. Lossy codes are always zstd:
    their near-zero codes need its entropy coder (lz4 stores quant4 deltas 1.6x larger).
    """

    compressor: str = "auto"
    level: int = 1

    def __post_init__(self) -> None:
        if self.compressor not in ("auto", "zstd", "lz4"):
            raise ValueError(f"compressor must be 'auto', 'lz4' or 'zstd', not {self.compressor!r}")

    def blosc(self, delta: DeltaCodec | None, packed: bool = False) -> tuple[str, Shuffle, int]:
        """(compressor, shuffle, level) of a chunk stored with ``delta`` (``None``: raw values
        of a full step, bit-shuffled so that sign and exponent bits line up across elements),
        ``packed``: a part of a pack. Entropy-coded chunks are only framed (level 0)."""
        if delta is None:
            return ("lz4" if self.compressor == "auto" else self.compressor), "bitshuffle", self.level
        if delta.entropy_coded:
            return "lz4", "noshuffle", 0
        if not isinstance(delta, LosslessDeltaCodec):
            return "zstd", delta.shuffle, self.level
        cname = self.compressor if self.compressor != "auto" else "zstd" if packed else delta.auto_compressor
        return cname, delta.shuffle_for(cname), self.level

    def config(self, typesize: int, delta: DeltaCodec | None, packed: bool = False) -> dict[str, Any]:
        """The zarr ``blosc`` codec metadata matching :meth:`compress`."""
        cname, shuffle, level = self.blosc(delta, packed)
        return {"name": "blosc", "configuration": {
            "typesize": typesize, "cname": cname, "clevel": level,
            "shuffle": _effective(shuffle, typesize), "blocksize": BLOSC_BLOCK}}

    def inner_codecs(self, dtype: str, delta: DeltaCodec | None) -> list[dict[str, Any]]:
        """The codec chain of one stored chunk of a ``dtype`` tensor, as zarr v3 metadata
        (inside ``sharding_indexed``)."""
        if delta is None or isinstance(delta, LosslessDeltaCodec):
            serializer: dict[str, Any] = {"name": "bytes", "configuration": {"endian": "little"}}
        else:
            serializer = delta.serializer(dtype)
        chain = [delta.to_dict()] if delta is not None else []
        return chain + [serializer, self.config(itemsize(dtype), delta), {"name": "crc32c"}]

    def compress(self, payload: Any, typesize: int, delta: DeltaCodec | None, packed: bool = False) -> list[bytes]:
        """One stored chunk of ``delta`` (``None``: raw values; ``packed``: a pack's part), as
        the parts to lay end to end: the blosc frame and its crc32c (kept apart: writers gather
        them without a copy). Releases the GIL, so chunks compress in parallel."""
        cname, shuffle, level = self.blosc(delta, packed)
        packed = blosc.compress(payload, typesize, level, _BLOSC_SHUFFLE[_effective(shuffle, typesize)], cname)
        return [packed, crc32c.crc32c(packed).to_bytes(4, "little")]


_BLOSC_SHUFFLE = {"noshuffle": blosc.NOSHUFFLE, "shuffle": blosc.SHUFFLE, "bitshuffle": blosc.BITSHUFFLE}


def _effective(shuffle: Shuffle, typesize: int) -> Shuffle:
    return "noshuffle" if shuffle == "shuffle" and typesize == 1 else shuffle


#: A blosc 1.x frame's header: version, versionlz, flags, typesize, then its uncompressed size,
#: block size and frame size (little-endian uint32 each).
_BLOSC_HEADER = 16


def decompress(stored: Any, out: np.ndarray | None = None) -> np.ndarray | None:
    """Check a stored chunk's crc32c and decompress it (into the front of ``out``, a contiguous
    buffer at least the chunk's size, when given).

    Returns the uint8 payload, or ``None`` if the checksum or the decoding failed.
    """
    view = memoryview(stored).cast("B")
    if len(view) < _BLOSC_HEADER + 4:
        return None
    body, tail = view[:-4], view[-4:]
    if crc32c.crc32c(body) != int.from_bytes(tail, "little"):
        return None
    try:
        if out is None:
            return np.frombuffer(blosc.decompress(body), dtype=np.uint8)
        if not out.flags.c_contiguous:
            raise ValueError("decompress needs a contiguous output buffer")
        # python-blosc writes as many bytes as the frame's header says, unchecked
        if int.from_bytes(body[4:8], "little") > out.nbytes:
            return None
        blosc.decompress_ptr(body, out.ctypes.data)
        return out
    except BloscError:
        return None


__all__ = [
    "AnsBytesCodec", "BlockDeltaCodec", "CodecPolicy", "Delta", "DeltaCodec", "PRESETS", "Pack4BytesCodec", "Policy",
    "QuantizedDeltaCodec", "RatioDeltaCodec", "SparseBytesCodec",
    "SparseDeltaCodec", "XorDeltaCodec", "DiffDeltaCodec", "LosslessDeltaCodec", "codec_named", "Compression", "codec_pool", "decompress", "dequantize",
]


_SCRATCH = threading.local()


def scratch(nbytes: int, slot: int = 0) -> np.ndarray:
    """A reusable byte buffer of the calling (codec) thread, so chunks are encoded and decoded
    without a fresh allocation each; valid until that thread's next call for the same ``slot``
    (a chunk's stored bytes take slot 0; codecs' temporaries the others)."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = bufs[slot] = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


#: threads of :func:`codec_pool`: one per core
CODEC_THREADS = os.cpu_count() or 2
_POOL_NAME = "amber-codec"
_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's one pool of threads named ``name``, made at first use with ``workers``
    threads and shared by every store."""
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        return pool


def codec_pool() -> ThreadPoolExecutor:
    """The threads that XOR, checksum, compress and decompress chunks (all release the GIL),
    one per core."""
    return shared_pool(_POOL_NAME, CODEC_THREADS)
