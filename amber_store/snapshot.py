"""Snapshots for background saves: consistent copies of a state's tensors in reused buffers, so
``save_async`` returns while training goes on updating the originals."""

from __future__ import annotations

import contextlib
import gc
import itertools
import operator
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import torch

from .runtime import shared_pool

T = TypeVar("T")


class Snapshots:
    """Consistent copies of a state's tensors in reusable buffers, so an async save can return
    while training goes on updating the originals.

    ``where="host"`` (default) copies to host memory (pinned for accelerator tensors): the
    smallest stall and no extra device memory; deltas are then encoded on the host.
    ``where="device"`` copies on the tensor's own device, so deltas are encoded there and only
    encoded bytes cross to the host, at the price of one more copy of the state in device
    memory.
    """

    def __init__(self, where: str = "host") -> None:
        self.where = where
        self._free: list[_Buffers] = []
        self._lent: dict[int, _Buffers] = {}
        self._lock = threading.Lock()

    def take(self, collect: Callable[[], tuple[T, dict[str, torch.Tensor]]]) -> tuple[T, dict[str, torch.Tensor]]:
        """Run ``collect`` (the walk of a state: anything, and its ``{key: tensor}``) and copy
        those tensors into buffers of a previous snapshot when the state's layout (keys,
        shapes, dtypes, devices) is unchanged, else into new ones; returns what ``collect``
        returned first and the copies, lent until :meth:`give_back`.

        While a helper thread runs ``collect``, this one copies again the CPU tensors that the
        buffers last received: a training loop hands over the same tensor objects at every
        save (an optimizer's state; not ``model.state_dict()``, which makes new detached ones
        each call), so the walk (Python) and the copy (memory) overlap, and the helper copies
        the rest of them from the other end once it has walked (:class:`_SharedCopy`). Each
        guess is checked afterwards (the same object at the same place of an unchanged
        layout), and the rest copied then; when most guesses were wrong, these buffers stop
        guessing. A store's walk keeps a :class:`~amber_store.format.FlattenMemo`, which makes
        it a few whole-list checks per dict of tensors. Measured for 2,000 tensors of 25 KB
        (alternately, medians): 0.8-0.9x the time of a bare copy loop, the walk included;
        1.0-1.1x right after a parallel torch op (its OpenMP worker spins on the other core for
        a few ms); for the 8,000 tiny tensors of a 2,000-parameter model and its AdamW state,
        1.6-1.9x (per-tensor Python work: the walk's checks, ~1 us a tensor, and a copy's
        dispatch, ~1.5 us)."""
        with _gc_paused():
            return self._take(collect)

    def _take(self, collect: Callable[[], tuple[T, dict[str, torch.Tensor]]]) -> tuple[T, dict[str, torch.Tensor]]:
        with self._lock:
            buffers = self._free.pop() if self._free else None
        guesses = buffers.guesses() if buffers is not None else None
        try:
            if guesses is None:
                extra, keys, values, layout = _walk(collect)
            else:
                # This thread copies, a helper walks and then copies too, from the other end:
                # the thread that called is the one surely running (after a parallel torch op,
                # an OpenMP worker spins on another core for ~9 ms, slowing a helper there)
                at, guess, targets = guesses
                shared = _SharedCopy(targets, guess, buffers.pace)
                walking = _copiers().submit(shared.walk_then_copy, collect)
                try:
                    shared.front()
                finally:
                    wait([walking])  # it copies into these buffers too: never free them while it runs
                extra, keys, values, layout = walking.result()
                copied = not shared.failed
                buffers.pace = shared.pace()
        except BaseException:
            if buffers is not None:
                with self._lock:
                    self._free.append(buffers)
            raise
        same = buffers is not None and buffers.keys == keys and buffers.layout == layout
        if guesses is not None and same and copied:
            if len(guess) == len(values) and all(map(operator.is_, guess, values)):
                return extra, self._lend(buffers, values, guessed=True)  # the usual case: all guessed
            # (whole-list operations: a Python loop over thousands of tensors would stall as long)
            done = set(itertools.compress(at, map(operator.is_, guess, map(values.__getitem__, at))))
            rest = list(itertools.filterfalse(done.__contains__, range(len(values))))
            buffers.speculate = len(done) >= len(rest)  # else the bookkeeping costs more than it saves
            for helper in _copy_in_parallel([buffers.ordered[i] for i in rest], [values[i] for i in rest]):
                helper.result()
            return extra, self._lend(buffers, values)
        if not same:
            buffers = self._buffers(keys, values, layout, buffers.out if buffers is not None else {})
        # Batched calls: per-tensor dispatch dominated the copy of small tensors. Copies from an
        # accelerator are asynchronous (non_blocking), hence the synchronize below.
        with torch.no_grad():
            helpers = _copy_in_parallel(buffers.small, [values[i] for i in buffers.small_at])
            if buffers.rest:
                torch._foreach_copy_(buffers.rest, [values[i] for i in buffers.rest_at], non_blocking=True)
        for helper in helpers:
            helper.result()
        for device in buffers.accelerators:
            getattr(torch, device.type).synchronize(device)  # the copies above were asynchronous
        return extra, self._lend(buffers, values)

    def _lend(self, buffers: _Buffers, values: list[torch.Tensor], guessed: bool = False) -> dict[str, torch.Tensor]:
        # Weak references: a state dropped by training must not be kept alive by its snapshot.
        # When every guess was right, the references held are to these very tensors already.
        if not guessed:
            buffers.sources = list(map(weakref.ref, values)) if buffers.speculate and not buffers.accelerators else None
        with self._lock:
            self._lent[id(buffers.out)] = buffers
        return buffers.out

    def give_back(self, snapshot: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._free.append(self._lent.pop(id(snapshot)))

    def clear(self) -> None:
        """Let the buffers not lent go (their memory returns once nothing else holds them)."""
        with self._lock:
            self._free.clear()

    def _buffers(self, keys: list[str], values: list[torch.Tensor], layout: tuple[list, list, list],
                 old: dict[str, torch.Tensor]) -> _Buffers:
        """Buffers for a new layout, reusing those of ``old`` whose tensor kept its shape, dtype
        and device."""
        on_device = self.where == "device"
        new = _Buffers(keys, layout, {})
        for i, (key, t) in enumerate(zip(keys, values)):
            device = t.device if t.is_cpu or on_device else torch.device("cpu")
            buf = old.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != device:
                buf = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=not (t.is_cpu or on_device))
            new.out[key] = buf
            new.ordered.append(buf)
            if not t.is_cpu:
                new.accelerators.add(t.device)
            # torch copies a tensor below its grain on one thread: those go to helper threads
            small = t.is_cpu and t.numel() < _COPY_GRAIN
            (new.small if small else new.rest).append(buf)
            (new.small_at if small else new.rest_at).append(i)
        return new


