"""Fused host kernels of the codecs' diffs, for tensors in the CPU's memory.

The torch code of :mod:`amber_store.codecs` takes a lossy delta in ~10 passes over each
piece of a tensor (sub, abs, compare, nonzero, round, gather ...), the right shape for an
accelerator. On the training host's CPU each pass costs memory bandwidth, and some of torch's
CPU kernels are slow there (a float compare into a bool mask: 4x numpy's; ``log2``: 1.2 ns an
element). These kernels (numba, compiled once per dtype and cached on disk) take a piece in
one or two vectorized passes that stay in the CPU's cache, release the GIL, and run a piece
per codec thread. They make the torch code's decisions (but where torch's float32 ``log2``
rounds across a code or an exponent, which they decide exactly: vanishingly rare) and write
the reconstruction readers compute, to the bit: the tests check both against the torch code
run on the same CPU tensors. More serve :mod:`amber_store.codecs.ans`: ``nibbles``, ``nonzeros``
and ``gaps`` lay out codes in one call where a dozen numpy passes would each take the GIL;
``ans`` and ``unans`` are its rANS coder. ``zigzag_diff`` and ``unzigzag_add`` are the lossless
diff codec's encode and decode: one call per chunk where numpy took five passes per cache-sized
piece, each call taking the GIL (on 16 cores, threads decoding a load spent most of their time
waiting for it).

Loops index slices from 0 (``range(x.size)``): a loop from an offset read from an array does
not vectorize (numba cannot tell the index is never negative), and nor does one that counts
booleans into an int64 (counts are taken in passes of their own, or in scalar loops).
Arguments are numpy arrays: ``v`` and ``b`` the values and base in the compute dtype (float32
or float64), ``vb``/``bb`` their raw bits in the tensor's own dtype, chunks as ``starts`` and
``ends`` within the piece.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

_OPTIONS = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}
_INTS = {types.float32: types.int32, types.float64: types.int64}


@intrinsic
def _bits(typingctx, x):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """A float's raw bits as a signed int of its width (numba has no scalar ``view``)."""
    if x not in _INTS:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], context.get_value_type(_INTS[x]))

    return _INTS[x](x), codegen


@intrinsic
def _float_of(typingctx, bits, like):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """The float of ``like``'s type whose raw bits are ``bits``."""
    if like not in _INTS:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        value = context.cast(builder, args[0], bits, _INTS[like])
        return builder.bitcast(value, context.get_value_type(like))

    return like(bits, like), codegen


@njit(**_OPTIONS)
def _significant(v, b, vb, bb, threshold, recon, mask):  # pragma: no cover (compiled)
    for i in range(v.size):
        x, y = v[i], b[i]
        keep = (abs(x - y) > abs(y) * threshold) | ~(np.isfinite(x) & np.isfinite(y))
        keep &= vb[i] != bb[i]  # (a non-finite pair stays only if its bits differ)
        recon[i] = vb[i] if keep else bb[i]
        mask[i] = keep


