"""``s3://bucket/prefix`` (and ``s3a://``): AWS S3, MinIO, SeaweedFS or any S3 server, on s3fs.

Options are s3fs's (``endpoint_url``, ``key``, ``secret``, ``token``, ``profile``, ``anon``,
``client_kwargs``, ``config_kwargs``) with the standard AWS environment honoured
(``AWS_ENDPOINT_URL[_S3]``, ``AWS_REGION``, credentials and profiles as botocore finds them).
The commit is a conditional PUT (``If-None-Match: *``). Every request is bounded
(:data:`S3_TIMEOUTS`), and the client's connections are closed at exit even if nobody calls
``close``.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import functools
import hashlib
import os
import weakref
from contextlib import suppress
from typing import Any
from urllib.parse import SplitResult, urlsplit

from ..errors import InvalidURIError
from .fsspecstore import FRESH, FsspecObjectStoreBackend

#: Defaults for every S3 request (botocore ``Config`` keys; ``storage_options["config_kwargs"]``
#: overrides them). A read from a server that stops answering fails after its attempts
#: (``S3_RETRIES`` x ``max_attempts`` x ``read_timeout`` plus back-off: ~130 s measured) instead
#: of never; a save has its own, overall deadline on top (``Store(save_timeout=...)``).
#: ``read_timeout`` bounds the silence between bytes, not a whole transfer.
S3_TIMEOUTS: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 15,
                               "retries": {"max_attempts": 3, "mode": "standard"}}
#: s3fs's own attempts at a request that timed out or lost its connection, around botocore's.
S3_RETRIES = 2


class S3Backend(FsspecObjectStoreBackend):
    """An S3 bucket prefix."""

    schemes = ("s3", "s3a")
    error_modules = ("botocore", "aiobotocore", "aiohttp", "s3fs")
    condition = "If-None-Match: *"
    honoured_by = "AWS S3, MinIO since RELEASE.2024-11, SeaweedFS"

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any], read_only: bool) -> "S3Backend":
        import s3fs

        text, path = cls.located(uri, parts._replace(scheme="s3"))
        try:
            fs = s3fs.S3FileSystem(asynchronous=True, **s3_options(storage_options))
        except (TypeError, ValueError) as e:
            raise InvalidURIError(f"{text}: cannot create an s3 filesystem: {e}") from None
        fs.retries = S3_RETRIES  # a class attribute of s3fs (5), not a constructor option
        # one GET per whole object: s3fs would ask for its size first (a HEAD), to split it
        return cls(fs, path, text, read_only, cat_options={"max_concurrency": 1})

    @property
    def endpoint(self) -> str:
        return (getattr(self.fs, "client_kwargs", None) or {}).get("endpoint_url") or "AWS S3"

    def integrity(self, data: bytes) -> dict[str, Any]:
        """``Content-MD5``: the server refuses a body that arrived incomplete (SeaweedFS, MinIO
        and AWS S3 check it) instead of storing a truncated commit."""
        return {"ContentMD5": base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()}

    def exists_error(self, e: OSError) -> bool:
        """A 412 to a conditional PUT: the object exists. s3fs maps it to FileExistsError only
        when the error body names the condition, which SeaweedFS's and MinIO's do not (it then
        raises OSError(EINVAL) from botocore's ClientError)."""
        cause = e.__cause__ or e.__context__
        response = getattr(cause, "response", None) or {}
        return (response.get("Error", {}).get("Code") == "PreconditionFailed"
                or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412)

    async def probe_request(self) -> None:
        await self.fs._call_s3("list_objects_v2", Bucket=self.bucket,
                               Prefix=f"{self.prefix}/" if self.prefix else "", MaxKeys=1)

    def connected(self) -> None:
        if getattr(self.fs, "_s3", None) is not None:
            _track_client(self.fs)

    def close(self) -> None:
        if _close_fs(self.fs):
            super().close()

    async def renew_client(self) -> None:
        await self.fs.set_session()
        _track_client(self.fs)


def s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options with the standard AWS environment honoured and object-store-safe defaults."""
    opts = dict(storage_options)
    endpoint = opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL"
    )
    client_kwargs = dict(opts.pop("client_kwargs", {}) or {})
    if endpoint:
        client_kwargs.setdefault("endpoint_url", endpoint)
    if urlsplit(client_kwargs.get("endpoint_url") or "").scheme.lower() == "http":
        # No TLS to verify: botocore would still load the CA bundle into an SSL context for
        # each client (40 ms of a 70 ms open and first read, measured on SeaweedFS).
        client_kwargs.setdefault("verify", False)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs.setdefault("region_name", region)
    opts["client_kwargs"] = client_kwargs
    config_kwargs = {**S3_TIMEOUTS, **(opts.pop("config_kwargs", {}) or {})}
    if endpoint:
        # MinIO and other S3-compatible servers want path-style addressing.
        config_kwargs.setdefault("s3", {"addressing_style": "path"})
    # botocore >= 1.36 adds checksums that several S3-compatible stores reject.
    config_kwargs.setdefault("request_checksum_calculation", "when_required")
    config_kwargs.setdefault("response_checksum_validation", "when_required")
    opts["config_kwargs"] = config_kwargs
    opts = {**FRESH, **opts}
    if "session" not in opts:
        opts["session"] = _session(opts.get("profile"))
    _no_expect_continue(opts["session"])
    return opts


def _no_expect_continue(session: Any) -> None:
    """Make the clients of ``session`` send a PUT's body at once. botocore asks for
    "Expect: 100-continue" on every PUT, and aiohttp waits for that interim answer with no
    timeout: a PUT to a hung server waited 400 s and more (GETs fail after their read
    timeouts), and once abandoned SeaweedFS stored an empty object. Without it
    ``read_timeout`` bounds the wait. Done on the session, not a client, so that the client
    made again after :meth:`S3Backend.close` sends no such header either."""
    from botocore.handlers import add_expect_header

    session.unregister("before-call.s3", add_expect_header)


def _session(profile: str | None) -> Any:
    """A new botocore session (credentials and configuration read afresh) that shares one
    loader of botocore's service models with every other: parsing them took 0.13-0.34 s of
    each S3 open, 0.01 s once loaded (measured on SeaweedFS)."""
    from aiobotocore.session import AioSession

    session = AioSession(profile=profile)
    session.register_component("data_loader", _models(session.get_config_variable("data_path")))
    return session


@functools.cache
def _models(data_path: str | None) -> Any:
    from botocore.loaders import create_loader

    return create_loader(data_path)


# S3 filesystems with a client session, and the event loop the session lives on (amber-store's,
# which nothing stops before the interpreter ends); closed at exit.
_SESSIONS: "weakref.WeakKeyDictionary[Any, asyncio.AbstractEventLoop]" = weakref.WeakKeyDictionary()


@atexit.register
def _close_sessions() -> None:
    for fs in list(_SESSIONS):
        _close_fs(fs)


def _close_fs(fs: Any) -> bool:
    """Close the client of ``fs`` if it is one of ours; whether it was."""
    client = getattr(fs, "_s3", None)
    if client is None or fs not in _SESSIONS:
        return False
    fs._s3 = None
    _close_client(client, _SESSIONS[fs])
    return True


def _track_client(fs: Any) -> None:
    """Close the client of ``fs`` when the filesystem goes, or at exit: aiohttp warns about
    every session still open then. Called on the event loop the client lives on."""
    loop = asyncio.get_running_loop()
    weakref.finalize(fs, _close_client, fs._s3, loop, False).atexit = False
    _SESSIONS[fs] = loop


def _close_client(client: Any, loop: asyncio.AbstractEventLoop, wait: bool = True) -> None:
    """Close an aiobotocore client on its event loop; waiting for it only with ``wait`` and
    never from that loop's own thread. The garbage collector's finalizer does not wait: it may
    strike in a thread that holds what the loop needs."""
    if loop.is_closed() or not loop.is_running():
        return
    fut = asyncio.run_coroutine_threadsafe(client.close(), loop)
    with suppress(RuntimeError):
        if asyncio.get_running_loop() is loop:
            return
    if wait:
        with suppress(Exception):
            fut.result(timeout=10)
