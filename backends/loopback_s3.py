"""A real S3 HTTP endpoint on 127.0.0.1, served by moto's server mode.

Used by the test fixtures and the benchmarks where no MinIO runs (CI has no docker engine).
The server is an HTTP server in a thread of this process; its data lives in moto's
process-wide backend, so :meth:`LoopbackS3.stop` followed by :meth:`LoopbackS3.start` on the
same port models an outage that the server recovers from with its data intact.

Run it by hand: ``python -m backends.loopback_s3 --port 5555 --bucket amber``.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import urllib.request

ACCESS_KEY = "amber-test-key"
SECRET_KEY = "amber-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackS3:
    """Start, stop and reset a moto S3 server bound to loopback."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self) -> "LoopbackS3":
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        # moto signs nothing, but botocore refuses to send requests without some credentials.
        os.environ.setdefault("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def reset(self) -> None:
        """Forget every bucket and object."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=5).close()

    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def create_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(
            key=ACCESS_KEY, secret=SECRET_KEY, client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True
        )
        if not fs.exists(name):
            fs.mkdir(name)

    def __enter__(self) -> "LoopbackS3":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    args = p.parse_args()
    with LoopbackS3(args.port) as s3:
        for b in args.bucket:
            s3.create_bucket(b)
        print(f"loopback S3 at {s3.endpoint} (key {ACCESS_KEY!r}, secret {SECRET_KEY!r}); Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
