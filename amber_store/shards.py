"""A step saved in shards (through torch.distributed.checkpoint) as the state its ranks saved.

DCP stores *items*: one per tensor shard (``model.w/256_0``) and one per plain Python value
(pickled by ``torch.save``). The manifest records how items make the state (docs/FORMAT.md):
its ``tree`` is the nested structure DCP flattened, and ``extra.dcp.state`` has each tensor's
global shape, dtype and shards and each value's item. From that, any single process opens the
step as the nested state dict the ranks passed to ``dcp.save``: one lazy tensor per logical
tensor, assembled from its shards; values read with ``torch.load(weights_only=True)``, so
opening a step never runs code stored in it. DCP's own ``Metadata``, which ``dcp.load``
plans with, is rebuilt from the same record (:func:`amber_store.dcp.metadata_of`).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CorruptDataError, UnsafeValueError
from .format import Manifest


@dataclass(frozen=True)
class ShardedTensor:
    """One logical tensor: global ``shape`` and ``dtype``, and its shards as ``(offset, item key)``."""

    dtype: str
    shape: tuple[int, ...]
    shards: tuple[tuple[tuple[int, ...], str], ...]


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
    format 8, whose tree is its items: it opens as them)."""
    state = m.extra.get("dcp", {}).get("state")
    if state is None:
        return None
    tensors = {name: ShardedTensor(t["dtype"], tuple(t["shape"]),
                                   tuple((tuple(offset), key) for offset, key in t["shards"]))
               for name, t in state["tensors"].items()}
    return Layout(m.tree, tensors, dict(state["values"]))


def to_json(layout: Layout) -> dict[str, Any]:
    """The layout as stored in ``extra.dcp.state`` (its tree is the manifest's ``tree``)."""
    return {"tensors": {name: {"dtype": t.dtype, "shape": list(t.shape),
                               "shards": [[list(offset), key] for offset, key in t.shards]}
                        for name, t in layout.tensors.items()},
            "values": layout.values}


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