@njit(**_OPTIONS)
def _gather(mask, vb, bb, at, xor):  # pragma: no cover (compiled)
    """The positions of ``mask`` into ``at``, their XOR into ``xor``: eight mask bytes at a time."""
    k = 0
    words = mask[: mask.size // 8 * 8].view(np.uint64)
    for w in range(words.size):
        if words[w]:
            for i in range(8 * w, 8 * w + 8):
                at[k] = i
                xor[k] = vb[i] ^ bb[i]
                k += mask[i]
    for i in range(8 * words.size, mask.size):
        at[k] = i
        xor[k] = vb[i] ^ bb[i]
        k += mask[i]
    return k


@njit(**_OPTIONS)
def sparse(v, b, vb, bb, threshold, recon, mask, at, xor):  # pragma: no cover (compiled)
    """Keep an element's new bits where ``|v - b| > |b| * threshold``, or where either is not
    finite and the bits differ; the rest keep the base. Writes ``recon`` (bits), the kept
    elements' positions into ``at`` and their XOR against the base into ``xor`` (``mask``:
    scratch); returns how many were kept."""
    _significant(v, b, vb, bb, threshold, recon, mask)
    return _gather(mask, vb, bb, at, xor)


@njit(**_OPTIONS)
def _peak(v, b):  # pragma: no cover (compiled)
    """(max |v - b|, whether every change is finite): the largest of the changes' raw bits
    with the sign cleared, an integer reduction that vectorizes (a float one does not), and
    which orders non-negative floats as their values, infinity and NaN above all."""
    infinity = _bits(v.dtype.type(np.inf))
    magnitude = infinity | (infinity - 1)  # every bit but the sign
    top = infinity - infinity
    for i in range(v.size):
        top = max(top, _bits(v[i] - b[i]) & magnitude)
    return _float_of(top, v.dtype.type(0)), top < infinity


@njit(**_OPTIONS)
def _divided(v, b, scale, top, codes, recon):  # pragma: no cover (compiled)
    zero = v.dtype.type(0)
    for i in range(v.size):
        q = min(max(np.rint((v[i] - b[i]) / scale), -top), top) + zero  # (+ 0: code 0 is +0.0 to readers)
        codes[i] = np.int8(q)
        recon[i] = b[i] + q * scale


@njit(**_OPTIONS)
def quantized(v, b, starts, ends, qmax, codes, recon, scales):  # pragma: no cover (compiled)
    """:class:`~amber_store.codecs.QuantizedDeltaCodec` of each chunk: ``scales[c]`` (float64)
    is its peak change over ``qmax``, codes ``round(change / scale)`` within ``+-qmax`` and
    ``recon`` ``b + q * scale`` (a chunk of scale 0 keeps ``b``). Returns -1 if a change is
    not finite (nothing is then usable), else whether any chunk moved."""
    moved = False
    for c in range(starts.size):
        lo, hi = starts[c], ends[c]
        peak, finite = _peak(v[lo:hi], b[lo:hi])
        if not finite:
            return -1
        scales[c] = float(peak) / qmax
        scale = v.dtype.type(scales[c])
        if scale == 0:
            codes[lo:hi] = 0
            recon[lo:hi] = b[lo:hi]
        else:
            moved = True
            _divided(v[lo:hi], b[lo:hi], scale, v.dtype.type(qmax), codes[lo:hi], recon[lo:hi])
    return 1 if moved else 0


@njit(fastmath={"reassoc"}, **_OPTIONS)
def _squares(v):  # pragma: no cover (compiled)
    """The sum of squares in float64 (a float32 block's never overflows), in any order."""
    total = 0.0
    for i in range(v.size):
        total += float(v[i]) * float(v[i])
    return total


@njit(**_OPTIONS)
def _finite_parts(v, b):  # pragma: no cover (compiled)
    """(max |v - b|, sum of squares of v), each over its finite elements only."""
    peak = v.dtype.type(0)
    total = 0.0
    for i in range(v.size):
        d = v[i] - b[i]
        if math.isfinite(d):
            peak = max(peak, abs(d))
        if math.isfinite(v[i]):
            total += float(v[i]) * float(v[i])
    return peak, total


@njit(**_OPTIONS)
def _round_log2(x):  # pragma: no cover (compiled)
    """``round(log2(x))`` of a float ``x >= 0``, exactly (from its exponent and mantissa:
    ``x = m 2^e``, ``m`` in [1/2, 1), rounds down where ``m < 2^-1/2``), 0 giving -126 and
    infinity 126, as ``torch.nan_to_num`` of ``log2`` would."""
    if x == 0 or not math.isfinite(x):
        return -126 if x == 0 else 126
    m, e = math.frexp(float(x))
    return e - 1 if m < 0.7071067811865476 else e


@njit(**_OPTIONS)
def _ceil_log2(x):  # pragma: no cover (compiled)
    """``ceil(log2(x))`` of a float ``x >= 0``, exactly, 0 giving -126 and infinity 126."""
    if x == 0 or not math.isfinite(x):
        return -126 if x == 0 else 126
    m, e = math.frexp(float(x))
    return e - 1 if m == 0.5 else e


@njit(**_OPTIONS)
def _scaled(v, b, inverse, scale, codes, recon):  # pragma: no cover (compiled)
    """Codes of finite changes at one block's step."""
    top, zero = v.dtype.type(127), v.dtype.type(0)
    for i in range(v.size):
        q = min(max(np.rint((v[i] - b[i]) * inverse), -top), top) + zero  # (+ 0: code 0 is +0.0 to readers)
        codes[i] = np.int8(q)
        recon[i] = b[i] + q * scale


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B1), np.uint64(0x85EBCA6B), np.uint64(0xC2B2AE35)
_LOW32 = np.uint64(0xFFFFFFFF)


