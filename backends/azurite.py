"""Azurite's Blob service, the Azure Storage emulator, as a local process. It installs from npm
(``backends/node/package.json``; ``make test`` runs ``npm ci`` there) and keeps its blobs in a
directory, so a restart after :meth:`~backends.process.ServerProcess.kill` finds them again.

It serves the published development account ``devstoreaccount1`` and checks its key, and it
honours ``If-None-Match: *`` (amber-store's commit). A crash loses its last 5 s of writes
(:attr:`Azurite.crash_safe_after`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .process import ServerProcess

#: Azurite's development account and its published key
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: where ``npm ci`` in backends/node puts the program
AZURITE = Path(__file__).resolve().parent / "node" / "node_modules" / ".bin" / "azurite-blob"


def azurite_blob() -> str:
    found = str(AZURITE) if AZURITE.exists() else shutil.which("azurite-blob")
    if found is None:
        raise FileNotFoundError(f"azurite-blob not found: run `npm ci --prefix {AZURITE.parents[2]}` (make test does)")
    return found


class Azurite(ServerProcess):
    """Azurite's Blob service on loopback, storing blobs under its data directory."""

    name = "azurite"
    scheme = "az"
    ready_timeout = 30.0
    #: Azurite keeps blob metadata in a LokiJS database saved every 5 s: a crash (SIGKILL)
    #: loses what it acknowledged since (Azure itself acknowledges a write once durable)
    crash_safe_after = 5.5

    def __init__(self, data_dir: Any = None) -> None:
        super().__init__(data_dir)
        self.endpoint = f"http://127.0.0.1:{self.port}/{ACCOUNT}"
        self._buckets: list[str] = []

    def command(self) -> list[str]:
        return [azurite_blob(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                "--location", str(self.data_dir / "data"), "--skipApiVersionCheck", "--disableTelemetry"]

    def connection_string(self, key: str = ACCOUNT_KEY) -> str:
        return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};BlobEndpoint={self.endpoint};"

    def storage_options(self) -> dict[str, Any]:
        """adlfs options for this server: its endpoint and the development account's key."""
        return {"endpoint_url": self.endpoint, "account_name": ACCOUNT, "account_key": ACCOUNT_KEY}

    def quick_options(self) -> dict[str, Any]:
        """Options that give up on this server fast: 1 s timeouts, no retry."""
        return {**self.storage_options(), "connection_timeout": 1, "read_timeout": 1, "retry_total": 0}

    def wrong_credentials(self, secret: str) -> dict[str, Any]:
        """Options naming this server with a wrong account key (``secret``, base64 as keys are)."""
        return {**self.storage_options(), "account_key": secret}

    def client(self) -> Any:
        """A synchronous Blob service client, for set-up."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string(), retry_total=0)

    def check_ready(self) -> None:
        client = self.client()
        for bucket in self._buckets:
            _ensure_container(client, bucket)
        list(client.list_containers(results_per_page=1))

    def create_bucket(self, name: str) -> None:
        """Create the container ``name`` if missing (now and after each restart)."""
        if name not in self._buckets:
            self._buckets.append(name)
        _ensure_container(self.client(), name)


def _ensure_container(client: Any, name: str) -> None:
    from azure.core.exceptions import ResourceExistsError

    try:
        client.create_container(name)
    except ResourceExistsError:
        pass
