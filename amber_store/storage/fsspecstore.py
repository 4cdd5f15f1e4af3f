"""The backends on an fsspec async filesystem (s3fs, gcsfs, adlfs): their reads, writes and
commits go through the filesystem (:class:`FsspecObjectStoreBackend`); zarr's
:class:`~zarr.storage.FsspecStore` on the same filesystem is made only for zarr's readers."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, AsyncIterator

import numpy as np

from ..runtime import sync
from .base import MISSING, ByteRange, as_array
from .objectstore import ObjectStoreBackend

if TYPE_CHECKING:
    from zarr.storage import FsspecStore

#: fsspec options every object store's filesystem gets: steps are discovered by listing, so a
#: cached listing would hide new commits; and a filesystem cached by its arguments would keep
#: the credentials (or their absence) of an earlier open, not the environment's now
FRESH: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}


class FsspecObjectStoreBackend(ObjectStoreBackend):
    """An object store through an fsspec async filesystem ``fs`` (s3fs, gcsfs, adlfs)."""

    def __init__(self, fs: Any, path: str, uri: str, read_only: bool,
                 cat_options: dict[str, Any] | None = None) -> None:
        super().__init__(None, uri, path, read_only)
        self.fs = fs
        #: options of a whole object's read (``_cat_file``): s3fs would otherwise ask for an
        #: object's size first, to split a big one into concurrent range reads, which doubled a
        #: load's requests; amber-store's readers range-read big objects chunk by chunk themselves
        #: (:data:`amber_store.reader.WHOLE_OBJECT_BYTES`)
        self.cat_options = cat_options or {}

    def zarr_store(self) -> FsspecStore:
        from zarr.storage import FsspecStore

        return FsspecStore(self.fs, path=self.path, read_only=self.read_only)

    def key_path(self, key: str) -> str:
        return f"{self.path}/{key}"

    # --- reading ------------------------------------------------------------------------

    async def get(self, key: str, byte_range: ByteRange | None = None) -> np.ndarray | None:
        path = self.key_path(key)
        try:
            if byte_range is None:
                return as_array(await self.fs._cat_file(path, **self.cat_options))
            return as_array(await self.fs._cat_file(path, start=byte_range[0], end=byte_range[1]))
        except MISSING:
            return None
        except OSError as e:
            if "not satisfiable" in str(e):  # (s3fs, for a range past an object's end: no bytes there)
                return as_array(b"")
            raise

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:  # type: ignore[override]
        base = self.key_path(prefix.rstrip("/"))
        try:
            found = await self.fs._ls(base, detail=False)
        except FileNotFoundError:
            return
        for name in (f.replace(base + "/", "") for f in found):
            yield name.removeprefix(self.path).removeprefix("/")

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:  # type: ignore[override]
        for path in await self.fs._find(self.key_path(prefix), detail=False, maxdepth=None, withdirs=False):
            yield path.removeprefix(f"{self.path}/")

    async def exists(self, key: str) -> bool:
        return bool(await self.fs._exists(self.key_path(key)))

    # --- writing ------------------------------------------------------------------------

    def integrity(self, data: bytes) -> dict[str, Any]:
        """Options of a metadata write that make the server refuse a body that arrived
        incomplete (a truncated commit), where the client does not check by itself."""
        return {}

    async def put_object(self, key: str, parts: list[Any], durable: bool = False) -> None:
        await self.fs._pipe_file(self.key_path(key), b"".join(parts))

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

    async def delete(self, key: str) -> None:
        try:
            await self.fs._rm(self.key_path(key))
        except MISSING:
            pass

    async def delete_dir(self, prefix: str) -> None:
        try:
            await self.fs._rm(self.key_path(prefix).rstrip("/"), recursive=True)
        except MISSING:
            pass

    def exists_error(self, e: OSError) -> bool:
        """Whether ``e`` (not a FileExistsError) still says that a create lost to an existing
        object: clients map a service's answer to FileExistsError only when they recognize
        its body."""
        return False

    async def footprint(self, prefix: str = "") -> dict[str, int]:
        found = await self.fs._find(self.key_path(prefix).rstrip("/"), detail=True)
        sizes = [info["size"] for info in found.values()]
        return {"objects": len(sizes), "bytes": sum(sizes), "allocated": sum(sizes)}

    # --- connections --------------------------------------------------------------------

    def close(self) -> None:
        sync(self.renew_client())

    @abc.abstractmethod
    async def renew_client(self) -> None:
        """Close the client's connections and leave a new client (no connection yet) in its
        place, closed in turn when the filesystem goes or at exit."""
