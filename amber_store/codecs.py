"""Delta and compression codecs, as zarr v3 codecs recorded in every array's metadata.

A delta codec has two faces. On the writer's side, :meth:`DeltaCodec.diff` turns a tensor and
the *reconstructed* value of its base into the stored delta with torch ops on the tensor's
device, and returns the new reconstruction (what a reader will materialize), which becomes the
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
``xor``         lossless          ``bits(value) XOR bits(base)``; unchanged chunks are zero
``sparse``      lossy, floats     XOR kept only where ``|value - base| > threshold * |base|``
                                  (or the ``topk`` largest updates); the rest keep the base
``quant8/4``    lossy, floats     ``round((value - base) / scale)``, one scale per chunk
==============  ================  =============================================================
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, Sequence, Union

import numpy as np
import torch
from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec
from zarr.core.common import parse_named_configuration
from zarr.registry import register_codec

from .format import (
    DTYPES,
    TensorEntry,
    bits_numpy_dtype,
    bits_to_numpy,
    dtype_name,
    itemsize,
    numpy_to_tensor,
    region_chunks,
    to_bits,
    whole,
)

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer


@dataclass
class Delta:
    """What a delta codec produced for one tensor: the array to store (host), the bits a reader
    will materialize, and per-tensor parameters for the manifest."""

    data: np.ndarray
    recon: torch.Tensor
    params: dict[str, Any] | None = None


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
        return replace(self, base_step=step, base_array=array)

    def applies_to(self, dtype: str, numel: int) -> bool:
        return True

    def storage_dtype(self, dtype: str) -> np.dtype:
        """dtype of the zarr array holding this codec's deltas."""
        return bits_numpy_dtype(dtype)

    def serializer(self, dtype: str) -> dict[str, Any]:
        return {"name": "bytes", "configuration": {"endian": "little"}}

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...]) -> Delta | None:
        """Delta of ``value`` (on its device) against host ``base`` bits; ``None`` if a reader
        would materialize exactly ``base`` (the tensor is then stored as ``same``)."""
        raise NotImplementedError

    def apply(self, stored: np.ndarray, base: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> np.ndarray:
        """Materialized bits of ``region`` of ``entry``'s tensor from its stored delta and base bits."""
        return np.bitwise_xor(stored, base, out=stored)

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> NDBuffer:
        return chunk_array

    async def _decode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> NDBuffer:
        return chunk_array

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return input_byte_length


@dataclass(frozen=True)
class XorDeltaCodec(DeltaCodec):
    """Bit-exact delta: the chunk holds ``raw_bits(value) XOR raw_bits(base)``."""

    name: ClassVar[str] = "amber.xor_delta"
    encoding: ClassVar[str] = "xor"
    lossless: ClassVar[bool] = True

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...]) -> Delta | None:
        bits = to_bits(value)
        delta = torch.bitwise_xor(bits, base.to(bits.device, non_blocking=True))
        if not bool(delta.any()):
            return None
        host = delta.to("cpu")
        return Delta(bits_to_numpy(host), torch.bitwise_xor(base, host))




