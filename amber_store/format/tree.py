"""The state-dict tree: a nested state flattened into JSON and tensor keys, and back."""

from __future__ import annotations

import base64
import functools
import io
import math
import operator
import pathlib
import re
from collections import OrderedDict
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import numpy as np
from ..errors import CorruptDataError, FormatVersionError, UnsupportedStateError

from .dtypes import ITEMSIZES, _torch_dtypes, dtype_name

if TYPE_CHECKING:
    import torch


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


