"""Keys, versions and zarr metadata of the on-disk hierarchy (docs/FORMAT.md)."""

from __future__ import annotations

import re
from typing import Any

import crc32c
import numpy as np


from .chunks import chunk_grid
from .tree import escape_segment


FORMAT_NAME = "amber-store"
# 1: full/xor/same encodings. 2 adds the lossy sparse and quant encodings and TensorEntry.params.
# 3: few objects per step: small tensors packed, one sharded object per large tensor, array
# metadata consolidated into the step group, chunk offsets in the manifest.
# 4: more leaf kinds in the state tree (numpy, bytes, paths, sets, torch dtype/device/Size, keys
# that are not str/int), and aliased tensors stored once (several nodes name one tensor key).
# 5: entropy-coded lossy encodings block and ratio (codecs amber.block_delta, amber.ratio_delta,
# serializer amber.ans).
# 6: lossless diff encoding (codec amber.diff_delta), the writers' default lossless delta.
# 7: entropy-coded chunks may store their codes sparse (the gaps between nonzero codes, then those),
# behind a layout byte; entries say so in params["sparse_codes"], amber.ans in its configuration.
# 8: a third layout behind that byte: dense codes as zstd-compressed nibbles, the few beyond +-7 escaped.
# 9: steps written through torch.distributed.checkpoint carry their layout as JSON (the state's
# tree, each tensor's shards, each value's item) instead of DCP's pickled metadata; entries leave
# out fields that are null.
# 10: a sharded step's index describes each tensor's shards once (a grid, format.sharding) and
# names one fragment per rank holding its items' records in binary columns (format.fragments);
# ranks write their arrays' zarr.json themselves, so the step group consolidates none.
FORMAT_VERSION = 10
ROOT_ATTR = "amber_store"
COMMITS_DIR = "commits"
CLAIMS_DIR = "claims"
STEPS_DIR = "steps"
#: Chunk size of tensors with a lossless codec, unless a store names one.
#: Every chunk costs a reader or writer a few calls that each take the GIL; on 16 cores, a
#: whole-step load of a 606 MB state took 0.58x the time with 4 MiB chunks as with 1 MiB (0.45x
#: with 16 MiB chunks, which on 2 cores fault in more memory than they save).
DEFAULT_CHUNK_BYTES = 4 << 20
#: Chunk size of tensors with a lossy codec: a quantizer's scale is per chunk.
LOSSY_CHUNK_BYTES = 1 << 20
#: Size of a pack's parts (its inner chunks), unless a store names a chunk size: 4 MiB parts
#: made full saves of 2,000 small tensors 1.2-1.75x slower (delta saves 0.88x; measured).
PACK_CHUNK_BYTES = 1 << 20
# Tensors smaller than this are packed together into one object per step.
DEFAULT_PACK_THRESHOLD = 1 << 20
#: Packed tensors start, and a pack's inner chunks end, at multiples of this many bytes (8
#: elements of 8 bytes: what blosc's bit shuffle needs, see :func:`choose_chunks`).
PACK_ALIGN = 64
PACK_PREFIX = "pack"
# Shard index entry of an absent inner chunk (zarr v3 sharding spec).
_ABSENT = (1 << 64) - 1

#: What a tensor entry stores: ``full`` (its values), ``same`` (nothing: its base's value), or
#: a delta codec's encoding (:data:`DELTA_ENCODINGS`, or an extension encoding).
Encoding = str
#: The format's delta encodings, each with the zarr codec its arrays name and the format version
#: that introduced it. The codec registry (:mod:`amber_store.codecs.registry`) implements exactly
#: these, and docs/FORMAT.md's version table names each at its version (a test holds the three
#: equal); this list is the one a manifest is checked against because it needs no torch, which
#: every codec imports (the CLI reads manifests without it).
DELTA_ENCODINGS: dict[str, tuple[str, int]] = {
    "xor": ("amber.xor_delta", 1), "sparse": ("amber.sparse_delta", 2), "quant": ("amber.quantized_delta", 2),
    "block": ("amber.block_delta", 5), "ratio": ("amber.ratio_delta", 5), "diff": ("amber.diff_delta", 6),
}
#: An extension encoding: a delta codec from outside amber-store, named ``<package>.<codec>``
#: (lowercase and dotted; the bare names are the format's own). Its arrays name the codec's
#: own zarr codec; a reader finds the codec through the entry point group ``amber_store.codecs``
#: (:func:`amber_store.codecs.register`), or refuses the tensor naming the encoding.
EXTENSION_ENCODING = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
#: The array-to-bytes codecs delta arrays name, and the format version that introduced each.
SERIALIZERS: dict[str, int] = {"amber.sparse": 2, "amber.pack4": 2, "amber.ans": 5}


