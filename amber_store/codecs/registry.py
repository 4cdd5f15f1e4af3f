"""The one registry of codecs: each delta codec by its manifest encoding and its zarr codec name
(zarr's readers find them through entry points, :mod:`~.zarr_codecs`), the named codecs a
store's ``codec=`` takes, the presets, and :class:`Policy`, which picks a tensor's codec.
:mod:`amber_store.format` checks its list of encodings against this one (a test). Codecs from
outside amber-store join it by :func:`register` or by an entry point (:data:`ENTRY_POINTS`)."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import inspect
import threading
from typing import Any, Sequence, Union

from ..errors import UnknownCodecError
from ..format import EXTENSION_ENCODING
from .base import DeltaCodec
from .entropy import AnsBytesCodec, BlockDeltaCodec, RatioDeltaCodec
from .lossless import DiffDeltaCodec, XorDeltaCodec
from .quantized import Pack4BytesCodec, QuantizedDeltaCodec
from .sparse import SparseBytesCodec, SparseDeltaCodec


#: the format's own delta codecs
BUILT_IN: tuple[type[DeltaCodec], ...] = (
    XorDeltaCodec, DiffDeltaCodec, SparseDeltaCodec, QuantizedDeltaCodec, BlockDeltaCodec, RatioDeltaCodec)
#: every delta codec by the encoding manifests name it by: the built-in ones and those registered
DELTA_ENCODINGS: dict[str, type[DeltaCodec]] = {c.encoding: c for c in BUILT_IN}
#: the array-to-bytes codecs the delta codecs serialize with
SERIALIZERS: tuple[type[Any], ...] = (SparseBytesCodec, Pack4BytesCodec, AnsBytesCodec)

#: The entry point group where a package names the delta codecs it provides, by encoding:
#: ``"acme.topk" = "acme_codecs:TopKCodec"`` under ``[project.entry-points."amber_store.codecs"]``.
ENTRY_POINTS = "amber_store.codecs"
_REGISTERING = threading.Lock()


def register(codec: type[DeltaCodec]) -> type[DeltaCodec]:
    """Add a delta codec class from outside amber-store (a call, or a class decorator): stores
    then take its instances as ``codec=`` and read back what they wrote. Its ``encoding`` is an
    extension encoding, ``<package>.<codec>`` (docs/FORMAT.md), and its ``name`` a zarr codec id
    of its own. Another process reading such a step finds the class through an entry point of
    the group :data:`ENTRY_POINTS` named by the encoding. Registering a class again does
    nothing; another class under a taken encoding or name is refused. Returns ``codec``."""
    if not (isinstance(codec, type) and issubclass(codec, DeltaCodec)) or inspect.isabstract(codec):
        raise TypeError(f"{codec!r} is not a DeltaCodec class with every abstract method implemented")
    encoding, name = getattr(codec, "encoding", None), getattr(codec, "name", None)
    if not (isinstance(encoding, str) and EXTENSION_ENCODING.fullmatch(encoding)):
        raise ValueError(f"{codec.__name__}.encoding is {encoding!r}: a codec from outside amber-store names "
                         "itself '<package>.<codec>' (lowercase, dotted); the bare names are the format's own")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{codec.__name__}.name (its zarr codec id) is {name!r}")
    with _REGISTERING:
        for other in DELTA_ENCODINGS.values():
            if other is not codec and (other.encoding == encoding or other.name == name):
                raise ValueError(f"{codec.__name__}: encoding {encoding!r} or zarr codec name {name!r} is "
                                 f"{other.__module__}.{other.__qualname__}'s already")
        DELTA_ENCODINGS[encoding] = codec
    return codec


def delta_codec(encoding: str) -> type[DeltaCodec]:
    """The codec class that reads a manifest's ``encoding``: the format's own, a registered one,
    or one that an installed package names by entry point (imported now, then registered).
    Raises :class:`~amber_store.errors.UnknownCodecError` if none does."""
    found = DELTA_ENCODINGS.get(encoding)
    if found is not None:
        return found
    if EXTENSION_ENCODING.fullmatch(encoding):  # (a crafted store's name imports no module: only
        for ep in importlib.metadata.entry_points(group=ENTRY_POINTS, name=encoding):  # installed ones)
            codec = ep.load()
            if getattr(codec, "encoding", None) != encoding:
                raise UnknownCodecError(f"the entry point {encoding!r} = {ep.value!r} (group {ENTRY_POINTS!r}) loads "
                                        f"{codec!r}, whose encoding is {getattr(codec, 'encoding', None)!r}")
            return register(codec)
    raise UnknownCodecError(f"encoding {encoding!r} is a delta codec this process does not have: install the "
                            f"package that provides it (it names the codec under the entry point group "
                            f"{ENTRY_POINTS!r}), or amber_store.codecs.register(<its class>) before loading")


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
        if DELTA_ENCODINGS.get(getattr(codec, "encoding", None)) is not type(codec):
            raise ValueError(f"{type(codec).__name__} is not a registered codec: its steps would not load (a reader "
                             f"decodes encoding {getattr(codec, 'encoding', None)!r} by the class registered for it); "
                             "amber_store.codecs.register() it, with an encoding of its own")
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


