"""Pointer files: a framework's checkpoint path that names a step of an amber-store.

Frameworks find, list and delete checkpoints as files (Lightning's ``last.ckpt``, its top-k
files). Each path they write becomes a small JSON file naming the store and the step, so their
bookkeeping keeps working while the data lives once, delta-coded, in the store.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..storage.local import replace_file

MAGIC = b'{"amber_store_checkpoint":'


@dataclass(frozen=True)
class Pointer:
    uri: str
    step: int
    # The state tree saved under this path when it differs from the step's (the same tensors
    # saved again with other metadata, e.g. Lightning's ``last_model_path``).
    tree: dict[str, Any] | None = None


def read(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer at ``path``; ``None`` when there is no file or it is not a pointer."""
    fs, p = fsspec.core.url_to_fs(str(path))
    try:
        with fs.open(p, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            d = json.loads(MAGIC + f.read())
    except FileNotFoundError:
        return None
    return Pointer(d["uri"], d["step"], d.get("tree"))


def write(path: str | os.PathLike[str], pointer: Pointer) -> None:
    """Write ``pointer`` at ``path`` whole or not at all (a rename locally; a PUT on object stores)."""
    body = {"amber_store_checkpoint": 1, "uri": pointer.uri, "step": pointer.step}
    if pointer.tree is not None:
        body["tree"] = pointer.tree
    data = json.dumps(body, separators=(",", ":")).encode()  # starts with MAGIC: the first key
    fs, p = fsspec.core.url_to_fs(str(path))
    if isinstance(fs, LocalFileSystem):
        replace_file(Path(p), data)
    else:
        fs.pipe_file(p, data)


def siblings(path: str | os.PathLike[str]) -> list[tuple[str, Pointer]]:
    """Every other pointer in ``path``'s directory."""
    fs, p = fsspec.core.url_to_fs(str(path))
    parent = p.rsplit("/", 1)[0]
    out = []
    for name in fs.ls(parent, detail=False):
        if name.rstrip("/") != p and fs.isfile(name):
            ptr = read(fs.unstrip_protocol(name))
            if ptr is not None:
                out.append((name, ptr))
    return out
