"""A step saved in shards (through torch.distributed.checkpoint) as the state its ranks saved.

DCP stores *items*: one per tensor shard (``model.w/256_0``) and one per plain Python value
(pickled by ``torch.save``). The manifest records how items make the state (docs/FORMAT.md):
its ``tree`` is the nested structure DCP flattened, and ``extra.dcp.state`` has each tensor's
global shape, dtype and shards (since format 10 described once, as a grid:
:mod:`amber_store.format.sharding`) and each value's item. Since format 10 the items' records
live in one fragment per rank (:mod:`amber_store.format.fragments`); :class:`FragmentMap` says
which fragment holds an item, so that a reader fetches only the fragments it needs. From that, any single process opens the
step as the nested state dict the ranks passed to ``dcp.save``: one lazy tensor per logical
tensor, assembled from its shards; values read with ``torch.load(weights_only=True)``, so
opening a step never runs code stored in it. DCP's own ``Metadata``, which ``dcp.load``
plans with, is rebuilt from the same record (:func:`amber_store.dcp.metadata_of`).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from . import format as fmt
from .errors import CorruptDataError, UnsafeValueError
from .format import Manifest, fragments, sharding


@dataclass(frozen=True)
class ShardedTensor:
    """One logical tensor: global ``shape`` and ``dtype``, its shards as ``(offset, item key)``
    and each shard's size."""

    dtype: str
    shape: tuple[int, ...]
    shards: tuple[tuple[tuple[int, ...], str], ...]
    sizes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Layout:
    """How a sharded step's items make its state.

    ``tree``: the nested state (the manifest's ``tree``), whose ``tensor`` leaves name entries of
    ``tensors`` or ``values``; ``values``: logical name -> item key of a pickled value.
    """

    tree: dict[str, Any]
    tensors: dict[str, ShardedTensor]
    values: dict[str, str]

    def names(self) -> dict[str, str]:
        """Item key -> the logical name it belongs to."""
        out = {key: name for name, key in self.values.items()}
        for name, t in self.tensors.items():
            out.update((key, name) for _, key in t.shards)
        return out


def layout_of(m: Manifest) -> Layout | None:
    """The logical layout of a sharded step (``None`` for a step saved whole, or a DCP step of
    format 8, whose tree is its items: it opens as them). Lists every shard: a whole-state
    read's (a DCP resume reads by :class:`FragmentMap`)."""
    state = m.extra.get("dcp", {}).get("state")
    if state is None:
        return None
    if "owners" not in state:  # format 9: each shard listed, its size in its entry
        tensors = {name: ShardedTensor(t["dtype"], tuple(t["shape"]),
                                       tuple((tuple(offset), key) for offset, key in t["shards"]),
                                       tuple(tuple(m.tensors[key].shape) for _, key in t["shards"]))
                   for name, t in state["tensors"].items()}
        return Layout(m.tree, tensors, dict(state["values"]))
    tensors = {}
    for name, fqn in _fqns(m.tree, state["tensors"]).items():
        t = state["tensors"][name]
        shape = tuple(t["shape"])
        shards = list(cells_of(shape, t))
        tensors[name] = ShardedTensor(t["dtype"], shape, tuple((o, sharding.item_key(fqn, o)) for o, _ in shards),
                                      tuple(s for _, s in shards))
    return Layout(m.tree, tensors, {name: key for name, (key, _) in state["values"].items()})


