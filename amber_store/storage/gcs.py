"""``gs://bucket/prefix`` (and ``gcs://``): Google Cloud Storage, on gcsfs.

Options are gcsfs's (``project``, ``token``: credentials as gcsfs takes them, ``endpoint_url``,
``requester_pays``, ``requests_timeout``, ...) and ``retries`` (:data:`GCS_RETRIES`). ``STORAGE_EMULATOR_HOST`` points every request at
an emulator (fake-gcs-server), and then, as Google's own client does, credentials default to
anonymous. The commit is an upload with ``ifGenerationMatch=0`` (412 when the object exists),
sent as one multipart request: fake-gcs-server honours the condition on those only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import types
from typing import Any
from urllib.parse import SplitResult

from ..errors import InvalidURIError, StorageAccessError
from .base import reason
from .fsspecstore import FRESH, FsspecObjectStoreBackend

#: bounds on each request (aiohttp ``ClientTimeout`` fields) unless ``requests_timeout`` is
#: given: a server that stops answering fails a request after its attempts instead of never;
#: a save has its own deadline on top.
GCS_TIMEOUTS: dict[str, float] = {"sock_connect": 5, "sock_read": 15}
#: attempts at a request (option ``retries``); gcsfs makes 6, with 31 s of back-off between them
GCS_RETRIES = 3

#: gcsfs's one-request upload takes objects below this size; a commit is sent as one request
#: whatever its size (see the module's docstring)
_SINGLE_REQUEST = 50 << 20


class GCSBackend(FsspecObjectStoreBackend):
    """A Google Cloud Storage bucket prefix."""

    schemes = ("gs", "gcs")
    error_modules = ("gcsfs", "google", "aiohttp", "requests")
    condition = "ifGenerationMatch=0"
    honoured_by = "Google Cloud Storage; fake-gcs-server on one-request uploads, which commits are"

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any], read_only: bool) -> "GCSBackend":
        import aiohttp

        text, path = cls.located(uri, parts._replace(scheme="gs"))
        opts = {**FRESH, **storage_options}
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            opts.setdefault("token", "anon")
        opts.setdefault("requests_timeout", aiohttp.ClientTimeout(**GCS_TIMEOUTS))
        try:
            fs = _filesystem(int(opts.pop("retries", GCS_RETRIES)))(asynchronous=True, **opts)
        except TypeError as e:
            raise InvalidURIError(f"{text}: cannot create a gcs filesystem: {e}") from None
        except Exception as e:  # gcsfs reads the credentials now: google-auth's errors, KeyError, ...
            raise StorageAccessError(f"{text}: the credentials cannot be used ({reason(e)})") from None
        return cls(fs, path, text, read_only)

    @property
    def endpoint(self) -> str:
        return self.fs._location if self.fs._location != "https://storage.googleapis.com" else "Google Cloud Storage"

    async def create(self, path: str, data: bytes) -> None:
        await self.fs._pipe_file(path, data, mode="create", chunksize=max(_SINGLE_REQUEST, len(data) + 1))

    def denied(self, e: Exception) -> bool:
        """gcsfs raises 403 as OSError("Forbidden: ...") and 401 as its HttpError."""
        return str(e).startswith("Forbidden") or getattr(e, "code", None) == 401

    async def probe_request(self) -> None:
        """One attempt only: an endpoint that does not answer fails the open within the connect
        timeout, not after gcsfs's retries and their back-off."""
        from gcsfs.core import GCSFileSystem
        from gcsfs.retry import retry_request

        self.fs._request = types.MethodType(retry_request(retries=1)(GCSFileSystem._request.__wrapped__), self.fs)
        try:
            await self.fs._call("GET", "b/{}/o", self.bucket, prefix=f"{self.prefix}/" if self.prefix else "",
                                maxResults=1, json_out=True)
        finally:
            del self.fs._request

    async def renew_client(self) -> None:
        """gcsfs makes a session (and arranges its closing) at the next request."""
        session, self.fs._session = self.fs._session, None
        if session is not None and not session.closed:
            await session.close()


class _Reported(logging.Filter):
    """Drops gcsfs's log records of a request that failed for good, with their tracebacks: the
    failure reaches the caller as one line (:class:`StorageAccessError`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "out of retries on exception" not in record.getMessage() and \
            "non-retriable exception" not in record.getMessage()


logging.getLogger("gcsfs").addFilter(_Reported())


@functools.cache
def _filesystem(retries: int) -> Any:
    """gcsfs's core filesystem making ``retries`` attempts at each request (gcsfs fixes them
    when its class is defined), whose sessions close on their own event loop. The core one:
    gcsfs's default first asks a gRPC service for a bucket's type (zonal buckets), which an
    emulator does not serve (60 s per call)."""
    from gcsfs.core import GCSFileSystem
    from gcsfs.retry import retry_request

    return type("GCSFileSystem", (GCSFileSystem,),
                {"_request": retry_request(retries=max(1, retries))(GCSFileSystem._request.__wrapped__),
                 "close_session": staticmethod(_close_session)})


def _close_session(loop: Any, session: Any, asynchronous: bool = False) -> None:
    """Close an aiohttp session (gcsfs's finalizer of a filesystem, when it goes or at exit) on
    the event loop it lives on (amber-store's): gcsfs's own closes it on whatever loop runs where the
    garbage collector struck ("attached to a different loop"). Scheduled, never waited for: the
    collector may strike in a thread that holds what that loop needs (waiting there stalled
    saves for the wait's whole timeout). Once the loop is gone, its connections are closed as
    they are."""
    if session is None or session.closed:
        return
    own = getattr(session, "_loop", None)
    if own is not None and own.is_running() and not own.is_closed():
        asyncio.run_coroutine_threadsafe(session.close(), own)
        return
    connector = getattr(session, "_connector", None)
    if connector is not None:
        connector._close()
