"""The rANS coder of quantized codes: exact round trips and sizes at the entropy."""

from __future__ import annotations

import tracemalloc

import constriction
import numpy as np
import pytest

from numcodecs import zstd

from amber_store.codecs.ans import (_SPARSE_AT_MOST, DENSE, NIBBLES, SPARSE, _gaps_encode, _positions_decode, ans_decode,
                                 ans_encode, decode_codes, encode_codes, encode_codes_many, entropy_bits)


@pytest.mark.parametrize("codes", [
    np.zeros(1000, dtype=np.int8),                       # one symbol: no stream at all
    np.full(7, -128, dtype=np.int8),                     # the escape code alone
    np.array([-128, 127, 0, 0, 0], dtype=np.int8),       # both ends of the range, gaps between
    np.array([5], dtype=np.int8),
    np.random.default_rng(0).integers(-128, 128, 20_000).astype(np.int8),
])
def test_ans_round_trips_any_int8_codes_and_reports_its_length(codes):
    block = ans_encode(codes)
    back, used = ans_decode(np.frombuffer(block + b"trailing", np.uint8), codes.size)
    assert used == len(block) and back.dtype == np.int8 and np.array_equal(back, codes)


@pytest.mark.parametrize("sigma", [0.3, 1.0, 4.0])
def test_ans_stores_near_zero_codes_within_a_percent_of_their_entropy(sigma):
    rng = np.random.default_rng(1)
    codes = np.clip(np.round(rng.standard_normal(1 << 18) * sigma), -127, 127).astype(np.int8)
    bits = 8 * len(ans_encode(codes)) / codes.size
    assert bits <= entropy_bits(codes) * 1.01 + 0.002


def constriction_block(codes: np.ndarray) -> bytes:
    """What ans_encode wrote by constriction's own encoder (formats 4-8): its kernel must write
    these bytes, which readers decode with constriction."""
    symbols = codes.view(np.uint8) ^ np.uint8(0x80)
    counts = np.bincount(symbols)
    used = np.flatnonzero(counts)
    first, last = int(used[0]), int(used[-1])
    counts = counts[first: last + 1].astype("<u4")
    head = bytes([first, last - first]) + counts.tobytes()
    if first == last:
        return head + bytes(4)
    coder = constriction.stream.stack.AnsCoder()
    probs = counts.astype(np.float64)
    coder.encode_reverse(np.subtract(symbols, first, dtype=np.int32),
                         constriction.stream.model.Categorical(probs / probs.sum(), perfect=False))
    words = coder.get_compressed().astype("<u4")
    return head + np.uint32(words.size).astype("<u4").tobytes() + words.tobytes()


def any_codes(seed: int) -> np.ndarray:
    """Codes of any histogram: from one to 256 codes in use, wherever in the range, from one
    code nearly always to flat."""
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 3, 100, 5000, 1 << 20]))
    symbols = int(rng.integers(1, 257))
    alphabet = rng.choice(256, symbols, replace=False) - 128
    return rng.choice(alphabet, n, p=rng.dirichlet(np.full(symbols, rng.choice([0.01, 0.3, 3.0])))).astype(np.int8)


@pytest.mark.parametrize("seed", range(40))
def test_the_ans_kernel_writes_the_words_constriction_writes(seed):
    codes = any_codes(seed)
    assert ans_encode(codes) == constriction_block(codes)


@pytest.mark.parametrize("seed", range(40))
def test_the_ans_kernel_reads_any_words_as_constriction_reads_them(seed):
    # Its own blocks back to their codes; and other words (a block damaged past its checksum,
    # a forged one) to whatever constriction would decode: the same function of the bytes.
    codes = any_codes(seed)
    block = np.frombuffer(ans_encode(codes), np.uint8)
    assert np.array_equal(ans_decode(block, codes.size)[0], codes)
    first, span = int(block[0]), int(block[1])
    counts = block[2: 2 + 4 * (span + 1)].view("<u4")
    rng = np.random.default_rng(seed)
    for nwords in range(1, 5) if span else []:
        words = rng.integers(0, 1 << 32, nwords, dtype=np.uint64).astype(np.uint32)
        forged = np.concatenate([block[: 2 + 4 * (span + 1)], np.array([nwords], "<u4").view(np.uint8),
                                 words.astype("<u4").view(np.uint8)])
        probs = counts.astype(np.float64)
        model = constriction.stream.model.Categorical(probs / probs.sum(), perfect=False)
        symbols = constriction.stream.stack.AnsCoder(words).decode(model, codes.size) + first
        assert np.array_equal(ans_decode(forged, codes.size)[0], (symbols.astype(np.uint8) ^ np.uint8(0x80)).view(np.int8))


