"""The background saver: ``save_async``'s saves, one after another on a thread of their own, with
back-pressure and failures that are never lost."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from .errors import AsyncSaveError


class Background:
    """Runs saves one after another on a background thread, at most ``max_pending`` at once.

    A submit blocks while ``max_pending`` saves are unfinished (back-pressure). A failure is
    set on that save's future and kept until :meth:`raise_failure` reports it, so it is never
    silently lost.
    """

    def __init__(self, max_pending: int = 1) -> None:
        self._pool: ThreadPoolExecutor | None = None  # made at the first save, again after close
        self.max_pending = max_pending
        self._slots = threading.Semaphore(max_pending)
        self._pending: set[Future[Any]] = set()
        self._failure: tuple[int, BaseException] | None = None
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Wait for a free slot; call before taking the snapshot a save will own. Returns the
        seconds waited (0.0 when a slot was free)."""
        if self._slots.acquire(blocking=False):
            return 0.0
        t0 = time.perf_counter()
        self._slots.acquire()
        return time.perf_counter() - t0

    def release(self) -> None:
        self._slots.release()

    def submit(self, step: int, work: Any, cleanup: Any) -> Future[Any]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="amber-save")
            fut = self._pool.submit(work)
            self._pending.add(fut)

        def done(f: Future[Any]) -> None:
            cleanup()
            with self._lock:
                self._pending.discard(f)
                if f.exception() is not None and self._failure is None:
                    self._failure = (step, f.exception())  # type: ignore[assignment]
            self._slots.release()

        fut.add_done_callback(done)
        return fut

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            step, err = failure
            raise AsyncSaveError(f"the background save of step {step} failed: {err}", step=step) from err

    def wait(self) -> None:
        """Wait for every submitted save, then raise the first failure not yet reported."""
        with self._lock:
            pending = list(self._pending)
        wait(pending)
        self.raise_failure()

    def close(self) -> None:
        """Stop the thread once queued saves are done (their failures stay on their futures); a
        later submit starts another."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
