"""The on-disk hierarchy: paths, manifests, tensor specs and the state-dict tree.

This module is the executable form of docs/FORMAT.md; it does no I/O. Everything written here
is plain JSON so that any zarr v3 reader can inspect a store, and so that the format can be
versioned: readers refuse a ``format_version`` newer than :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import math
import mmap
import operator
import pathlib
import re
import sys
from collections import OrderedDict
from itertools import chain, repeat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, NamedTuple

import crc32c
import numpy as np

from .errors import CorruptDataError, FormatVersionError, UnsupportedStateError

if TYPE_CHECKING:
    import torch

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
FORMAT_VERSION = 9
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

Encoding = Literal["full", "diff", "xor", "sparse", "quant", "block", "ratio", "same"]
#: The delta encodings, each with the zarr codec its arrays name and the format version that
#: introduced it (``full`` and ``same`` store values and nothing). :mod:`amber_store.codecs`
#: registers exactly these (a test holds them equal): a new codec is a new entry here.
DELTA_ENCODINGS: dict[str, tuple[str, int]] = {
    "xor": ("amber.xor_delta", 1), "sparse": ("amber.sparse_delta", 2), "quant": ("amber.quantized_delta", 2),
    "block": ("amber.block_delta", 5), "ratio": ("amber.ratio_delta", 5), "diff": ("amber.diff_delta", 6),
}
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


# --- dtypes -------------------------------------------------------------------------------

# Tensors are stored as their raw bits in an unsigned integer array of the same width, which
# is what XOR deltas work on and what lets bfloat16 (no zarr dtype) live in plain zarr.
_BITS_NUMPY = {1: np.dtype("uint8"), 2: np.dtype("uint16"), 4: np.dtype("uint32"), 8: np.dtype("uint64")}
# numpy dtypes torch.from_numpy accepts, per width (torch lacks full uint16/32/64 support)
_TORCHABLE_NUMPY = {1: np.dtype("uint8"), 2: np.dtype("int16"), 4: np.dtype("int32"), 8: np.dtype("int64")}
# Bytes per element of every dtype name the format knows (torch's names), so that reading a
# store's metadata needs no torch import.
ITEMSIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
             "float8_e5m2": 1}


class _TorchDtypes(NamedTuple):
    by_name: dict[str, torch.dtype]
    by_dtype: dict[torch.dtype, str]
    bits: dict[int, torch.dtype]  # the same-width integer dtype raw bits are viewed as


@functools.cache
def _torch_dtypes() -> _TorchDtypes:
    import torch

    by_name = {n: getattr(torch, n) for n in ITEMSIZES if hasattr(torch, n)}
    return _TorchDtypes(by_name, {v: k for k, v in by_name.items()},
                        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # {dtype name: torch.dtype}, built on first use (it imports torch)
        return _torch_dtypes().by_name
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _torch_dtypes().by_dtype[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"dtype {dtype} is not supported; supported: {', '.join(_torch_dtypes().by_name)}"
        ) from None


def itemsize(name: str) -> int:
    return ITEMSIZES[name]


def bits_numpy_dtype(name: str) -> np.dtype:
    """The unsigned dtype of the zarr array that stores ``name``'s raw bits."""
    return _BITS_NUMPY[itemsize(name)]


