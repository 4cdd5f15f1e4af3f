"""Where deltas are taken: on the tensor's device with torch, in pieces of whole chunks that stay
in cache, or for CPU tensors with the fused host kernels (:mod:`~amber_store.codecs.kernels`) on
the codec threads; what crosses to the host lands in pinned memory (:func:`to_host`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, TypeVar, Union

import numpy as np
import torch

from ..format import chunk_runs, to_bits
from ..runtime import codec_pool, on_codec_thread
from .base import Delta, Finish
from .compression import scratch

T = TypeVar("T")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def host_floats(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray | None:
    """``bits`` (a ``dtype`` tensor's raw bits) viewed as the numpy floats a host kernel restores
    in place, or ``None`` where ``dtype`` is computed in another (float16, bfloat16: torch's code)."""
    if compute_dtype(dtype) != dtype:
        return None
    return bits.view(np.float64 if dtype == torch.float64 else np.float32)


#: elements per piece where a temporary of a whole large tensor would cost its page faults
PIECE = 1 << 20
#: bytes of values a lossy encode takes at a time (whole chunks): its ~10 passes stay in the
#: CPU's cache (measured: 1.4x faster than passes over a whole 64 MB tensor; 1 MiB is too small)
PIECE_BYTES = 4 << 20
#: the same on an accelerator, where a piece only bounds the temporaries: each costs a few
#: dozen kernel launches and synchronizations (an H200's lossy diffs of 256 MB: 35-55 ms in
#: 4 MiB pieces, 21 ms in these)
DEVICE_PIECE_BYTES = 64 << 20


def piece_numel(t: torch.Tensor) -> int:
    """Elements of ``t`` that a sparse delta takes at a time."""
    return PIECE if t.is_cpu else DEVICE_PIECE_BYTES // t.element_size()


class NonFinite(Exception):
    """A quantizer met a NaN or infinite change."""


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: a CPU tensor as it is, an accelerator's copied into pinned memory,
    which torch's host allocator caches and hands out again once freed. (Into fresh pageable
    memory the copy ran at 1.2 GB/s on an H200 VM, page faults included; pinned: 54 GB/s.)
    Pinned, it also crosses back fast when it is the base of the next delta."""
    return t if t.is_cpu else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def flat_pair(value: torch.Tensor, base: torch.Tensor, ct: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` and ``base`` (its bits) flat, in the compute dtype ``ct``, on value's device."""
    b = base.to(value.device, non_blocking=True).view(value.dtype).reshape(-1)
    return value.reshape(-1).to(ct), b.to(ct)


def recycled_values(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor | None:
    """The caller's recycled buffer as flat values of ``value``'s dtype, when it can hold a
    temporary of the compute dtype on value's device (else ``None``: ops allocate)."""
    if out is None or compute_dtype(value.dtype) != value.dtype or out.device != value.device:
        return None
    return out.view(value.dtype).reshape(-1)


def recon_buffer(out: torch.Tensor | None, base: torch.Tensor) -> torch.Tensor:
    """A flat CPU buffer for the bits of a reconstruction: the caller's recycled one if given."""
    if out is not None and out.device.type == "cpu":
        return out.view(base.dtype).reshape(-1)
    return torch.empty(base.numel(), dtype=base.dtype)


def by_chunk(x: torch.Tensor, runs: list[tuple[int, int]], width: int) -> tuple[torch.Tensor, bool]:
    """Flat ``x`` as one row of ``width`` per chunk (``runs``), and whether that is a view:
    when the chunks do not tile it exactly, a copy with each row zero-padded."""
    if all(hi - lo == width for lo, hi in runs):
        return x.view(len(runs), width), True
    rows = x.new_zeros(len(runs), width)
    for k, (lo, hi) in enumerate(runs):
        rows[k, : hi - lo] = x[lo:hi]
    return rows, False


def unchunk(rows: torch.Tensor, runs: list[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`by_chunk`'s copy, into flat ``out``."""
    for k, (lo, hi) in enumerate(runs):
        out[lo:hi] = rows[k, : hi - lo]
    return out


#: what a quantizer returns besides its codes and restored values: its per-chunk side data
#: and the mask of the escaped elements (each ``None`` if there are none)
Quantized = tuple[Any, Union[torch.Tensor, None]]
#: A quantizer of a piece of whole chunks (:func:`quantize_in_pieces`): given flat values and
#: base (compute dtype), the chunks' runs within them, the padded chunk size, and flat buffers
#: for the restored values (compute dtype; its scratch until then) and the int8 codes, it
#: writes both and returns :data:`Quantized`, or ``None`` when every code would be 0 (the
#: buffers then hold nothing).
Quantizer = Callable[[torch.Tensor, torch.Tensor, list[tuple[int, int]], int, torch.Tensor, torch.Tensor],
                      Union[Quantized, None]]


def quantize_in_pieces(value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...], out: torch.Tensor | None,
                        quantize: Quantizer, host: Quantizer | None = None, finish: Finish | None = None,
                        sided: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, Any]], list[Any] | None] | None:
    """A lossy delta of ``value`` against ``base`` (its bits), :data:`PIECE_BYTES` of whole
    chunks at a time: (int8 codes, bits of the reconstruction, in ``out`` when it is on value's
    device, each piece's chunk count and side data, ``None`` if it has none or its codes are
    all 0, and what ``finish`` returned for each piece), or ``None`` when every code is 0.
    Escaped elements keep their exact bits. ``host``: the quantizer of a CPU tensor when
    :func:`host_kernels_take`, whose pieces then run on the codec threads, each then passed to
    ``finish`` (host only) with its side data as :attr:`Delta.side` when ``sided`` (rows of
    side codes, not a quantizer's own data)."""
    on_host = host is not None and host_kernels_take(value)
    quantize = host if on_host else quantize
    finish = finish if on_host else None
    ct = compute_dtype(value.dtype)
    flat = value.detach().reshape(-1)
    base_values = base.to(value.device, non_blocking=True).view(value.dtype).reshape(-1)
    recon = out.view(value.dtype).reshape(-1) if out is not None and out.device == value.device else torch.empty_like(flat)
    bits, value_bits = to_bits(recon), to_bits(flat)
    codes = torch.empty(flat.shape, dtype=torch.int8, device=flat.device)
    runs, padded = chunk_runs(tuple(value.shape), chunks), math.prod(chunks)
    per = max(1, (PIECE_BYTES if flat.is_cpu else DEVICE_PIECE_BYTES) // (padded * flat.element_size()))

    def piece(part: list[tuple[int, int]]) -> tuple[Quantized | None, Any]:
        lo, hi = part[0][0], part[-1][1]
        restored = recon[lo:hi] if ct == value.dtype else staging(hi - lo, ct, flat.device)
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
    done = list(map_pieces(piece, parts) if on_host else map(piece, parts))
    if all(quantized is None for quantized, _ in done):
        return None
    sides = [(len(part), None if quantized is None else quantized[0]) for part, (quantized, _) in zip(parts, done)]
    return codes, bits, sides, None if finish is None else [encoded for _, encoded in done]


#: Whether lossy diffs of CPU tensors run the fused kernels of :mod:`amber_store.codecs.kernels` on
#: the codec threads (off: the torch code, an accelerator's path, which tests run on the CPU)
HOST_KERNELS = True


def host_kernels_take(value: torch.Tensor) -> bool:
    return HOST_KERNELS and value.device.type == "cpu"


def map_pieces(fn: Callable[[Any], T], items: list[Any]) -> Iterator[T]:
    """``fn`` over ``items``, on the codec threads when there are several and the caller is not
    one of them (it would wait on itself)."""
    if len(items) < 2 or on_codec_thread():
        return map(fn, items)
    return codec_pool().map(fn, items)


def staging(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements of scratch on ``device``: the calling thread's reused buffer on the CPU."""
    if device.type == "cpu":
        return torch.from_numpy(scratch(n * dtype.itemsize, 3)).view(dtype)
    return torch.empty(n, dtype=dtype, device=device)


