"""The :class:`Backend` protocol: the few operations amber-store asks of a storage system.

A backend is one location (a directory, a bucket prefix, a container prefix) seen two ways: the
operations amber-store needs (byte-range reads, listings, a commit that creates an object only
if it is absent, a replace readers never see half of, data objects written from parts,
durability before a commit, reachability and conditional-write checks at open, a footprint for
``du``, bounds on requests that could otherwise hang), and ``store``, the zarr v3 store any zarr
reader opens it with. A backend that does its reads and writes itself makes the zarr store only
when asked for it, so that a load imports no zarr (~0.12 s of a fresh process's resume).
"""

from __future__ import annotations

import abc
import asyncio
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, ClassVar, Iterator, TypeVar
from urllib.parse import SplitResult

import numpy as np

from ..errors import AmberError, StorageAccessError

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore
    from zarr.core.buffer import Buffer

T = TypeVar("T")

#: A range of an object's bytes: ``(start, end)``, ``end`` exclusive.
ByteRange = tuple[int, int]

#: What a filesystem or client raises for a key that holds no object (what :meth:`Backend.get`
#: answers ``None`` to, as zarr's stores do)
MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)

#: top-level modules whose exceptions are I/O failures (each backend adds its client's)
_ERROR_MODULES: set[str] = set()


@dataclass(frozen=True)
class Upload:
    """An upload in parts that was begun and never completed nor aborted (a killed process's):
    invisible to listings, and billed until aborted."""

    key: str
    upload_id: str
    #: when it began (seconds since the epoch)
    initiated: float


def as_buffer(data: Any) -> Buffer:
    """``data`` (bytes-like) as a zarr buffer, for a zarr store's ``set``."""
    from zarr.core.buffer import default_buffer_prototype

    return default_buffer_prototype().buffer.from_bytes(data)


def as_array(data: Any) -> np.ndarray:
    """An object's bytes (bytes-like) as :meth:`Backend.get` returns them: a uint8 array over
    the same memory."""
    return np.frombuffer(data, dtype=np.uint8)


