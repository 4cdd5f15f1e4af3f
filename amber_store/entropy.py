"""Entropy coding of small-integer codes (quantized deltas, block exponents) with rANS.

zstd stores codes that cluster near zero about twice as large as their entropy (measured: 1.10
bits per code at 0.55 bits of entropy; its Huffman stage spends at least one bit per literal).
An asymmetric numeral system coder driven by the chunk's own histogram reaches the entropy
(0.551 bits at 0.551). The coder is ``constriction``'s (Rust; about 60-90 M codes/s encoding
and 30-50 M/s decoding per core on this project's 2-core machine).

A coded block is, little-endian::

    u8 first   the smallest symbol (code + 128)
    u8 span    symbols in use minus one (largest - smallest)
    u32[span + 1] counts   how often each symbol occurs (the model; zero for unused ones)
    u32 nwords, u32[nwords] the ANS stream (none when only one symbol occurs)
"""

from __future__ import annotations

import constriction
import numpy as np

# constriction's submodules live in its extension module: attributes, not importable packages.
AnsCoder = constriction.stream.stack.AnsCoder
Categorical = constriction.stream.model.Categorical


def ans_encode(codes: np.ndarray) -> bytes:
    """``codes`` (int8, any shape; read in C order) as one coded block."""
    symbols = codes.reshape(-1).view(np.uint8) ^ np.uint8(0x80)  # code + 128, without a copy to int16
    counts = np.bincount(symbols, minlength=1)
    used = np.flatnonzero(counts)
    if used.size == 0:
        return bytes(6)
    first, last = int(used[0]), int(used[-1])
    counts = counts[first: last + 1].astype("<u4")
    head = bytes([first, last - first]) + counts.tobytes()
    if first == last:
        return head + bytes(4)
    coder = AnsCoder()
    coder.encode_reverse(np.subtract(symbols, first, dtype=np.int32), _model(counts))
    words = coder.get_compressed().astype("<u4")
    return head + np.uint32(words.size).astype("<u4").tobytes() + words.tobytes()


def ans_decode(raw: np.ndarray, n: int) -> tuple[np.ndarray, int]:
    """The ``n`` int8 codes of the coded block at the start of ``raw`` (uint8), and the number
    of bytes it took. Raises ``ValueError`` on a malformed block."""
    if raw.size < 6:
        raise ValueError("truncated entropy-coded block")
    first, span = int(raw[0]), int(raw[1])
    end = 2 + 4 * (span + 1)
    if raw.size < end + 4:
        raise ValueError("truncated entropy-coded block")
    counts = raw[2:end].view("<u4")
    nwords = int(raw[end: end + 4].view("<u4")[0])
    stop = end + 4 + 4 * nwords
    if raw.size < stop or int(counts.sum(dtype=np.uint64)) != n:
        raise ValueError("malformed entropy-coded block")
    if nwords == 0:
        if span:
            raise ValueError("malformed entropy-coded block")
        symbols = np.full(n, first, dtype=np.int32)
    else:
        words = raw[end + 4: stop].view("<u4").astype(np.uint32)
        symbols = AnsCoder(words).decode(_model(counts), n) + first
    return (symbols.astype(np.uint8) ^ np.uint8(0x80)).view(np.int8), stop


def _model(counts: np.ndarray) -> constriction.stream.model.Categorical:
    # The writer and every reader build the model from the same counts by the same float ops.
    probs = counts.astype(np.float64)
    return Categorical(probs / probs.sum(), perfect=False)


def entropy_bits(codes: np.ndarray) -> float:
    """Empirical (order-0) entropy of ``codes`` in bits per code: the bound :func:`ans_encode`
    approaches, reported by the benchmarks."""
    counts = np.bincount(codes.reshape(-1).view(np.uint8)).astype(np.float64)
    p = counts[counts > 0] / max(1, codes.size)
    return float(-(p * np.log2(p)).sum())
