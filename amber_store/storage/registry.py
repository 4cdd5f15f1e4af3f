"""URI -> backend, the way fsspec resolves URLs to filesystems: a scheme names a backend class,
imported when first used (a backend's client library is imported only by stores that use it).
Backends from outside the package: :func:`register` at run time, or an entry point in the group
:data:`ENTRY_POINTS` of an installed package (looked up only for a scheme nothing else serves)."""

from __future__ import annotations

import importlib
import os
import re
from importlib.metadata import entry_points
from typing import Any, Union
from urllib.parse import urlsplit


from ..errors import InvalidURIError
from ..runtime import sync
from .base import Backend

#: URI scheme -> its backend: a class, or ``module:class`` imported when first used (as fsspec's
#: ``known_implementations``). A new backend of this package is a module and a line here.
BACKENDS: dict[str, Union[str, type[Backend]]] = {
    "file": "amber_store.storage.local:LocalBackend",
    "memory": "amber_store.storage.memory:MemoryBackend",
    "s3": "amber_store.storage.s3_obstore:ObstoreS3Backend",
    "s3a": "amber_store.storage.s3_obstore:ObstoreS3Backend",
    "gs": "amber_store.storage.gcs:GCSBackend",
    "gcs": "amber_store.storage.gcs:GCSBackend",
    "az": "amber_store.storage.azure_obstore:ObstoreAzureBackend",
    "abfs": "amber_store.storage.azure_obstore:ObstoreAzureBackend",
    "abfss": "amber_store.storage.azure_obstore:ObstoreAzureBackend",
}

#: The entry-point group through which an installed package serves a scheme (``scheme =
#: "module:Class"``, a :class:`Backend` subclass), as fsspec's ``fsspec.specs``.
ENTRY_POINTS = "amber_store.backends"

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


def supported() -> str:
    """The storage a URI may name, for messages."""
    return "a local path, " + ", ".join(f"{s}://" for s in BACKENDS)


def register(scheme: str, backend: Union[str, type[Backend]], *, clobber: bool = False) -> None:
    """Serve URIs of ``scheme`` by ``backend``: a :class:`Backend` subclass, or its
    ``"module:Class"`` (imported when a URI first names the scheme), as fsspec's
    ``register_implementation``. A scheme already served is refused unless ``clobber``."""
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme):
        raise ValueError(f"{scheme!r} is not a URI scheme (a letter, then letters, digits, '+', '-' or '.')")
    if isinstance(backend, str):
        if not re.fullmatch(r"[\w.]+:\w+", backend):
            raise ValueError(f"backend {backend!r}: give a Backend subclass or 'module:Class'")
    elif not (isinstance(backend, type) and issubclass(backend, Backend)):
        raise TypeError(f"backend {backend!r} is not a subclass of amber_store.storage.Backend")
    if scheme in BACKENDS and BACKENDS[scheme] != backend and not clobber:
        raise ValueError(f"{scheme}:// is served already (by {_name(BACKENDS[scheme])}); pass clobber=True to "
                         "replace it")
    BACKENDS[scheme] = backend


def _name(target: Union[str, type[Backend]]) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def backend_class(scheme: str, uri: str = "") -> type[Backend]:
    """The backend class serving ``scheme``."""
    target = BACKENDS.get(scheme)
    if target is None:
        found = entry_points(group=ENTRY_POINTS, name=scheme)
        if not found:
            raise InvalidURIError(f"{uri or scheme}: unsupported URI scheme {scheme!r}; use {supported()} (or a "
                                  "backend registered by amber_store.storage.register or an installed package)")
        target = next(iter(found)).value
    if isinstance(target, str):
        module, _, name = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), name)
        except ImportError as e:
            raise InvalidURIError(f"{uri or scheme}: the {scheme}:// backend needs {e.name!r}, which is not "
                                  f"installed ({e})") from None
        except AttributeError:
            raise InvalidURIError(f"{uri or scheme}: the {scheme}:// backend {target} does not exist") from None
        if not (isinstance(target, type) and issubclass(target, Backend)):
            raise InvalidURIError(f"{uri or scheme}: the {scheme}:// backend {module}:{name} is not a subclass of "
                                  "amber_store.storage.Backend")
        BACKENDS[scheme] = target
    return target


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
