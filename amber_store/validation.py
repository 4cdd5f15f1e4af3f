"""A store is untrusted input: the checks a manifest passes before anything reads by it.

A manifest comes from whoever wrote the store (a colleague, a shared bucket, a download). Every
load path parses it through :func:`parse_manifest`, which checks, before any tensor is read or
allocated: the format version first (a newer one says "upgrade amber-store"), then that every
object key it names lies inside the store (:func:`check_key`), that each tensor's shape, chunk
grid, byte count and per-chunk lists agree and stay within :data:`MAX_CHUNK_BYTES`, that every
delta names an earlier step (a chain always ends), and that the state tree names only tensors
the step has. What a manifest claims and its bytes then agree, or it is refused as
:class:`~amber_store.errors.CorruptDataError`: a crafted shape fails here in microseconds, not
in an allocation of terabytes. docs/SECURITY.md states the guarantees.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from . import format as fmt
from . import shards
from .errors import CorruptDataError, FormatVersionError

#: The largest chunk (and packed tensor, and pack part) a reader accepts and a writer makes: a
#: read allocates at most this per chunk the manifest lists (c-blosc 1.x frames stop at 2 GB).
MAX_CHUNK_BYTES = 1 << 30
#: The largest manifest JSON a compressed index may expand to.
MAX_INDEX_BYTES = 1 << 31
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: The deepest state tree a manifest may hold (a model's nesting is a few dozen levels).
MAX_TREE_DEPTH = 200

_BAD_KEY = re.compile(r"[\x00-\x1f\\:]")
ENCODINGS = ("full", "same", *fmt.DELTA_ENCODINGS)


def known_encoding(name: Any) -> bool:
    """Whether ``name`` is an encoding a manifest may name: the format's own, or an extension
    encoding (its codec is looked up only when a tensor of it is read)."""
    return isinstance(name, str) and (name in ENCODINGS or fmt.EXTENSION_ENCODING.fullmatch(name) is not None)
_CONTAINERS = ("list", "tuple", "set", "frozenset")
_LEAVES = ("value", "float", "bytes", "bytearray", "npy", "npscalar", "path", "dtype", "device", "size")


class Invalid(ValueError):
    """What is wrong with a manifest (turned into a CorruptDataError naming the step)."""


def check_key(key: Any, prefix: str = "") -> str:
    """``key`` if it is an object key inside the store (below ``prefix``): relative, '/'-separated,
    no empty, ``.`` or ``..`` segment, no backslash, colon, NUL or other control character."""
    if not isinstance(key, str) or not key or _BAD_KEY.search(key) or key.startswith("/") or not key.startswith(prefix):
        raise Invalid(f"object key {key!r} is not a key inside the store")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise Invalid(f"object key {key!r} leaves its folder")
    return key


def parse_manifest(data: bytes) -> fmt.Manifest:
    """The manifest in ``data``, checked (:func:`validate`). Raises
    :class:`FormatVersionError` for a newer format (before anything else is looked at) and
    :class:`Invalid` for anything malformed."""
    if data[:4] == ZSTD_MAGIC:  # a sharded step's index (format 10)
        try:
            data = fmt.fragments.inflate(data, min(MAX_INDEX_BYTES, (1 << 20) + 256 * len(data)))
        except ValueError as e:
            raise Invalid(str(e)) from None
    try:
        d = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise Invalid(f"not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise Invalid("not a JSON object")
    version = d.get("format_version", fmt.FORMAT_VERSION)
    if type(version) is not int or version < 1:
        raise Invalid(f"format_version {version!r} is not a version")
    if version > fmt.FORMAT_VERSION:
        raise FormatVersionError(f"written with format version {version}; this amber-store reads up to "
                                 f"{fmt.FORMAT_VERSION}; upgrade amber-store")
    if d.get("format", fmt.FORMAT_NAME) != fmt.FORMAT_NAME:
        raise Invalid(f"format {d.get('format')!r} is not {fmt.FORMAT_NAME!r}")
    if version < 10 and "fragments" in d:
        raise Invalid(f"fragments in a step of format {version}")
    try:
        tensors = d["tensors"]
        if not isinstance(tensors, dict):
            raise Invalid("tensors is not an object")
        d["tensors"] = {k: fmt.TensorEntry(**_object(v, f"tensor {k!r}")) for k, v in tensors.items()}
        m = fmt.Manifest(**d)
    except (KeyError, TypeError) as e:
        raise Invalid(f"{type(e).__name__}: {e}") from None
    validate(m)
    return m


def validate(m: fmt.Manifest) -> None:
    """Check a parsed manifest's consistency (see the module's docstring); raises :class:`Invalid`."""
    if not (_is_int(m.step) and m.step >= 0):
        raise Invalid(f"step {m.step!r} is not a step")
    if m.kind not in ("full", "delta"):
        raise Invalid(f"kind {m.kind!r}")
    if not (m.base is None or (_is_int(m.base) and 0 <= m.base < m.step)):
        raise Invalid(f"base {m.base!r} is not an earlier step")
    if not (_is_int(m.depth) and m.depth >= 0):
        raise Invalid(f"depth {m.depth!r}")
    if not (isinstance(m.segment, list) and all(_is_int(s) and s <= m.step for s in m.segment)):
        raise Invalid(f"segment {m.segment!r}")
    if not isinstance(m.extra, dict):
        raise Invalid("extra is not an object")
    if not isinstance(m.packs, dict):
        raise Invalid("packs is not an object")
    check_key(m.group, f"{fmt.STEPS_DIR}/")
    for name, info in m.packs.items():
        check_pack(name, _object(info, f"pack {name!r}"))
    for key, e in m.tensors.items():
        if not (isinstance(key, str) and key != ""):
            raise Invalid(f"tensor key {key!r}")
        try:
            check_entry(m.step, m.packs, e)
        except Invalid as err:
            raise Invalid(f"tensor {key!r}: {err}") from None
    if m.fragments is not None:
        _check_fragments(m)
    folded = m.extra.get("folded")
    if folded is not None:
        check_key(_object(folded, "extra.folded").get("group"), f"{fmt.STEPS_DIR}/")
    dcp = m.extra.get("dcp")
    names = set(m.tensors)
    if dcp is not None:
        dcp = _object(dcp, "extra.dcp")
        if "metadata" in dcp:  # format 8: DCP's Metadata beside the step
            check_key(dcp["metadata"], f"{fmt.STEPS_DIR}/")
        if dcp.get("state") is not None:
            state = _object(dcp["state"], "extra.dcp.state")
            names = _check_index(m, state) if "owners" in state else _check_layout(m, state)
    _check_tree(m.tree, names, 0)
    if dcp is not None and "owners" in (dcp.get("state") or {}) and m.fragments is None:
        _check_own_records(m)


def check_entry(step: int, packs: dict[str, Any], e: fmt.TensorEntry) -> None:
    """Check one tensor entry of step ``step``, whose packs are ``packs``; raises :class:`Invalid`."""
    if not _named(e.dtype, fmt.ITEMSIZES):
        raise Invalid(f"dtype {e.dtype!r} is unknown")
    if not known_encoding(e.encoding):
        raise Invalid(f"encoding {e.encoding!r} is unknown")
    shape, chunks = _ints(e.shape, "shape"), _ints(e.chunks, "chunks")
    if len(chunks) != len(shape):
        raise Invalid(f"chunks {chunks} do not match shape {shape}")
    if not (all(1 <= c <= max(1, s) for s, c in zip(shape, chunks))):
        raise Invalid(f"chunks {chunks} do not fit shape {shape}")
    item = fmt.ITEMSIZES[e.dtype]
    if math.prod(chunks) * item > MAX_CHUNK_BYTES:
        raise Invalid(f"a chunk of {chunks} x {item} bytes is over the {MAX_CHUNK_BYTES}-byte limit")
    if not (_is_int(e.nbytes) and e.nbytes == math.prod(shape) * item):
        raise Invalid(f"nbytes {e.nbytes!r} is not shape {shape} x {item} bytes")
    n = math.prod(fmt.chunk_grid(tuple(shape), tuple(chunks)))
    lengths = (n,) if n else (0, 1)  # (an empty tensor's one checksum is of nothing)
    if not (isinstance(e.crc32c, list) and len(e.crc32c) in lengths and all(type(c) is int for c in e.crc32c)):
        raise Invalid(f"{n} chunks need {n} checksums")
    if not (_is_int(e.stored) and e.stored >= 0):
        raise Invalid(f"stored {e.stored!r}")
    if not (e.params is None or isinstance(e.params, dict)):
        raise Invalid("params is not an object")
    if e.encoding != "full":
        if not (_is_int(e.base) and 0 <= e.base < step):
            raise Invalid(f"base {e.base!r} is not an earlier step")
    if e.encoding == "same":
        return
    if e.array is not None:
        check_key(e.array, f"{fmt.STEPS_DIR}/")
    if e.index is not None:
        if not (e.array is not None and isinstance(e.index, list) and len(e.index) in lengths):
            raise Invalid(f"{n} chunks need an array and {n} index entries")
        for loc in e.index:
            if not (loc is None or (isinstance(loc, list) and len(loc) == 2
                                    and all(_is_int(v) and v >= 0 for v in loc))):
                raise Invalid(f"index entry {loc!r}")
    if e.pack is not None:
        p = e.pack
        if not (isinstance(p, list) and len(p) == 3 and _is_int(p[1]) and _is_int(p[2]) and p[1] >= 0
                and (p[2] == 0 or (p[2] > 0 and _named(p[0], packs) and p[1] + p[2] <= packs[p[0]]["nbytes"]))):
            raise Invalid(f"pack location {p!r} is not inside a pack of the step")
        if e.nbytes > MAX_CHUNK_BYTES:
            raise Invalid("a packed tensor is over the chunk limit")
        if not (e.encoding != "full" or p[2] in (0, e.nbytes)):
            raise Invalid(f"{p[2]} packed bytes hold no {e.nbytes} bytes of values")
    if e.index is not None and e.pack is not None:
        raise Invalid("both an index and a pack")
    if e.array is None and e.pack is None:
        raise Invalid("no data named")


def check_pack(name: str, info: dict[str, Any]) -> None:
    """Check one pack's record (its array, part size, length and part index); raises :class:`Invalid`."""
    check_key(info.get("array"), f"{fmt.STEPS_DIR}/")
    chunk, nbytes, index = info.get("chunk"), info.get("nbytes"), info.get("index")
    if not (_is_int(chunk) and 1 <= chunk <= MAX_CHUNK_BYTES):
        raise Invalid(f"pack {name!r}: chunk {chunk!r}")
    if not (_is_int(nbytes) and nbytes >= 0):
        raise Invalid(f"pack {name!r}: nbytes {nbytes!r}")
    if not (isinstance(index, list) and len(index) == -(-nbytes // chunk)
            and all(isinstance(loc, list) and len(loc) == 2 and all(_is_int(v) and v >= 0 for v in loc)
                    for loc in index)):
        raise Invalid(f"pack {name!r}: its index does not list its {-(-nbytes // chunk)} chunks")


def _check_layout(m: fmt.Manifest, state: dict[str, Any]) -> set[str]:
    """A sharded step's layout (``extra.dcp.state``): each tensor's shards are items of the step
    of its dtype, inside its shape; each value an item. Returns the names the tree may use."""
    tensors, values = _object(state.get("tensors"), "dcp tensors"), _object(state.get("values"), "dcp values")
    for name, t in tensors.items():
        t = _object(t, f"dcp tensor {name!r}")
        if not _named(t.get("dtype"), fmt.ITEMSIZES):
            raise Invalid(f"dcp tensor {name!r}: dtype {t.get('dtype')!r}")
        shape = _ints(t.get("shape"), f"dcp tensor {name!r} shape")
        if not isinstance(t.get("shards"), list):
            raise Invalid(f"dcp tensor {name!r}: shards")
        for shard in t["shards"]:
            if not (isinstance(shard, list) and len(shard) == 2 and _named(shard[1], m.tensors)):
                raise Invalid(f"dcp tensor {name!r}: shard {shard!r} names no item of the step")
            offset, item = _ints(shard[0], "shard offset"), m.tensors[shard[1]]
            if not (item.dtype == t["dtype"] and len(offset) == len(shape) == len(item.shape)
                    and all(o + s <= n for o, s, n in zip(offset, item.shape, shape))):
                raise Invalid(f"dcp tensor {name!r}: shard {shard[1]!r} does not fit {t['dtype']}{shape}")
    for name, item in values.items():
        if not _named(item, m.tensors):
            raise Invalid(f"dcp value {name!r} names no item of the step")
    return set(tensors) | set(values)


def _check_fragments(m: fmt.Manifest) -> None:
    if not isinstance(m.fragments, list):
        raise Invalid("fragments is not a list")
    for i, f in enumerate(m.fragments):
        if f is None:
            continue
        f = _object(f, f"fragment {i}")
        check_key(f.get("key"), f"{m.group}/")
        if not (_is_int(f.get("crc32c")) and _is_int(f.get("nbytes")) and 0 <= f["nbytes"] <= MAX_CHUNK_BYTES
                and _is_int(f.get("items")) and f["items"] >= 0):
            raise Invalid(f"fragment {i}: {f!r}")
    if m.tensors or m.packs:
        raise Invalid("a step with fragments lists tensors or packs of its own")


def _check_index(m: fmt.Manifest, state: dict[str, Any]) -> set[str]:
    """A format-10 sharded step's index: each tensor's grid (or shard list) fits its shape, its
    owners row has one fragment per shard, each fragment named is one of the step's; each value
    names its item and fragment. Returns the names the tree may use."""
    tensors, values = _object(state.get("tensors"), "dcp tensors"), _object(state.get("values"), "dcp values")
    owners = state.get("owners")
    # (a step gc folded holds its records itself: its owners name fragments no longer read)
    present = None if m.fragments is None else {i for i, f in enumerate(m.fragments) if f is not None}
    if not (isinstance(owners, list) and all(isinstance(row, list) and all(_is_int(f) for f in row)
                                             and (present is None or set(row) <= present) for row in owners)):
        raise Invalid("dcp owners name fragments the step lacks")
    for name, t in tensors.items():
        t = _object(t, f"dcp tensor {name!r}")
        if not _named(t.get("dtype"), fmt.ITEMSIZES):
            raise Invalid(f"dcp tensor {name!r}: dtype {t.get('dtype')!r}")
        shape = _ints(t.get("shape"), f"dcp tensor {name!r} shape")
        k = t.get("owners")
        if not (_is_int(k) and 0 <= k < len(owners)):
            raise Invalid(f"dcp tensor {name!r}: owners {k!r}")
        if "grid" in t:
            problem = fmt.sharding.check(shape, t["grid"])
            if problem:
                raise Invalid(f"dcp tensor {name!r}: {problem}")
            n = fmt.sharding.count(shape, t["grid"])
        else:
            listed = t.get("shards")
            if not isinstance(listed, list):
                raise Invalid(f"dcp tensor {name!r}: no grid and no shards")
            for shard in listed:
                if not (isinstance(shard, list) and len(shard) == 2):
                    raise Invalid(f"dcp tensor {name!r}: shard {shard!r}")
                offset, size = _ints(shard[0], "shard offset"), _ints(shard[1], "shard size")
                if not (len(offset) == len(size) == len(shape) and all(o + s <= d for o, s, d in zip(offset, size, shape))):
                    raise Invalid(f"dcp tensor {name!r}: shard {shard!r} does not fit {shape}")
            n = len(listed)
        if len(owners[k]) != n:
            raise Invalid(f"dcp tensor {name!r}: {n} shards, {len(owners[k])} owners")
    for name, v in values.items():
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                and _is_int(v[1]) and (present is None or v[1] in present)):
            raise Invalid(f"dcp value {name!r}: {v!r}")
    return set(tensors) | set(values)


