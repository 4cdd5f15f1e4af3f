"""Manifests: a committed step and how each of its tensors materializes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import zstandard


from .layout import FORMAT_NAME, FORMAT_VERSION, Encoding


@dataclass
class TensorEntry:
    """How one tensor of one step materializes.

    ``full``: the array at ``array`` holds the raw bits. ``xor``/``sparse``/``quant``: it holds
    a delta against ``materialized(base, key)``, applied by the delta codec named in the
    array's metadata (``params`` holds per-tensor codec data, e.g. quantization scales).
    ``same``: no array; the value equals ``materialized(base, key)``. ``crc32c`` lists one
    checksum per chunk of the *materialized* bits, in C order.
    """

    dtype: str
    shape: list[int]
    chunks: list[int]
    encoding: Encoding
    base: int | None
    array: str | None
    crc32c: list[int]
    nbytes: int
    stored: int = 0
    params: dict[str, Any] | None = None
    # version 3: where the stored chunks are. ``index``: ``[offset, nbytes]`` of each chunk in
    # the shard object of ``array`` (``None``: not stored, all zero). ``pack``: ``[pack name,
    # offset, nbytes]`` of the tensor's one chunk in the step's uncompressed pack stream.
    index: list[list[int] | None] | None = None
    pack: list[Any] | None = None

    @property
    def legacy(self) -> bool:
        """Whether the data is a zarr array of its own (versions 1-2; ``same`` entries hold none)."""
        return self.encoding != "same" and self.index is None and self.pack is None


_OPTIONAL = {"params", "index", "pack"}  # TensorEntry fields that default to None


@dataclass
class Manifest:
    """A committed step. Written last; its presence is what makes the step exist."""

    step: int
    kind: Literal["full", "delta"]
    base: int | None
    depth: int
    group: str
    tree: dict[str, Any]
    tensors: dict[str, TensorEntry]
    created: float
    seconds: float
    attempt: str
    writer: str = ""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # version 3: the step's packs (name -> ``{"array", "chunk", "nbytes", "index"}``: the pack
    # array, its inner chunk bytes, stream length, and chunk index as in TensorEntry), and the steps of its
    # segment since the last full step (position ``depth`` is this step), for base policies.
    packs: dict[str, Any] = field(default_factory=dict)
    segment: list[int] = field(default_factory=list)
    # version 10: a sharded step's records live in one fragment object per rank (``None``: in
    # ``tensors``), each ``{"key", "crc32c", "nbytes", "items"}`` or ``None`` (a rank that wrote
    # nothing). Its ``tensors`` and ``packs`` then hold what was read of them
    # (:meth:`History.entry`); they are not written here.
    fragments: list[dict[str, Any] | None] | None = None

    @property
    def nbytes_raw(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())

    @property
    def nbytes_stored(self) -> int:
        return sum(e.stored for e in self.tensors.values())

    def encode(self) -> bytes:
        """The commit object: the JSON, zstd-compressed for a sharded step's index (format 10;
        its names and descriptors repeat, so it compresses ~10x: a resuming rank reads it whole)."""
        data = self.to_json()
        return data if self.fragments is None else zstandard.ZstdCompressor(level=3).compress(data)

    def to_json(self) -> bytes:
        d = vars(self)
        if self.fragments is None:
            d = {k: v for k, v in d.items() if k != "fragments"}
            # (an entry's null optional fields left out)
            d["tensors"] = {k: {f: v for f, v in vars(e).items() if v is not None or f not in _OPTIONAL}
                            for k, e in self.tensors.items()}
        else:
            d = {**d, "tensors": {}, "packs": {}}
        return json.dumps(d, separators=(",", ":")).encode()