class Backend(abc.ABC):
    """One store location and what amber-store does with it.

    Subclasses implement :meth:`from_uri` and :meth:`put_if_absent`; everything else has a
    default that goes through the zarr store, which a backend overrides where its storage
    can do better (a local rename, an object store's conditional create, an fsync) or where it
    reads and writes without zarr (then it passes no store and implements :meth:`zarr_store`). A new
    backend is one module and one line in :data:`amber_store.storage.registry.BACKENDS` (outside
    the package: :func:`amber_store.storage.register`, or an ``amber_store.backends`` entry point).
    """

    #: URI schemes this backend serves (the registry maps each to the class)
    schemes: ClassVar[tuple[str, ...]] = ()
    #: top-level modules of the client library whose exceptions are I/O failures
    error_modules: ClassVar[tuple[str, ...]] = ()
    #: seconds a commit or other metadata put outside a save may take (``None``: unbounded,
    #: for storage that cannot hang on a network)
    put_timeout: float | None = None
    #: whether :attr:`uri` opens the location again (what messages may tell a user to run)
    reopens: ClassVar[bool] = True
    #: whether :meth:`put_object` holds a copy of an object's parts while it writes them (a body
    #: joined for one request, a client's part buffers): a save counts it against
    #: ``max_inflight_bytes`` (measured on SeaweedFS: uncounted, a save held twice the bound)
    put_holds_copy: ClassVar[bool] = True

    def __init__(self, store: ZarrStore | None, uri: str, read_only: bool | None = None) -> None:
        self._store = store
        #: the location as messages name it (never with credentials)
        self.uri = uri
        self._read_only = read_only  # (None: the zarr store's)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _ERROR_MODULES.update(cls.error_modules)

    @classmethod
    @abc.abstractmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any], read_only: bool) -> "Backend":
        """The backend of ``uri`` (already split into ``parts``), with no I/O yet; raises
        :class:`~amber_store.errors.InvalidURIError` for a URI or options it cannot use."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    @property
    def store(self) -> ZarrStore:
        """zarr's view of the location: the same objects, as any zarr v3 reader sees them (made
        by :meth:`zarr_store` at first use where the backend was given none)."""
        if self._store is None:
            self._store = self.zarr_store()
        return self._store

    def zarr_store(self) -> ZarrStore:
        """The zarr store of a backend that does its reads and writes without one."""
        raise NotImplementedError(f"{type(self).__name__} has no zarr store")

    @property
    def read_only(self) -> bool:
        return bool(self.store.read_only) if self._read_only is None else self._read_only

    @property
    def endpoint(self) -> str:
        """The service behind the location, as messages name it."""
        return self.uri

    # --- reading ------------------------------------------------------------------------

    async def get(self, key: str, byte_range: ByteRange | None = None) -> np.ndarray | None:
        """The bytes of object ``key`` (or of a range of it) as a uint8 array, which may be
        read-only; ``None`` if it does not exist."""
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype

        found = await self.store.get(key, default_buffer_prototype(),
                                     None if byte_range is None else RangeByteRequest(*byte_range))
        return None if found is None else found.as_numpy_array()

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """Names directly below ``prefix`` (objects and "directories")."""
        return self.store.list_dir(prefix)

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every key below ``prefix``."""
        return self.store.list_prefix(prefix)

    async def exists(self, key: str) -> bool:
        return await self.store.exists(key)

    async def is_empty(self) -> bool:
        async for _ in self.list_prefix(""):
            return False
        return True

    # --- writing ------------------------------------------------------------------------

    async def put_object(self, key: str, parts: list[Any], durable: bool = False) -> None:
        """Write the object ``key``: ``parts`` (buffers) laid end to end. With ``durable``, the
        backend may make it durable now rather than in :meth:`make_durable` (which still runs
        before a commit)."""
        await self.store.set(key, as_buffer(b"".join(parts)))

    async def put(self, key: str, data: bytes) -> None:
        """Create or replace the small object ``key`` (metadata written outside a save: pins, a
        folded step's manifest); readers see the old object or the new one, never a mix."""
        await self.bounded(self.store.set(key, as_buffer(data)))

    @abc.abstractmethod
    async def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` only if it does not exist; ``False`` if it did. The
        commit point of a step: of two writers racing for one key, exactly one may win."""

    async def make_durable(self, keys: list[str]) -> None:
        """Make the objects at ``keys`` durable before a commit names them (object stores
        acknowledge a PUT once it is durable: nothing to do)."""

    async def delete(self, key: str) -> None:
        await self.store.delete(key)

    async def delete_dir(self, prefix: str) -> None:
        await self.store.delete_dir(prefix)

    # --- checking -----------------------------------------------------------------------

    async def probe(self) -> None:
        """Fail now, with a clear message, if the location cannot be used."""

    async def require_conditional_writes(self) -> None:
        """Refuse (:class:`~amber_store.errors.UnsafeStorageError`) a location whose
        :meth:`put_if_absent` cannot keep two writers from both committing one step."""

    async def footprint(self, prefix: str = "") -> dict[str, int]:
        """What the location (or the keys below ``prefix``) occupies: ``objects``, ``bytes``
        (their sizes) and ``allocated`` (disk blocks where known, else the same as ``bytes``)."""
        sizes = [await self.store.getsize(key) async for key in self.list_prefix(prefix)]
        return {"objects": len(sizes), "bytes": sum(sizes), "allocated": sum(sizes)}

    async def incomplete_uploads(self) -> list[Upload]:
        """Uploads in parts under the location begun and never completed (storage whose
        uploads leave nothing billed behind has none)."""
        return []

    async def abort_upload(self, upload: Upload) -> None:
        """Abort an upload of :meth:`incomplete_uploads`, freeing its parts."""

    def close(self) -> None:
        """Close the client's connections. The backend stays usable: a later request connects
        again."""

    async def bounded(self, aw: Awaitable[T]) -> T:
        """``aw`` within :attr:`put_timeout`."""
        return await (aw if self.put_timeout is None else asyncio.wait_for(aw, self.put_timeout))


def is_storage_error(e: BaseException) -> bool:
    """I/O failures (disk, network, the object store's answers), as opposed to bugs."""
    return isinstance(e, (OSError, TimeoutError, asyncio.TimeoutError)) or \
        type(e).__module__.split(".")[0] in _ERROR_MODULES


@contextmanager
def storage_errors(uri: str, doing: str) -> Iterator[None]:
    """Turn an I/O failure inside the block into a :class:`StorageAccessError` saying what was
    being done where (client libraries' errors share no base class); amber-store's own errors
    and bugs pass through."""
    try:
        yield
    except AmberError:
        raise
    except Exception as e:
        if not is_storage_error(e):
            raise
        raise StorageAccessError(f"{uri}: {doing} failed ({reason(e)})") from e


def reason(e: BaseException) -> str:
    """One line on an error, for messages (never a credential): a server's answer as its status,
    code and message in words, without the XML it came in, the client's request URLs and
    retry accounting, or a debug dump."""
    name = type(e).__name__
    full = str(e)
    text = full.splitlines()[0] if full else ""
    if "credential" in (name + text).lower():
        return f"no valid credentials found: {name}"
    status = re.search(r"status code:? (\d{3}(?: [A-Za-z][A-Za-z ]*[A-Za-z])?)", full)
    said = [m.group(1).strip() for tag in ("Code", "Message") for m in [re.search(rf"<{tag}>([^<]*)</{tag}>", full)] if m]
    if status or said:
        return f"{name}: the server answered {status.group(1) if status else 'with an error'}" + \
            (f" ({': '.join(said)})" if said else "")
    text = re.sub(r"(https?://[^/\s]+)\S*", r"\1", text)  # (a request's path and query: noise)
    text = re.sub(r" in [\d.]+[mµn]?s\b|,? after \d+ retries, max_retries: \d+, retry_timeout: \S+", "", text)
    return f"{name}: {text}"[:300]