def test_a_malformed_block_is_refused_not_misread():
    block = np.frombuffer(ans_encode(np.array([0, 1, 1, -1] * 50, dtype=np.int8)), np.uint8)
    with pytest.raises(ValueError):
        ans_decode(block[:-3], 200)
    with pytest.raises(ValueError):
        ans_decode(block, 199)  # the counts say 200 codes


def _codes(n: int, nonzero: float, seed: int = 2, spread: float = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    codes = np.clip(np.round(rng.standard_normal(n) * spread), -127, 127).astype(np.int8)
    codes[codes == 0] = 1
    codes[rng.random(n) >= nonzero] = 0
    return codes


@pytest.mark.parametrize("n, nonzero, spread, layout", [
    (1 << 16, 0.02, 3, SPARSE), (1 << 16, 0.0, 3, SPARSE), (1 << 20 | 5, 0.1, 3, SPARSE),  # long gaps; one nonzero code
    (1 << 16, 0.6, 3, NIBBLES), (1 << 16 | 1, 1.0, 1.5, NIBBLES),  # dense and spread over +-7 (an odd count)
    (1 << 16, 0.3, 1, DENSE),  # too dense to be sparse, too few bits of entropy for nibbles
    (1 << 16, 0.6, 12, DENSE),  # too many codes beyond +-7
    (100, 0.02, 3, DENSE), (4000, 0.6, 3, DENSE),  # too few codes for another layout's model to pay
])
def test_codes_round_trip_in_the_layout_their_density_and_spread_call_for(n, nonzero, spread, layout):
    codes = _codes(n, nonzero, spread=spread)
    codes[-1] = -128  # the escape code is one of the nonzero ones
    block = encode_codes(codes)
    back, used = decode_codes(np.frombuffer(block + b"tail", np.uint8), n)
    assert block[0] == layout and used == len(block) and np.array_equal(back, codes)


def test_a_run_of_chunks_encodes_each_chunk_as_it_would_alone():
    # rows of every kind side by side: the vectorized pass must restart gaps and extra bits per row
    n = 1 << 16
    rows = np.stack([_codes(n, 0.02, seed=5), np.zeros(n, np.int8), _codes(n, 0.6, seed=6), _codes(n, 0.0005, seed=7),
                     _codes(n, 0.1, seed=8), _codes(n, 0.2, seed=9), _codes(n, 0.9, seed=10, spread=2)])
    rows[3, 0], rows[3, -1] = -128, 7  # nonzero first and last codes
    rows[4, : n // 2] = 0  # a long first gap
    rows[6, 1000:1100] = -128  # escaped nibbles, some of them the escape code
    coded, escapes = encode_codes_many(rows, find=-128)
    assert coded[1] is None  # a chunk of zeros is not stored
    assert [c[0] for c in coded if c is not None] == [SPARSE, NIBBLES, SPARSE, SPARSE, DENSE, NIBBLES]
    for row, block, escaped in zip(rows, coded, escapes):
        assert np.array_equal(escaped, np.flatnonzero(row == -128))
        if block is not None:
            back, used = decode_codes(np.frombuffer(block, np.uint8), n)
            assert used == len(block) and np.array_equal(back, row)


@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 37])  # (the codes past the last 64 are tested one by one)
def test_codes_are_sparse_up_to_the_densest_sparse_row_and_no_further(n):
    most = int(_SPARSE_AT_MOST * n)
    for count, sparse in ((most, True), (most + 1, False)):
        codes = np.zeros(n, np.int8)
        at = np.random.default_rng(count).choice(np.arange(1, n - 1), count - 2, replace=False)
        codes[np.concatenate([[0, n - 1], at])] = np.int8(-3)  # (the first and last codes among them)
        block = encode_codes(codes)
        back, used = decode_codes(np.frombuffer(block, np.uint8), n)
        assert (block[0] == SPARSE) == sparse and used == len(block) and np.array_equal(back, codes)


def test_sparse_codes_cost_within_a_percent_of_dense_ones():
    codes = _codes(1 << 20, 0.03)
    sparse, dense = encode_codes(codes), ans_encode(codes)
    assert sparse[0] == SPARSE and len(sparse) <= 1.01 * len(dense)


@pytest.mark.parametrize("spread", [1.5, 2.0, 3.0])
def test_nibbles_cost_within_four_percent_of_the_entropy_coded_block(spread):
    codes = _codes(1 << 18, 1.0, spread=spread)
    nibbles, dense = encode_codes(codes), ans_encode(codes)
    assert nibbles[0] == NIBBLES and len(nibbles) <= 1.04 * len(dense)


