"""URI -> backend, the way fsspec resolves URLs to filesystems: a scheme names a backend class,
imported when first used (a backend's client library is imported only by stores that use it)."""

from __future__ import annotations

import importlib
import os
from typing import Any
from urllib.parse import urlsplit

from zarr.core.sync import sync

from ..errors import InvalidURIError
from .base import Backend

#: URI scheme -> ``module:class`` of its backend (as fsspec's ``known_implementations``). A new
#: backend is a module of this package and a line here.
BACKENDS: dict[str, str] = {
    "file": "amber_store.storage.local:LocalBackend",
    "memory": "amber_store.storage.memory:MemoryBackend",
    "s3": "amber_store.storage.s3_obstore:ObstoreS3Backend",
    "s3a": "amber_store.storage.s3_obstore:ObstoreS3Backend",
    "gs": "amber_store.storage.gcs:GCSBackend",
    "gcs": "amber_store.storage.gcs:GCSBackend",
    "az": "amber_store.storage.azure:AzureBackend",
    "abfs": "amber_store.storage.azure:AzureBackend",
    "abfss": "amber_store.storage.azure:AzureBackend",
}

SUPPORTED = "a local path, " + ", ".join(f"{s}://" for s in BACKENDS)


def backend_class(scheme: str, uri: str = "") -> type[Backend]:
    """The backend class serving ``scheme``."""
    target = BACKENDS.get(scheme)
    if target is None:
        raise InvalidURIError(f"{uri or scheme}: unsupported URI scheme {scheme!r}; use {SUPPORTED}")
    module, _, name = target.partition(":")
    try:
        cls: type[Backend] = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise InvalidURIError(f"{uri or scheme}: the {scheme}:// backend needs {e.name!r}, which is not installed "
                              f"({e})") from None
    return cls


def resolve(uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
            read_only: bool = False) -> Backend:
    """The backend of ``uri`` (no I/O; see :func:`connect`)."""
    text = os.fspath(uri)
    if not text:
        raise InvalidURIError("empty checkpoint URI")
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):  # a path (C:\ on Windows)
        scheme = "file"
    return backend_class(scheme, text).from_uri(text, parts, dict(storage_options or {}), read_only)


def connect(uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
            read_only: bool = False) -> Backend:
    """Resolve ``uri`` and check now that its storage can be used (:meth:`Backend.probe`): a
    wrong URI, bucket or credential fails here, with a message that names the URI and never
    the secrets."""
    backend = resolve(uri, storage_options, read_only=read_only)
    sync(backend.probe())
    return backend
