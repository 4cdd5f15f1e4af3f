"""What S3, GCS and Azure Blob backends share: bounded metadata writes, the commit as the
service's conditional create, a check at open that the server honours it, and reachability
probed with one request (:class:`ObjectStoreBackend`, whatever the client); and, for the
backends on an fsspec async filesystem under zarr's :class:`~zarr.storage.FsspecStore`, their
reads and writes (:class:`FsspecObjectStoreBackend`).

A subclass says how to build its client from a URI and the ecosystem's own options, how to
probe reachability with one request and how its client reports a lost conditional create and
refused credentials; an fsspec one also how to close and renew its client.
"""

from __future__ import annotations

import abc
import uuid
from contextlib import suppress
from typing import Any, ClassVar
from urllib.parse import SplitResult

from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import FsspecStore

from ..errors import InvalidURIError, StorageAccessError, UnsafeStorageError
from ..runtime import sync
from .base import Backend, reason

#: Bound on a commit (its listing and conditional create) and on other metadata writes outside
#: a save's deadline (pins, retention's folds): small requests, which would otherwise wait out
#: every attempt's read timeout (~130 s for a listing, measured on SeaweedFS stopped by SIGSTOP).
PUT_TIMEOUT = 60.0

# Whether each (backend, endpoint) enforces conditional creates (checked once per process).
_CONDITIONAL: dict[tuple[str, str], bool] = {}


class WholeObjectStore(FsspecStore):
    """zarr's :class:`~zarr.storage.FsspecStore`, reading a whole object with one request:
    ``cat_options`` go to the filesystem's ``_cat_file`` (s3fs would otherwise ask for an
    object's size first, to split a big one into concurrent range reads: that doubled a
    load's requests). amber-store's readers range-read big objects chunk by chunk themselves
    (:data:`amber_store.reader.WHOLE_OBJECT_BYTES`)."""

    cat_options: dict[str, Any] = {}

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        if byte_range is not None or not self.cat_options:
            return await super().get(key, prototype, byte_range)
        if not self._is_open:
            await self._open()
        try:
            data = await self.fs._cat_file(f"{self.path.rstrip('/')}/{key}", **self.cat_options)
        except self.allowed_exceptions:
            return None
        return prototype.buffer.from_bytes(data)


#: fsspec options every object store's filesystem gets: steps are discovered by listing, so a
#: cached listing would hide new commits; and a filesystem cached by its arguments would keep
#: the credentials (or their absence) of an earlier open, not the environment's now
FRESH: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}


