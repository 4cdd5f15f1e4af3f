"""The one registry of codecs: each delta codec by its manifest encoding and its zarr codec name
(zarr's readers find them through entry points, :mod:`~.zarr_codecs`), the named codecs a
store's ``codec=`` takes, the presets, and :class:`Policy`, which picks a tensor's codec.
:mod:`amber_store.format` checks its list of encodings against this one (a test)."""

from __future__ import annotations

import fnmatch
from typing import Any, Sequence, Union

from .base import DeltaCodec
from .entropy import AnsBytesCodec, BlockDeltaCodec, RatioDeltaCodec
from .lossless import DiffDeltaCodec, XorDeltaCodec
from .quantized import Pack4BytesCodec, QuantizedDeltaCodec
from .sparse import SparseBytesCodec, SparseDeltaCodec


#: every delta codec by the encoding manifests name it by
DELTA_ENCODINGS: dict[str, type[DeltaCodec]] = {c.encoding: c for c in (
    XorDeltaCodec, DiffDeltaCodec, SparseDeltaCodec, QuantizedDeltaCodec, BlockDeltaCodec, RatioDeltaCodec)}
#: the array-to-bytes codecs the delta codecs serialize with
SERIALIZERS: tuple[type[Any], ...] = (SparseBytesCodec, Pack4BytesCodec, AnsBytesCodec)

CodecLike = Union[str, DeltaCodec]
CodecPolicy = Union[CodecLike, Sequence[tuple[str, CodecLike]]]
_NAMED: dict[str, DeltaCodec] = {
    "lossless": DiffDeltaCodec(),
    "diff": DiffDeltaCodec(),
    "xor": XorDeltaCodec(),
    "sparse": SparseDeltaCodec(),
    "quant8": QuantizedDeltaCodec(bits=8),
    "quant4": QuantizedDeltaCodec(bits=4),
    "block": BlockDeltaCodec(),
    "ratio": RatioDeltaCodec(),
}

#: Named policies. ``"lossy"``, the recommended lossy preset: Adam's second moments (positive,
#: dividing the update) by ratio within a factor sqrt(2) (their root, Adam's denominator, within
#: 19%); weights (and every other float tensor) by blocks at a step near 0.6 of a block's RMS
#: value, rounded stochastically: each element moves a whole step with the probability of its
#: change's fraction of one, so the restored state lacks no update on average, where rounding to
#: the nearest step kept every element that moved less than half a step at its base, and those
#: lost updates, not the error's size, were what a resume paid for (benchmarks/sensitivity.py);
#: Adam's first moment, which changes wholesale between checkpoints, kept at its value in the
#: delta's base but where an element changed by over ~32 RMS values of its block (a block whose
#: gradients stopped, its moment collapsing toward zero): coded at step 6 it took 18-80% of a
#: delta's bytes and still came back no better than zeros (error 1.1-1.5 of its RMS); its error
#: fades within a few dozen steps of a resume. Tensors of 64 elements and up are lossy (the
#: codecs' default is 256): a narrow model's norms and biases, and their moments, took a fifth
#: of its delta steps' bytes stored exact. Measured against the preset before (weights at 0.15
#: rounded to nearest) in benchmarks/regimes.py, benchmarks/resume_seeds.py and
#: benchmarks/lossy.py (benchmarks/RESULTS.md).
PRESETS: dict[str, list[tuple[str, DeltaCodec]]] = {
    "lossy": [("*exp_avg_sq", RatioDeltaCodec(step=1.0, min_numel=64)),
              ("*exp_avg", BlockDeltaCodec(step=64.0, min_numel=64)),
              ("*", BlockDeltaCodec(step=0.6, stochastic=True, min_numel=64))],
}


def codec_named(codec: CodecLike) -> DeltaCodec:
    if isinstance(codec, DeltaCodec):
        return codec
    try:
        return _NAMED[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; use one of {sorted(_NAMED)} or a DeltaCodec (or, for a whole "
                         f"store, a preset: {sorted(PRESETS)})") from None


class Policy:
    """Which delta codec each tensor gets: one codec for all (default ``"lossless"``, the
    :class:`DiffDeltaCodec`), or rules ``[(pattern, codec), ...]`` matched in order against the
    tensor key with :mod:`fnmatch` (e.g. ``[("optim/*", "sparse"), ("*", "lossless")]``), or a
    preset's name (:data:`PRESETS`). Unmatched tensors, and tensors a lossy codec does not apply
    to (integers, bool, fewer than its ``min_numel`` elements, such as Adam's step counters),
    stay lossless."""

    def __init__(self, policy: CodecPolicy = "lossless") -> None:
        if isinstance(policy, str) and policy in PRESETS:
            policy = PRESETS[policy]
        rules = [("*", policy)] if isinstance(policy, (str, DeltaCodec)) else list(policy)
        self.rules = [(pattern, codec_named(c)) for pattern, c in rules]

    def for_tensor(self, key: str, dtype: str, numel: int) -> DeltaCodec:
        for pattern, codec in self.rules:
            if fnmatch.fnmatchcase(key, pattern):
                return codec if codec.applies_to(dtype, numel) else _NAMED["lossless"]
        return _NAMED["lossless"]


