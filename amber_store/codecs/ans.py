"""Entropy coding of small-integer codes (quantized deltas, block exponents) with rANS.

zstd stores codes that cluster near zero about twice as large as their entropy (measured: 1.10
bits per code at 0.55 bits of entropy; its Huffman stage spends at least one bit per literal).
An asymmetric numeral system coder driven by the chunk's own histogram reaches the entropy
(0.551 bits at 0.551). The coder is ``constriction``'s rANS (formats 4-8 were written by it),
restated as numba kernels (:func:`amber_store.codecs.kernels.ans` and ``unans``: the same words and
the same codes, which the tests check against constriction's own on many histograms) that
release the GIL, so both cores code: ``ans_encode`` of 1M codes takes 6.4-7.3 ms (8.3-9.0 with
constriction's encoder), ``ans_decode`` 8.1-8.6 ms (12-22), and constriction took one core at a
time. constriction itself is now only the tests' reference.

A coded block is, little-endian::

    u8 first   the smallest symbol (code + 128)
    u8 span    symbols in use minus one (largest - smallest)
    u32[span + 1] counts   how often each symbol occurs (the model; zero for unused ones)
    u32 nwords, u32[nwords] the ANS stream (none when only one symbol occurs)

Most codes of a lossy delta are zero, and the coder's cost is per symbol, so a chunk's codes
(format 7, :func:`encode_codes`) may be stored *sparse*: the gaps between nonzero codes, as
deflate codes distances (a coded bit-length class and raw low bits: within 2% of the entropy of
geometric gaps), then only those codes. Two coded symbols per nonzero code instead of one per
code: per 1M codes with 2% nonzero, 3.1 ms to encode instead of 17 and 2.3 ms to decode instead
of 29, 0.8% larger (measured here with constriction's coder). Past 15-20% nonzero the dense
block is faster.

Dense codes of at least 2 bits of entropy, nearly all within [-7, 7] (a fine step: most
elements move by a few steps), may be stored as *nibbles* instead (format 8): two codes a
byte, compressed by zstd, whose Huffman stage then codes pairs of codes (its one bit per
symbol at least costs half a bit a code) and which releases the GIL. Measured on 1M-code
chunks of block and ratio deltas at 2.1-3.1 bits of entropy: 1.3-3.7% larger than the rANS
block, 4-6x less time on one thread, and both cores work. zstd's match finder is cut to its
least (:data:`_NIBBLES_ZSTD`): such bytes hold few matches, and looking for them was half of
level 1's time (measured on 128 KiB of block step 0.01 nibbles: 311 -> 134 us, 0.562 -> 0.560
of their size; quant4-like codes 564 -> 356 us, 0.386 -> 0.344). Any zstd decoder reads the
frames.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard


def ans_encode(codes: np.ndarray) -> bytes:
    """``codes`` (int8, any shape; read in C order) as one coded block (by
    :func:`amber_store.codecs.kernels.ans`: constriction's words, with the GIL released)."""
    from . import kernels

    flat = codes.reshape(-1)
    if flat.size == 0:
        return bytes(10)  # an empty block: one (zero) count, no words
    counts, words = np.empty(256, np.int64), np.empty(flat.size + 2, np.uint32)
    first, last, m = kernels.ans(flat, counts, words)
    head = bytes([first, last - first]) + counts[first: last + 1].astype("<u4").tobytes()
    return head + np.uint32(m).astype("<u4").tobytes() + words[:m].astype("<u4").tobytes()


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
        return np.full(n, first ^ 0x80, np.uint8).view(np.int8), stop
    from . import kernels

    codes = np.empty(n, np.int8)
    kernels.unans(raw[end + 4: stop].view("<u4").astype(np.uint32), first, counts.astype(np.int64), codes)
    return codes, stop


DENSE, SPARSE, NIBBLES = 0, 1, 2
#: the densest chunks stored sparse (nonzero codes per code) and the fewest codes of a chunk
#: stored in another layout than dense (measured)
_SPARSE_AT_MOST, _LAYOUT_MIN_CODES = 0.15, 1 << 16
#: chunks stored as nibbles: at least this entropy (bits per code), at most this share of codes
#: outside [-7, 7] (escaped), judged on up to this many codes spread over the chunk. Below
#: 2 bits zstd's Huffman stage falls behind (measured: 1.3 bits, 20% larger than rANS; 0.6,
#: 60%), and escapes cost a byte each (12% of them: 10% larger).
_NIBBLES_MIN_BITS, _NIBBLES_MAX_ESCAPED, _NIBBLES_SAMPLE = 2.0, 0.03, 1 << 12
#: the nibble that marks an escaped code
_NIBBLE_ESCAPE = -8
#: zstd's settings for nibbles: level 1's fast strategy with the smallest hash table and search,
#: matches of 7 bytes at least, within 128 KiB (measured, see above)
_NIBBLES_ZSTD = zstandard.ZstdCompressionParameters(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
                                                    target_length=0, strategy=zstandard.STRATEGY_FAST)
_compressors = threading.local()  # (a compressor, or decompressor, is not for two threads at once)


def _nibbles_frame(packed: np.ndarray) -> bytes:
    """``packed`` as one zstd frame (its size in the header), by this thread's compressor."""
    compressor = getattr(_compressors, "nibbles", None)
    if compressor is None:
        compressor = _compressors.nibbles = zstandard.ZstdCompressor(compression_params=_NIBBLES_ZSTD)
    return compressor.compress(packed)


def _unnibbles(frame: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` bytes of :func:`_nibbles_frame`'s ``frame``; a frame that declares another
    size is refused before anything is allocated for it (a store is untrusted input)."""
    try:
        if zstandard.frame_content_size(frame) != size:
            raise ValueError("malformed entropy-coded codes")
        decompressor = getattr(_compressors, "unnibbles", None)
        if decompressor is None:
            decompressor = _compressors.unnibbles = zstandard.ZstdDecompressor()
        packed = np.frombuffer(decompressor.decompress(frame), np.uint8)
    except zstandard.ZstdError as e:
        raise ValueError(f"malformed entropy-coded codes ({e})") from e
    if packed.size != size:
        raise ValueError("malformed entropy-coded codes")
    return packed


def encode_codes(codes: np.ndarray) -> bytes:
    """``codes`` (int8, flat) as ``u8 layout`` and then, for :data:`DENSE`, one coded block of
    the codes; for :data:`SPARSE`, the positions of the ``k`` nonzero codes as gaps (the zeros
    before each), then those codes: ``u32 k``, a coded block of the gaps' classes (a gap's bit
    length, 0 to 32), ``u32 m`` and ``m`` bytes of the gaps' extra bits (a gap of class
    ``c >= 2`` is ``2^(c-1) + x``, ``x`` in ``c - 1`` bits, least significant first, packed
    little-endian bit order), a coded block of the ``k`` codes; for :data:`NIBBLES`, ``u32 k``,
    the ``k`` escaped codes (those outside [-7, 7], in order), then a zstd frame of the
    ``ceil(n / 2)`` bytes that hold code ``i`` in the low (even ``i``) or high (odd) half of
    byte ``i // 2`` as 4-bit two's complement, an escaped one as -8 (a last odd half: 0)."""
    return encode_codes_many(codes.reshape(1, -1))[0][0] or bytes([DENSE]) + ans_encode(codes)


def encode_codes_many(rows: np.ndarray, find: int | None = None) -> tuple[list[bytes | None], list[np.ndarray]]:
    """:func:`encode_codes` of each row of ``rows`` (int8, ``(chunks, n)``), or ``None`` for a
    row of zeros; and the positions of the nonzero code ``find`` in each row (an empty list
    without it). A row's layout is found and packed by kernels that release the GIL
    (:mod:`amber_store.codecs.kernels`: its nonzero codes, their gaps, the nibbles); what holds it is
    the rANS coder and a few numpy calls a row."""
    from . import kernels

    rows = np.ascontiguousarray(rows)
    n = rows.shape[1]
    layouts_ok = _LAYOUT_MIN_CODES <= n < 1 << 32
    most = int(_SPARSE_AT_MOST * n)
    if layouts_ok:  # (reused by every row: a row's positions are copied out before the next)
        positions, codes = np.empty(most, np.int64), np.empty(most, np.int8)
    out: list[bytes | None] = []
    found: list[np.ndarray] = []
    for row in rows:
        if layouts_ok:
            count = kernels.nonzeros(row, positions, codes, most)
            if count >= 0:
                at, kept = positions[:count], codes[:count]
                out.append(_sparse(at, kept) if count else None)
                if find is not None:
                    found.append(at[kept == find])
                continue
            nibbles = _nibbles(row)
            if nibbles is not None:
                block, at, escaped = nibbles
                out.append(block)
                if find is not None:
                    found.append(at[escaped == find])
                continue
        elif not row.any():
            out.append(None)
            if find is not None:
                found.append(np.empty(0, np.int64))
            continue
        out.append(bytes([DENSE]) + ans_encode(row))
        if find is not None:
            found.append(np.flatnonzero(row == find))
    return out, found


def _sparse(at: np.ndarray, kept: np.ndarray) -> bytes:
    """The :data:`SPARSE` layout of the nonzero codes ``kept`` at positions ``at``."""
    classes, extra = _gaps_encode(at)
    return b"".join([bytes([SPARSE]), np.uint32(at.size).astype("<u4").tobytes(), ans_encode(classes),
                     np.uint32(extra.size).astype("<u4").tobytes(), extra.tobytes(), ans_encode(kept)])


def _nibbles(row: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray] | None:
    """``row`` (int8, contiguous) in the :data:`NIBBLES` layout, the positions of its escaped
    codes and those codes; ``None`` when its codes suit the layout badly (judged on a sample:
    their entropy and the share outside [-7, 7])."""
    sample = row[:: max(1, row.size // _NIBBLES_SAMPLE)]
    outside = sample.size - np.count_nonzero((sample >= -7) & (sample <= 7))
    if outside > _NIBBLES_MAX_ESCAPED * sample.size or entropy_bits(sample) < _NIBBLES_MIN_BITS:
        return None
    from . import kernels

    packed, at = np.empty((row.size + 1) // 2, np.uint8), np.empty(row.size, np.int64)
    at = at[: kernels.nibbles(row, packed, at)]
    escaped = row[at]
    frame = _nibbles_frame(packed)
    head = np.array([NIBBLES], np.uint8).tobytes() + np.uint32(at.size).astype("<u4").tobytes()
    return b"".join([head, escaped.tobytes(), np.uint32(len(frame)).astype("<u4").tobytes(), frame]), at, escaped


def _nibbles_decode(raw: np.ndarray, n: int) -> tuple[np.ndarray, int]:
    """:func:`decode_codes` of a :data:`NIBBLES` layout (``raw[0]``)."""
    if raw.size < 5:
        raise ValueError("truncated entropy-coded codes")
    k = int(raw[1:5].view("<u4")[0])
    escaped = raw[5: 5 + k].view(np.int8)
    at = 5 + k
    if raw.size < at + 4:
        raise ValueError("truncated entropy-coded codes")
    size = int(raw[at: at + 4].view("<u4")[0])
    at += 4
    if raw.size < at + size:
        raise ValueError("truncated entropy-coded codes")
    packed = _unnibbles(raw[at: at + size], (n + 1) // 2)
    codes = np.empty(2 * packed.size, np.int8)
    codes[0::2] = (packed << 4).view(np.int8) >> 4  # (arithmetic shifts: 4-bit two's complement)
    codes[1::2] = packed.view(np.int8) >> 4
    marked = np.flatnonzero(codes[:n] == _NIBBLE_ESCAPE)
    if marked.size != k or codes[n:].any() or ((escaped >= -7) & (escaped <= 7)).any():
        raise ValueError("malformed entropy-coded codes")
    codes[marked] = escaped
    return codes[:n], at + size


def decode_codes(raw: np.ndarray, n: int) -> tuple[np.ndarray, int]:
    """The ``n`` codes of :func:`encode_codes`'s bytes at the start of ``raw`` (uint8), and the
    number of bytes they took. Raises ``ValueError`` on a malformed block."""
    if raw.size < 1 or raw[0] not in (DENSE, SPARSE, NIBBLES):
        raise ValueError("unknown layout of entropy-coded codes")
    if raw[0] == DENSE:
        codes, used = ans_decode(raw[1:], n)
        return codes, used + 1
    if raw[0] == NIBBLES:
        return _nibbles_decode(raw, n)
    if raw.size < 5:
        raise ValueError("truncated entropy-coded codes")
    k = int(raw[1:5].view("<u4")[0])
    classes, at = ans_decode(raw[5:], k)
    at += 5
    if raw.size < at + 4:
        raise ValueError("truncated entropy-coded codes")
    m = int(raw[at: at + 4].view("<u4")[0])
    extra = raw[at + 4: at + 4 + m]
    at += 4 + m
    positions = _positions_decode(classes, extra)
    kept, used = ans_decode(raw[at:], k)
    if k and (positions[-1] >= n or (kept == 0).any()):
        raise ValueError("malformed entropy-coded codes")
    codes = np.zeros(n, dtype=np.int8)
    codes[positions] = kept
    return codes, at + used


def _gaps_encode(at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(classes as int8, packed extra bits) of the gaps before the increasing positions ``at``
    (int64), as deflate codes distances: within 2% of the entropy of geometric gaps
    (measured), with one coded symbol per gap."""
    from . import kernels

    classes, extra = np.empty(at.size, np.int8), np.empty(4 * at.size, np.uint8)
    return classes, extra[: kernels.gaps(at, classes, extra)]


def _positions_decode(classes: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """The positions (int64) after the gaps of :func:`_gaps_encode`'s output, in one kernel call
    (:func:`amber_store.codecs.kernels.ungaps`: a dozen numpy passes over the gaps took a fifth
    of a sparse chunk's decode)."""
    from . import kernels

    positions = np.empty(classes.size, np.int64)
    if not kernels.ungaps(classes, extra, positions):
        raise ValueError("malformed entropy-coded gaps")
    return positions


def entropy_bits(codes: np.ndarray) -> float:
    """Empirical (order-0) entropy of ``codes`` in bits per code: the bound :func:`ans_encode`
    approaches, reported by the benchmarks; on a sample, what decides the nibble layout."""
    counts = np.bincount(codes.reshape(-1).view(np.uint8)).astype(np.float64)
    p = counts[counts > 0] / max(1, codes.size)
    return float(-(p * np.log2(p)).sum())