def commit_key(step: int) -> str:
    """Key of a step's manifest: the commit point. Zero-padded so listings sort by step."""
    return f"{COMMITS_DIR}/{step:012d}.json"


def claim_key(parent: int | None, n: int) -> str:
    """Key of the ``n``-th claim of ``parent`` as a new step's base (``None``: the first step of a
    store): created exclusively before a commit, so that one writer builds on each step."""
    return f"{CLAIMS_DIR}/{'start' if parent is None else f'{parent:012d}'}-{n}.json"


def parse_commit_key(name: str) -> int | None:
    m = re.fullmatch(r"(\d{12})\.json", name)
    return int(m.group(1)) if m else None


def step_group(step: int, attempt: str) -> str:
    """Group holding one save attempt's arrays; the attempt id keeps a retry off stale chunks."""
    return f"{STEPS_DIR}/{step:012d}-{attempt}"


def group_metadata(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def array_name(key: str) -> str:
    """The node name of a tensor's array inside its step group: the whole key, '/' escaped
    too, so a step group is flat (no directory per nesting level); never a pack's name."""
    name = "%2F".join(escape_segment(part) for part in key.split("/"))
    return f"%70{name[1:]}" if name.startswith(PACK_PREFIX) else name


def regular_chunk_grid(shape: list[int] | tuple[int, ...]) -> dict[str, Any]:
    return {"name": "regular", "configuration": {"chunk_shape": list(shape)}}


def sharded_array_metadata(
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    data_type: str,
    inner_codecs: list[dict[str, Any]],
    attributes: dict[str, Any],
) -> dict[str, Any]:
    """zarr v3 metadata of an array stored as one shard object holding every inner chunk.

    The shard is the whole array (rounded up to whole inner chunks); its key is ``0.0...``
    (v2 chunk key encoding), so the array is one file in one directory.
    """
    grid = chunk_grid(shape, chunks)
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": data_type,
        "chunk_grid": regular_chunk_grid([g * c for g, c in zip(grid, chunks)]),
        "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
        "fill_value": 0,
        "codecs": [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(chunks),
                "codecs": inner_codecs,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end",
            },
        }],
        "attributes": {ROOT_ATTR: attributes},
    }


def shard_key(array: str, ndim: int) -> str:
    """Key of the one shard object of a sharded array of ``ndim`` dimensions."""
    return f"{array}/{'.'.join(['0'] * ndim)}"


def shard_index(index: list[list[int] | None]) -> bytes:
    """The shard's trailing index: ``(offset, nbytes)`` little-endian u64 per inner chunk in C
    order, ``2**64-1`` twice for an absent chunk, then its crc32c."""
    flat = np.array([_ABSENT if e is None else v for e in index for v in (e or (0, 0))], dtype="<u8")
    raw = flat.tobytes()
    return raw + np.uint32(crc32c.crc32c(raw)).astype("<u4").tobytes()


def step_group_metadata(step: int, created: float, arrays: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """A step group's zarr.json: its attributes and the consolidated metadata of its arrays, so
    no array needs a zarr.json of its own (``zarr.open_group(..., use_consolidated=True)``);
    ``None``: each array has its own (a sharded step's ranks write them)."""
    meta = group_metadata({ROOT_ATTR: {"step": step, "created": created}})
    if arrays is not None:
        meta["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": arrays}
    return meta


