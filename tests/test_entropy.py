"""The rANS coder of quantized codes: exact round trips and sizes at the entropy."""

from __future__ import annotations

import numpy as np
import pytest

from amber_store.entropy import ans_decode, ans_encode, entropy_bits


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


def test_a_malformed_block_is_refused_not_misread():
    block = np.frombuffer(ans_encode(np.array([0, 1, 1, -1] * 50, dtype=np.int8)), np.uint8)
    with pytest.raises(ValueError):
        ans_decode(block[:-3], 200)
    with pytest.raises(ValueError):
        ans_decode(block, 199)  # the counts say 200 codes