def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...]) -> Delta | None:
        b = base.to(value.device, non_blocking=True)
        ct = _compute_dtype(value.dtype)
        v, bv = value.to(ct), b.view(value.dtype).to(ct)
        moved = (v - bv).abs()
        if self.topk is not None:
            k = max(1, math.ceil(self.topk * moved.numel())) if moved.numel() else 0
            keep = torch.zeros_like(moved, dtype=torch.bool)
            if k:
                keep.view(-1)[moved.view(-1).nan_to_num(math.inf).topk(k).indices] = True
        else:
            keep = moved > self.threshold * bv.abs()
        keep |= ~torch.isfinite(v) | ~torch.isfinite(bv)  # NaN/inf never compare: keep them exact
        xor = torch.bitwise_xor(to_bits(value), b)
        keep &= xor != 0
        idx = keep.view(-1).nonzero().view(-1)
        if idx.numel() == 0:
            return None
        # Only the kept elements leave the device; the dense delta is rebuilt on the host.
        host_idx, host_vals = idx.to("cpu"), xor.view(-1)[idx].to("cpu")
        dense = torch.zeros_like(base)
        dense.view(-1)[host_idx] = host_vals
        return Delta(bits_to_numpy(dense), torch.bitwise_xor(base, dense), {"kept": int(idx.numel())})


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

    def serializer(self, dtype: str) -> dict[str, Any]:
        return Pack4BytesCodec().to_dict() if self.bits == 4 else {"name": "bytes", "configuration": {}}

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...]) -> Delta | None:
        ct = _compute_dtype(value.dtype)
        d = value.to(ct) - base.to(value.device, non_blocking=True).view(value.dtype).to(ct)
        if not bool(torch.isfinite(d).all()):
            return XorDeltaCodec().diff(value, base, chunks)  # never quantize NaN/inf
        shape = tuple(value.shape)
        q = torch.zeros(shape, dtype=torch.int8, device=value.device)
        scales = []
        for _, _, sl in region_chunks(whole(shape), shape, chunks):
            peak = float(d[sl].abs().max()) if d[sl].numel() else 0.0
            scale = peak / self.qmax
            scales.append(scale)
            if scale > 0:
                q[sl] = torch.round(d[sl] / scale).clamp_(-self.qmax, self.qmax).to(torch.int8)
        if not bool(q.any()):
            return None
        host_q = q.to("cpu")
        recon = dequantize(base, host_q.numpy(), whole(shape), dtype_name(value.dtype),
                           shape, chunks, scales)
        return Delta(host_q.numpy(), torch.from_numpy(recon).view(base.dtype), {"scales": [s.hex() for s in scales]})

    def apply(self, stored: np.ndarray, base: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> np.ndarray:
        assert entry.params is not None
        scales = [float.fromhex(s) for s in entry.params["scales"]]
        return dequantize(to_bits(numpy_to_tensor(base, entry.dtype)), stored, region, entry.dtype,
                          tuple(entry.shape), tuple(entry.chunks), scales)


def dequantize(base: torch.Tensor, q: np.ndarray, region: tuple[slice, ...], dtype: str, shape: tuple[int, ...],
               chunks: tuple[int, ...], scales: list[float]) -> np.ndarray:
    """Bits of ``base + q * scale`` over a chunk-aligned ``region`` of a tensor of ``shape``
    (``scales``: one per chunk of the whole tensor, C order), computed on the CPU: the one
    function both the writer (for its next base) and every reader run, so they agree to the bit."""
    torch_dtype = DTYPES[dtype]
    ct = _compute_dtype(torch_dtype)
    out = base.view(torch_dtype).to(ct)
    qt = torch.from_numpy(q if q.flags.c_contiguous else q.copy()).to(ct)  # (ascontiguousarray makes 0-d 1-d)
    for flat, _, local in region_chunks(region, shape, chunks):
        if scales[flat]:
            out[local] += qt[local] * scales[flat]
    return to_bits(out.to(torch_dtype)).numpy().view(bits_numpy_dtype(dtype))


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


@dataclass(frozen=True)
class SparseBytesCodec(_Serializer):
    """Serializes a mostly-zero chunk as ``[n: u32][n index gaps: u32][n values]``."""

    name: ClassVar[str] = "amber.sparse"

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        flat = np.ascontiguousarray(chunk_array.as_numpy_array()).reshape(-1)
        idx = np.flatnonzero(flat).astype(np.uint32)
        gaps = np.diff(idx, prepend=np.uint32(0)).astype("<u4")
        payload = b"".join([np.uint32(len(idx)).astype("<u4").tobytes(), gaps.tobytes(),
                            flat[idx].astype(flat.dtype.newbyteorder("<")).tobytes()])
        return chunk_spec.prototype.buffer.from_bytes(payload)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        raw = chunk_bytes.as_numpy_array().view(np.uint8)
        n = int(raw[:4].view("<u4")[0])
        idx = np.cumsum(raw[4 : 4 + 4 * n].view("<u4"), dtype=np.uint64)
        dtype = chunk_spec.dtype.to_native_dtype()
        vals = raw[4 + 4 * n :].view(dtype.newbyteorder("<"))
        out = np.zeros(int(np.prod(chunk_spec.shape)), dtype=dtype)
        out[idx] = vals
        return chunk_spec.prototype.nd_buffer.from_numpy_array(out.reshape(chunk_spec.shape))

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError  # variable size


@dataclass(frozen=True)
class Pack4BytesCodec(_Serializer):
    """Serializes int8 codes in [-7, 7] as 4-bit nibbles, two per byte."""

    name: ClassVar[str] = "amber.pack4"

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        flat = (np.ascontiguousarray(chunk_array.as_numpy_array()).reshape(-1).astype(np.int16) + 8).astype(np.uint8)
        if flat.size % 2:
            flat = np.append(flat, np.uint8(8))
        return chunk_spec.prototype.buffer.from_bytes((flat[0::2] | (flat[1::2] << 4)).tobytes())

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        packed = chunk_bytes.as_numpy_array().view(np.uint8)
        n = int(np.prod(chunk_spec.shape))
        codes = np.empty(packed.size * 2, dtype=np.int8)
        codes[0::2] = (packed & 0x0F).astype(np.int8) - 8
        codes[1::2] = (packed >> 4).astype(np.int8) - 8
        return chunk_spec.prototype.nd_buffer.from_numpy_array(codes[:n].reshape(chunk_spec.shape))

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return (input_byte_length + 1) // 2


for _codec in (XorDeltaCodec, SparseDeltaCodec, QuantizedDeltaCodec, SparseBytesCodec, Pack4BytesCodec):
    register_codec(_codec.name, _codec)

XOR_DELTA = XorDeltaCodec.name
DELTA_ENCODINGS = {c.encoding: c for c in (XorDeltaCodec, SparseDeltaCodec, QuantizedDeltaCodec)}

CodecLike = Union[str, DeltaCodec]
CodecPolicy = Union[CodecLike, Sequence[tuple[str, CodecLike]]]
_NAMED: dict[str, DeltaCodec] = {
    "xor": XorDeltaCodec(),
    "lossless": XorDeltaCodec(),
    "sparse": SparseDeltaCodec(),
    "quant8": QuantizedDeltaCodec(bits=8),
    "quant4": QuantizedDeltaCodec(bits=4),
}


def codec_named(codec: CodecLike) -> DeltaCodec:
    if isinstance(codec, DeltaCodec):
        return codec
    try:
        return _NAMED[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; use one of {sorted(_NAMED)} or a DeltaCodec") from None


class Policy:
    """Which delta codec each tensor gets: ``"xor"`` for all, one codec for all, or rules
    ``[(pattern, codec), ...]`` matched in order against the tensor key with :mod:`fnmatch`
    (e.g. ``[("optim/*", "sparse"), ("*", "xor")]``). Unmatched tensors, and tensors a lossy
    codec does not apply to (integers, bool, fewer than its ``min_numel`` elements, such as
    Adam's step counters), stay lossless."""

    def __init__(self, policy: CodecPolicy = "xor") -> None:
        rules = [("*", policy)] if isinstance(policy, (str, DeltaCodec)) else list(policy)
        self.rules = [(pattern, codec_named(c)) for pattern, c in rules]

    def for_tensor(self, key: str, dtype: str, numel: int) -> DeltaCodec:
        for pattern, codec in self.rules:
            if fnmatch.fnmatchcase(key, pattern):
                return codec if codec.applies_to(dtype, numel) else _NAMED["xor"]
        return _NAMED["xor"]


def storage_codecs(dtype: str, level: int, delta: DeltaCodec | None) -> list[dict[str, Any]]:
    """The codec chain of one tensor array, as zarr v3 metadata.

    Blosc's SIMD byte shuffle groups the sign/exponent bytes of each element, which barely
    change between steps and XOR to zero runs; zstd level 1 inside 1 MiB blosc blocks measured
    as ratio-equal to level 3 on XOR deltas and 3-4x faster (numcodecs' standalone shuffle ran
    at 0.38 GB/s, blosc's at over 1 GB/s on 2 cores). Sparse and quantized deltas are already
    compact, so plain zstd follows their serializers. crc32c last catches a damaged object
    before it is decoded.
    """
    if delta is not None and not isinstance(delta, XorDeltaCodec):
        return [delta.to_dict(), delta.serializer(dtype),
                {"name": "zstd", "configuration": {"level": level, "checksum": False}}, {"name": "crc32c"}]
    width = itemsize(dtype)
    chain: list[dict[str, Any]] = [delta.to_dict()] if delta is not None else []
    chain.append({"name": "bytes", "configuration": {"endian": "little"}})
    chain.append({
        "name": "blosc",
        "configuration": {
            "typesize": width,
            "cname": "zstd",
            "clevel": level,
            "shuffle": "shuffle" if width > 1 else "noshuffle",
            "blocksize": 1 << 20,
        },
    })
    chain.append({"name": "crc32c"})
    return chain


__all__ = [
    "CodecPolicy", "Delta", "DeltaCodec", "Pack4BytesCodec", "Policy", "QuantizedDeltaCodec", "SparseBytesCodec",
    "SparseDeltaCodec", "XorDeltaCodec", "codec_named", "dequantize", "storage_codecs",
]