@njit(**_OPTIONS)
def _fmix(h):  # pragma: no cover (compiled)
    """murmur3's 32-bit finalizer, on a uint64 holding 32 bits."""
    h ^= h >> np.uint64(16)
    h = (h * _MIX1) & _LOW32
    h ^= h >> np.uint64(13)
    h = (h * _MIX2) & _LOW32
    return h ^ (h >> np.uint64(16))


@njit(**_OPTIONS)
def _fold(x):  # pragma: no cover (compiled)
    """A float's raw bits folded to 32 (sign-extended to 64 first, as torch's ``to(int64)``)."""
    bits = np.int64(_bits(x))
    return np.uint64(bits ^ (bits >> 32)) & _LOW32


@njit(**_OPTIONS)
def _dither(x, y, at):  # pragma: no cover (compiled)
    """A uniform 24-bit integer (2^-24 of it: a number in [0, 1)) from a value, its base and
    its place in the chunk: a hash, so the same delta codes the same bytes on every run and
    device (the torch code's :func:`~amber_store.codecs.entropy.dither`), drawn anew whenever
    the value moves."""
    h = _fmix(_fold(x) ^ ((np.uint64(at) * _GOLDEN) & _LOW32))
    return _fmix(h ^ _fold(y)) >> np.uint64(8)


@njit(**_OPTIONS)
def _dithered(v, b, inverse, scale, at, codes, recon):  # pragma: no cover (compiled)
    """:func:`_scaled`, each code rounded down or up, up with the probability of the change's
    fraction of a step (:func:`_dither`; ``at``: the block's place in its chunk), so that no
    update is lost on average. Returns whether a code is nonzero."""
    top, zero, unit = v.dtype.type(127), v.dtype.type(0), v.dtype.type(2.0 ** -24)
    largest = 0
    for i in range(v.size):
        x = np.floor((v[i] - b[i]) * inverse + v.dtype.type(_dither(v[i], b[i], at + i)) * unit)
        q = min(max(x, -top), top) + zero  # (+ 0: code 0 is +0.0 to readers)
        codes[i] = np.int8(q)
        largest = max(largest, abs(np.int32(q)))
        recon[i] = b[i] + q * scale
    return largest > 0


@njit(**_OPTIONS)
def _scaled_with_escapes(v, b, inverse, scale, codes, recon, at):  # pragma: no cover (compiled)
    """:func:`_scaled` of a block with a change that is not finite: escaped (-128, ``recon``
    ``v``) where the values differ, a change of 0 where they are equal (an infinity that stays
    put); ``at`` >= 0 (the block's first element's place in its chunk): each code rounded
    down or up, up with the probability of the change's fraction of a step (:func:`_dither`),
    so that no update is lost on average. Returns (whether any code is nonzero, escapes)."""
    top, unit = v.dtype.type(127), v.dtype.type(2.0 ** -24)
    nonzero, escapes = False, 0
    for i in range(v.size):
        d = v[i] - b[i]
        if not math.isfinite(d):
            if v[i] != b[i]:  # (NaN included)
                codes[i] = -128
                recon[i] = v[i]
                escapes += 1
                nonzero = True
                continue
            d = v.dtype.type(0)
        x = d * inverse
        x = np.floor(x + v.dtype.type(_dither(v[i], b[i], at + i)) * unit) if at >= 0 else np.rint(x)
        code = np.int8(min(max(x, -top), top))
        codes[i] = code
        nonzero |= code != 0
        recon[i] = b[i] + v.dtype.type(code) * scale
    return nonzero, escapes


@njit(**_OPTIONS)
def _drift_factor(v, b, drift):  # pragma: no cover (compiled)
    """How much coarser than its ``step`` a chunk is coded: ``sqrt(d / drift)`` where the
    chunk's drift ``d`` (RMS change over RMS value, finite elements, in float64) is above
    ``drift``, else 1. One pass without tests; again leaving out non-finite elements only
    where a sum is not finite."""
    changes, squares = 0.0, 0.0
    for i in range(v.size):
        d, x = float(v[i] - b[i]), float(v[i])  # (the change in the values' dtype, as the torch code's)
        changes += d * d
        squares += x * x
    if not (math.isfinite(changes) and math.isfinite(squares)):
        changes, squares = 0.0, 0.0
        for i in range(v.size):
            d, x = float(v[i] - b[i]), float(v[i])
            if math.isfinite(d):
                changes += d * d
            if math.isfinite(x):
                squares += x * x
    return _coarsened(changes, squares, drift)


