"""What S3, GCS and Azure Blob backends share, whatever the client: bounded metadata writes, the
commit as the service's conditional create, a check at open that the server honours it, and
reachability probed with one request (:class:`ObjectStoreBackend`). The backends on an fsspec
filesystem build on it in :mod:`~amber_store.storage.fsspecstore`.

A subclass says how to build its client from a URI and the ecosystem's own options, how to
probe reachability with one request and how its client reports a lost conditional create and
refused credentials.
"""

from __future__ import annotations

import abc
import uuid
from contextlib import suppress
from typing import Any, ClassVar
from urllib.parse import SplitResult

from ..errors import InvalidURIError, StorageAccessError, UnsafeStorageError
from .base import Backend, reason

#: Bound on a commit (its listing and conditional create) and on other metadata writes outside
#: a save's deadline (pins, retention's folds): small requests, which would otherwise wait out
#: every attempt's read timeout (~130 s for a listing, measured on SeaweedFS stopped by SIGSTOP).
PUT_TIMEOUT = 60.0

# Whether each (backend, endpoint) enforces conditional creates (checked once per process).
_CONDITIONAL: dict[tuple[str, str], bool] = {}


class ObjectStoreBackend(Backend):
    """A bucket (or container) prefix on an object store; ``path`` is ``bucket/prefix``."""

    put_timeout: float | None = PUT_TIMEOUT
    #: what the service calls a bucket, for messages
    container: ClassVar[str] = "bucket"
    #: the request condition that makes a create exclusive, for messages
    condition: ClassVar[str]
    #: servers known to honour it, for the message that refuses one that does not
    honoured_by: ClassVar[str]

    def __init__(self, store: Any, uri: str, path: str, read_only: bool | None = None) -> None:
        super().__init__(store, uri, read_only)
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