def cells_of(shape: Sequence[int], t: dict[str, Any]) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The shards (offset, size) of a format-10 index's tensor ``t``: its grid's cells, or its list."""
    if "grid" in t:
        return sharding.cells(shape, t["grid"])
    return ((tuple(o), tuple(s)) for o, s in t["shards"])


def _fqns(tree: dict[str, Any], names: Any) -> dict[str, str]:
    """Each tensor's DCP flattened key (its path in the state, joined by dots, as DCP's
    ``flatten_state_dict`` makes it), by name."""
    return {name: ".".join(map(str, path)) for name, path in paths(tree).items() if name in names}


class FragmentMap:
    """Which fragment of a format-10 sharded step holds each item, and which items (keys,
    dtypes, shapes, in key order) each fragment holds, from the index alone."""

    def __init__(self, m: Manifest) -> None:
        self.manifest = m
        state = m.extra["dcp"]["state"]
        self.tensors: dict[str, dict[str, Any]] = state["tensors"]
        self.owners: list[list[int]] = state["owners"]
        self.values = {key: f for key, f in state["values"].values()}
        self.prefix = {name: fmt.escape_segment(fqn) for name, fqn in _fqns(m.tree, self.tensors).items()}
        self.by_prefix = {prefix: name for name, prefix in self.prefix.items()}
        self._rows: dict[int, dict[int, list[int]]] = {}  # owners row -> fragment -> its cells
        self._explicit: dict[str, dict[tuple[int, ...], int]] = {}

    def fragment(self, key: str) -> int | None:
        """The fragment holding item ``key`` (``None``: the step has no such item)."""
        if key in self.values:
            return self.values[key]
        prefix, _, last = key.rpartition("/")
        name = self.by_prefix.get(prefix)
        if name is None:
            return None
        t = self.tensors[name]
        try:
            offset = () if last == "scalar" else tuple(int(x) for x in last.split("_"))
        except ValueError:
            return None
        if "grid" in t:
            cell = sharding.cell_of(t["shape"], t["grid"], offset)
        else:
            where = self._explicit.get(name)
            if where is None:
                where = self._explicit[name] = {tuple(o): i for i, (o, _) in enumerate(t["shards"])}
            cell = where.get(offset)
        return None if cell is None else self.owners[t["owners"]][cell]

    def items(self, f: int) -> list[fragments.Item]:
        """The items of fragment ``f``, in key order (the order of its records)."""
        out = [fragments.Item(key, "uint8", None) for key, g in self.values.items() if g == f]
        for name, t in self.tensors.items():
            cells = self._row(t["owners"]).get(f)
            if not cells:
                continue
            shape = tuple(t["shape"])
            for cell in cells:
                offset, size = (sharding.cell(shape, t["grid"], cell) if "grid" in t
                                else (tuple(t["shards"][cell][0]), tuple(t["shards"][cell][1])))
                out.append(fragments.Item(f"{self.prefix[name]}/{'_'.join(map(str, offset)) or 'scalar'}", t["dtype"], size))
        out.sort(key=lambda it: it.key)
        return out

    def _row(self, k: int) -> dict[int, list[int]]:
        row = self._rows.get(k)
        if row is None:
            row = self._rows[k] = {}
            for cell, f in enumerate(self.owners[k]):
                row.setdefault(f, []).append(cell)
        return row


def items_tree(m: Manifest) -> dict[str, Any]:
    """A tree of a step's stored items, each under its own key: ``store.load(step,
    tree=items_tree(store.manifest(step)))`` opens a sharded step as DCP stored it."""
    return {"dict": [[key, {"tensor": key}] for key in m.tensors]}


def paths(tree: dict[str, Any]) -> dict[str, tuple[str | int, ...]]:
    """Each leaf name of a sharded step's tree -> its path in the state (dict keys, list indices)."""
    out: dict[str, tuple[str | int, ...]] = {}

    def walk(node: dict[str, Any], path: tuple[str | int, ...]) -> None:
        kind, body = next(iter(node.items()))
        if kind == "tensor":
            out[body] = path
        elif kind == "dict":
            for key, child in body:
                walk(child, (*path, key))
        elif kind == "list":
            for i, child in enumerate(body):
                walk(child, (*path, i))

    walk(tree, ())
    return out


def value(raw: np.ndarray, step: int, name: str, item: str, allow_pickle: bool = False) -> Any:
    """The Python value of item ``item`` (``torch.save`` bytes), loaded without running code
    stored in it; a value that needs that is refused, naming it, unless ``allow_pickle`` (a
    store the caller trusts as they would trust running its writer's code)."""
    import torch  # here: listing and inspecting a store (history) never import torch

    try:
        return torch.load(io.BytesIO(raw.tobytes()), map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        lines = str(e).splitlines() or [type(e).__name__]  # (torch's names the global it refused)
        reason = next((line.strip() for line in lines if "global" in line.lower()), lines[0])
        raise UnsafeValueError(
            f"step {step}: {name!r} is a pickled object that cannot be read without running code stored with it "
            f"({reason}); if you trust this store as you would trust running its writer's code, load it with "
            "allow_pickle=True") from None
    except Exception as e:  # (torch.load's own errors on bytes that are no torch.save file)
        raise CorruptDataError(f"step {step}: {name!r} (item {item!r}) is not a readable value "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