class ObjectStoreBackend(Backend):
    """A bucket (or container) prefix on an object store; ``path`` is ``bucket/prefix``."""

    put_timeout: float | None = PUT_TIMEOUT
    #: what the service calls a bucket, for messages
    container: ClassVar[str] = "bucket"
    #: the request condition that makes a create exclusive, for messages
    condition: ClassVar[str]
    #: servers known to honour it, for the message that refuses one that does not
    honoured_by: ClassVar[str]

    def __init__(self, store: Any, uri: str, path: str) -> None:
        super().__init__(store, uri)
        self.path = path

    @classmethod
    def located(cls, uri: str, parts: SplitResult, bucket: str | None = None) -> tuple[str, str]:
        """The URI as messages name it and the path (``bucket/prefix``) of ``uri`` (``bucket``:
        the URI's own host part, unless given); refuses a URI without a bucket."""
        bucket = parts.netloc if bucket is None else bucket
        scheme = parts.scheme.lower()
        if not bucket:
            raise InvalidURIError(f"{uri}: needs a {cls.container}: {scheme}://{cls.container}/prefix")
        return f"{scheme}://{parts.netloc}{parts.path}".rstrip("/"), f"{bucket}{parts.path}".rstrip("/")

    @property
    def bucket(self) -> str:
        return self.path.partition("/")[0]

    @property
    def prefix(self) -> str:
        return self.path.partition("/")[2]

    @abc.abstractmethod
    async def remove(self, key: str) -> None:
        """Delete one object (the probe of :meth:`require_conditional_writes`)."""

    # --- checking -----------------------------------------------------------------------

    async def probe(self) -> None:
        try:
            await self.probe_request()
        except FileNotFoundError:
            raise StorageAccessError(f"{self.uri}: {self.container} {self.bucket!r} does not exist") from None
        except Exception as e:  # client, HTTP and socket errors share no base class
            if isinstance(e, PermissionError) or self.denied(e):
                raise StorageAccessError(f"{self.uri}: access denied; check the credentials ({reason(e)})") from None
            raise StorageAccessError(f"{self.uri}: storage not usable: {reason(e)}") from None
        finally:
            self.connected()

    @abc.abstractmethod
    async def probe_request(self) -> None:
        """One cheap request within the store's own prefix (a listing of the bucket's root
        pages through every top-level entry, and an access policy may allow only this
        prefix): FileNotFoundError for a missing bucket, PermissionError for refused
        credentials."""

    def denied(self, e: Exception) -> bool:
        """Whether the client's error ``e`` is the service refusing the credentials (clients
        that raise PermissionError for it need not say)."""
        return False

    def connected(self) -> None:
        """Called on the event loop once the client exists (after the probe)."""

    async def require_conditional_writes(self) -> None:
        """Refuse a server that ignores the conditional create: there, two writers could both
        "create" a step's commit and one would silently overwrite the other's. Checked once per
        endpoint and process, by creating a probe object twice the way a commit is created
        (inside the store's prefix, and only once it holds the root: some servers leave an
        empty folder marker behind the deleted probe object)."""
        verdict = (type(self).__name__, self.endpoint)
        if verdict not in _CONDITIONAL:
            key = f".amber-probe-{uuid.uuid4().hex}"
            try:
                await self.put_if_absent(key, b"first")
                _CONDITIONAL[verdict] = not await self.put_if_absent(key, b"second")
            except (PermissionError, FileNotFoundError) as e:
                raise StorageAccessError(f"{self.uri}: cannot write here ({reason(e)})") from None
            finally:
                with suppress(FileNotFoundError):
                    await self.remove(key)
        if not _CONDITIONAL[verdict]:
            raise UnsafeStorageError(
                f"{self.uri}: the server at {self.endpoint} ignores conditional writes ({self.condition}), so "
                "two writers could both commit one step and overwrite each other; use a server that "
                f"honours them ({self.honoured_by}), or, if this store is only ever written by one process "
                "at a time, open it with single_writer=True"
            )


class FsspecObjectStoreBackend(ObjectStoreBackend):
    """An object store through an fsspec async filesystem ``fs`` (s3fs, gcsfs, adlfs)."""

    def __init__(self, fs: Any, path: str, uri: str, read_only: bool, cat_options: dict[str, Any] | None = None) -> None:
        store = WholeObjectStore(fs, path=path, read_only=read_only)
        if cat_options:
            store.cat_options = cat_options
        super().__init__(store, uri, path)
        self.fs = fs

    def key_path(self, key: str) -> str:
        return f"{self.path}/{key}"

    # --- writing ------------------------------------------------------------------------

    def integrity(self, data: bytes) -> dict[str, Any]:
        """Options of a metadata write that make the server refuse a body that arrived
        incomplete (a truncated commit), where the client does not check by itself."""
        return {}

    async def put(self, key: str, data: bytes) -> None:
        await self.bounded(self.fs._pipe_file(self.key_path(key), data, **self.integrity(data)))

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            await self.bounded(self.create(self.key_path(key), data))
        except FileExistsError:
            return False
        except OSError as e:
            if self.exists_error(e):
                return False
            raise
        return True

    async def create(self, path: str, data: bytes) -> None:
        """The conditional create of one small object."""
        await self.fs._pipe_file(path, data, mode="create", **self.integrity(data))

    async def remove(self, key: str) -> None:
        await self.fs._rm_file(self.key_path(key))

    def exists_error(self, e: OSError) -> bool:
        """Whether ``e`` (not a FileExistsError) still says that a create lost to an existing
        object: clients map a service's answer to FileExistsError only when they recognize
        its body."""
        return False

    async def footprint(self) -> dict[str, int]:
        sizes = [info["size"] for info in (await self.fs._find(self.path, detail=True)).values()]
        return {"objects": len(sizes), "bytes": sum(sizes), "allocated": sum(sizes)}

    # --- connections --------------------------------------------------------------------

    def close(self) -> None:
        sync(self.renew_client())

    @abc.abstractmethod
    async def renew_client(self) -> None:
        """Close the client's connections and leave a new client (no connection yet) in its
        place, closed in turn when the filesystem goes or at exit."""