@njit(**_OPTIONS)
def _coarsened(changes, squares, drift):  # pragma: no cover (compiled)
    """:func:`_drift_factor` of a chunk's sums of squares (the torch code's
    :func:`amber_store.codecs.entropy.drift_factors` calls it uncompiled)."""
    if not (squares > 0 and changes > squares * drift * drift):
        return 1.0
    return math.sqrt(math.sqrt(changes / squares) / drift)


@njit(**_OPTIONS)
def block(v, b, starts, ends, width, size, step, drift, stochastic, codes, recon, side):  # pragma: no cover (compiled)
    """:class:`~amber_store.codecs.BlockDeltaCodec` of each chunk, blocks of ``size``
    elements counted from its start (``width``: a chunk's padded length, a multiple of
    ``size``; blocks past a chunk's end are padding): each block's exponent into ``side``
    (chunk, block), the codes, and the reconstruction ``b + q * 2^e``. ``drift`` > 0 coarsens
    a chunk's step by :func:`_drift_factor`; ``stochastic`` rounds by :func:`_dithered`. A
    chunk whose codes are all 0 keeps ``b``. Returns (whether a code is nonzero, escapes)."""
    root = v.dtype.type(math.sqrt(size))
    moved, escapes = False, 0
    for c in range(starts.size):
        lo, hi = starts[c], ends[c]
        factor = _drift_factor(v[lo:hi], b[lo:hi], drift) if drift > 0 else 1.0
        chunk_step = v.dtype.type(step * factor)
        nonzero = False
        for j in range(width // size):
            a = min(lo + j * size, hi)
            z = min(a + size, hi)
            vs, bs = v[a:z], b[a:z]
            peak, finite = _peak(vs, bs)
            squares = _squares(vs)
            finite &= math.isfinite(squares)
            if not finite:
                peak, squares = _finite_parts(vs, bs)
            rms = v.dtype.type(math.sqrt(squares)) / root
            e = min(max(_round_log2(rms * chunk_step), _ceil_log2(peak / v.dtype.type(127)), -126), 126)
            side[c, j] = e
            scale, inverse = v.dtype.type(2.0 ** e), v.dtype.type(2.0 ** -e)  # (exact: normal powers of two)
            if finite and stochastic:
                nonzero |= _dithered(vs, bs, inverse, scale, a - lo, codes[a:z], recon[a:z])
            elif finite:
                _scaled(vs, bs, inverse, scale, codes[a:z], recon[a:z])
                nonzero |= peak * inverse > 0.5  # (its largest change codes to 0 or not, and so do all)
            else:
                some, escaped = _scaled_with_escapes(vs, bs, inverse, scale, codes[a:z], recon[a:z],
                                                     a - lo if stochastic else -1)
                nonzero |= some
                escapes += escaped
        if not nonzero:
            recon[lo:hi] = b[lo:hi]
        moved |= nonzero
    return moved, escapes


#: Where a ratio's first guess is trusted: within this many codes of half a code the exact
#: test decides (:func:`_ratio_guess` is off by at most a quarter of it)
_MARGIN = 0.001


@njit(**_OPTIONS)
def _ratio_guess(v, b, low, high, scale, codes):  # pragma: no cover (compiled)
    """Codes where the ratio's code is certain: ``log(v / b)`` by its series in ``u = v / b -
    1`` to ``u^4``, for ``|u|`` small enough that the series is off by at most ``_MARGIN / 4``
    of a code (at most 1/8), rounded, unless within :data:`_MARGIN` of half a code; -128 for
    every other element."""
    T = v.dtype.type
    # the terms left out add up to at most |u|^5 / (5 (1 - |u|)) <= near^5 * 8 / 35
    near = T(min(0.125, (_MARGIN * 35 / 32 / scale) ** 0.2))
    one, top, edge = T(1), T(127), T(0.5 - _MARGIN)
    c2, c3, c4 = T(-1 / 2), T(1 / 3), T(-1 / 4)
    scale, low, high = T(scale), T(low), T(high)
    for i in range(v.size):
        x = v[i]
        r = x / b[i]
        u = r - one
        sure = (x > 0) & (r >= low) & (r < high) & (abs(u) < near)
        u = u if sure else T(0)
        t = u * (one + u * (c2 + u * (c3 + u * c4))) * scale
        q = min(max(np.rint(t), -top), top)
        sure &= abs(t - q) < edge
        codes[i] = np.int8(q if sure else T(-128))


@njit(**_OPTIONS)
def _ratio_restore(b, factors, codes, recon):  # pragma: no cover (compiled)
    """``recon`` ``b * factors[code + 128]``; returns how many codes are nonzero."""
    nonzero = 0
    for i in range(b.size):
        recon[i] = b[i] * factors[np.uint8(codes[i]) ^ np.uint8(128)]  # (the code + 128)
        nonzero += codes[i] != 0
    return nonzero


@njit(**_OPTIONS)
def _escaped(codes, at):  # pragma: no cover (compiled)
    """The positions of the -128 codes into ``at``, eight codes at a time (a word holds one
    when it XOR 0x80 in every byte has a zero byte); returns how many."""
    k = 0
    words = codes[: codes.size // 8 * 8].view(np.uint64)
    for w in range(words.size):
        x = words[w] ^ np.uint64(0x8080808080808080)
        if (x - np.uint64(0x0101010101010101)) & ~x & np.uint64(0x8080808080808080):
            for i in range(8 * w, 8 * w + 8):
                at[k] = i
                k += codes[i] == -128
    for i in range(8 * words.size, codes.size):
        at[k] = i
        k += codes[i] == -128
    return k


@njit(**_OPTIONS)
def ratio(v, b, factors, bounds, scale, codes, recon):  # pragma: no cover (compiled)
    """:class:`~amber_store.codecs.RatioDeltaCodec`: code ``q`` with ``bounds[q + 127] <=
    v / b < bounds[q + 128]`` (float64 ``(1 + step)^(q -+ 1/2)``; ``scale``: ``1 / log(1 +
    step)``), reconstruction ``b * factors[q + 128]``. An element that is not positive, or
    whose ratio is out of range, is escaped (-128, ``recon`` ``v``) unless it equals its base
    (code 0), whose reconstruction ``b * 1`` is then ``b``, bit for bit (a NaN base never
    codes: it differs from every value). Returns (nonzero codes but escapes, escapes)."""
    low, high = bounds[0], bounds[255]
    _ratio_guess(v, b, low, high, scale, codes)
    nonzero = _ratio_restore(b, factors, codes, recon)
    at = np.empty(v.size, np.int64)
    marked = _escaped(codes, at)
    nonzero -= marked
    escapes = 0
    for i in at[:marked]:  # (few: far or uncertain ratios, and escapes)
        x, y = v[i], b[i]
        r = float(x / y)
        if x > 0 and low <= r < high:
            q = min(max(int(np.rint(math.log(r) * scale)), -127), 127)
            while r >= bounds[q + 128]:
                q += 1
            while r < bounds[q + 127]:
                q -= 1
        elif x == y:
            q = 0
        else:
            recon[i] = x
            escapes += 1
            continue
        codes[i] = q
        recon[i] = y * factors[q + 128]
        nonzero += q != 0
    return nonzero, escapes


@njit(**_OPTIONS)
def nibbles(codes, packed, at):  # pragma: no cover (compiled)
    """``codes`` (int8) two a byte into ``packed`` (``ceil(n / 2)`` bytes; an odd count pads a
    0): code ``2i`` in the low nibble, ``2i + 1`` in the high one, as 4-bit two's complement,
    a code outside [-7, 7] as -8, whose positions go to ``at``; returns how many there are.
    (:func:`amber_store.codecs.ans.encode_codes`'s nibble layout: one call instead of a dozen
    numpy passes that each take the GIL.)"""
    n = codes.size
    for j in range(n // 2):
        low, high = codes[2 * j], codes[2 * j + 1]
        low = low if -7 <= low <= 7 else np.int8(-8)
        high = high if -7 <= high <= 7 else np.int8(-8)
        packed[j] = np.uint8(low & 15) | np.uint8((high & 15) << 4)
    if n % 2:
        last = codes[n - 1]
        packed[n // 2] = np.uint8((last if -7 <= last <= 7 else np.int8(-8)) & 15)
    k = 0
    words = packed[: packed.size // 8 * 8].view(np.uint64)
    for w in range(words.size):  # a word holds an 8 nibble where it XOR 0x8... has a zero nibble
        x = words[w] ^ np.uint64(0x8888888888888888)
        if (x - np.uint64(0x1111111111111111)) & ~x & np.uint64(0x8888888888888888):
            for i in range(16 * w, min(16 * w + 16, n)):
                at[k] = i
                k += (codes[i] < -7) | (codes[i] > 7)
    for i in range(16 * words.size, n):
        at[k] = i
        k += (codes[i] < -7) | (codes[i] > 7)
    return k


@njit(**_OPTIONS)
def nonzeros(codes, at, kept):  # pragma: no cover (compiled)
    """The positions of the nonzero ``codes`` into ``at`` and those codes into ``kept`` (both
    sized to their count), eight codes at a time (a zero word holds none)."""
    k = 0
    words = codes[: codes.size // 8 * 8].view(np.uint64)
    for w in range(words.size):
        if words[w]:
            for i in range(8 * w, 8 * w + 8):
                if codes[i]:
                    at[k] = i
                    kept[k] = codes[i]
                    k += 1
    for i in range(8 * words.size, codes.size):
        if codes[i]:
            at[k] = i
            kept[k] = codes[i]
            k += 1


@njit(**_OPTIONS)
def gaps(at, classes, extra):  # pragma: no cover (compiled)
    """The gaps before the increasing positions ``at`` (the zeros before each nonzero code) as
    deflate codes distances: each one's class, its bit length, into ``classes`` (int8), and
    its bits but the leading one, least significant first, into ``extra`` (bytes, in
    little-endian bit order, at most 31 bits a gap); returns the bytes of ``extra`` used."""
    acc = np.uint64(0)
    fill = 0
    m = 0
    prev = -1
    for i in range(at.size):
        gap = at[i] - prev - 1
        prev = at[i]
        c = math.frexp(float(gap))[1]  # (exact below 2^53; 0 for a gap of 0)
        classes[i] = c
        if c > 1:
            acc |= np.uint64(gap & ((1 << (c - 1)) - 1)) << np.uint64(fill)
            fill += c - 1
            while fill >= 8:
                extra[m] = np.uint8(acc & np.uint64(255))
                acc >>= np.uint64(8)
                fill -= 8
                m += 1
    if fill:
        extra[m] = np.uint8(acc)
        m += 1
    return m


@njit(**_OPTIONS)
def _cumulative(counts):  # pragma: no cover (compiled)
    """The rANS model of a histogram (``n`` symbols) as constriction's ``Categorical(counts /
    sum(counts), perfect=False)`` quantizes it: each symbol's left cumulative of 2^24,
    ``int(cdf * ((2^24 - n) / sum(p))) + s`` by the same float64 operations in the same order,
    and ``2^24`` after the last."""
    n = counts.size
    total = 0.0
    for s in range(n):
        total += counts[s]
    norm = 0.0
    for s in range(n):
        norm += counts[s] / total
    scale = float((1 << 24) - n) / norm
    left = np.empty(n + 1, np.uint64)
    cdf = 0.0
    for s in range(n):
        left[s] = np.uint64(np.uint32(cdf * scale) + s)
        cdf += counts[s] / total
    left[n] = np.uint64(1 << 24)
    return left


@njit(**_OPTIONS)
def ans(codes, counts, words):  # pragma: no cover (compiled)
    """``codes`` (int8) rANS-coded to the word as constriction's ``AnsCoder().encode_reverse``
    codes their symbols (code + 128, less the smallest) under the model of their histogram
    (:func:`_cumulative`): a 64-bit state, 32-bit words, the state's low and then high word
    last. Fills ``counts`` (256) with the histogram; returns (smallest symbol, largest symbol,
    words written to ``words``: none when one symbol occurs). The GIL is released: both cores
    code."""
    counts[:] = 0
    for i in range(codes.size):
        counts[np.uint8(codes[i]) ^ np.uint8(0x80)] += 1
    first, last = 0, 255
    while first < 255 and counts[first] == 0:
        first += 1
    while last > first and counts[last] == 0:
        last -= 1
    if first == last:
        return first, last, 0
    left = _cumulative(counts[first: last + 1])
    state = np.uint64(0)
    m = 0
    for i in range(codes.size - 1, -1, -1):
        s = (np.uint8(codes[i]) ^ np.uint8(0x80)) - first
        p = left[s + 1] - left[s]
        if (state >> np.uint64(40)) >= p:
            words[m] = np.uint32(state & np.uint64(0xFFFFFFFF))
            m += 1
            state >>= np.uint64(32)
        state = ((state // p) << np.uint64(24)) | (left[s] + state % p)
    if state:
        words[m] = np.uint32(state & np.uint64(0xFFFFFFFF))
        m += 1
        if state >> np.uint64(32):
            words[m] = np.uint32(state >> np.uint64(32))
            m += 1
    return first, last, m


@njit(**_OPTIONS)
def pack4(codes, packed):  # pragma: no cover (compiled)
    """``codes`` (int8 in [-7, 7]) two a byte into ``packed`` as ``code + 8``, code ``2i`` in
    the low nibble (an odd count pads code 0): :func:`amber_store.codecs.pack4_encode`."""
    n = codes.size
    for j in range(n // 2):
        packed[j] = np.uint8((codes[2 * j] + 8) & 15) | np.uint8(((codes[2 * j + 1] + 8) & 15) << 4)
    if n % 2:
        packed[n // 2] = np.uint8((codes[n - 1] + 8) & 15) | np.uint8(8 << 4)


@njit(**_OPTIONS)
def unans(words, first, counts, codes):  # pragma: no cover (compiled)
    """The ``codes.size`` codes of an :func:`ans` stream ``words`` (its model from ``counts``,
    the histogram of symbols ``first`` on), into ``codes``, as constriction's
    ``AnsCoder(words).decode`` takes them from any words: the state from the last two (high,
    low), each symbol the one whose interval holds the state's low 24 bits, a word read back
    whenever the state falls below 2^32. The GIL is released: both cores decode."""
    left = _cumulative(counts)
    start = np.empty(4096, np.int64)  # the symbol at each multiple of 2^12: a search of a step or two
    s = 0
    for j in range(4096):
        while left[s + 1] <= np.uint64(j << 12):
            s += 1
        start[j] = s
    m = words.size
    state = np.uint64(0)
    if m:
        m -= 1
        state = np.uint64(words[m])
        if m:
            m -= 1
            state = (state << np.uint64(32)) | np.uint64(words[m])
    for i in range(codes.size):
        quantile = state & np.uint64((1 << 24) - 1)
        lo = start[quantile >> np.uint64(12)]
        while left[lo + 1] <= quantile:
            lo += 1
        codes[i] = np.int8(np.uint8(first + lo) ^ np.uint8(0x80))
        state = (state >> np.uint64(24)) * (left[lo + 1] - left[lo]) + (quantile - left[lo])
        if state < np.uint64(1 << 32) and m:
            m -= 1
            state = (state << np.uint64(32)) | np.uint64(words[m])


@njit(**_OPTIONS)
def unblock(x, codes, side, block):  # pragma: no cover (compiled)
    """A block delta restored in place: ``x`` (a chunk's base values, float32 or float64) plus
    each code times its block's ``2^side``, by the writer's two IEEE operations (an exact
    product, a rounded sum), code 0 included: it makes -0.0 +0.0, as for the writer."""
    for j in range((x.size + block - 1) // block):
        scale = x.dtype.type(math.ldexp(1.0, side[j]))  # (exact: side within +-126)
        xs, cs = x[j * block: (j + 1) * block], codes[j * block: (j + 1) * block]
        for k in range(xs.size):
            xs[k] = xs[k] + x.dtype.type(cs[k]) * scale


@njit(**_OPTIONS)
def unratio(x, codes, factors):  # pragma: no cover (compiled)
    """A ratio delta restored in place: ``x`` (a chunk's base values) times each code's factor
    (``factors[code + 128]``, the writer's table), one rounded product as for the writer."""
    for i in range(x.size):
        x[i] = factors[codes[i] + 128] * x[i]


@njit(**_OPTIONS)
def zigzag_diff(out, value, base, spread):  # pragma: no cover (compiled)
    """``out = zigzag(value - base)`` of signed ints of one width, modulo 2**width, with
    ``spread = 64 - 8 * width`` (elements arrive as int64: the difference sign-extended from
    its own width, then zigzag's sign, then the store truncates)."""
    for i in range(out.size):
        d = ((value[i] - base[i]) << spread) >> spread
        out[i] = (d << 1) ^ (d >> 63)


@njit(**_OPTIONS)
def unzigzag_add(out, stored, low):  # pragma: no cover (compiled)
    """``out += unzigzag(stored)``, modulo 2**width, with ``low = 2**(8 * width - 1) - 1``:
    the mask that makes the arithmetic shift of a sign-extended int a logical one."""
    for i in range(out.size):
        z = stored[i]
        out[i] += ((z >> 1) & low) ^ -(z & 1)