def to_bits(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s raw bits as a same-width integer tensor (no copy)."""
    return t.contiguous().view(_torch_dtypes().bits[t.element_size()])


def bits_to_numpy(bits: torch.Tensor) -> np.ndarray:
    """Host bits tensor -> unsigned numpy view (no copy)."""
    return bits.numpy().view(_BITS_NUMPY[bits.element_size()])


def numpy_to_tensor(bits: np.ndarray, name: str) -> torch.Tensor:
    """Unsigned numpy bits -> tensor of dtype ``name`` sharing its memory."""
    # (np.ascontiguousarray would turn a 0-d array into 1-d)
    import torch

    signed = (bits if bits.flags.c_contiguous else bits.copy()).view(_TORCHABLE_NUMPY[bits.dtype.itemsize])
    return torch.from_numpy(signed).view(_torch_dtypes().by_name[name])


def host_empty(shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
    """An uninitialized host array in memory from torch's allocator: what reads decode into,
    and the codec threads' scratch buffers.

    numpy asks the kernel for huge pages for arrays of 4 MiB and up; on a VM that hands freed
    memory back to its host, their first touch in a fresh process (a resume) cost 3x the time
    of small pages, which torch's tensors, torch.load's included, get (measured, a 1 GiB state
    loaded in a fresh process on this project's 2-core VM: full step 2.0 s, 0.83 s; torch.load
    1.0 s). Where huge pages are cheap, ``THP_MEM_ALLOC_ENABLE=1`` asks them of torch, for
    these buffers as for every tensor."""
    import torch

    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    return torch.empty(n * dtype.itemsize, dtype=torch.uint8).numpy().view(dtype).reshape(shape)


#: Linux's ``madvise(MADV_POPULATE_WRITE)`` (5.14 and later)
_POPULATE_WRITE = 23
_madvise: Any = None  # (libc's, once looked up; False where there is none or the kernel refuses)


def populate(a: np.ndarray) -> None:
    """Fault in the pages of ``a`` (contiguous, about to be written whole) with one call, rather
    than one trap per page as a decoder first writes each: a fresh process's load writes into
    fresh memory (measured, 512 MiB of fresh tensor memory on this project's 2-core VM: 0.13-0.17
    s of system time populated, 0.19-0.25 s faulted page by page). Does nothing where the
    platform or the kernel has no such call."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            import ctypes

            f = ctypes.CDLL(None, use_errno=True).madvise
            f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _madvise = f
    if not _madvise:
        return
    start = -(-a.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE  # (whole pages of ``a`` only)
    end = (a.ctypes.data + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and _madvise(start, end - start, _POPULATE_WRITE) != 0:
        _madvise = False  # (an older kernel: EINVAL)


# --- chunking -----------------------------------------------------------------------------

def choose_chunks(shape: tuple[int, ...], item: int, target_bytes: int) -> tuple[int, ...]:
    """Chunk shape of about ``target_bytes``: trailing dims whole, leading dims split (to a
    multiple of 8 elements where that leaves a whole slab).

    Keeping trailing dimensions whole makes each chunk one contiguous run of the C-order
    tensor, so a slice of leading rows touches the fewest chunks. blosc bit-shuffles (full
    steps) only a block of a multiple of 8 elements and stores any other as is, which leaves
    float values about 1.14x larger (measured): the split dimension is rounded down to make the
    count a multiple of 8, where at least one slab remains (with fewer than 8 slabs of an odd
    size per chunk, the chunk stays as it is).
    """
    budget = max(1, target_bytes // item)
    chunks = [1] * len(shape)
    split = 0  # the dimension split (or, if none is, the leading one)
    for d in range(len(shape) - 1, -1, -1):
        n = max(1, shape[d])
        if n <= budget:
            chunks[d] = n
            budget //= n
        else:
            chunks[d], split = budget, d
            break
    if chunks and chunks[split] < shape[split]:
        step = 8 // math.gcd(8, math.prod(chunks[split + 1:]))
        chunks[split] = chunks[split] - chunks[split] % step or chunks[split]
    return tuple(chunks)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple


def chunk_grid(shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.ceil(s / c) for s, c in zip(shape, chunks))


def iter_chunk_indices(grid: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Chunk grid indices in C order (the order of a tensor entry's ``crc32c`` list)."""
    return iter(np.ndindex(*grid)) if grid else iter([()])


def chunk_slices(index: tuple[int, ...], shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunks, shape))


def region_chunks(
    region: tuple[slice, ...], shape: tuple[int, ...], chunks: tuple[int, ...]
) -> Iterator[tuple[int, tuple[int, ...], tuple[slice, ...]]]:
    """For each chunk of a chunk-aligned ``region``: its flat index in the tensor's chunk grid
    (C order), its grid index, and its slices relative to the region."""
    grid = chunk_grid(shape, chunks)
    first = tuple(r.start // c for r, c in zip(region, chunks))
    counts = tuple(-(-(r.stop - r.start) // c) for r, c in zip(region, chunks))
    for rel in iter_chunk_indices(counts):
        idx = tuple(f + r for f, r in zip(first, rel))
        flat = int(np.ravel_multi_index(idx, grid)) if grid else 0
        local = tuple(slice(s.start - r.start, s.stop - r.start) for s, r in zip(chunk_slices(idx, shape, chunks), region))
        yield flat, idx, local


def chunk_runs(shape: tuple[int, ...], chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """Flat C-order element range ``[start, stop)`` of each chunk, chunks in C order.

    Chunks of this format keep trailing dimensions whole and split one dimension (dimensions
    before it have chunk size 1), so every chunk is one contiguous run of the tensor.
    """
    if not shape:
        return [(0, 1)]
    split = max((d for d, (s, c) in enumerate(zip(shape, chunks)) if c != s), default=0)
    if any(c != 1 for c in chunks[:split]):
        raise ValueError(f"chunks {chunks} of shape {shape} are not contiguous runs")
    outer, n, c, inner = math.prod(shape[:split]), shape[split], chunks[split], math.prod(shape[split + 1:])
    runs = []
    for o in range(outer):
        for j in range(0, n, c):
            start = (o * n + j) * inner
            runs.append((start, start + min(c, n - j) * inner))
    return runs


def whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, s) for s in shape)


def region_crcs(
    data: np.ndarray, region: tuple[slice, ...], shape: tuple[int, ...], chunks: tuple[int, ...]
) -> Iterator[tuple[int, tuple[int, ...], int]]:
    """(flat index, grid index, crc32c) of each chunk of ``data``, the bits of a chunk-aligned
    ``region``: the checksum of a chunk is that of its in-bounds elements in C order."""
    for flat, idx, local in region_chunks(region, shape, chunks):
        yield flat, idx, crc32c.crc32c(np.ascontiguousarray(data[local]).data)


def tensor_crcs(t: torch.Tensor, chunks: list[int] | tuple[int, ...]) -> list[int]:
    """The per-chunk checksums a manifest lists for ``t`` stored with ``chunks``."""
    data = bits_to_numpy(to_bits(t.detach().cpu()))
    shape = tuple(t.shape)
    return [crc for _, _, crc in region_crcs(data, whole(shape), shape, tuple(chunks))]


# --- zarr metadata -----------------------------------------------------------------------

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


def step_group_metadata(step: int, created: float, arrays: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A step group's zarr.json: its attributes and the consolidated metadata of its arrays, so
    no array needs a zarr.json of its own (``zarr.open_group(..., use_consolidated=True)``)."""
    meta = group_metadata({ROOT_ATTR: {"step": step, "created": created}})
    meta["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": arrays}
    return meta


# --- state-dict tree ----------------------------------------------------------------------

_SAFE = re.compile(r"[A-Za-z0-9_.\-]")
_PLAIN = {int, str, bool, type(None)}  # leaves stored as they are
# Leaf classes rebuilt by name: an allow-list, so that loading never imports or runs code.
_PATHS = {cls.__name__: cls for cls in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath,
                                        pathlib.WindowsPath)}


@functools.lru_cache(maxsize=1 << 16, typed=True)  # the same keys come back at every save
def escape_segment(key: str | int) -> str:
    """A dict key as one zarr node name: reversible, and never a reserved name."""
    s = "".join(c if _SAFE.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode()) for c in str(key))
    if s in ("", ".", "..", "zarr.json") or s.startswith("__"):
        s = f"%{ord(s[0]):02X}{s[1:]}" if s else "%00"
    return s


def _key_segment(key: Any) -> str:
    """The path segment of a dict key. Keys other than str/int start with '@', which
    :func:`escape_segment` never emits, so they cannot collide with a str key's segment."""
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return escape_segment(key)
    return "@" + escape_segment(repr(key))


def _npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _from_npy(text: str) -> np.ndarray:
    raw = base64.b64decode(text)
    try:
        buf = io.BytesIO(raw)
        version = np.lib.format.read_magic(buf)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(buf)
        # (numpy allocates what the header says before it reads: a crafted header asks for terabytes)
        if dtype.itemsize * math.prod(shape) > len(raw) - buf.tell():
            raise ValueError(f"its header's shape {shape} holds more than its {len(raw)} bytes")
        return np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
    except ValueError as e:  # e.g. an object array, which only pickle could make: never loaded
        raise CorruptDataError(f"a numpy value in the state tree cannot be read safely ({e})") from e


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``b`` stored at the same address: one storage, offset, shape, strides and
    dtype (tied weights). Partly overlapping views are not: each is stored on its own."""
    return (a.numel() > 0 and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class _Dicts(NamedTuple):
    """A dict of tensors or of plain leaves, or a dict of such dicts with str keys (an
    optimizer's state, a module's ``_metadata``), as :func:`flatten` last found it at one path."""

    keys: list[Any]
    types: list[type] | None  # of the keys, unless all are str: 1 == True, yet they are different keys
    inner: list[list[str]] | None  # the keys of its values, when they are dicts
    tensors: bool  # whether the leaves are tensors (else int, str, bool or None)
    leaves: list[Any]  # the tensors' addresses, or the plain leaves
    leaf_types: list[Any]  # the tensors' dtypes, or the plain leaves' types
    tensor_keys: list[str]
    items: list[list[Any]]  # its node in the tree


class FlattenMemo:
    """What :func:`flatten` found last time in each dict of tensors or of plain leaves (or of
    such dicts), by path.

    A training loop hands over the same tensors in the same dicts at every save (an
    optimizer's state; ``model.state_dict()`` makes new tensor objects, at the same addresses),
    and for thousands of small tensors the walk's per-tensor work is most of ``save_async``'s
    stall: with a memo, such a dict is checked in a few whole-list comparisons (keys, tensor
    addresses and dtypes, or plain leaves and their types) and its node of the tree reused.
    Holds no tensor.
    """

    def __init__(self) -> None:
        self._dicts: dict[str, _Dicts | None] = {}  # None: it changed, remembered next time


def flatten(state: Any, memo: FlattenMemo | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split a nested state dict into a JSON tree and ``{tensor key: tensor}``.

    The tree keeps container types (dict, OrderedDict, list, tuple, set, frozenset), key order
    and exact leaves, so :func:`unflatten` rebuilds an equal object of the same types. Tensors
    that alias one another (tied weights) are stored once: each of their nodes names the key of
    the first. numpy arrays of a dtype torch has are stored as tensors too (delta-coded); other
    numpy values go into the tree as ``.npy`` bytes, written and read without pickle.
    ``memo``, kept by the caller from one call to the next, makes walking the same state again
    cheaper (see :class:`FlattenMemo`); the result is the same.
    """
    import torch

    tensors: dict[str, torch.Tensor] = {}
    # The key of the first tensor at each address (data_ptr(): 0 for empty and meta tensors,
    # which never alias), and of any others there that are not the same tensor; only tensors at
    # one address are compared in full. Per-tensor work here is most of save_async's stall for
    # thousands of small tensors, and so is the garbage collection of what it allocates: no
    # container per tensor but the tree's own.
    first: dict[int, str] = {}
    others: dict[int, list[str]] = {}
    dtypes = _torch_dtypes().by_dtype
    strided, Tensor, escape = torch.strided, torch.Tensor, escape_segment  # (locals: read per tensor)

    def where(path: str) -> str:  # a node's path in error messages
        return path or "<root>"

    def tensor(t: torch.Tensor, path: str) -> str:
        if t.layout != strided or t.is_nested:  # sparse, sparse CSR, mkldnn, nested: no one dense buffer
            raise UnsupportedStateError(f"{where(path)}: only strided (dense) tensors are supported"
                                        + (" (a nested tensor: save its components, t.unbind())" if t.is_nested else ""))
        ptr = t.data_ptr()
        if not ptr and t.is_meta:
            raise UnsupportedStateError(f"{where(path)}: a tensor on the meta device holds no data (give it values "
                                        "first, e.g. module.to_empty(device=...) then load or initialize it)")
        there = first.get(ptr) if ptr else None
        if there is not None:
            for other_key in (there, *others.get(ptr, ())):
                if _same_tensor(t, tensors[other_key]):
                    return other_key
        if t.dtype not in dtypes:
            dtype_name(t.dtype)  # raises, naming the supported dtypes
        key = path or "_"
        if tensors.setdefault(key, t) is not t:
            raise UnsupportedStateError(f"two tensors map to the same key {key!r}")
        if there is not None:
            others.setdefault(ptr, []).append(key)
        elif ptr:
            first[ptr] = key
        return key

    def walk(obj: Any, path: str) -> dict[str, Any]:
        kind = type(obj)  # exact scalar types first: the most common leaves
        if kind in _PLAIN:
            return {"value": obj}
        if kind is float:
            return {"float": obj.hex()}
        if isinstance(obj, torch.Tensor):
            return {"tensor": tensor(obj, path)}
        prefix = path + "/" if path else ""
        if isinstance(obj, dict):
            items = recall(obj, path) if last else None
            if items is None:
                items = []
                # whether every value is a tensor under its own key, a plain leaf, or a dict the memo keeps
                tensors_only = plains_only = dicts_only = memo is not None and len(obj) > 0
                children = []
                for k, v in obj.items():
                    plain = isinstance(k, str) or type(k) is int
                    # walk's commonest cases inline: tensors (~20% of flatten for thousands of
                    # them) and plain leaves (a module's _metadata is a dict of them per module)
                    if type(v) in _PLAIN:
                        tensors_only, plains_only, dicts_only = False, plains_only and plain, False
                        items.append([k if plain else key(k, path), {"value": v}])
                        continue
                    sub = prefix + (escape(k) if plain else _key_segment(k))
                    if isinstance(v, Tensor):
                        at = tensor(v, sub)
                        tensors_only, plains_only, dicts_only = tensors_only and plain and at == sub, False, False
                        items.append([k if plain else key(k, path), {"tensor": at}])
                    else:
                        items.append([k if plain else key(k, path), walk(v, sub)])
                        child = kept.get(sub) if dicts_only and plain and type(v) is dict else None
                        tensors_only = plains_only = False
                        dicts_only = child is not None and child.inner is None and child.types is None
                        children.append(child)
                if (tensors_only or plains_only or dicts_only) and path not in kept:
                    remember(obj, path, items, tensors_only, children if dicts_only else None)
            if not isinstance(obj, OrderedDict):
                return {"dict": items}
            # nn.Module.state_dict() is an OrderedDict whose _metadata (per-module versions)
            # load_state_dict consults; torch.save keeps it, and so do we.
            meta = getattr(obj, "_metadata", None)
            node: dict[str, Any] = {"odict": items}
            if meta is not None:
                node["metadata"] = walk(meta, prefix + "_metadata")
            return node
        if isinstance(obj, torch.Size):
            return {"size": list(obj)}
        if isinstance(obj, (list, tuple, set, frozenset)):
            kind = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}[
                next(c for c in (list, tuple, set, frozenset) if isinstance(obj, c))]
            if set(map(type, obj)) <= _PLAIN:  # an optimizer's param_groups: one int per parameter
                return {kind: [{"value": v} for v in obj]}
            return {kind: [walk(v, prefix + str(i)) for i, v in enumerate(obj)]}
        if isinstance(obj, np.ndarray):
            if obj.dtype.isnative and obj.dtype.name in ITEMSIZES:
                array = np.ascontiguousarray(obj)
                return {"ndarray": tensor(torch.from_numpy(array if array.flags.writeable else array.copy()), path)}
            return {"npy": npy(obj, path)}
        if isinstance(obj, np.generic):
            return {"npscalar": npy(np.asarray(obj), path)}
        if isinstance(obj, float):
            return {"float": obj.hex()}
        if obj is None or isinstance(obj, (bool, int, str)):
            return {"value": obj}
        if isinstance(obj, (bytes, bytearray)):
            return {"bytearray" if isinstance(obj, bytearray) else "bytes": base64.b64encode(obj).decode()}
        if _PATHS.get(type(obj).__name__) is type(obj):
            return {"path": [type(obj).__name__, str(obj)]}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        raise UnsupportedStateError(
            f"{where(path)}: cannot store a {type(obj).__name__}; leaves must be tensors, numpy arrays or scalars, "
            "int, float, str, bool, None, bytes, pathlib paths, torch.dtype, torch.device or torch.Size"
        )

    def npy(array: np.ndarray, path: str) -> str:
        try:
            return _npy(array)
        except ValueError as e:  # object arrays need pickle
            raise UnsupportedStateError(f"{where(path)}: cannot store a numpy array of dtype {array.dtype} ({e})") from e

    last = memo._dicts if memo is not None else {}
    kept: dict[str, _Dicts | None] = {}

    def recall(obj: dict[Any, Any], path: str) -> list[list[Any]] | None:
        """The node of a dict that the last walk found at ``path`` with the same keys (down to
        the leaves) and the same plain leaves, or tensors at the same addresses with the same
        dtypes, none at an address seen earlier in this walk: its tensors are entered as the
        per-tensor walk would enter them (their keys depend on the path, ties on addresses, the
        checks on dtypes); else None."""
        m = last.get(path)
        if m is None:
            return None
        leaves = gather(obj, m)
        if leaves is not None and (enter(leaves, m) if m.tensors else
                                   leaves == m.leaves and list(map(type, leaves)) == m.leaf_types):
            kept[path] = m
            return m.items
        # not remembered this time: a state of new tensors at every save (clones, gathered
        # full state dicts) pays for a memo it never uses only every other save
        kept[path] = None
        return None

    def gather(obj: dict[Any, Any], m: _Dicts) -> list[Any] | None:
        """The leaves of ``obj`` if it has ``m``'s keys down to them, else None."""
        keys = list(obj)
        if keys != m.keys or (m.types is not None and list(map(type, keys)) != m.types):
            return None
        if m.inner is None:
            return list(obj.values())
        values = list(obj.values())
        if set(map(type, values)) != {dict} or list(map(list, values)) != m.inner:
            return None
        return list(chain.from_iterable(map(dict.values, values)))

    def enter(values: list[Any], m: _Dicts) -> bool:
        try:
            if not (all(map(isinstance, values, repeat(Tensor))) and values[0].data_ptr() == m.leaves[0]
                    and [t.data_ptr() for t in values] == m.leaves and [t.dtype for t in values] == m.leaf_types
                    and first.keys().isdisjoint(m.leaves) and tensors.keys().isdisjoint(m.tensor_keys)):
                return False
        except RuntimeError:  # a tensor without storage: the per-tensor walk says why it is refused
            return False
        first.update(zip(m.leaves, m.tensor_keys))
        tensors.update(zip(m.tensor_keys, values))
        return True

    def remember(obj: dict[Any, Any], path: str, items: list[list[Any]], of_tensors: bool,
                 children: list[_Dicts] | None) -> None:
        keys = list(obj)
        types = None if all(type(k) is str for k in keys) else list(map(type, keys))
        if children is not None:
            if len(set(c.tensors for c in children)) == 1:
                kept[path] = _Dicts(keys, types, [c.keys for c in children], children[0].tensors,
                                    [x for c in children for x in c.leaves], [x for c in children for x in c.leaf_types],
                                    [x for c in children for x in c.tensor_keys], items)
            return
        values = list(obj.values())
        if not of_tensors:
            kept[path] = _Dicts(keys, types, None, False, values, list(map(type, values)), [], items)
            return
        at = [node["tensor"] for _, node in items]
        ptrs = [t.data_ptr() for t in values]
        if all(map(operator.eq, map(first.get, ptrs), at)):  # each the first at its address (not empty)
            kept[path] = _Dicts(keys, types, None, True, ptrs, [t.dtype for t in values], at, items)

    def key(k: Any, path: str) -> dict[str, Any]:
        def holds_tensor(o: Any) -> bool:
            return isinstance(o, torch.Tensor) or (isinstance(o, (tuple, frozenset)) and any(map(holds_tensor, o)))

        if holds_tensor(k):
            raise UnsupportedStateError(f"{where(path)}: dict key {k!r} holds a tensor")
        return walk(k, "")

    try:
        tree = walk(state, "")
        if memo is not None:
            memo._dicts = kept
        return tree, tensors
    finally:
        # walk refers to itself through its closure: left so, the cycle would keep every tensor
        # of the state alive until the next garbage collection (and make it the gc's work)
        walk = None  # noqa: F841


def unflatten(tree: dict[str, Any], leaf: Callable[[str], Any], mapping: Callable[[Any], Any] = lambda d: d) -> Any:
    """Rebuild the nested object; ``leaf(key)`` supplies each tensor (or a lazy stand-in).

    Each dict is rebuilt with its saved type (dict, or OrderedDict with ``_metadata``) and
    then passed through ``mapping``, which the lazy loader uses to wrap it. Nodes that name the
    same tensor key get what ``leaf`` returns for it (callers return one object per key).
    """
    kind = next(iter(tree))
    body = tree[kind]

    def dict_key(k: Any) -> Any:
        return unflatten(k, leaf) if isinstance(k, dict) else k

    if kind == "tensor":
        return leaf(body)
    if kind == "dict":
        return mapping({dict_key(k): unflatten(v, leaf, mapping) for k, v in body})
    if kind == "odict":
        d: OrderedDict[Any, Any] = OrderedDict((dict_key(k), unflatten(v, leaf, mapping)) for k, v in body)
        if "metadata" in tree:
            d._metadata = unflatten(tree["metadata"], leaf)  # type: ignore[attr-defined]
        return mapping(d)
    if kind in _CONTAINERS:
        return _CONTAINERS[kind](unflatten(v, leaf, mapping) for v in body)
    if kind == "ndarray":
        return leaf(body).numpy()  # a LazyTensor reads itself here
    if kind in _LEAVES:
        try:
            return _LEAVES[kind](body)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:  # a store is untrusted input
            raise CorruptDataError(f"a {kind} value in the state tree is malformed ({type(e).__name__}: {e})") from None
    # A node kind of a newer format must never be read as a plain value.
    raise FormatVersionError(f"unknown state tree node {kind!r}: written by a newer amber-store; upgrade amber-store")


def _path(body: list[str]) -> pathlib.PurePath:
    cls = _PATHS[body[0]]
    try:
        return cls(body[1])
    except NotImplementedError:
        # a WindowsPath saved on Windows cannot be made on POSIX (nor the reverse): its pure form can
        return (pathlib.PureWindowsPath if body[0] == "WindowsPath" else pathlib.PurePosixPath)(body[1])


def _torch_attr(kind: str) -> Callable[[Any], Any]:
    def make(body: Any) -> Any:
        import torch

        if kind == "dtype":
            dtype = getattr(torch, body, None)
            if not isinstance(dtype, torch.dtype):
                raise FormatVersionError(f"unknown torch dtype {body!r}: written by a newer torch or amber-store")
            return dtype
        return torch.device(body) if kind == "device" else torch.Size(body)

    return make


_CONTAINERS: dict[str, Callable[[Iterator[Any]], Any]] = {"list": list, "tuple": tuple, "set": set,
                                                          "frozenset": frozenset}
_LEAVES: dict[str, Callable[[Any], Any]] = {
    "float": float.fromhex,
    "value": lambda body: body,
    "bytes": base64.b64decode,
    "bytearray": lambda body: bytearray(base64.b64decode(body)),
    "npy": _from_npy,
    "npscalar": lambda body: _from_npy(body)[()],
    "path": _path,
    "dtype": _torch_attr("dtype"),
    "device": _torch_attr("device"),
    "size": _torch_attr("size"),
}


# --- manifests ----------------------------------------------------------------------------

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

    @property
    def nbytes_raw(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())

    @property
    def nbytes_stored(self) -> int:
        return sum(e.stored for e in self.tensors.values())

    def to_json(self) -> bytes:
        # (an entry's null optional fields left out: a sharded step has an entry per shard)
        d = {**vars(self), "tensors": {k: {f: v for f, v in vars(e).items() if v is not None or f not in _OPTIONAL}
                                       for k, e in self.tensors.items()}}
        return json.dumps(d, separators=(",", ":")).encode()