@dataclass(eq=False)
class _Buffers:
    """Snapshot buffers for one layout of a state, and how its tensors are copied into them."""

    keys: list[str]
    layout: tuple[list, list, list]  # shapes, dtypes and devices of the tensors, in key order
    out: dict[str, torch.Tensor]
    ordered: list[torch.Tensor] = field(default_factory=list)  # out's values, in key order
    small: list[torch.Tensor] = field(default_factory=list)  # buffers copied on helper threads
    small_at: list[int] = field(default_factory=list)  # their tensors' positions
    rest: list[torch.Tensor] = field(default_factory=list)
    rest_at: list[int] = field(default_factory=list)
    accelerators: set[torch.device] = field(default_factory=set)
    sources: list[weakref.ref[torch.Tensor]] | None = None  # the CPU tensors copied in last
    speculate: bool = True  # whether to copy them ahead: most were the same objects last time
    pace: tuple[float, float] | None = None  # the last walk's seconds, and the copy's per guessed tensor

    def guesses(self) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]] | None:
        """The tensors copied in last that are still alive: their places, them, and their
        buffers; None if there are none."""
        guess = list(map(weakref.ref.__call__, self.sources or ()))
        alive = list(map(operator.is_not, guess, itertools.repeat(None)))
        if not all(alive):  # a state of new tensors and kept ones (model.state_dict() and an optimizer's)
            at = list(itertools.compress(range(len(guess)), alive))
            return (at, list(itertools.compress(guess, alive)), list(itertools.compress(self.ordered, alive))) if at else None
        return (list(range(len(guess))), guess, self.ordered) if guess else None


def _walk(collect: Callable[[], tuple[T, dict[str, torch.Tensor]]]) -> tuple[T, list[str], list[torch.Tensor],
                                                                             tuple[list, list, list]]:
    """Run ``collect``; returns what it returned first, the keys and tensors it found and their
    layout. Per-tensor Python work is most of the stall for many small tensors: the layout is
    compared as whole lists, and the per-tensor loop runs only when it changed."""
    extra, tensors = collect()
    keys, values = list(tensors), list(tensors.values())
    return extra, keys, values, ([t.shape for t in values], [t.dtype for t in values], [t.device for t in values])


