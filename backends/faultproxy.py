"""A proxy in front of an HTTP object store that relays requests, drops chosen answers and fails
chosen requests, and can hold each request back a while (a distant server's latency).

What a client sees when the server stored its request and the answer was lost on the way (a
timeout, a reset connection): the request reaches the server, the server answers, and the proxy
closes the client's connection instead of passing that answer on. Requests are HTTP/1.1 with a
``Content-Length`` body (what the S3, GCS and Azure clients send for small objects); the proxy
parses only request heads, relays everything else byte for byte, and leaves signatures intact
(the ``Host`` header is passed on as the client signed it). Loopback only.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable
from urllib.parse import urlsplit

#: (method, path with query) -> whether to drop the answer to that request
Rule = Callable[[str, str], bool]


#: what the proxy answers a request ``fail`` picks, by status: S3's answers (a server error; a
#: conditional write racing another, as AWS answers it)
ANSWERS = {
    500: ("500 Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    409: ("409 Conflict", "ConditionalRequestConflict",
          "A conflicting conditional operation is currently in progress against this resource. Please try again."),
}


def _answer(status: int) -> bytes:
    line, code, message = ANSWERS[status]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            "<RequestId>1</RequestId></Error>").encode()
    return (f"HTTP/1.1 {line}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


class FaultProxy:
    """Relays connections to ``upstream`` (``http://host:port``), dropping the answer to each
    request ``drop(method, path)`` picks, and answering each that ``fail`` picks itself with
    ``status`` (500, or 409); :attr:`dropped` and :attr:`failed` list those requests. Each
    request waits ``delay`` seconds before it is relayed (requests on other connections wait
    alongside: a round trip's latency, not a queue)."""

    def __init__(self, upstream: str, drop: Rule = lambda m, p: False, fail: Rule = lambda m, p: False,
                 status: int = 500, delay: float = 0.0) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.drop = drop
        self.fail = fail
        self.status = status
        self.delay = delay
        self.dropped: list[tuple[str, str]] = []
        self.failed: list[tuple[str, str]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            dropping = threading.Event()
            threading.Thread(target=self._requests, args=(client, upstream, dropping), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client, dropping), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, dropping: threading.Event) -> None:
        """Client -> server, one request at a time (clients do not pipeline)."""
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = client.recv(65536)
                    if not data:
                        return _close(client, upstream)
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                               if line.lower().startswith("content-length:")), 0)
                while len(buf) < length:
                    data = client.recv(65536)
                    if not data:
                        return _close(client, upstream)
                    buf += data
                body, buf = buf[:length], buf[length:]
                if self.fail(method, path):
                    self.failed.append((method, path))
                    client.sendall(_answer(self.status))
                    continue
                if self.drop(method, path):
                    self.dropped.append((method, path))
                    dropping.set()
                if self.delay:
                    time.sleep(self.delay)
                upstream.sendall(head + b"\r\n\r\n" + body)
        except OSError:
            _close(client, upstream)

    def _answers(self, upstream: socket.socket, client: socket.socket, dropping: threading.Event) -> None:
        """Server -> client, byte for byte; once the server answers a dropped request, both
        connections close and the client never sees that answer."""
        try:
            while True:
                data = upstream.recv(65536)
                if not data or dropping.is_set():
                    return _close(client, upstream)  # (the server has answered: the request took effect)
                client.sendall(data)
        except OSError:
            _close(client, upstream)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
