"""``memory://name``: a :class:`zarr.storage.MemoryStore` shared by every open of the same name
in this process (tests, notebooks, a scratch store)."""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import SplitResult

from zarr.core.buffer import Buffer
from zarr.storage import MemoryStore

from ..errors import InvalidURIError
from .zarrstore import ZarrStoreBackend

_MEMORY: dict[str, dict[str, Buffer]] = {}
_MEMORY_LOCK = threading.Lock()


class MemoryBackend(ZarrStoreBackend):
    """Its commit is exclusive: zarr's ``set_if_not_exists`` of a memory store is one
    ``dict.setdefault``."""

    schemes = ("memory",)

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any], read_only: bool) -> "MemoryBackend":
        if storage_options:
            raise InvalidURIError(f"{uri}: storage_options are not used by memory:// stores")
        name = (parts.netloc + parts.path).strip("/")
        with _MEMORY_LOCK:
            data = _MEMORY.setdefault(name, {})
        return cls(MemoryStore(data, read_only=read_only), f"memory://{name}")
