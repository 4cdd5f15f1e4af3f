"""Checkpoints in and out of standard formats: safetensors and torch.save files. Files only: the
store's ``export`` and :func:`amber_store.import_checkpoint` load and save the states."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from .errors import StorageAccessError, UnsupportedStateError
from .lazy import materialize

Format = Literal["safetensors", "torch"]
_SUFFIXES: dict[str, Format] = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch",
                                ".ckpt": "torch"}


def file_format(path: str | os.PathLike[str], format: Format | None) -> Format:
    if format is not None:
        if format not in ("safetensors", "torch"):
            raise ValueError(f"format must be 'safetensors' or 'torch', not {format!r}")
        return format
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"{path}: cannot tell the format from its suffix {suffix!r}; use .safetensors or .pt, or "
                         "pass format='safetensors' or 'torch' (CLI: --format)")
    return _SUFFIXES[suffix]


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of a nested state, keyed by their '.'-joined path (a model state dict stays as is)."""
    out: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v.contiguous()
        else:
            out.update(flat_tensors(v, key + "."))
    return out


def untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each repeat of one tensor (a tied weight) copied: safetensors refuses
    tensors that share memory, and a file holds every key."""
    out, seen = {}, set()
    for k, t in tensors.items():
        out[k] = t.clone() if id(t) in seen else t
        seen.add(id(t))
    return out


def export(state: Any, step: int, path: str | os.PathLike[str], *, format: Format | None = None,
           subtree: str | None = None) -> Path:
    """Write ``state``, the (lazy) state of ``step``, to ``path``. torch: the whole state, exactly
    as saved, via ``torch.save``. safetensors: the tensors of ``subtree`` (default: ``"model"``
    when the state has it, else all), keyed by their dotted path, so
    ``model.load_state_dict(load_file(path))`` works."""
    fmt_ = file_format(path, format)
    path = Path(path)
    if not path.parent.is_dir():  # (before anything is read)
        raise StorageAccessError(f"{path}: cannot export there: {path.parent} is not a directory")
    if fmt_ == "torch":
        torch.save(materialize(state), path)
        return path
    from safetensors.torch import save_file

    node = state
    if subtree is None and isinstance(node, Mapping) and "model" in node:
        subtree = "model"
    for part in subtree.split("/") if subtree else []:
        if not isinstance(node, Mapping) or part not in node:
            have = ", ".join(map(repr, list(node)[:10])) if isinstance(node, Mapping) else type(node).__name__
            raise UnsupportedStateError(f"step {step}: no {part!r} in the state to export (there: {have})")
        node = node[part]
    tensors = untied(flat_tensors(materialize(node)))
    if not tensors:
        raise UnsupportedStateError(f"step {step}: no tensors under {subtree or 'the root'!r} to export")
    save_file(tensors, str(path), metadata={"amber_store.step": str(step), "amber_store.subtree": subtree or ""})
    # safetensors writes through a private temporary file (mode 0600); give the file the mode
    # any new file gets here, as torch.save's does.
    path.chmod(_new_file_mode(path.parent))
    return path


def _new_file_mode(directory: Path) -> int:
    """The permissions a new file gets in ``directory`` (0o666 less the umask), learnt by
    creating one: reading the umask means setting it, process-wide, under other threads' feet
    (a background save creating files at that moment would get them world-writable)."""
    probe = directory / f".amber-mode-{uuid.uuid4().hex}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


def read(path: str | os.PathLike[str], *, format: Format | None = None, subtree: str | None = None) -> Any:
    """The state in a ``torch.save`` file (loaded with ``weights_only=True``) or a safetensors
    file. A safetensors file exported from a subtree goes back under it: ``subtree``, or by
    default the one recorded in the file by :func:`export`; ``subtree=""`` puts its tensors at
    the top level."""
    fmt_ = file_format(path, format)
    if fmt_ == "torch":
        state = torch.load(path, map_location="cpu", weights_only=True)
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file

        state = load_file(str(path))
        if subtree is None:
            with safe_open(str(path), "pt") as f:
                subtree = (f.metadata() or {}).get("amber_store.subtree", "")
        for part in reversed(subtree.split("/") if subtree else []):
            state = {part: state}
    return state
