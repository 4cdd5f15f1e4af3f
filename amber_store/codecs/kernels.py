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
``ans`` and ``unans`` are its rANS coder. (The lossless diff's host kernels are C, built with
the native decoder: ``native/zigzag.c``; a lossless save or load never imports numba.)

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
from llvmlite import ir
from numba import njit, types
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros
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


_EXPONENT = {types.float32: (23, 127), types.float64: (52, 1023)}  # (the exponent's place, its bias)


@intrinsic
def _pow2(typingctx, e, like):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """``2^e`` (a normal power: ``e`` in [-126, 126]) as a float of ``like``'s type, built from
    its exponent bits: exact, and no ``pow`` call per block."""
    if like not in _EXPONENT or not isinstance(e, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        shift, bias = _EXPONENT[like]
        int_type = context.get_value_type(_INTS[like])
        x = builder.add(context.cast(builder, args[0], e, _INTS[like]), ir.Constant(int_type, bias))
        return builder.bitcast(builder.shl(x, ir.Constant(int_type, shift)), context.get_value_type(like))

    return like(e, like), codegen


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
    which orders non-negative floats as their values, infinity and NaN above all. (Started
    from zero's bits, it stays in the float's own int width: numba's integer arithmetic widens
    to int64, which runs the loop four lanes wide.)"""
    top = _bits(v.dtype.type(0))
    for i in range(v.size):
        top = max(top, _bits(abs(v[i] - b[i])))
    return _float_of(top, v.dtype.type(0)), top < _bits(v.dtype.type(np.inf))


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


#: The mantissa bits of the float64 nearest sqrt(2): below them, ``log2`` rounds down
_ROOT2_MANTISSA = int(np.array(2 * 0.7071067811865476).view(np.int64)) & ((1 << 52) - 1)


@njit(**_OPTIONS)
def _round_log2(x):  # pragma: no cover (compiled)
    """``round(log2(x))`` of a float ``x >= 0``, exactly (from its bits in float64: its
    exponent, plus one where its mantissa is at least sqrt(2)'s), 0 giving -126 and infinity
    126, as ``torch.nan_to_num`` of ``log2`` would. (A float64 subnormal's exponent is off,
    below -1022: callers clamp to -126.)"""
    if x == 0 or not math.isfinite(x):
        return -126 if x == 0 else 126
    bits = _bits(np.float64(x))
    return (bits >> 52) - 1023 + ((bits & ((1 << 52) - 1)) >= _ROOT2_MANTISSA)


@njit(**_OPTIONS)
def _ceil_log2(x):  # pragma: no cover (compiled)
    """``ceil(log2(x))`` of a float ``x >= 0``, exactly (as :func:`_round_log2`), 0 giving -126
    and infinity 126."""
    if x == 0 or not math.isfinite(x):
        return -126 if x == 0 else 126
    bits = _bits(np.float64(x))
    return (bits >> 52) - 1023 + ((bits & ((1 << 52) - 1)) != 0)


@njit(**_OPTIONS)
def _rounded(v, b, inverse, scale, codes, recon):  # pragma: no cover (compiled)
    """Codes of finite changes, each at its block's step (``inverse`` and ``scale``: per
    element). Returns whether a code is nonzero."""
    top, zero = v.dtype.type(127), v.dtype.type(0)
    nonzero = np.int8(0)
    for i in range(v.size):
        q = min(max(np.rint((v[i] - b[i]) * inverse[i]), -top), top) + zero  # (+ 0: code 0 is +0.0 to readers)
        code = np.int8(q)
        codes[i] = code
        nonzero = np.int8(nonzero | code)  # (an int8 reduction: a wider one halves the lanes)
        recon[i] = b[i] + q * scale[i]
    return nonzero != 0


_WIDTHS = {types.float32: 32, types.float64: 64}


@intrinsic
def _draw(typingctx, x, y, at, offset):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """A uniform 24-bit integer (2^-24 of it: a number in [0, 1)) from a value ``x``, its base
    ``y`` and its place ``at + k`` in the chunk, ``offset`` being ``k`` times :data:`GOLDEN`
    (mod 2^32; a loop reads it from :func:`golden_places`: computed per element, a place
    took 64-bit lanes and a multiply, a fifth of the loop): a hash, so the same delta codes
    the same bytes on every run and device (the torch code's :func:`~amber_store.codecs.entropy.dither`), drawn
    anew whenever the value moves. Two rounds of murmur3's 32-bit finalizer, on each float's
    bits folded to 32 (those of a negative one inverted, as torch's sign-extending
    ``to(int64)`` does). Written in 32-bit LLVM integers: numba widens every integer to 64
    bits, which would halve the vector lanes of the loops that draw."""
    if x not in _WIDTHS or y != x or not isinstance(at, types.Integer) or not isinstance(offset, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)

        def const(n: int) -> ir.Constant:
            return ir.Constant(i32, n)

        def fold(value):  # type: ignore[no-untyped-def]
            width = ir.IntType(_WIDTHS[x])
            bits = builder.bitcast(value, width)
            folded = builder.xor(bits, builder.ashr(bits, ir.Constant(width, min(_WIDTHS[x] - 1, 32))))
            return builder.trunc(folded, i32) if _WIDTHS[x] == 64 else folded

        def fmix(h):  # type: ignore[no-untyped-def]
            h = builder.mul(builder.xor(h, builder.lshr(h, const(16))), const(0x85EBCA6B))
            h = builder.mul(builder.xor(h, builder.lshr(h, const(13))), const(0xC2B2AE35))
            return builder.xor(h, builder.lshr(h, const(16)))

        place = builder.add(builder.mul(context.cast(builder, args[2], at, types.int32), const(GOLDEN)),
                            context.cast(builder, args[3], offset, types.int32))
        h = fmix(builder.xor(fold(args[0]), place))
        return builder.lshr(fmix(builder.xor(h, fold(args[1]))), const(8))

    return types.int32(x, y, at, offset), codegen


#: The multiplier of a place in :func:`_draw`'s hash (the torch code's ``entropy._GOLDEN``)
GOLDEN = 0x9E3779B1


@njit(**_OPTIONS)
def golden_places(n):  # pragma: no cover (compiled)
    """``k * GOLDEN`` mod 2^32 for ``k < n`` (uint32): :func:`_draw`'s offsets."""
    out = np.empty(n, np.uint32)
    for k in range(n):
        out[k] = np.uint32((k * GOLDEN) & 0xFFFFFFFF)
    return out


@njit(**_OPTIONS)
def _dithered(v, b, inverse, scale, at, places, codes, recon):  # pragma: no cover (compiled)
    """:func:`_rounded`, each code rounded down or up, up with the probability of the change's
    fraction of a step (:func:`_draw`; ``at``: the first element's place in its chunk,
    ``places``: :func:`golden_places` of at least ``v.size``), so that no update is lost on
    average. Returns whether a code is nonzero."""
    top, zero, unit = v.dtype.type(127), v.dtype.type(0), v.dtype.type(2.0 ** -24)
    nonzero = np.int8(0)
    for i in range(v.size):
        x = np.floor((v[i] - b[i]) * inverse[i] + v.dtype.type(_draw(v[i], b[i], at, places[i])) * unit)
        q = min(max(x, -top), top) + zero  # (+ 0: code 0 is +0.0 to readers)
        code = np.int8(q)
        codes[i] = code
        nonzero = np.int8(nonzero | code)
        recon[i] = b[i] + q * scale[i]
    return nonzero != 0


@njit(**_OPTIONS)
def _scaled_with_escapes(v, b, inverse, scale, codes, recon, at):  # pragma: no cover (compiled)
    """:func:`_rounded` of a block with a change that is not finite, at its step: escaped (-128,
    ``recon`` ``v``) where the values differ, a change of 0 where they are equal (an infinity
    that stays put); ``at`` >= 0 (the block's first element's place in its chunk): each code
    rounded down or up, up with the probability of the change's fraction of a step (:func:`_draw`),
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
        x = np.floor(x + v.dtype.type(_draw(v[i], b[i], at, i * GOLDEN)) * unit) if at >= 0 else np.rint(x)
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
def _coded(v, b, inverse, scale, at, places, stochastic, codes, recon):  # pragma: no cover (compiled)
    """:func:`_dithered` or :func:`_rounded` of finite changes."""
    if stochastic:
        return _dithered(v, b, inverse, scale, at, places, codes, recon)
    return _rounded(v, b, inverse, scale, codes, recon)


#: Blocks whose codes one loop takes: a vectorized loop's setup and tail cost about as much
#: as a 64-element block's codes, which a run of blocks then shares (measured: 1.2x the speed
#: of a loop per block, rounding stochastically)
_RUN = 16


@njit(**_OPTIONS)
def block(v, b, starts, ends, width, size, step, drift, stochastic, codes, recon, side):  # pragma: no cover (compiled)
    """:class:`~amber_store.codecs.BlockDeltaCodec` of each chunk, blocks of ``size``
    elements counted from its start (``width``: a chunk's padded length, a multiple of
    ``size``; blocks past a chunk's end are padding): each block's exponent into ``side``
    (chunk, block), the codes, and the reconstruction ``b + q * 2^e``. ``drift`` > 0 coarsens
    a chunk's step by :func:`_drift_factor`; ``stochastic`` rounds by :func:`_dithered`. A
    chunk whose codes are all 0 keeps ``b``. Returns (whether a code is nonzero, escapes).

    The exponents of a run of :data:`_RUN` blocks are taken first, each spread over its
    elements, then the run's codes in one loop (block by block where a change is not finite)."""
    zero, root = v.dtype.type(0), v.dtype.type(math.sqrt(size))
    inverse, scale = np.empty(_RUN * size, v.dtype), np.empty(_RUN * size, v.dtype)  # 2^-e and 2^e
    places = golden_places(_RUN * size)
    finite = np.empty(_RUN, np.bool_)
    moved, escapes = False, 0
    for c in range(starts.size):
        lo, hi = starts[c], ends[c]
        factor = _drift_factor(v[lo:hi], b[lo:hi], drift) if drift > 0 else 1.0
        chunk_step = v.dtype.type(step * factor)
        nonzero = False
        for first in range(0, width // size, _RUN):
            last = min(first + _RUN, width // size)
            start, stop = min(lo + first * size, hi), min(lo + last * size, hi)
            for j in range(first, last):
                a = min(lo + j * size, hi)
                z = min(a + size, hi)
                peak, ok = _peak(v[a:z], b[a:z])
                squares = _squares(v[a:z])
                ok &= math.isfinite(squares)
                if not ok:
                    peak, squares = _finite_parts(v[a:z], b[a:z])
                finite[j - first] = ok
                rms = v.dtype.type(math.sqrt(squares)) / root
                e = min(max(_round_log2(rms * chunk_step), _ceil_log2(peak / v.dtype.type(127)), -126), 126)
                side[c, j] = e
                inverse[a - start:z - start] = _pow2(-e, zero)  # (exact: normal powers of two)
                scale[a - start:z - start] = _pow2(e, zero)
            if finite[:last - first].all():
                n = stop - start
                nonzero |= _coded(v[start:stop], b[start:stop], inverse[:n], scale[:n], start - lo, places, stochastic,
                                  codes[start:stop], recon[start:stop])
                continue
            for j in range(first, last):
                a = min(lo + j * size, hi)
                z = min(a + size, hi)
                k = a - start
                if finite[j - first]:
                    nonzero |= _coded(v[a:z], b[a:z], inverse[k:k + z - a], scale[k:k + z - a], a - lo, places,
                                      stochastic, codes[a:z], recon[a:z])
                else:
                    some, escaped = _scaled_with_escapes(v[a:z], b[a:z], inverse[k], scale[k], codes[a:z], recon[a:z],
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


#: codes a :func:`_matches` tests at once
_MASK = 64


@intrinsic
def _matches(typingctx, codes, at, value):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """Which of the 64 int8 ``codes[at:at + 64]`` equal ``value``, as the bits of a uint64 (bit
    ``i``: code ``at + i``; little-endian targets): one vector compare (on AVX-512 one
    instruction and a mask move) where a loop over the codes branched per code."""
    if not (isinstance(codes, types.Array) and codes.dtype == types.int8 and codes.layout == "C"
            and isinstance(at, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        vector = ir.VectorType(ir.IntType(8), _MASK)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        loaded = builder.load(builder.bitcast(builder.gep(data, [args[1]]), vector.as_pointer()), align=1)
        byte = builder.trunc(context.cast(builder, args[2], value, types.int64), ir.IntType(8))
        first = builder.insert_element(ir.Constant(vector, None), byte, ir.Constant(ir.IntType(32), 0))
        splat = builder.shuffle_vector(first, ir.Constant(vector, None),
                                       ir.Constant(ir.VectorType(ir.IntType(32), _MASK), None))  # (all lanes: lane 0)
        return builder.bitcast(builder.icmp_unsigned("==", loaded, splat), ir.IntType(_MASK))

    return types.uint64(codes, at, value), codegen


@intrinsic
def _popcount(typingctx, x):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """The set bits of a uint64, as an int64."""
    if x != types.uint64:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.ctpop(args[0])

    return types.int64(x), codegen


@njit(**_OPTIONS)
def count(codes, value):  # pragma: no cover (compiled)
    """How many of the (contiguous) ``codes`` equal ``value``, 64 at a time."""
    end = codes.size // _MASK * _MASK
    k = 0
    for w in range(0, end, _MASK):
        k += _popcount(_matches(codes, w, value))
    for i in range(end, codes.size):
        k += codes[i] == value
    return k


@njit(**_OPTIONS)
def nonzeros(codes, at, kept, most):  # pragma: no cover (compiled)
    """The positions of the nonzero ``codes`` (contiguous) into ``at`` and those codes into
    ``kept`` (both at least ``most`` long), 64 codes tested at a time; returns their count, or
    -1 when there are more than ``most``: counted first, from the masks alone, so that a dense
    row is refused in one cheap pass (measured per 1 MiB of codes: 6 us at 60% nonzero; at
    1.3%, 16 us in all against 11 for the positions alone)."""
    if codes.size - count(codes, 0) > most:
        return -1
    end = codes.size // _MASK * _MASK
    k = 0
    for w in range(0, end, _MASK):
        mask = ~_matches(codes, w, 0)
        while mask:
            i = w + trailing_zeros(mask)
            at[k] = i
            kept[k] = codes[i]
            k += 1
            mask &= mask - np.uint64(1)
    for i in range(end, codes.size):
        if codes[i]:
            at[k] = i
            kept[k] = codes[i]
            k += 1
    return k


@njit(**_OPTIONS)
def gaps(at, classes, extra):  # pragma: no cover (compiled)
    """The gaps before the increasing positions ``at`` (the zeros before each nonzero code; each
    below 2^32) as deflate codes distances: each one's class, its bit length, into ``classes``
    (int8), and its bits but the leading one, least significant first, into ``extra`` (bytes, in
    little-endian bit order, at most 31 bits a gap; at least ``4 * at.size`` long); returns the
    bytes of ``extra`` used."""
    acc = np.uint64(0)
    fill = np.uint64(0)  # (bits in acc: below 32 between gaps)
    m = 0
    prev = -1
    for i in range(at.size):
        gap = np.uint64(at[i] - prev - 1)
        prev = at[i]
        c = np.uint64(64) - leading_zeros(gap)  # (0 for a gap of 0)
        classes[i] = np.int8(c)
        if c > 1:
            acc |= (gap ^ (np.uint64(1) << (c - np.uint64(1)))) << fill
            fill += c - np.uint64(1)
            if fill >= 32:
                for j in range(4):
                    extra[m + j] = np.uint8((acc >> np.uint64(8 * j)) & np.uint64(255))
                acc >>= np.uint64(32)
                fill -= np.uint64(32)
                m += 4
    while fill > 0:
        extra[m] = np.uint8(acc & np.uint64(255))
        acc >>= np.uint64(8)
        fill = fill - np.uint64(8) if fill > 8 else np.uint64(0)
        m += 1
    return m


@njit(**_OPTIONS)
def ungaps(classes, extra, positions):  # pragma: no cover (compiled)
    """The positions (into ``positions``, int64) after the gaps :func:`gaps` wrote as
    ``classes`` and ``extra``; returns False (positions unfinished) when those are malformed:
    a class outside [0, 32], or extra bits that do not end in the last byte of ``extra``."""
    acc = np.uint64(0)
    fill = 0  # (bits in acc: fewer than 8 between gaps)
    m = 0
    at = -1
    for i in range(classes.size):
        c = np.int64(classes[i])
        if c < 0 or c > 32:
            return False
        gap = c  # (classes 0 and 1 are the gaps 0 and 1)
        if c > 1:
            width = c - 1
            while fill < width:
                if m == extra.size:
                    return False
                acc |= np.uint64(extra[m]) << np.uint64(fill)
                fill += 8
                m += 1
            gap = (1 << width) + np.int64(acc & ((np.uint64(1) << np.uint64(width)) - np.uint64(1)))
            acc >>= np.uint64(width)
            fill -= width
        at += gap + 1
        positions[i] = at
    return m == extra.size


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
def unquant(x, codes, scale):  # pragma: no cover (compiled)
    """A quantized delta restored in place: ``x`` (a chunk's base values, float32 or float64)
    plus each code times the chunk's ``scale`` rounded to ``x``'s dtype, a rounded product and
    a rounded sum, as :func:`quantized` (the writer) and the torch code compute them."""
    step = x.dtype.type(scale)
    for i in range(x.size):
        x[i] = x[i] + x.dtype.type(codes[i]) * step


@njit(**_OPTIONS)
def unratio(x, codes, factors):  # pragma: no cover (compiled)
    """A ratio delta restored in place: ``x`` (a chunk's base values) times each code's factor
    (``factors[code + 128]``, the writer's table), one rounded product as for the writer."""
    for i in range(x.size):
        x[i] = factors[codes[i] + 128] * x[i]
