"""Where work runs: the process's event loop (every storage call, on a thread of its own), its
thread pools (codecs, step writers, snapshot copies, host transfers), and waits on them that
stay interruptible.

The loop and the pools are made at first use and shared by every store of the process: their
sizes are facts of the machine, not of one store. The loop is amber-store's own, not zarr's
(``zarr.core.sync``), so that a load imports no zarr (~0.12 s of a fresh process's resume); zarr's
async API runs on it like any other coroutine.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any, Iterable, TypeVar

T = TypeVar("T")

#: threads of :func:`codec_pool`: one per core
CODEC_THREADS = os.cpu_count() or 2
#: concurrent saves whose writers run at once (:func:`writer_pool`)
WRITER_THREADS = 32
_CODEC_POOL = "amber-codec"
_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


_LOOP: list[asyncio.AbstractEventLoop] = []
_LOOP_THREAD: list[threading.Thread] = []
_LOOP_LOCK = threading.Lock()
#: how long the exit waits for the loop to stop
STOP_SECONDS = 0.2


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop (a daemon thread of its own), on which every storage call runs."""
    if not _LOOP:
        with _LOOP_LOCK:
            if not _LOOP:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="amber-io", daemon=True)
                thread.start()
                _LOOP.append(loop)
                _LOOP_THREAD.append(thread)
    return _LOOP[0]


@atexit.register
def _stop_loop() -> None:
    """Stop the loop before the interpreter finalizes, as zarr stopped its own (which ran every
    storage call before): no client's thread (obstore's runtime, aiohttp's callbacks) then hands
    a result to a loop that still runs while Python goes away. Registered first, so it runs after
    the backends' exit hooks, which close their clients on this loop."""
    if _LOOP and _LOOP[0].is_running():
        _LOOP[0].call_soon_threadsafe(_LOOP[0].stop)
        _LOOP_THREAD[0].join(STOP_SECONDS)


def _forget_after_fork() -> None:
    # (a forked child has the parent's loop object but not its thread: it makes its own, and its
    # own pools, whose threads did not survive the fork either)
    _LOOP.clear()
    _LOOP_THREAD.clear()
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on :func:`event_loop` and wait for its result (the sync face of the async
    core: :class:`~amber_store.store.Store`, the DCP adapters, the CLI)."""
    loop = event_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError("sync() called on amber-store's event loop itself: await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


#: how long an interrupted call waits for its own cleanup (a save deleting its attempt), and
#: how much longer once interrupted again
CLEANUP_SECONDS = 30.0
IMPATIENT_SECONDS = 2.0


def interruptible(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the event loop and wait for it, like :func:`sync`, but cancel it
    when the wait is interrupted (KeyboardInterrupt) and let it clean up before the interrupt
    goes on: a save interrupted before its commit began is never committed behind the caller's
    back, and its data is gone (one interrupted during its commit, milliseconds, is committed).
    The first interrupt is raised, alone (see :func:`_await_cleanup`).

    An interrupt may land anywhere in this function, the hand-over to the loop included: the
    task is made and cancelled by callbacks on the loop, which run in the order they were
    handed over, so a cancel always finds the task made or knows it never will be."""
    loop = event_loop()
    outcome: Future[T] = Future()
    finished = threading.Event()
    task: list[asyncio.Task[T]] = []

    def start() -> None:
        t = loop.create_task(coro)
        task.append(t)
        t.add_done_callback(lambda t: (_settle(outcome, t), finished.set()))

    def cancel() -> None:
        if task:
            task[0].cancel()
        else:  # start() was never handed over: the coroutine never runs
            outcome.cancel()
            coro.close()
            finished.set()

    try:
        loop.call_soon_threadsafe(start)
        return outcome.result()
    except BaseException:
        _hand_over(loop, cancel)
        _await_cleanup(finished, task)
        raise


def _hand_over(loop: asyncio.AbstractEventLoop, cancel: Any) -> None:
    """Hand ``cancel`` over to the loop, again if another interrupt lands meanwhile (a cancel
    that runs twice does nothing more), so that it never escapes before the cleanup wait."""
    while True:
        try:
            loop.call_soon_threadsafe(cancel)
            return
        except KeyboardInterrupt:
            continue


def _settle(outcome: Future[T], task: asyncio.Task[T]) -> None:
    if task.cancelled():
        outcome.cancel()
    elif task.exception() is not None:
        outcome.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        outcome.set_result(task.result())


def _await_cleanup(finished: threading.Event, task: list[asyncio.Task[Any]]) -> None:
    """Wait for a cancelled call's cleanup, at most CLEANUP_SECONDS; more interrupts meanwhile
    cut the wait to IMPATIENT_SECONDS (a cleanup takes milliseconds when the storage answers),
    never into a second traceback."""
    deadline = time.monotonic() + CLEANUP_SECONDS
    while not finished.is_set() and time.monotonic() < deadline:
        try:
            finished.wait(deadline - time.monotonic())
        except KeyboardInterrupt:
            deadline = min(deadline, time.monotonic() + IMPATIENT_SECONDS)
    if not finished.is_set():
        # Given up on: it goes on while the process lives; were the process to exit first,
        # asyncio would print "Task was destroyed but it is pending" at exit.
        for t in task:
            t._log_destroy_pending = False  # type: ignore[attr-defined]


