"""Fragments: one rank's records of the items it wrote in a sharded step (format 10).

A sharded step's index (the manifest) describes each tensor once (:mod:`.sharding`); what
differs between its shards lives in one fragment object per rank, ``<group>/fragment-r<rank>``:
for each item the rank wrote, its encoding, base step, stored bytes, chunk shape, one crc32c
per chunk (but for a ``same`` item: its base's, which a reader takes from there; so a step in
which nothing changed costs next to nothing a shard), and where its bytes lie (a location in one of the rank's packs, or the chunk index
of its own shard object), plus the rank's packs and any codec parameters. The records are
columns of little-endian integers, compressed with zstd (a packed shard's record is ~10 bytes),
in the order of the items' keys; which items a fragment holds, and their shapes and dtypes,
come from the index, so keys are not stored.

Object: one zstd frame of ``b"AMBF"``, the header's length (u32), the header (JSON:
``format_version``, ``items``, ``encodings`` named by the ``enc`` column, ``packs``, sparse
``params``), then the columns in :data:`COLUMNS` order.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import crc32c
import numpy as np
import zstandard

from .chunks import chunk_grid
from .dtypes import ITEMSIZES
from .layout import FORMAT_VERSION, array_name
from .manifest import TensorEntry

MAGIC = b"AMBF"
FRAGMENT_PREFIX = "fragment-r"
VALUE_SUFFIX = "/bytes"  # (an item key's ending that no shard offset has: a value's)
#: (name, dtype): per item, except ``chunks`` (one per dimension), ``crc32c`` (one per chunk)
#: and ``index`` (two per chunk of each item stored in an object of its own). ``kind``: 0 an
#: item that stores nothing (``same``), 1 one with an object of its own, 2 a packed one.
COLUMNS = (("kind", "<u1"), ("enc", "<u1"), ("base", "<i8"), ("stored", "<u8"), ("pack", "<i4"), ("poff", "<u8"),
           ("plen", "<u8"), ("chunks", "<u8"), ("crc32c", "<u4"), ("index", "<u8"))
_PER_ITEM = 7
_ABSENT = (1 << 64) - 1
#: what a fragment may decompress to, beyond what its items justify: a record is a few dozen
#: bytes, so a frame that expands more than this per compressed byte is refused before it is read
_RATIO = 2048
_MAX_BYTES = 1 << 30


class Invalid(ValueError):
    """A fragment whose bytes do not agree with themselves or with the index."""


def key(group: str, rank: int) -> str:
    """The object key of rank ``rank``'s fragment in the attempt group ``group``."""
    return f"{group}/{FRAGMENT_PREFIX}{rank}"


@dataclass(frozen=True)
class Item:
    """What the index says of one item of a fragment."""

    key: str
    dtype: str
    #: ``None``: a value (pickled bytes), whose length the fragment says
    shape: tuple[int, ...] | None


def encode(entries: dict[str, TensorEntry], packs: dict[str, Any]) -> bytes:
    """The fragment of ``entries`` (by key) and the rank's ``packs``."""
    keys = sorted(entries)
    shapes = {str(i): entries[k].shape for i, k in enumerate(keys) if k.endswith(VALUE_SUFFIX)}
    entries = [entries[k] for k in keys]
    encodings = sorted({e.encoding for e in entries})
    code = {name: i for i, name in enumerate(encodings)}
    pack_names = sorted(packs)
    pack_no = {name: i for i, name in enumerate(pack_names)}
    cols: dict[str, list[int]] = {name: [] for name, _ in COLUMNS}
    params: dict[str, Any] = {}
    for i, e in enumerate(entries):
        kind = 2 if e.pack is not None else 1 if e.index is not None else 0
        cols["kind"].append(kind)
        cols["enc"].append(code[e.encoding])
        cols["base"].append(-1 if e.base is None else e.base)
        cols["stored"].append(e.stored)
        cols["pack"].append(pack_no.get(e.pack[0], -1) if e.pack is not None else -1)
        cols["poff"].append(e.pack[1] if e.pack is not None else 0)
        cols["plen"].append(e.pack[2] if e.pack is not None else 0)
        cols["chunks"].extend(e.chunks)
        if kind:  # (a ``same`` item's checksums are its base's: its reader takes them from there)
            cols["crc32c"].extend(e.crc32c)
        if e.index is not None:
            cols["index"].extend(v for loc in e.index for v in (loc if loc is not None else (_ABSENT, _ABSENT)))
        if e.params:
            params[str(i)] = e.params
    header = json.dumps({"format_version": FORMAT_VERSION, "items": len(entries), "encodings": encodings,
                         "packs": {n: packs[n] for n in pack_names}, "params": params, "shapes": shapes,
                         "described": described([Item(k, e.dtype, tuple(e.shape)) for k, e in zip(keys, entries)])},
                        separators=(",", ":")).encode()
    body = b"".join(np.asarray(cols[name], dtype=dt).tobytes() for name, dt in COLUMNS)
    raw = MAGIC + struct.pack("<I", len(header)) + header + body
    return zstandard.ZstdCompressor(level=3).compress(raw)


