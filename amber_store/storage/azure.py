"""``az://container/prefix`` (and ``abfs://``, ``abfss://``; ``container@account.host`` names the
account too): Azure Blob Storage, on adlfs, with ``client="adlfs"`` or an option only adlfs knows
(the default client is obstore: :mod:`~amber_store.storage.azure_obstore`).

Credentials as adlfs takes them: ``connection_string``, ``account_name`` + ``account_key``,
``sas_token``, a service principal (``tenant_id``, ``client_id``, ``client_secret``) or
``credential``, and their ``AZURE_STORAGE_*`` environment variables
(``AZURE_STORAGE_CONNECTION_STRING``, ...). ``endpoint_url`` names the blob service of an
account key's account (Azurite: ``http://127.0.0.1:10000/devstoreaccount1``). The commit is an
upload with ``If-None-Match: *`` (409 or 412 when the blob exists).
"""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from contextlib import suppress
from typing import Any
from urllib.parse import SplitResult


from ..errors import InvalidURIError
from ..runtime import sync
from .fsspecstore import FRESH, FsspecObjectStoreBackend

#: per-request bounds (seconds) unless the options name them: a server that stops answering
#: fails a request after its retries instead of after the SDK's 60 s read timeout, each
AZURE_TIMEOUTS: dict[str, float] = {"connection_timeout": 5, "read_timeout": 15}
#: the SDK's retries of a failed request (its default: 3, the first after 15 s)
AZURE_RETRIES: dict[str, float] = {"retry_total": 2, "initial_backoff": 1, "increment_base": 2}


# Azure filesystems whose SDK clients are closed at exit, on the event loop they live on
# (amber-store's, which runs until the interpreter ends). adlfs's own closing, a finalizer, runs its coroutine on the filesystem's loop,
# which an asynchronous adlfs does not have: it fails and prints a traceback at every exit, so
# it is detached. (By id: filesystems of equal options compare equal.)
_LIVE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


@functools.cache
def _close_at_exit() -> None:
    """Register :func:`_close_clients` once an adlfs finalizer exists: exit hooks run last
    registered first, so it runs before the finalizers' hook."""
    atexit.register(_close_clients)


def _close_clients() -> None:
    for fs in list(_LIVE.values()):
        with suppress(Exception):
            sync(fs.service_client.close())
        for finalizer, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]
            if any(arg is fs for arg in info.args):
                finalizer.detach()


class AzureBackend(FsspecObjectStoreBackend):
    """An Azure Blob Storage container prefix, whose SDK client makes its requests with
    ``retries`` (``ExponentialRetry``'s arguments) and ``timeouts``."""

    schemes = ("az", "abfs", "abfss")
    error_modules = ("azure", "adlfs", "aiohttp")
    container = "container"
    condition = "If-None-Match: *"
    honoured_by = "Azure Blob Storage, Azurite"

    def __init__(self, fs: Any, path: str, uri: str, read_only: bool, retries: dict[str, float],
                 timeouts: dict[str, float]) -> None:
        super().__init__(fs, path, uri, read_only)
        self.retries, self.timeouts = retries, timeouts
        fs.service_client = self.client_like(fs.service_client)

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any], read_only: bool) -> "AzureBackend":
        from adlfs import AzureBlobFileSystem

        container, _, host = parts.netloc.partition("@")
        text, path = cls.located(uri, parts, container)
        opts = {**FRESH, **storage_options}
        if host and "account_name" not in opts:
            opts["account_name"] = host.split(".", 1)[0]
        endpoint = opts.pop("endpoint_url", None)
        retries = {k: opts.pop(k, v) for k, v in AZURE_RETRIES.items()}
        timeouts = {k: opts.setdefault(k, v) for k, v in AZURE_TIMEOUTS.items()}
        if endpoint:
            opts.setdefault("connection_string", _connection_string(text, endpoint, opts))
        try:
            fs = AzureBlobFileSystem(asynchronous=True, **opts)
        except (TypeError, ValueError) as e:
            raise InvalidURIError(f"{text}: cannot create an azure filesystem: {e}") from None
        _LIVE[id(fs)] = fs
        _close_at_exit()
        return cls(fs, path, text, read_only, retries, timeouts)

    @property
    def endpoint(self) -> str:
        return self.fs.service_client.primary_endpoint.split("?", 1)[0]

    async def probe_request(self) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        client = self.fs.service_client.get_container_client(self.bucket)
        try:
            async for _ in client.list_blobs(name_starts_with=f"{self.prefix}/" if self.prefix else None,
                                             results_per_page=1):
                break
        except ResourceNotFoundError as e:
            raise FileNotFoundError(str(e).splitlines()[0]) from e

    def denied(self, e: Exception) -> bool:
        """A credential the SDK could not get (ClientAuthenticationError), or one the service
        refused (403: a wrong account key or SAS token)."""
        from azure.core.exceptions import ClientAuthenticationError

        return isinstance(e, ClientAuthenticationError) or getattr(e, "status_code", None) in (401, 403)

    async def renew_client(self) -> None:
        old = self.fs.service_client
        self.fs.service_client = self.client_like(old)  # a closed SDK client cannot be used again
        await old.close()

    def client_like(self, client: Any) -> Any:
        """A service client for the same account URL (with its SAS) and credential as
        ``client``, with this backend's retries and timeouts for every request: adlfs builds
        its client with the SDK's (3 retries after 15, 18 and 24 s; 60 s read timeouts, which
        it overrides only on some requests)."""
        from azure.storage.blob.aio import BlobServiceClient, ExponentialRetry

        return BlobServiceClient(account_url=client.url, credential=client.credential,
                                 retry_policy=ExponentialRetry(**self.retries), **self.timeouts)


def _connection_string(uri: str, endpoint: str, opts: dict[str, Any]) -> str:
    """A connection string for ``endpoint`` (the account's blob service) with the account key
    (or SAS token) of the options or the environment."""
    name = opts.pop("account_name", None) or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    key = opts.pop("account_key", None) or os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    sas = opts.pop("sas_token", None) or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    if key and name:
        return f"AccountName={name};AccountKey={key};BlobEndpoint={endpoint};"
    if sas:
        return f"BlobEndpoint={endpoint};SharedAccessSignature={sas.lstrip('?')};"
    raise InvalidURIError(f"{uri}: endpoint_url {endpoint!r} needs account_name and account_key (or sas_token)")