async def finish(aw: Awaitable[T], within: float | None = None, stop: Callable[[], Any] | None = None) -> T:
    """Await ``aw`` to its end even if the caller is cancelled meanwhile (for at most ``within``
    seconds more; ``stop``, called first, may end it sooner), then let the cancellation go on:
    for work that must not outlive its caller's cleanup (a thread's write, which nothing stops,
    landing after an interrupted save deleted its attempt) or whose outcome must be learnt (a
    commit)."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if stop is not None:
            stop()
        loop = asyncio.get_running_loop()
        end = None if within is None else loop.time() + within
        while not task.done() and (end is None or loop.time() < end):  # (cancelled again meanwhile: still wait)
            with suppress(asyncio.CancelledError):
                await asyncio.wait([task], timeout=None if end is None else end - loop.time())
        task.add_done_callback(_retrieved)  # (one given up on may fail later, unheard)
        raise


async def in_thread(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``pool``. Cancelled (a sibling read failed), a call not yet started never
    runs and a running one is waited for: no thread goes on writing into buffers once the call
    that failed has returned (a caller's tensors, which it may load again at once, or a mapped
    file's pages)."""
    job = pool.submit(fn, *args)
    return await finish(asyncio.wrap_future(job), stop=job.cancel)  # (a running call refuses to be cancelled)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


#: metadata requests (manifests, claims, deletes) a bookkeeping pass keeps in flight at once
REQUESTS_AT_ONCE = 32


async def gather(aws: Iterable[Any], limit: int | None = None) -> list[Any]:
    """Await all, in order, at most ``limit`` at once (``None``: all); on the first failure
    cancel the rest and wait for them, then raise it, so no read (or delete) outlives the call
    that failed, nor reports to a closed loop at exit."""
    if limit is not None:
        sem = asyncio.Semaphore(limit)

        async def bounded(a: Awaitable[Any]) -> Any:
            async with sem:
                return await a

        aws = [bounded(a) for a in aws]
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


#: bytes of values a thread off the loop has read ahead of the one it works on (:func:`ahead`)
READ_AHEAD_BYTES = 256 << 20

K = TypeVar("K")


class Budget:
    """Bytes that coroutines hold at once inside :meth:`hold`: at most ``nbytes``, or one holder
    alone of any size (a tensor larger than the budget still gets read)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = self.free = nbytes
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= nbytes or self.free == self.nbytes)
            self.free -= nbytes
        try:
            yield
        finally:
            async with self._changed:
                self.free += nbytes
                self._changed.notify_all()


def ahead(keys: Iterable[K], read: Callable[[K], Coroutine[Any, Any, T]], nbytes: Callable[[K], int],
          budget: int = READ_AHEAD_BYTES) -> Iterator[tuple[K, T]]:
    """``(key, await read(key))`` for each of ``keys`` in order, to a thread off the event loop,
    which works on one while the reads of the next run: as many as ``budget`` bytes and
    :data:`REQUESTS_AT_ONCE` allow, at least one. On an object store each read is a round trip,
    which one after another added up to most of retention's folds. Reads still in flight when
    the caller stops are cancelled."""
    loop = event_loop()
    todo = iter(keys)
    pending: deque[tuple[K, int, Future[T]]] = deque()
    held = 0
    following = next(todo, _END)
    try:
        while True:
            while following is not _END and len(pending) < REQUESTS_AT_ONCE and (
                    not pending or held + nbytes(following) <= budget):
                size = nbytes(following)
                pending.append((following, size, asyncio.run_coroutine_threadsafe(read(following), loop)))
                held += size
                following = next(todo, _END)
            if not pending:
                return
            key, size, future = pending.popleft()
            value = future.result()
            held -= size
            yield key, value
    finally:
        for *_, future in pending:
            future.cancel()


_END: Any = object()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's one pool of threads named ``name``, made at first use with ``workers``
    threads and shared by every store."""
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        return pool


def codec_pool() -> ThreadPoolExecutor:
    """The threads that diff, checksum, compress and decompress chunks (all release the GIL),
    one per core."""
    return shared_pool(_CODEC_POOL, CODEC_THREADS)


def on_codec_thread() -> bool:
    """Whether the caller is one of :func:`codec_pool`'s threads (which must not wait on it)."""
    return threading.current_thread().name.startswith(_CODEC_POOL)


def writer_pool() -> ThreadPoolExecutor:
    """Threads that run a save's step writer. A writer waits on the event loop for its writes,
    and a local write runs on the loop's default executor: were writers drawn from that
    executor too, as many concurrent saves as its threads (6 on 2 cores) would wait forever
    for writes that have no thread left to run on. Past this pool's size, saves queue."""
    return shared_pool("amber-writer", WRITER_THREADS)


def return_free_memory() -> None:
    """Hand the C heap's free memory back to the kernel (glibc's ``malloc_trim``): buffers
    freed in pieces of a few MiB (snapshots, decoded tensors) are otherwise kept by glibc for
    reuse, and the process's RSS would not fall when they go. A no-op elsewhere."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None
