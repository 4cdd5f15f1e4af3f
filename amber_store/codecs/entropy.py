"""Entropy-coded lossy deltas: block-quantized updates (``block``) and ratio-coded positive values
(``ratio``), their codes rANS-coded per chunk (:mod:`~amber_store.codecs.ans`, the serializer
:class:`AnsBytesCodec`)."""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..format import DTYPES, TensorEntry, numpy_to_tensor, round_up, to_bits
from .ans import ans_decode, ans_encode, decode_codes, encode_codes_many
from .base import Delta, DeltaCodec, Finish, Shuffle, configuration
from . import device
from .device import Quantized, by_chunk, compute_dtype, host_floats, quantize_in_pieces, to_host, unchunk

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer


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
class CodedDelta(DeltaCodec):
    """Shared by the entropy-coded lossy deltas: one int8 code per element, rANS-coded per chunk
    with the chunk's own histogram (:mod:`amber_store.codecs.ans`), escaped elements stored exact.

    A stored chunk is ``[side codes][element codes][escaped elements' raw bits]``: the side block
    (only for codecs with per-block data) in :func:`~amber_store.codecs.ans.ans_encode`'s form, the
    element codes in :func:`~amber_store.codecs.ans.encode_codes`'s (dense; or the gaps between the
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
        """(side codes, element codes, escaped bits, the positions of the escaped codes) of
        one stored chunk of ``n`` elements."""
        from . import kernels

        side, codes, at = _coded_chunk(raw, n, self.side_width, self.sparse_codes)
        escaped = raw[at:].view(bits.newbyteorder("<"))
        if escaped.size != kernels.count(codes, ESCAPE):  # (counted 64 at a time: most chunks have none)
            raise ValueError("escaped values do not match their codes")
        return side, codes, escaped, np.flatnonzero(codes == ESCAPE) if escaped.size else np.empty(0, np.int64)

    def decode_into(self, out: np.ndarray, raw: np.ndarray, padded: int, region: tuple[slice, ...],
                    entry: TensorEntry) -> None:
        side, codes, escaped, at = self._parse(raw, padded, out.dtype)
        codes, flat = codes[: out.size], out.reshape(-1)
        dtype = DTYPES[entry.dtype]
        values = host_floats(flat, dtype)
        if values is not None:  # (float32, float64) in place, in one pass
            self._restore_on_host(values, codes, side)
        else:
            base = numpy_to_tensor(flat, entry.dtype).to(compute_dtype(dtype))
            flat[...] = to_bits(self._restore(base, torch.from_numpy(codes), side).to(dtype)).numpy().view(out.dtype)
        if at.size and at[-1] >= out.size:  # (the padding of an edge chunk holds only zeros)
            raise ValueError("an escaped code in a chunk's padding")
        flat[at] = escaped

    @abc.abstractmethod
    def _restore(self, base: torch.Tensor, codes: torch.Tensor, side: np.ndarray | None) -> torch.Tensor:
        """``base`` (compute dtype, flat, one chunk) moved by ``codes``; escaped elements arbitrary."""

    @abc.abstractmethod
    def _restore_on_host(self, values: np.ndarray, codes: np.ndarray, side: np.ndarray | None) -> None:
        """:meth:`_restore` in place, of values in their own compute dtype, by a kernel
        (:mod:`amber_store.codecs.kernels`): the same bits in one pass instead of torch's several."""

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...],
             out: torch.Tensor | None = None, finish: Finish | None = None) -> Delta | None:
        delta = quantize_in_pieces(value, base, chunks, out, self._quantize, self._quantize_on_host, finish,
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

    @abc.abstractmethod
    def _quantize(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                  restored: torch.Tensor, codes: torch.Tensor) -> Quantized | None:
        """A :data:`Quantizer`: the side codes are one row per chunk."""

    @abc.abstractmethod
    def _quantize_on_host(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                          restored: torch.Tensor, codes: torch.Tensor) -> Quantized | None:
        """:meth:`_quantize` of CPU tensors by a fused kernel (:mod:`amber_store.codecs.kernels`)."""

    @abc.abstractmethod
    def params(self) -> dict[str, Any]:
        """What a reader needs to decode (the entry's ``params``)."""


def _block_norms(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's 2-norm, non-finite elements counted as zero. Only when a norm is not finite
    (a non-finite element, or squares overflowing) are they masked and the norms taken in
    float64."""
    norm = torch.linalg.vector_norm(blocks, dim=-1)
    if bool(torch.isfinite(norm).all()):
        return norm
    finite = blocks.where(torch.isfinite(blocks), 0)
    return torch.linalg.vector_norm(finite.to(torch.float64), dim=-1).to(blocks.dtype)


def drift_factors(changes: torch.Tensor, values: torch.Tensor, drift: float) -> list[float]:
    """Per chunk (the first dimension; non-finite changes already zeroed), how much coarser
    than its step a :class:`BlockDeltaCodec` codes it: the kernels' ``_drift_factor``, from
    the same float64 sums of squares (non-finite values left out)."""
    from .kernels import _coarsened

    values = values.to(torch.float64)  # (the same tensors when they are float64: nothing in place)
    squares = values.where(torch.isfinite(values), 0).square_().flatten(1).sum(1)
    moved = changes.to(torch.float64).square().flatten(1).sum(1)
    return [_coarsened.py_func(c, s, drift) for c, s in zip(moved.tolist(), squares.tolist())]


def _divided(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` in place, correctly rounded on every device: CUDA divides by a Python
    number as a multiply by its reciprocal (an ulp off), so it goes as a tensor on x's device."""
    return x.div_(divisor if x.device.type == "cpu" else torch.tensor(divisor, dtype=x.dtype, device=x.device))


_GOLDEN, _MIX1, _MIX2, _LOW32 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 0xFFFFFFFF


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer, in int64 (products wrap; their low 32 bits are kept)."""
    h = h ^ (h >> 16)
    h = (h * _MIX1) & _LOW32
    h = h ^ (h >> 13)
    h = (h * _MIX2) & _LOW32
    return h ^ (h >> 16)


def _fold(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32 if x.dtype == torch.float32 else torch.int64).to(torch.int64)
    return (bits ^ (bits >> 32)) & _LOW32


def dither(values: torch.Tensor, base: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1) (24 bits) hashed from each value, its base and its place
    ``at`` in its chunk: the kernels' ``_draw``, to the bit, on any device."""
    h = _fmix(_fold(values) ^ ((at * _GOLDEN) & _LOW32))
    return (_fmix(h ^ _fold(base)) >> 8).to(values.dtype).mul_(2.0 ** -24)


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2 ** e`` built from its exponent bits: exact on every device."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


@dataclass(frozen=True)
class BlockDeltaCodec(CodedDelta):
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

    ``drift`` (off by default) makes the step grow where the values moved far since the base,
    as early in training: a chunk whose drift ``d`` (RMS change over RMS value, over the chunk;
    small tensors diffed together in one batch share the batch's) above ``drift`` is coded at
    ``step * sqrt(d / drift)``. Measured (benchmarks/regimes.py, RESULTS.md): weights at step 0.1
    and ``drift=0.01``, with the ``"lossy"`` preset's ``exp_avg_sq``, stored delta steps early in
    training 68-111x smaller than torch.save (weights at a fixed 0.15: 50.5-94.4x) at +0.3% to
    +0.7% of resumed loss, but resumed benchmarks/lossy.py's 3.2M-parameter run +1.1% (mean of
    six data streams, median +0.8%). The choice is the writer's alone: readers take each block's
    exponent from its side codes.

    ``stochastic`` rounds each code down or up, up with the probability of the change's fraction
    of a step, instead of to the nearest: an element that moved a fifth of a step moves a whole
    step one time in five, so the restored state lacks no update on average, where rounding to
    nearest keeps every element that moved less than half a step at its base. Those lost updates
    are what a resume pays for, more than the error's size: on one 40-step delta of an MLP-mixer,
    step 0.6 rounded stochastically took 0.59 bits a weight and resumed within 0.01%, step 0.3
    rounded to nearest 0.51 bits and +0.4-0.5% (benchmarks/sensitivity.py; the ``"lossy"``
    preset's weights are at step 0.6, stochastic). The draws are hashed from each value, its
    base and its place in the chunk (the same delta is the same bytes, on every device). Also
    the writer's alone.

    Error bound, at every step of a chain: ``|restored - value| <= 2^e / 2`` (stochastic:
    ``< 2^e``) per element of a block, with ``2^e <= sqrt(2) * step * g * rms(block's values)``
    (``g``: the chunk's ``sqrt(d / drift)``, or 1), unless a larger power of two is needed to
    keep ``|q| <= 127`` (the smallest that does: a change of more than ``127 / sqrt(2) / step``
    RMS values, e.g. a block whose values collapse), plus the rounding of the result to the
    tensor's dtype; non-finite values are exact. Signs are not preserved: a
    second moment near zero may come back negative, so use :class:`RatioDeltaCodec` for those
    (the ``"lossy"`` preset does).
    """

    name: ClassVar[str] = "amber.block_delta"
    encoding: ClassVar[str] = "block"
    step: float = 0.1
    block: int = 256
    drift: float | None = None
    stochastic: bool = False

    def __post_init__(self) -> None:
        if not 0.001 < self.step <= 64:
            raise ValueError("BlockDeltaCodec step (a fraction of a block's RMS value) must be within (0.001, 64]")
        if self.drift is not None and not 0 < self.drift <= 1:
            raise ValueError("BlockDeltaCodec drift (RMS change over RMS value) must be None or within (0, 1]")
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

    def to_dict(self) -> dict[str, Any]:
        # (drift and the rounding are the writer's choice, which readers never need: left out
        # of the array's metadata, which stays what earlier versions of amber-store read)
        d = super().to_dict()
        del d["configuration"]["drift"], d["configuration"]["stochastic"]
        return d

    def _quantize(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                  restored: torch.Tensor, codes: torch.Tensor) -> Quantized | None:
        width = round_up(padded, self.block)

        def blocked(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
            # blocks are counted from each chunk's start: (chunks, blocks, block)
            rows, tiled = by_chunk(x, runs, width)
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
        values = blocked(v)[0]
        rms = _divided(_block_norms(values), math.sqrt(self.block))
        step: float | torch.Tensor = self.step
        if self.drift:
            factors = [self.step * f for f in drift_factors(changes, values, self.drift)]
            step = torch.tensor(factors, dtype=torch.float64).to(device=v.device, dtype=v.dtype).unsqueeze(-1)
        e = torch.log2(rms.mul_(step)).round_().nan_to_num_(0, posinf=126, neginf=-126)
        # never so fine that a code leaves +-127 (a change far above the block's RMS value)
        fit = torch.log2(_divided(peak.clone(), 127)).ceil_().nan_to_num_(0, posinf=126, neginf=-126)
        e = torch.maximum(e, fit).clamp_(-126, 126)  # 2^e and 2^-e normal: multiplying by them is exact
        inverse = _pow2(-e, v.dtype)
        # A code is nonzero iff its change is over half a step (0.5 rounds to even, 0), and
        # leaves +-127 only where e hit its cap (float64 changes beyond 1e40): both decided per
        # block (the scaled peak is exactly the largest scaled change), without a full pass.
        scaled = peak.mul_(inverse)
        if exact is None and not bool(scaled.gt(0 if self.stochastic else 0.5).any()):
            return None
        q = changes.mul_(inverse.unsqueeze(-1))
        if self.stochastic:
            at = torch.arange(width, device=v.device).view(1, -1, self.block)
            q.add_(dither(values, blocked(b)[0], at)).floor_()
            if exact is None and not bool(q.ne(0).any()):
                return None
        else:
            q.round_()
        if bool(scaled.ge(127.5).any()):
            q.clamp_(-127, 127)
        if whole:
            codes.view_as(q).copy_(q)
        else:
            unchunk(q.to(torch.int8).view(len(runs), -1), runs, codes)
        moved = q.add_(0.0).mul_(_pow2(e, v.dtype).unsqueeze(-1))  # (code 0 is +0.0 to readers, not -0.0)
        if not whole:
            unchunk(moved.view(len(runs), -1), runs, restored)
        restored.add_(b)
        if exact is not None:
            exact = exact.view(-1) if whole else unchunk(exact.view(len(runs), -1), runs, torch.empty_like(codes, dtype=torch.bool))
            codes.masked_fill_(exact, ESCAPE)
        return e.to(torch.int8), exact

    def _quantize_on_host(self, v: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int]], padded: int,
                          restored: torch.Tensor, codes: torch.Tensor) -> Quantized | None:
        from . import kernels

        width = round_up(padded, self.block)
        side = np.empty((len(runs), width // self.block), dtype=np.int8)
        starts, ends = np.asarray(runs, dtype=np.int64).T
        moved, escapes = kernels.block(v.numpy(), b.numpy(), starts, ends, width, self.block, self.step,
                                       self.drift or 0.0, self.stochastic, codes.numpy(), restored.numpy(), side)
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
class RatioDeltaCodec(CodedDelta):
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
                  restored: torch.Tensor, codes: torch.Tensor) -> Quantized | None:
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
                          restored: torch.Tensor, codes: torch.Tensor) -> Quantized | None:
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
        index = torch.empty(min(device.PIECE, codes.numel()), dtype=torch.int32, device=codes.device)
        for lo in range(0, codes.numel(), device.PIECE):
            hi = min(lo + device.PIECE, codes.numel())
            torch.index_select(factors, 0, index[: hi - lo].copy_(codes[lo:hi]).add_(128), out=out[lo:hi])
        return out.mul_(base)

    def _restore_on_host(self, values: np.ndarray, codes: np.ndarray, side: np.ndarray | None) -> None:
        from . import kernels

        kernels.unratio(values, codes, self._factors(torch.from_numpy(values).dtype).numpy())




@dataclass(frozen=True)
class AnsBytesCodec:
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
        return cls(**configuration(data, cls.name))

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