def decode(data: bytes, items: Sequence[Item], group: str, step: int, *, max_chunk: int,
           known: Callable[[str], bool]) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """The entries (by key) and packs of the fragment in ``data``, whose items the index says
    are ``items`` (in key order), written into ``group`` at ``step`` (a ``same`` entry's
    ``crc32c`` left empty: its base's are its own), each checked as a
    manifest's entries are (:mod:`amber_store.validation`: encodings ``known`` says are, chunks and
    packed items of at most ``max_chunk`` bytes, bases earlier steps, pack locations inside the
    fragment's packs; its packs' own records are the caller's to check). Raises :class:`Invalid`."""
    try:
        raw = inflate(data, min(_MAX_BYTES, (1 << 20) + 64 * len(items) + _RATIO * len(data)))
    except ValueError as e:
        raise Invalid(f"{e}, more than its {len(items)} items justify" if "expands" in str(e) else str(e)) from None
    if raw[:4] != MAGIC or len(raw) < 8:
        raise Invalid("not a fragment (no magic)")
    (hlen,) = struct.unpack_from("<I", raw, 4)
    try:
        header = json.loads(raw[8: 8 + hlen])
    except ValueError as e:
        raise Invalid(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise Invalid("its header is not an object")
    version = header.get("format_version")
    if type(version) is not int or not 10 <= version <= FORMAT_VERSION:
        raise Invalid(f"format_version {version!r}")
    n = header.get("items")
    if n != len(items):
        raise Invalid(f"it holds {n!r} items; the index gives it {len(items)}")
    encodings, packs, params = header.get("encodings"), header.get("packs"), header.get("params")
    shapes = header.get("shapes")
    if not (isinstance(encodings, list) and all(isinstance(x, str) for x in encodings) and isinstance(packs, dict)
            and all(isinstance(v, dict) and type(v.get("nbytes")) is int for v in packs.values())
            and isinstance(params, dict)
            and all(isinstance(v, dict) for v in params.values()) and isinstance(shapes, dict)):
        raise Invalid("its header is malformed")
    unknown = sorted(x for x in encodings if not known(x))
    if unknown:
        raise Invalid(f"encoding {unknown[0]!r} is unknown")
    items = [it if it.shape is not None else Item(it.key, it.dtype, _length(shapes.get(str(i)), it.key))
             for i, it in enumerate(items)]
    if header.get("described") != described(items):
        raise Invalid("its items' keys, dtypes or shapes are not those the index gives it")
    pack_names = list(packs)
    pos = 8 + hlen

    def column(name: str, dt: str, count: int) -> list[int]:
        nonlocal pos
        size = np.dtype(dt).itemsize * count
        if pos + size > len(raw):
            raise Invalid(f"column {name} ends past the fragment's bytes")
        out = np.frombuffer(raw, dtype=dt, count=count, offset=pos).tolist()
        pos += size
        return out

    kind, enc, base, stored, pack, poff, plen = (column(name, dt, n) for name, dt in COLUMNS[:_PER_ITEM])
    flat_chunks = column("chunks", "<u8", sum(len(it.shape) for it in items))
    chunk_shapes, at = [], 0
    for it in items:
        c = tuple(flat_chunks[at: at + len(it.shape)])
        at += len(it.shape)
        if any(x < 1 or x > max(1, s) for x, s in zip(c, it.shape)):
            raise Invalid(f"item {it.key!r}: chunks {list(c)} do not fit shape {list(it.shape)}")
        if math.prod(c) * ITEMSIZES[it.dtype] > max_chunk:
            raise Invalid(f"item {it.key!r}: a chunk of {list(c)} is over the {max_chunk}-byte limit")
        chunk_shapes.append(c)
    counts = [max(1, math.prod(chunk_grid(it.shape, c))) for it, c in zip(items, chunk_shapes)]
    crcs = column("crc32c", "<u4", sum(c for c, k in zip(counts, kind) if k))
    index = column("index", "<u8", 2 * sum(c for c, k in zip(counts, kind) if k == 1))
    out: dict[str, TensorEntry] = {}
    at_crc = at_index = 0
    for i, it in enumerate(items):
        encoding = _name(encodings, enc[i])
        nbytes = math.prod(it.shape) * ITEMSIZES[it.dtype]
        if encoding != "full" and not 0 <= base[i] < step:
            raise Invalid(f"item {it.key!r}: base {base[i]} is not an earlier step")
        if (kind[i] == 0) != (encoding == "same"):
            raise Invalid(f"item {it.key!r}: a {encoding} record of kind {kind[i]}")
        loc = idx = array = None
        if kind[i] == 2:
            if pack[i] >= len(pack_names) or (plen[i] and (
                    pack[i] < 0 or poff[i] + plen[i] > packs[pack_names[pack[i]]].get("nbytes", -1))):
                raise Invalid(f"item {it.key!r}: pack location {[pack[i], poff[i], plen[i]]} is not inside a pack "
                              "of the fragment")
            if nbytes > max_chunk or (encoding == "full" and plen[i] not in (0, nbytes)):
                raise Invalid(f"item {it.key!r}: {plen[i]} packed bytes for {nbytes} bytes of values")
            loc = [pack_names[pack[i]] if pack[i] >= 0 else "", poff[i], plen[i]]
        elif kind[i] == 1:
            pairs = index[at_index: at_index + 2 * counts[i]]
            at_index += 2 * counts[i]
            idx = [None if a == _ABSENT else [a, b] for a, b in zip(pairs[::2], pairs[1::2])]
            array = f"{group}/{array_name(it.key)}"
        elif kind[i] != 0:
            raise Invalid(f"item {it.key!r}: kind {kind[i]}")
        out[it.key] = TensorEntry(
            dtype=it.dtype, shape=list(it.shape), chunks=list(chunk_shapes[i]), encoding=encoding,  # type: ignore[arg-type]
            base=None if base[i] < 0 else base[i], array=array, crc32c=crcs[at_crc: at_crc + counts[i]] if kind[i] else [],
            nbytes=nbytes, stored=stored[i], params=params.get(str(i)),
            index=idx, pack=loc)
        at_crc += counts[i] if kind[i] else 0
    if pos != len(raw):
        raise Invalid(f"{len(raw) - pos} bytes follow its last column")
    return out, packs


def inflate(data: bytes, limit: int) -> bytes:
    """The zstd frame ``data`` decompressed, refused (ValueError) as soon as it expands past
    ``limit`` bytes: what its header claims is never allocated."""
    try:
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read(limit + 1)
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame ({e})") from None
    if len(raw) > limit:
        raise ValueError(f"it expands past {limit} bytes")
    return raw


def described(items: Sequence[Item]) -> int:
    """A checksum of the items' keys, dtypes and shapes: a fragment keeps the one its rank wrote
    it with, so that an index that describes its tensors otherwise (a crafted or damaged dtype
    or grid) is refused rather than read by."""
    text = "\n".join(f"{it.key}\0{it.dtype}\0{','.join(map(str, it.shape or ()))}" for it in items)
    return crc32c.crc32c(text.encode())


def _length(shape: Any, key: str) -> tuple[int, ...]:
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and 0 <= shape[0] <= _MAX_BYTES):
        raise Invalid(f"value {key!r}: length {shape!r}")
    return (shape[0],)


def _name(encodings: list[str], code: int) -> str:
    if not 0 <= code < len(encodings):
        raise Invalid(f"encoding number {code} of {len(encodings)}")
    return encodings[code]
