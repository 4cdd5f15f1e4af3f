"""Check-N-Run style quantized deltas (``quant8``, ``quant4``): one scale per chunk, int8 codes,
4-bit codes two per byte (the serializer :class:`Pack4BytesCodec`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..format import DTYPES, TensorEntry, bits_numpy_dtype, numpy_to_tensor, region_chunks, to_bits
from .base import Delta, DeltaCodec, ElementwiseDeltaCodec, Finish, Serializer, Shuffle
from .device import NonFinite, by_chunk, compute_dtype, host_floats, quantize_in_pieces, to_host, unchunk
from .lossless import DiffDeltaCodec

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer


@dataclass(frozen=True)
class QuantizedDeltaCodec(ElementwiseDeltaCodec):
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
            delta = quantize_in_pieces(value, base, chunks, out, self._quantize, self._quantize_on_host, finish)
        except NonFinite:
            return DiffDeltaCodec().diff(value, base, chunks)  # never quantize NaN/inf
        if delta is None:
            return None
        codes, bits, sides, encoded = delta
        scales = [scale for n, piece in sides for scale in (piece if piece is not None else [0.0] * n)]
        return Delta(to_host(codes).numpy().reshape(tuple(value.shape)), to_host(bits).reshape(base.shape),
                     {"scales": [s.hex() for s in scales], "bits": self.bits}, encoded=encoded)

    def _quantize(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                  restored: torch.Tensor, codes: torch.Tensor) -> tuple[list[float], None] | None:
        rows, tiled = by_chunk(torch.sub(v, b, out=restored), runs, padded)
        peak = torch.maximum(rows.amax(-1), rows.amin(-1).neg_())  # NaN or inf if any change is
        if not bool(torch.isfinite(peak).all()):
            raise NonFinite
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
            unchunk(q.to(torch.int8), runs, codes)
        moved = q.add_(0.0).mul_(scale)  # (code 0 is +0.0 to readers, not -0.0)
        if not tiled:
            unchunk(moved, runs, restored)
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
            raise NonFinite
        return (scales.tolist(), None) if moved else None

    def stored_as(self, delta: Delta) -> DeltaCodec:
        """Non-finite values are never quantized: such a tensor's delta is an exact diff."""
        return self if delta.params is not None else DiffDeltaCodec(self.base_step, self.base_array)

    def apply_into(self, out: np.ndarray, stored: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> None:
        if entry.params is None:
            raise ValueError("a quantized delta without its scales")
        values = host_floats(out, DTYPES[entry.dtype]) if out.flags.c_contiguous else None
        if values is not None:  # (float32, float64) in place, by a kernel
            from . import kernels

            for flat, _, local in region_chunks(region, tuple(entry.shape), tuple(entry.chunks)):
                scale = float.fromhex(entry.params["scales"][flat])
                if scale:  # (a chunk is one contiguous run of its region: its reshape is a view)
                    kernels.unquant(values[local].reshape(-1), np.ascontiguousarray(stored[local]).reshape(-1), scale)
            return
        scales = [float.fromhex(s) for s in entry.params["scales"]]
        out[...] = dequantize(to_bits(numpy_to_tensor(out, entry.dtype)), stored, region, entry.dtype,
                              tuple(entry.shape), tuple(entry.chunks), scales)


def dequantize(base: torch.Tensor, q: np.ndarray, region: tuple[slice, ...], dtype: str, shape: tuple[int, ...],
               chunks: tuple[int, ...], scales: list[float]) -> np.ndarray:
    """Bits of ``base + q * scale`` over a chunk-aligned ``region`` of a tensor of ``shape``
    (``scales``: one per chunk of the whole tensor, C order), computed on the CPU: the one
    function both the writer (for its next base) and every reader run, so they agree to the bit."""
    torch_dtype = DTYPES[dtype]
    ct = compute_dtype(torch_dtype)
    out = base.view(torch_dtype).to(ct, copy=True)  # never write into the caller's base
    # (a copy of read-only codes: torch warns on them; ascontiguousarray would make 0-d 1-d)
    qt = torch.from_numpy(q if q.flags.c_contiguous and q.flags.writeable else q.copy()).to(ct)
    for flat, _, local in region_chunks(region, shape, chunks):
        if scales[flat]:
            out[local] += qt[local] * scales[flat]
    return to_bits(out.to(torch_dtype)).numpy().view(bits_numpy_dtype(dtype))


#: The code that stands for "this element's exact bits follow the codes" in the entropy-coded
#: lossy deltas: non-finite values, and changes their code range cannot reach.


def pack4_encode(chunk: np.ndarray) -> bytes:
    """int8 codes in [-7, 7] as nibbles ``code + 8``, two per byte (low nibble first; an odd
    count pads code 0), in one pass that releases the GIL (:func:`amber_store.codecs.kernels.pack4`)."""
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
class Pack4BytesCodec(Serializer):
    """zarr serializer of :func:`pack4_encode`."""

    name: ClassVar[str] = "amber.pack4"

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return chunk_spec.prototype.buffer.from_bytes(pack4_encode(np.ascontiguousarray(chunk_array.as_numpy_array())))

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        out = pack4_decode(chunk_bytes.as_numpy_array().view(np.uint8), chunk_spec.shape)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(out)

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return (input_byte_length + 1) // 2


