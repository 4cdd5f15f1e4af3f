"""The backends on an fsspec async filesystem (s3fs, gcsfs, adlfs), under zarr's
:class:`~zarr.storage.FsspecStore`: their reads go through zarr's store, their metadata writes
and commits through the filesystem (:class:`FsspecObjectStoreBackend`)."""

from __future__ import annotations

import abc
from typing import Any

from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import FsspecStore

from ..runtime import sync
from .objectstore import ObjectStoreBackend


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

    async def footprint(self, prefix: str = "") -> dict[str, int]:
        found = await self.fs._find(f"{self.path}/{prefix}".rstrip("/"), detail=True)
        sizes = [info["size"] for info in found.values()]
        return {"objects": len(sizes), "bytes": sum(sizes), "allocated": sum(sizes)}

    # --- connections --------------------------------------------------------------------

    def close(self) -> None:
        sync(self.renew_client())

    @abc.abstractmethod
    async def renew_client(self) -> None:
        """Close the client's connections and leave a new client (no connection yet) in its
        place, closed in turn when the filesystem goes or at exit."""