class _SharedCopy:
    """Copies of ``tensors`` into ``buffers`` by two threads: the calling one from the front, a
    helper from the back once its walk is done, in parts, until they meet.

    The calling thread's first part is as much as it can copy while the other walks and then
    half of the rest, by the last snapshot's pace (``(walk s, copy s per tensor)``; without
    one, all). Parts are copied with the GIL released, and a thread asks for it back only
    between parts: one that asked while the other walks would wait out the interpreter's
    switch interval (5 ms), hence few parts, the first one long.
    """

    def __init__(self, buffers: list[torch.Tensor], tensors: list[torch.Tensor],
                 pace: tuple[float, float] | None) -> None:
        self.buffers, self.tensors = buffers, tensors
        n = len(tensors)
        self.first = n if pace is None else min(n, int((n + pace[0] / max(pace[1], 1e-9)) / 2) + 1)
        self.part = max(_COPY_BATCH, n // 8)
        self.lo, self.hi = 0, n
        self.failed = False  # a tensor that no longer fits its buffer: the walk tells the rest
        self._walk_s: float | None = None
        self._each: float | None = None  # seconds per tensor of the first part
        self._lock = threading.Lock()

    def walk_then_copy(self, collect: Callable[[], tuple[T, dict[str, torch.Tensor]]]
                       ) -> tuple[T, list[str], list[torch.Tensor], tuple[list, list, list]]:
        """The helper's part: :func:`_walk`, timed, then copies from the back."""
        start = time.perf_counter()
        walked = _walk(collect)
        self._walk_s = time.perf_counter() - start
        self.back()
        return walked

    def pace(self) -> tuple[float, float] | None:
        """This time's pace, once both threads are done."""
        return None if self._walk_s is None or self._each is None else (self._walk_s, self._each)

    def _copy(self, lo: int, hi: int) -> None:
        try:
            _copy(self.buffers[lo:hi], self.tensors[lo:hi])
        except RuntimeError:
            self.failed = True

    def front(self) -> None:
        size = self.first
        while True:
            with self._lock:
                lo = self.lo
                self.lo = hi = min(self.hi, lo + size)
            if lo >= hi:
                return
            start = time.perf_counter()
            self._copy(lo, hi)
            if self._each is None:
                self._each = (time.perf_counter() - start) / (hi - lo)
            size = self.part

    def back(self) -> None:
        while True:
            with self._lock:
                hi = self.hi
                self.hi = lo = max(self.lo, hi - self.part)
            if lo >= hi:
                return
            self._copy(lo, hi)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the few ms of a snapshot: its walk and
    bookkeeping make thousands of small containers, and the collections they trigger traverse
    every object the training process holds (measured with ~300K tracked objects: 11-25% of
    the walk). What they leave is collected at the next allocations after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_COPY_GRAIN = 32768  # torch's intra-op grain (elements): smaller copies run on one thread
_COPY_BATCH = 64  # below this many small tensors, a helper thread costs more than it saves


def _copy_in_parallel(buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[Future[None]]:
    """Start copying CPU ``tensors`` into ``buffers`` in one part per intra-op thread, on helper
    threads of their own (not the codec pool, which a previous save may keep busy); returns
    their futures. Measured on 2 cores: 2,000 tensors of 25 KB copy in ~0.7x the time of one
    batched call. The parts are sliced here, not on the helpers: a helper waiting for the GIL
    while this thread runs Python would wait out the interpreter's switch interval (5 ms)."""
    parts = min(torch.get_num_threads(), len(tensors) // _COPY_BATCH)
    if parts < 2:
        if tensors:
            _copy(buffers, tensors)
        return []
    sizes = [t.numel() for t in tensors]
    total, bounds, acc = sum(sizes), [0], 0
    for i, n in enumerate(sizes):
        acc += n
        if acc * parts >= total * len(bounds) and len(bounds) < parts:
            bounds.append(i + 1)
    bounds.append(len(tensors))
    slices = [(buffers[lo:hi], tensors[lo:hi]) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    return [_copiers().submit(_copy, *part) for part in slices]


def _copiers() -> ThreadPoolExecutor:
    """The snapshot copies' own threads (not the codec pool, which a previous save may keep busy)."""
    return shared_pool("amber-snapshot", max(2, torch.get_num_threads()))


def _copy(buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():  # grad mode is per thread; parameters must not be recorded
        torch._foreach_copy_(buffers, tensors)
