"""The codec contract: :class:`DeltaCodec`, what every delta codec is (its configuration
round-trips through zarr v3 codec metadata; :mod:`~.zarr_codecs` makes it a zarr codec for
zarr's readers), and :class:`Delta`, what its ``diff`` produces.

A codec implements :meth:`DeltaCodec.diff` (the writer's side, on the tensor's device) and
:meth:`DeltaCodec.apply_into` (the reader's side, on host chunks); the rest has defaults that
store the delta's elements raw. See docs/ARCHITECTURE.md for adding one.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from ..format import TensorEntry, bits_numpy_dtype

if TYPE_CHECKING:
    from typing import Self

T = TypeVar("T")

# blosc's shuffles (zarr's names): none, bytes of one significance together, bits likewise.
Shuffle = Literal["noshuffle", "shuffle", "bitshuffle"]


@dataclass
class Delta:
    """What a delta codec produced for one tensor: the array to store (host; ``None`` for a
    sparse delta, see :attr:`changes`), the bits a reader will materialize, and per-tensor
    parameters for the manifest."""

    data: np.ndarray | None
    recon: torch.Tensor
    params: dict[str, Any] | None = None
    #: per-chunk data a codec's :meth:`DeltaCodec.serialize` stores next to the chunk's codes
    #: (one row per chunk, C order), e.g. block exponents
    side: np.ndarray | None = None
    #: a sparse delta's stored elements instead of a mostly-zero ``data``: their flat positions
    #: (ascending) and values (host)
    changes: tuple[np.ndarray, np.ndarray] | None = None
    #: what ``diff``'s ``finish`` returned for each piece, in order (``None``: it was not called)
    encoded: list[Any] | None = None


#: Serializes a piece of a delta on the codec thread that took it, while the piece is in the
#: CPU's cache: given the piece as a :class:`Delta` whose arrays index as the whole tensor's
#: (but ``side``: the piece's own rows) and the piece's chunk runs. Host diffs only.
Finish = Callable[[Delta, list[tuple[int, int]]], Any]


def configuration(data: dict[str, Any], name: str, required: bool = True) -> dict[str, Any]:
    """The configuration of codec metadata ``{"name": name, "configuration": {...}}``."""
    if not isinstance(data, dict) or data.get("name") != name:
        raise ValueError(f"expected codec metadata named {name!r}, got {data!r}")
    config = data.get("configuration", None if required else {})
    if not isinstance(config, dict):
        raise ValueError(f"codec {name!r}: metadata without a configuration object: {data!r}")
    return config


@dataclass(frozen=True)
class DeltaCodec(abc.ABC):
    """Base of the delta codecs: configuration round-trips, pass-through inside zarr.

    A codec names itself (``name``: its zarr codec id; ``encoding``: its manifest encoding)
    and implements :meth:`diff` (the writer's side) and :meth:`decode_into` (the reader's).
    """

    name: ClassVar[str]
    encoding: ClassVar[str]
    lossless: ClassVar[bool] = False
    is_fixed_size = True
    base_step: int = -1
    base_array: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**configuration(data, cls.name))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {f.name: getattr(self, f.name) for f in fields(self)}}

    def with_base(self, step: int, array: str) -> Self:
        return _with_base(self, step, array)

    @classmethod
    def for_entry(cls, entry: TensorEntry) -> DeltaCodec:
        """The codec that decodes ``entry``'s stored chunks (format 3 keeps what decoding
        needs in the entry's ``params``)."""
        return cls()

    def applies_to(self, dtype: str, numel: int) -> bool:
        return True

    def stored_as(self, delta: Delta) -> DeltaCodec:
        """The codec that ``delta``, from :meth:`diff`, is stored and read with: this one, or
        another one a codec fell back to."""
        return self

    @property
    def batch_align(self) -> int:
        """Whether small tensors of this codec may be diffed together, concatenated, each
        zero-padded to a multiple of this many elements, with the same result as alone (0:
        no; the quantizer has a scale per chunk, or a count per tensor)."""
        return 0

    def storage_dtype(self, dtype: str) -> np.dtype:
        """dtype of the zarr array holding this codec's deltas."""
        return bits_numpy_dtype(dtype)

    def serializer(self, dtype: str) -> dict[str, Any]:
        return {"name": "bytes", "configuration": {"endian": "little"}}

    @abc.abstractmethod
    def diff(self, value: torch.Tensor, base: torch.Tensor, chunks: tuple[int, ...],
             out: torch.Tensor | None = None, finish: Finish | None = None) -> Delta | None:
        """Delta of ``value`` (on its device) against host ``base`` bits; ``None`` if a reader
        would materialize exactly ``base`` (the tensor is then stored as ``same``). ``out``: a
        free buffer of ``value``'s raw bits (shape, bits dtype, device) that the codec may
        build the reconstruction in (a fresh one costs page faults: 64 MB in 20 ms here).
        ``finish``: see :data:`Finish`; a codec that takes the delta on the host in pieces
        calls it (:attr:`Delta.encoded`), others ignore it."""

    @abc.abstractmethod
    def decode_into(self, out: np.ndarray, raw: np.ndarray, padded: int, region: tuple[slice, ...],
                    entry: TensorEntry) -> None:
        """Apply one stored chunk (``raw``: its serialized bytes, ``padded`` elements) to ``out``,
        which holds the base bits of the chunk's ``region`` and gets the materialized bits."""

    #: the blosc compressor of ``Compression(compressor="auto")`` for the chunks of large tensors
    #: (packs of small ones, and every lossy delta: zstd, see :meth:`Compression.blosc`)
    auto_compressor: ClassVar[str] = "zstd"

    def shuffle_for(self, cname: str) -> Shuffle:
        """blosc's shuffle of this codec's deltas before the compressor ``cname``."""
        return self.shuffle

    # Per-chunk serialization (the array-to-bytes step); the default stores the raw elements.
    # blosc's shuffle of the serialized chunk before compression: bytes of one significance
    # together (an XOR delta's zero high bytes make long runs)
    shuffle: ClassVar[Shuffle] = "shuffle"
    # whether serialize() already entropy-codes its output: blosc then only frames it
    entropy_coded: ClassVar[bool] = False
    # the op of compression.FUSED_OPS equal to apply_into on a chunk's stored elements, which the
    # native decoder then applies as it decodes them (None: decoded, then applied)
    fused_op: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The native decoder applies a fused op onto raw decompressed bytes: a subclass that
        # stores its chunks another way decodes through its own methods unless it names an op.
        super().__init_subclass__(**kwargs)
        own = {"deserialize", "decode_into", "apply_into"} & cls.__dict__.keys()
        if own and "fused_op" not in cls.__dict__:
            cls.fused_op = None

    def serialize(self, chunk: np.ndarray, side: np.ndarray | None = None, recon: np.ndarray | None = None) -> Any:
        """Bytes-like of one chunk of the stored array (chunk-shaped, C-contiguous), given the
        chunk's row of :attr:`Delta.side` and its materialized bits ``recon`` (unpadded)."""
        return chunk.reshape(-1).view(np.uint8)

    def serialize_run(self, delta: Delta, first: int, runs: list[tuple[int, int]], padded: int,
                      recons: list[np.ndarray]) -> list[Any]:
        """:meth:`serialize_chunks` of the chunks of ``delta`` at the flat ``runs`` (adjacent;
        ``first``: the index of the first chunk, ``padded``: elements per chunk), given their
        materialized bits."""
        assert delta.data is not None
        data = delta.data.reshape(-1)
        if all(b - a == padded for a, b in runs):
            rows = data[runs[0][0]: runs[-1][1]].reshape(len(runs), padded)
        else:
            rows = np.zeros((len(runs), padded), dtype=data.dtype)
            for r, (a, b) in enumerate(runs):
                rows[r, : b - a] = data[a:b]
        return self.serialize_chunks(rows, None if delta.side is None else delta.side[first: first + len(runs)], recons)

    def serialize_chunks(self, rows: np.ndarray, sides: np.ndarray | None, recons: list[np.ndarray]) -> list[Any]:
        """:meth:`serialize` of each chunk of a run of one tensor's chunks: ``rows`` (one a row,
        zero-padded), their rows of :attr:`Delta.side` and their materialized bits; ``None``
        for a chunk of zeros (not stored)."""
        return [self.serialize(row, None if sides is None else sides[r], recons[r]) if row.any() else None
                for r, row in enumerate(rows)]

    def deserialize(self, raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The chunk back from :meth:`serialize`'s bytes (``raw``: uint8)."""
        return raw.view(dtype).reshape(shape)


@dataclass(frozen=True)
class ElementwiseDeltaCodec(DeltaCodec):
    """A delta codec whose stored chunk deserializes to one element per value element, applied
    onto the base's elements (:meth:`apply_into`): the lossless, sparse and quantized codecs."""

    def decode_into(self, out: np.ndarray, raw: np.ndarray, padded: int, region: tuple[slice, ...],
                    entry: TensorEntry) -> None:
        delta = self.deserialize(raw, (padded,), self.storage_dtype(entry.dtype))[: out.size]
        self.apply_into(out, delta.reshape(out.shape), region, entry)

    def apply(self, stored: np.ndarray, base: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> np.ndarray:
        """Materialized bits of ``region`` of ``entry``'s tensor from its stored delta and base bits."""
        out = np.array(base, copy=True)
        self.apply_into(out, stored, region, entry)
        return out

    @abc.abstractmethod
    def apply_into(self, out: np.ndarray, stored: np.ndarray, region: tuple[slice, ...], entry: TensorEntry) -> None:
        """Like :meth:`apply`, in place: ``out`` holds the base bits of ``region`` and gets the result."""


@runtime_checkable
class HostDiff(Protocol):
    """A codec whose delta of a tensor in host memory the step writer takes chunk by chunk as it
    encodes them (:meth:`encode_into`, on the codec threads) rather than by
    :meth:`DeltaCodec.diff` beforehand: the lossless deltas. The writer tests for this, never
    for a class."""

    def encode_into(self, out: np.ndarray, value: np.ndarray, base: np.ndarray) -> None:
        """``out`` gets the stored delta of the bits ``value`` against ``base`` (same shape and
        unsigned dtype)."""


@functools.lru_cache(maxsize=1 << 12)  # every small tensor of a save asks for the same one
def _with_base(codec: Any, step: int, array: str) -> Any:
    return replace(codec, base_step=step, base_array=array)



@dataclass(frozen=True)
class Serializer:
    """An array-to-bytes codec (a delta's chunks to bytes, in zarr's pipeline) without
    configuration."""

    name: ClassVar[str]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        configuration(data, cls.name, required=False)
        return cls()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name}


