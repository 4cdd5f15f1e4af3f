"""``az://container/prefix`` (and ``abfs://``, ``abfss://``; ``container@account.host`` names the
account too) on obstore (:mod:`~amber_store.storage.obstorestore`): Azure Blob Storage and
Azurite.

The default Azure client. Options are the ones users pass to adlfs: ``account_name`` with
``account_key`` or ``sas_token``, ``connection_string``, a service principal (``tenant_id``,
``client_id``, ``client_secret``), ``endpoint_url`` (the account's blob service; Azurite:
``http://127.0.0.1:10000/devstoreaccount1``), ``anon``, and the Azure SDK's request bounds
``connection_timeout``, ``read_timeout`` (seconds) and ``retry_total``; the ``AZURE_STORAGE_*``
environment is honoured (``AZURE_STORAGE_CONNECTION_STRING``, ``..._ACCOUNT_NAME``,
``..._ACCOUNT_KEY``, ...). Without credentials, obstore's chain finds them (managed identity,
workload identity); adlfs would go anonymous. ``client="adlfs"``, or an option only adlfs knows
(``credential``: an ``azure.identity`` object, ``account_host``, ...), selects the adlfs backend
(:mod:`amber_store.storage.azure`). The commit is an upload with ``If-None-Match: *``; an
upload in parts is a block blob whose uncommitted blocks Azure discards within a week.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import SplitResult

from ..errors import InvalidURIError
from .base import Backend
from .obstorestore import RETRY, ObstoreBackend, client_options, renamed

#: Options that only adlfs (and the Azure SDK) understands: with any of them, the store goes
#: through adlfs.
ADLFS_ONLY = frozenset({"credential", "account_host", "location_mode", "request_session", "socket_timeout",
                        "blocksize", "default_fill_cache", "default_cache_type", "version_aware",
                        "assume_container_exists", "max_concurrency", "timeout", "asynchronous", "loop",
                        "initial_backoff", "increment_base", "use_listings_cache", "skip_instance_cache"})
#: storage_options -> obstore's Azure configuration keys
_RENAMED = {"account_name": "account_name", "account_key": "account_key", "sas_token": "sas_key",
            "tenant_id": "tenant_id", "client_id": "client_id", "client_secret": "client_secret",
            "endpoint_url": "endpoint"}
#: the Azure SDK's request bounds (adlfs passes them on) -> obstore's client options, in seconds
_BOUNDS = {"connection_timeout": "connect_timeout", "read_timeout": "read_timeout"}


class ObstoreAzureBackend(ObstoreBackend):
    """An Azure Blob Storage container prefix, through obstore."""

    schemes = ("az", "abfs", "abfss")
    container = "container"
    condition = "If-None-Match: *"
    honoured_by = "Azure Blob Storage, Azurite"
    missing_container = r"ContainerNotFound"
    delete_batch = 256  # (a blob batch request's limit)
    fsspec_client = ("adlfs", "amber_store.storage.azure:AzureBackend", ADLFS_ONLY)

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any], read_only: bool) -> Backend:
        opts = dict(storage_options)
        if (other := cls.through_fsspec(uri, parts, opts, read_only)) is not None:
            return other
        from obstore.store import AzureStore

        container, _, host = parts.netloc.partition("@")
        text, path = cls.located(uri, parts, container)
        config, bounds, retries = azure_config(opts, text, account=host.split(".", 1)[0] if host else None)
        _, _, prefix = path.partition("/")
        try:
            store = AzureStore(container, prefix=prefix or None, config=config,
                               client_options=client_options(config.get("endpoint"), **bounds),
                               retry_config={**RETRY, **retries})
        except Exception as e:  # obstore reports bad configuration as its own errors
            raise InvalidURIError(f"{text}: cannot create an Azure client: {e}") from None
        endpoint = config.get("endpoint") or f"https://{config.get('account_name', '?')}.blob.core.windows.net"
        return cls(store, text, path, read_only, endpoint)


def azure_config(storage_options: dict[str, Any], uri: str,
                 account: str | None = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """obstore's Azure configuration, client options and retry options from adlfs-style options
    (over the ``AZURE_*`` environment, which obstore reads itself; a connection string, from the
    options or ``AZURE_STORAGE_CONNECTION_STRING``, it does not)."""
    opts = dict(storage_options)
    config = renamed(opts, _RENAMED)
    bounds = {new: f"{float(seconds)}s" for new, seconds in renamed(opts, _BOUNDS).items()}
    retries = {"max_retries": int(total)} if (total := opts.pop("retry_total", None)) is not None else {}
    connection = opts.pop("connection_string", None)
    if opts.pop("anon", False):
        config["skip_signature"] = True
    if opts:
        raise InvalidURIError(f"{uri}: unknown storage_options {sorted(opts)} for Azure (the obstore client takes "
                              f"{sorted([*_RENAMED, *_BOUNDS, 'retry_total', 'connection_string', 'anon', 'client'])}; "
                              "client='adlfs' takes adlfs's)")
    credentials = {"account_key", "sas_key", "client_secret", "skip_signature"}
    if connection is None and not credentials & config.keys():
        connection = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection:
        for key, value in _connection_settings(connection, uri).items():
            config.setdefault(key, value)
    if account and "account_name" not in config:
        config["account_name"] = account
    if "sas_key" in config:  # (a token as copied from Azure's portal starts with '?')
        config["sas_key"] = config["sas_key"].lstrip("?")
    return config, bounds, retries


def _connection_settings(connection: str, uri: str) -> dict[str, Any]:
    """obstore's configuration from an Azure Storage connection string."""
    fields = {}
    for item in filter(None, (part.strip() for part in connection.split(";"))):
        name, sep, value = item.partition("=")
        if not sep:
            raise InvalidURIError(f"{uri}: the connection string has a part without '=' (not shown: it may hold "
                                  "the key)")
        fields[name.lower()] = value
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        return {"use_emulator": True}
    config: dict[str, Any] = {}
    for name, key in (("accountname", "account_name"), ("accountkey", "account_key"),
                      ("sharedaccesssignature", "sas_key"), ("blobendpoint", "endpoint")):
        if fields.get(name):
            config[key] = fields[name]
    if "endpoint" not in config and "accountname" in fields and "endpointsuffix" in fields:
        config["endpoint"] = (f"{fields.get('defaultendpointsprotocol', 'https')}://{fields['accountname']}.blob."
                              f"{fields['endpointsuffix']}")
    return config

