"""Bit-exact deltas: the integer difference of the raw bits (``diff``, the default) and their XOR
(``xor``)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..format import TensorEntry, bits_to_numpy, to_bits
from . import compression
from .base import Delta, ElementwiseDeltaCodec, Finish, Shuffle
from .device import to_host

# the diff's host kernels, built with the native decoder (native/zigzag.c); without them (no C
# compiler at install, or AMBER_DECODE_PATH=c-blosc), torch's ops on the CPU: the same bits
zigzag_diff, unzigzag_add = ((compression._blosc1.zigzag_diff, compression._blosc1.unzigzag_add)
                             if compression._blosc1 is not None else (None, None))


@dataclass(frozen=True)
class LosslessDeltaCodec(ElementwiseDeltaCodec):
    """Base of the bit-exact deltas: a reversible map of (value bits, base bits) to stored
    bits, computed with torch on the tensor's device (:meth:`diff`) or with numpy on host
    chunks (:meth:`encode_into`, the writer's CPU path), and undone by :meth:`apply_into`."""

    lossless: ClassVar[bool] = True

    @abc.abstractmethod
    def encode_into(self, out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
        """``out`` gets the stored delta of the bits ``value`` against ``base`` (same shape and
        unsigned dtype). Uses the calling thread's scratch slots 1 and up, never slot 0."""

    @abc.abstractmethod
    def _delta(self, bits: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """The stored delta of ``bits`` against ``base`` (both raw bits, on one device)."""

    @abc.abstractmethod
    def _restore(self, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``base`` bits with ``delta`` applied (:meth:`_delta`'s inverse)."""

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

    def apply_into(self, out: np.ndarray, stored: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> None:
        np.bitwise_xor(out, stored, out=out)


_SIGNED_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as flat signed ints of their width (a copy only if ``a`` is strided)."""
    return a.reshape(-1).view(f"i{a.itemsize}")


def _into(out: np.ndarray) -> np.ndarray:
    """:func:`_signed` of an array a kernel writes into (a flat copy would lose the writes)."""
    if not out.flags.c_contiguous:
        raise ValueError("a diff is written into a C-contiguous array")
    return _signed(out)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a CPU tensor (a read-only array copied: torch warns of one; the warnings module's
    filters are no thread's to change while codec threads run)."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


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
    On the host both directions are one pass per chunk in C (``native/zigzag.c``; the apply of
    most chunks a load reads is fused into the native decoder's unshuffle), a fraction of
    compression's time; without a C compiler at install, :meth:`diff`'s torch ops on the CPU.
    """

    name: ClassVar[str] = "amber.diff_delta"
    encoding: ClassVar[str] = "diff"
    auto_compressor: ClassVar[str] = "lz4"
    fused_op: ClassVar[str | None] = "unzigzag_add"

    def shuffle_for(self, cname: str) -> Shuffle:
        # lz4 has no entropy stage: bit planes give it runs; zstd codes byte planes better
        return "bitshuffle" if cname == "lz4" else "shuffle"

    def encode_into(self, out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
        into, value, base = _into(out), _signed(value), _signed(base)
        if zigzag_diff is not None and into.flags.aligned and value.flags.aligned and base.flags.aligned:
            zigzag_diff(into, value, base, into.itemsize)
        else:
            torch.from_numpy(into).copy_(self._delta(_tensor(value), _tensor(base)))

    def apply_into(self, out: np.ndarray, stored: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> None:
        into, stored = _into(out), _signed(stored)
        if unzigzag_add is not None and into.flags.aligned and stored.flags.aligned:
            unzigzag_add(into, stored, into.itemsize)
        else:
            o = torch.from_numpy(into)
            o.copy_(self._restore(o, _tensor(stored)))

    def _delta(self, bits: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        d = (bits - base).view(_SIGNED_TORCH[bits.element_size()])
        sign = d >> (8 * d.element_size() - 1)
        return d.bitwise_left_shift_(1).bitwise_xor_(sign).view(bits.dtype)

    def _restore(self, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        z = delta.view(_SIGNED_TORCH[delta.element_size()])
        half = (z >> 1).bitwise_and_((1 << (8 * z.element_size() - 1)) - 1)  # a logical shift
        half.bitwise_xor_((z & 1).neg_())
        return half.view(base.dtype).add_(base)