def _check_own_records(m: fmt.Manifest) -> None:
    """A format-10 index that holds its records itself (a step gc folded): each shard and value
    has an entry, of its shard's dtype and size (its tree checked already)."""
    layout = shards.layout_of(m)
    assert layout is not None
    for name, t in layout.tensors.items():
        for (_, key), size in zip(t.shards, t.sizes):
            e = m.tensors.get(key)
            if e is None or e.dtype != t.dtype or tuple(e.shape) != size:
                raise Invalid(f"dcp tensor {name!r}: shard {key!r} is no entry of {t.dtype}{list(size)}")
    for name, key in layout.values.items():
        if key not in m.tensors:
            raise Invalid(f"dcp value {name!r} names no entry of the step")


def check_tree(tree: Any, names: set[str]) -> None:
    """Check a state tree given for a step (a pointer file's) against the tensors it names;
    raises :class:`CorruptDataError`."""
    try:
        _check_tree(tree, names, 0)
    except Invalid as e:
        raise CorruptDataError(f"the state tree given does not fit the step: {e}") from None


def _check_tree(node: Any, names: set[str], depth: int) -> None:
    """The state tree's containers and that its tensor leaves name ``names`` (leaf bodies are
    checked as they are built: :func:`amber_store.format.unflatten`)."""
    if depth >= MAX_TREE_DEPTH:
        raise Invalid("the state tree nests too deep")
    if not (isinstance(node, dict) and len(node) >= 1):
        raise Invalid(f"tree node {node!r}")
    kind, body = next(iter(node.items()))
    if kind == "tensor" or kind == "ndarray":
        if not _named(body, names):
            raise Invalid(f"the state tree names tensor {body!r}, which the step lacks")
    elif kind in ("dict", "odict"):
        if not isinstance(body, list):
            raise Invalid(f"{kind} node is not a list")
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise Invalid(f"{kind} item {pair!r}")
            if isinstance(pair[0], dict):
                _check_tree(pair[0], names, depth + 1)
            else:
                if not (pair[0] is None or isinstance(pair[0], (str, int, float, bool))):
                    raise Invalid(f"dict key {pair[0]!r}")
            _check_tree(pair[1], names, depth + 1)
        if kind == "odict" and "metadata" in node:
            _check_tree(node["metadata"], names, depth + 1)
    elif kind in _CONTAINERS:
        if not isinstance(body, list):
            raise Invalid(f"{kind} node is not a list")
        for child in body:
            _check_tree(child, names, depth + 1)
    elif kind == "value":
        if not (body is None or isinstance(body, (str, int, float, bool))):
            raise Invalid(f"value {body!r} is not a plain value")
    # other kinds: leaves checked as they are built, or a newer format's (unflatten refuses those)


def _object(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise Invalid(f"{what} is not an object")
    return v


def _ints(v: Any, what: str) -> list[int]:
    if not (isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v)):
        raise Invalid(f"{what} {v!r} is not a list of sizes")
    return v


def _named(v: Any, names: Any) -> bool:
    return isinstance(v, str) and v in names


def _is_int(v: Any) -> bool:
    return type(v) is int


def corrupt(uri: str, step: int, key: str, data: bytes, e: Invalid) -> CorruptDataError:
    """The error for the manifest of ``step`` at ``key`` that failed its checks."""
    return CorruptDataError(f"{uri}: the manifest of step {step} ({key}, {len(data)} bytes) is unreadable: {e}",
                            step=step)
