"""Any zarr v3 store a caller hands to :func:`amber_store.open` (a ``zarr.storage.ObjectStore``
on obstore, a wrapper of their own, ...): amber-store reads and writes through zarr's store API
alone."""

from __future__ import annotations

from typing import Any
from urllib.parse import SplitResult

from zarr.abc.store import Store as ZarrStore

from ..errors import InvalidURIError
from .base import Backend, as_buffer


class ZarrStoreBackend(Backend):
    """A zarr store as it is. Its commit is zarr's check-then-set, exclusive only where the
    store makes it so (two processes racing on a store that does not could both commit one
    step)."""

    reopens = False  # (its uri is the store's repr)

    def __init__(self, store: ZarrStore, uri: str | None = None) -> None:
        super().__init__(store, uri or repr(store))

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any],
                 read_only: bool) -> "ZarrStoreBackend":
        raise InvalidURIError(f"{uri}: pass a zarr store object, not a URI, to use a zarr store as it is")

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        await self.store.set_if_not_exists(key, as_buffer(data))
        stored = await self.get(key)
        return stored is not None and stored.tobytes() == data
