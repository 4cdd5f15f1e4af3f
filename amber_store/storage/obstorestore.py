"""The backends on obstore, the Python binding of the Rust ``object_store`` client (which zarr's
:class:`~zarr.storage.ObjectStore` wraps, for zarr's readers): amber-store's own reads, writes,
listings and commits call obstore directly (:class:`ObstoreBackend`), and a cloud's module says
how its client is built from a URI and the options users pass to the fsspec client of that cloud
(:mod:`~amber_store.storage.s3_obstore`, :mod:`~amber_store.storage.azure_obstore`).

Every request is bounded (:data:`CLIENT_OPTIONS`, :data:`RETRY`); the commit is obstore's
conditional create (``put(mode="create")``), which each cloud sends as its own condition.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib
import re
from typing import TYPE_CHECKING, Any, AsyncIterator, ClassVar
from urllib.parse import SplitResult

import numpy as np

from ..errors import InvalidURIError
from .base import MISSING, Backend, ByteRange, as_array
from .objectstore import ObjectStoreBackend

if TYPE_CHECKING:
    from zarr.storage import ObjectStore

#: Bounds on every request: to connect, of silence between bytes (a frozen server), and on a
#: whole request (a GET of a large object at 100 MB/s takes seconds, not minutes).
CLIENT_OPTIONS: dict[str, Any] = {"connect_timeout": "5s", "read_timeout": "15s", "timeout": "300s"}
#: Attempts at a request that failed in transit or timed out, and how long they may go on.
RETRY: dict[str, Any] = {"max_retries": 3, "retry_timeout": datetime.timedelta(seconds=60)}
#: Objects above this size are uploaded in parts of this size, several at once.
PART_BYTES = 64 << 20
#: Times a conditional create that lost to a racing conditional write, not to an existing
#: object (:meth:`ObstoreBackend.racing`), is asked again.
CONFLICT_RETRIES = 5


class ObstoreBackend(ObjectStoreBackend):
    """A bucket (or container) prefix through an obstore ``client`` rooted at that prefix."""

    error_modules = ("obstore",)
    #: objects one bulk delete request may name (the service's limit)
    delete_batch: ClassVar[int] = 1000
    #: the cloud's fsspec client, which ``client=<name>`` or any option only it knows selects:
    #: (its name, its backend as ``"module:Class"``, those options)
    fsspec_client: ClassVar[tuple[str, str, frozenset[str]]]

    def __init__(self, client: Any, uri: str, path: str, read_only: bool, endpoint: str) -> None:
        super().__init__(None, uri, path, read_only)
        self.client = client
        self._endpoint = endpoint

    @classmethod
    def through_fsspec(cls, uri: str, parts: SplitResult, opts: dict[str, Any], read_only: bool) -> Backend | None:
        """The fsspec client's backend where ``opts`` ask for it, else ``None`` (``client`` is
        taken out of ``opts`` either way)."""
        name, target, only = cls.fsspec_client
        client = opts.pop("client", "obstore")
        if client == name or only & opts.keys():
            module, _, attr = target.partition(":")
            return getattr(importlib.import_module(module), attr).from_uri(uri, parts, opts, read_only)
        if client != "obstore":
            raise InvalidURIError(f"{uri}: client must be 'obstore' (the default) or {name!r}, not {client!r}")
        return None

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def zarr_store(self) -> ObjectStore:
        from zarr.storage import ObjectStore

        return ObjectStore(self.client, read_only=self.read_only)

    # --- reading ------------------------------------------------------------------------

    async def get(self, key: str, byte_range: ByteRange | None = None) -> np.ndarray | None:
        import obstore

        try:
            if byte_range is None:
                return as_array(await (await obstore.get_async(self.client, key)).bytes_async())
            return as_array(await obstore.get_range_async(self.client, key, start=byte_range[0], end=byte_range[1]))
        except MISSING:  # (obstore raises the built-in FileNotFoundError)
            return None

    async def exists(self, key: str) -> bool:
        import obstore

        try:
            await obstore.head_async(self.client, key)
        except FileNotFoundError:
            return False
        return True

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:  # type: ignore[override]
        import obstore

        async for batch in obstore.list(self.client, prefix=prefix or None):
            for meta in batch:
                yield meta["path"]

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:  # type: ignore[override]
        """Names directly below ``prefix``; a server's marker of the "directory" itself
        (SeaweedFS lists an emptied one as its own entry) is not one of them."""
        import obstore

        base = prefix.rstrip("/")
        found = await obstore.list_with_delimiter_async(self.client, prefix=base or None)
        for path in [*found["common_prefixes"], *(meta["path"] for meta in found["objects"])]:
            name = path[len(base) + 1:] if base else path
            if (not base or path.startswith(base + "/")) and name:
                yield name.rstrip("/")

    # --- writing ------------------------------------------------------------------------

    async def put_object(self, key: str, parts: list[Any], durable: bool = False) -> None:
        """One PUT from the parts joined, or, above :data:`PART_BYTES`, an upload of the parts as
        they are, in parts of that size, several at once (acknowledged once durable: nothing
        for :meth:`make_durable`)."""
        import obstore

        size = sum(memoryview(p).nbytes for p in parts)
        if size <= PART_BYTES:
            await obstore.put_async(self.client, key, b"".join(parts) if len(parts) != 1 else parts[0],
                                    use_multipart=False)
            return
        try:
            await obstore.put_async(self.client, key, iter(parts), chunk_size=PART_BYTES, max_concurrency=4)
        except BaseException:
            self.upload_failed(key)
            raise

    def upload_failed(self, key: str) -> None:
        """An upload in parts of ``key`` failed or was cancelled: clean up what the service
        keeps of it, if anything (called on the event loop; must not wait)."""

    async def put(self, key: str, data: bytes) -> None:
        import obstore

        await self.bounded(obstore.put_async(self.client, key, data, use_multipart=False))

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        attempt = 0
        while True:
            try:
                await self.bounded(obstore.put_async(self.client, key, data, mode="create", use_multipart=False))
                return True
            except (AlreadyExistsError, PreconditionError) as e:
                if attempt == CONFLICT_RETRIES or not self.racing(e):
                    return False
            await asyncio.sleep(0.05 * 2**attempt)
            attempt += 1

    def racing(self, e: Exception) -> bool:
        """Whether a lost conditional create ``e`` lost to another conditional write still in
        flight rather than to an existing object: neither has won yet, so it is asked again."""
        return False

    async def remove(self, key: str) -> None:
        import obstore

        await obstore.delete_async(self.client, key)

    async def delete(self, key: str) -> None:
        try:
            await self.remove(key)
        except FileNotFoundError:  # (S3 deletes are idempotent, Azure's say what was missing)
            pass

    async def delete_dir(self, prefix: str) -> None:
        import obstore

        if prefix and not prefix.endswith("/"):
            prefix += "/"
        keys = [meta["path"] async for batch in obstore.list(self.client, prefix=prefix or None) for meta in batch]
        for start in range(0, len(keys), self.delete_batch):
            try:
                await obstore.delete_async(self.client, keys[start: start + self.delete_batch])
            except FileNotFoundError:  # (one of them deleted meanwhile: delete the rest one by one)
                for key in keys[start: start + self.delete_batch]:
                    await self.delete(key)

    # --- checking -----------------------------------------------------------------------

    async def probe_request(self) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            await obstore.list_with_delimiter_async(self.client)
        except Exception as e:  # a missing bucket is a 404 to the listing, a GenericError to obstore
            if isinstance(e, NotFoundError) or re.search(self.missing_container, str(e)):
                raise FileNotFoundError(str(e)) from None
            raise

    #: what the service's answer to a listing of a missing bucket says (a regular expression)
    missing_container: ClassVar[str] = r"404 Not Found"

    def denied(self, e: Exception) -> bool:
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        return isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or \
            re.search(r"status code:? 40[13]\b", str(e)) is not None

    async def footprint(self, prefix: str = "") -> dict[str, int]:
        import obstore

        sizes = [meta["size"] async for batch in obstore.list(self.client, prefix=prefix or None, chunk_size=1000)
                 for meta in batch]
        return {"objects": len(sizes), "bytes": sum(sizes), "allocated": sum(sizes)}

    def close(self) -> None:
        """Nothing to do: the client's pooled connections close when it goes."""


def renamed(opts: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """obstore's configuration from the options of ``opts`` that ``names`` maps to its keys
    (taken out of ``opts``; those set to ``None`` are left out)."""
    return {new: value for old, new in names.items() if (value := opts.pop(old, None)) is not None}


def client_options(endpoint: str | None, **bounds: Any) -> dict[str, Any]:
    """obstore's client options: :data:`CLIENT_OPTIONS` with ``bounds`` over them, and plain
    HTTP allowed where the endpoint asks for it (an emulator, a server on the same host)."""
    options = {**CLIENT_OPTIONS, **bounds}
    if str(endpoint or "").lower().startswith("http://"):
        options["allow_http"] = True
    return options
