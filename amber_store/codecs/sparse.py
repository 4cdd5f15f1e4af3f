"""Amber's significant-update delta (``sparse``): only elements that moved past a threshold are
stored, as positions and values (the serializer :class:`SparseBytesCodec`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np
import torch

from ..format import DTYPES, TensorEntry, bits_to_numpy, chunk_runs, to_bits
from .base import Delta, ElementwiseDeltaCodec, Finish, Serializer
from .compression import scratch
from . import device
from .device import (compute_dtype, flat_pair, host_kernels_take, map_pieces, piece_numel, recon_buffer,
                     recycled_values, to_host)

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer


@dataclass(frozen=True)
class SparseDeltaCodec(ElementwiseDeltaCodec):
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

    def apply_into(self, out: np.ndarray, stored: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> None:
        np.bitwise_xor(out, stored, out=out)  # the kept elements' new bits XOR their base bits

    def serialize_run(self, delta: Delta, first: int, runs: list[tuple[int, int]], padded: int,
                      recons: list[np.ndarray]) -> list[Any]:
        assert delta.changes is not None
        at, values = delta.changes
        cuts = np.searchsorted(at, np.asarray(runs).reshape(-1)).reshape(-1, 2)
        return [sparse_pack(at[i:j] - lo, values[i:j]) if j > i else None for (lo, _), (i, j) in zip(runs, cuts)]

    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...],
             out: torch.Tensor | None = None, finish: Finish | None = None) -> Delta | None:
        bits, base_bits = to_bits(value).reshape(-1), base.to(value.device, non_blocking=True).reshape(-1)
        ct = compute_dtype(value.dtype)
        recon = recon_buffer(out, base)
        encoded = None
        if self.topk is None and host_kernels_take(value):
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
            v, b = flat_pair(value, base_bits, ct)
            moved = torch.sub(v, b, out=recycled_values(out, value)).abs_()
            k = max(1, math.ceil(self.topk * moved.numel())) if moved.numel() else 0
            chosen = torch.zeros_like(moved, dtype=torch.bool)
            if k:
                chosen[moved.nan_to_num(math.inf).topk(k).indices] = True

            def keep(lo: int, hi: int, into: torch.Tensor) -> torch.Tensor:
                return torch.ne(bits[lo:hi], base_bits[lo:hi], out=into).logical_and_(chosen[lo:hi])
        else:
            size = min(value.numel(), piece_numel(value))
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
        for each piece: a fused kernel (:mod:`amber_store.codecs.kernels`) over whole chunks of about
        :data:`PIECE` elements at a time, on the codec threads."""
        from . import kernels

        threshold = torch.tensor(self.threshold, dtype=ct).numpy()[()]  # (as torch's multiply by it rounds it)
        bits_np, base_np, recon_np = bits_to_numpy(bits), bits_to_numpy(base_bits), bits_to_numpy(recon)
        base_values = base_bits.view(value.dtype)
        per = max(1, device.PIECE // max(1, runs[0][1] - runs[0][0]))

        def piece(part: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, Any]:
            lo, hi = part[0][0], part[-1][1]
            at, xor = np.empty(hi - lo, dtype=np.int64), np.empty(hi - lo, dtype=bits_np.dtype)
            kept = kernels.sparse(value[lo:hi].to(ct).numpy(), base_values[lo:hi].to(ct).numpy(), bits_np[lo:hi],
                                  base_np[lo:hi], threshold, recon_np[lo:hi], scratch(hi - lo, 3).view(np.bool_), at,
                                  xor)
            changes = (at[:kept] + lo, xor[:kept].copy())
            return (*changes, None if finish is None else finish(Delta(None, recon, changes=changes), part))

        done = list(map_pieces(piece, [runs[k: k + per] for k in range(0, len(runs), per)]))
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
        piece = piece_numel(bits)
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


@dataclass(frozen=True)
class SparseBytesCodec(Serializer):
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