def test_gaps_round_trip_up_to_the_largest_a_chunk_can_hold():
    rng = np.random.default_rng(4)
    gaps = np.floor(rng.exponential(10.0 ** rng.uniform(0, 9, 500))).astype(np.int64)
    gaps[:4] = [0, 1, (1 << 31), (1 << 32) - 1]
    positions = np.cumsum(gaps + 1) - 1  # (the positions after those gaps)
    classes, extra = _gaps_encode(positions)
    assert np.array_equal(_positions_decode(classes, extra), positions)


def test_malformed_gaps_are_refused_not_misread():
    classes, extra = _gaps_encode(np.array([0, 9, 700, 70_000], np.int64))
    assert extra.size > 1
    for bad_classes, bad_extra in ((np.r_[classes[:-1], 33].astype(np.int8), extra),  # a class past 32 bits
                                   (np.r_[classes[:-1], -1].astype(np.int8), extra),
                                   (classes, extra[:-1]),  # extra bits cut short
                                   (classes, np.r_[extra, 0].astype(np.uint8))):  # a byte too many
        with pytest.raises(ValueError, match="malformed"):
            _positions_decode(bad_classes, bad_extra)


def test_malformed_codes_are_refused_not_misread():
    n = 1 << 16
    block = np.frombuffer(encode_codes(_codes(n, 0.05)), np.uint8)
    assert block[0] == SPARSE
    for bad in (np.concatenate([[7], block[1:]]), block[:-5], block[:40]):
        with pytest.raises(ValueError):
            decode_codes(bad.astype(np.uint8), n)

    def forged(gaps: list[int], codes: list[int]) -> np.ndarray:
        classes, extra = _gaps_encode(np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1)
        return np.frombuffer(b"".join([bytes([SPARSE]), np.uint32(len(gaps)).tobytes(), ans_encode(classes),
                                       np.uint32(extra.size).tobytes(), extra.tobytes(),
                                       ans_encode(np.array(codes, dtype=np.int8))]), np.uint8)

    assert np.array_equal(decode_codes(forged([3, 0], [5, -2]), 8)[0], [0, 0, 0, 5, -2, 0, 0, 0])
    with pytest.raises(ValueError):
        decode_codes(forged([3, 0], [5, 0]), 8)  # a zero among the nonzero codes
    with pytest.raises(ValueError):
        decode_codes(forged([3, 4], [5, 1]), 8)  # a position past the end


def test_malformed_nibbles_are_refused_not_misread():
    n = 1 << 16
    codes = _codes(n, 1.0, spread=2)
    codes[10] = 9
    block = np.frombuffer(encode_codes(codes), np.uint8)
    assert block[0] == NIBBLES
    assert np.array_equal(decode_codes(block, n)[0], codes)
    for bad in (block[:-5], block[:9]):
        with pytest.raises(ValueError):
            decode_codes(bad, n)
    with pytest.raises(ValueError):
        decode_codes(block, n - 2)  # the frame holds another count of codes

    def forged(escaped: list[int], packed: list[int]) -> np.ndarray:
        frame = zstd.compress(np.array(packed, np.uint8), 1)
        return np.frombuffer(b"".join([bytes([NIBBLES]), np.uint32(len(escaped)).tobytes(),
                                       np.array(escaped, np.int8).tobytes(), np.uint32(len(frame)).tobytes(), frame]),
                             np.uint8)

    assert np.array_equal(decode_codes(forged([100], [0x8F, 0x07]), 3)[0], [-1, 100, 7])  # (an odd count: pad 0)
    # a frame that declares 64 MiB for 3 codes: refused before anything is allocated for it
    huge = zstd.compress(bytes(64 << 20), 1)
    tracemalloc.start()
    with pytest.raises(ValueError, match="malformed"):
        decode_codes(np.frombuffer(b"".join([bytes([NIBBLES]), np.uint32(0).tobytes(), np.uint32(len(huge)).tobytes(),
                                             huge]), np.uint8), 3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20
    for escaped, packed in (([100, 101], [0x8F, 0x07]),  # more escaped codes than marks
                            ([], [0x8F, 0x07]),  # a mark without its code
                            ([5], [0x8F, 0x07]),  # an escaped code that fits a nibble
                            ([100], [0x8F, 0x17])):  # a nonzero pad
        with pytest.raises(ValueError):
            decode_codes(forged(escaped, packed), 3)
