"""Lazy tensors and state dicts: read a tensor, or a slice of one, only when it is used.

A :class:`LazyTensor` knows its shape and dtype from the step's manifest. Indexing it reads the
chunk-aligned box around the selection, from every array along that tensor's delta chain, and
nothing else; :func:`materialize` reads a whole tree concurrently. A tensor that a sharded save
(torch.distributed.checkpoint) stored in pieces is one LazyTensor of its global shape, assembled
from the pieces a selection overlaps.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .errors import CorruptDataError
from .format import DTYPES, TensorEntry, bits_to_numpy, itemsize, round_up, to_bits
from .reader import ReadSession
from .runtime import gather, in_thread, shared_pool, sync

if TYPE_CHECKING:
    from .reader import Reader

_MAX_CONCURRENT_TENSORS = 16

Index = int | slice | type(Ellipsis) | tuple[Any, ...]


class LazyTensor:
    """A tensor of a committed step that is read from storage on demand.

    ``lt.shape``, ``lt.dtype`` cost nothing; ``lt[0:8]`` or ``lt[..., 3]`` reads only the chunks
    that selection touches; ``lt.materialize(device)`` reads it all.
    """

    def __init__(self, reader: Reader, step: int, key: str, entry: TensorEntry) -> None:
        self._reader = reader
        self.step = step
        self.key = key
        self._entry = entry
        self._shape = tuple(entry.shape)
        self._dtype = entry.dtype
        # a tensor stored in pieces: (offset of the piece in the tensor, the piece), else None
        self._pieces: list[tuple[tuple[int, ...], LazyTensor]] | None = None

    @classmethod
    def assembled(cls, key: str, shape: tuple[int, ...], dtype: str,
                  pieces: list[tuple[tuple[int, ...], LazyTensor]]) -> LazyTensor:
        """The tensor ``key`` of global ``shape`` whose pieces, each at its offset, tile it
        (a sharded save's shards); raises :class:`CorruptDataError` if they do not."""
        where = f"step {pieces[0][1].step}, tensor {key!r}" if pieces else f"tensor {key!r}"
        covered = 0
        for offset, piece in pieces:
            if piece._dtype != dtype or len(offset) != len(shape) or any(
                    o < 0 or o + n > size for o, n, size in zip(offset, piece._shape, shape)):
                raise CorruptDataError(f"{where}: shard {piece.key!r} ({piece._dtype}{list(piece._shape)} at "
                                       f"{list(offset)}) does not lie in the tensor ({dtype}{list(shape)})")
            covered += math.prod(piece._shape)
        if covered != math.prod(shape):  # DCP's planner saves non-overlapping shards
            raise CorruptDataError(f"{where}: its shards hold {covered} elements, the tensor {math.prod(shape)}")
        lt = cls.__new__(cls)
        lt._reader = pieces[0][1]._reader if pieces else None
        lt.step = pieces[0][1].step if pieces else -1
        lt.key = key
        lt._entry = None
        lt._shape = tuple(shape)
        lt._dtype = dtype
        lt._pieces = pieces
        return lt

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self._dtype]

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel() * itemsize(self._dtype)

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __repr__(self) -> str:
        shards = "" if self._pieces is None else f", shards={len(self._pieces)}"
        return f"LazyTensor(step={self.step}, key={self.key!r}, shape={tuple(self.shape)}, dtype={self.dtype}{shards})"

    def materialize(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor, bit-exact, on ``device`` (default CPU)."""
        return _to(sync(self._read(Ellipsis)), device)

    def __getitem__(self, index: Index) -> torch.Tensor:
        """Read a selection of ints, slices (positive step) and ``...``; returns a CPU tensor."""
        return sync(self._read(index))

    # Used as a tensor, it reads itself whole: `model.load_state_dict(store.load(step)["model"])`
    # (which calls `param.copy_(value)`), `torch.equal(lt, t)`, `lt + 1`, `lt.float()`.

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return func(*_real(args), **_real(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __deepcopy__(self, memo: dict[int, Any]) -> LazyTensor:
        return self  # a read-only handle; Optimizer.load_state_dict deep-copies what it is given

    def __add__(self, other: Any) -> torch.Tensor:
        return self.materialize() + _real(other)

    def __radd__(self, other: Any) -> torch.Tensor:
        return _real(other) + self.materialize()

    def __sub__(self, other: Any) -> torch.Tensor:
        return self.materialize() - _real(other)

    def __rsub__(self, other: Any) -> torch.Tensor:
        return _real(other) - self.materialize()

    def __mul__(self, other: Any) -> torch.Tensor:
        return self.materialize() * _real(other)

    def __rmul__(self, other: Any) -> torch.Tensor:
        return _real(other) * self.materialize()

    def __truediv__(self, other: Any) -> torch.Tensor:
        return self.materialize() / _real(other)

    def __neg__(self) -> torch.Tensor:
        return -self.materialize()

    async def _read(self, index: Index, session: ReadSession | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The selection; ``out``: a tensor that :meth:`fits` the whole tensor, filled instead."""
        if self._pieces is not None:
            return await self._assemble(index, session)
        region, local = _plan(index, self._shape, tuple(self._entry.chunks))
        if region is None:
            return self._empty(local)
        # decoded straight into the tensor returned (torch's memory: see format.host_empty)
        if out is None:
            out = torch.empty([r.stop - r.start for r in region], dtype=DTYPES[self._dtype])
        await self._reader.read(self.step, self.key, region, session=session, out=bits_to_numpy(to_bits(out.detach())))
        return out[local]

    def fits(self, t: torch.Tensor) -> bool:
        """Whether the whole tensor can be decoded straight into ``t``'s memory: a plain CPU
        tensor (or parameter) of its shape and dtype, contiguous."""
        return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and self._pieces is None
                and tuple(t.shape) == self._shape and t.dtype == DTYPES[self._dtype] and t.is_contiguous())

    async def _assemble(self, index: Index, session: ReadSession | None) -> torch.Tensor:
        """Read the selection from the pieces it overlaps, each only over the overlap."""
        pieces = self._pieces
        assert pieces is not None
        if len(pieces) == 1 and pieces[0][1]._shape == self._shape:
            return await pieces[0][1]._read(index, session)
        box, local = _plan(index, self._shape, (1,) * len(self._shape))  # the selection's bounding box
        if box is None:
            return self._empty(local)
        overlaps = []
        for offset, piece in pieces:
            inner = tuple(slice(max(b.start, o) - o, min(b.stop, o + n) - o)
                          for b, o, n in zip(box, offset, piece._shape))
            if all(s.stop > s.start for s in inner):
                overlaps.append((offset, piece, inner))
        parts = await gather(piece._read(inner, session) for _, piece, inner in overlaps)
        out = torch.empty([b.stop - b.start for b in box], dtype=self.dtype)
        for (offset, _, inner), part in zip(overlaps, parts):
            out[tuple(slice(o + s.start - b.start, o + s.stop - b.start) for o, s, b in zip(offset, inner, box))] = part
        return out[local]

    def _empty(self, local: tuple[Any, ...]) -> torch.Tensor:
        shape = torch.empty(self.shape, dtype=self.dtype, device="meta")[local].shape
        return torch.empty(shape, dtype=self.dtype)


def _real(obj: Any) -> Any:
    """``obj`` with every LazyTensor in it (in lists, tuples, dicts) read."""
    if isinstance(obj, LazyTensor):
        return obj.materialize()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_real(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _real(v) for k, v in obj.items()}
    return obj


def _plan(index: Index, shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[tuple[slice, ...] | None, tuple[Any, ...]]:
    """Chunk-aligned region covering ``index`` and the index into that region.

    Region ``None`` means the selection is empty: nothing needs reading.
    """
    items = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    for i in items:
        if not (i is Ellipsis or isinstance(i, slice) or (isinstance(i, int) and not isinstance(i, bool))):
            raise TypeError(
                f"LazyTensor supports int, slice and ... indices, not {type(i).__name__}; "
                "call .materialize() and index the tensor"
            )
    n_dims = sum(i is not Ellipsis for i in items)
    if n_dims > len(shape):
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - n_dims) + items[at + 1:]
    items = items + (slice(None),) * (len(shape) - len(items))

    region: list[slice] = []
    local: list[Any] = []
    empty = any(n == 0 for n in shape)
    for i, n, c in zip(items, shape, chunks):
        if isinstance(i, int):
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension with size {n}")
            i %= n
            lo, hi = i, i + 1
        else:
            start, stop, step = i.indices(n)
            if step <= 0:
                raise ValueError("step must be greater than zero")
            if stop <= start:
                empty = True
                lo, hi = 0, 0
            else:
                lo, hi = start, start + (stop - start - 1) // step * step + 1
        r = slice(lo // c * c, min(round_up(hi, c), n))
        region.append(r)
        local.append(i - r.start if isinstance(i, int) else slice(lo - r.start, hi - r.start, i.indices(n)[2]))
    if empty:
        return None, tuple(items)
    return tuple(region), tuple(local)


def _to(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return t if device is None else t.to(device)


def _transfer_thread() -> ThreadPoolExecutor:
    """One thread for copies to accelerators (they queue on one link; torch releases the GIL)."""
    return shared_pool("amber-transfer", 1)


class LazyStateDict(Mapping[Any, Any]):
    """A read-only mapping mirroring one saved dict; leaves are :class:`LazyTensor` or values."""

    def __init__(self, items: dict[Any, Any]) -> None:
        self._items = items

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def _metadata(self) -> Any:
        """The saved ``OrderedDict``'s module versions, which ``load_state_dict`` consults."""
        return getattr(self._items, "_metadata", None)

    def __repr__(self) -> str:
        return f"LazyStateDict({list(self._items)!r})"

    def copy(self) -> dict[Any, Any]:
        """A plain, mutable copy with every tensor below read (concurrently): code that copies a
        state dict before consuming all of it, as ``Optimizer.load_state_dict`` does, gets
        real tensors. Same as :meth:`materialize`."""
        return self.materialize()

    def materialize(self, device: torch.device | str | None = None) -> dict[Any, Any]:
        """Read every tensor below this mapping (concurrently) into plain dicts of tensors."""
        return materialize(self, device)


@dataclass
class Destinations:
    """Where :func:`materialize` puts each tensor of a load ``into=`` a state tree
    (:func:`destinations`), and where the two trees do not match."""

    #: the LazyTensor's id -> the tensors of ``into`` at its place
    tensors: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    #: places of ``into`` holding a tensor where the step has none
    missing: list[str] = field(default_factory=list)
    #: places of the step holding a tensor, under a part of the state ``into`` names, where
    #: ``into`` has none
    unexpected: list[str] = field(default_factory=list)


def destinations(obj: Any, into: Any) -> Destinations:
    """The tensors of ``into``, a state tree of the loaded one's form (``model.state_dict()``, a
    dict of them), that :func:`materialize` fills in place, by the id of the LazyTensor at the
    same place in ``obj``: a CPU tensor that :meth:`LazyTensor.fits` is decoded into, any other
    copied into (on its device); and the places where the trees differ (``missing``,
    ``unexpected``: places that ``into`` lacks are read into new tensors). Raises ValueError,
    before anything is read, for a tensor of another shape or dtype. A read that fails midway
    leaves its destination partly written."""
    out = Destinations()

    def at(path: str, k: Any) -> str:
        return f"{path}.{k}" if path else str(k)

    def walk(o: Any, i: Any, path: str) -> None:
        if isinstance(o, LazyTensor):
            if isinstance(i, torch.Tensor):
                if tuple(i.shape) != o._shape or i.dtype != o.dtype:
                    raise ValueError(f"into[{path}] is {i.dtype} {tuple(i.shape)}; step {o.step} holds "
                                     f"{o.dtype} {o._shape} there")
                out.tensors.setdefault(id(o), []).append(i)
            else:
                out.unexpected.append(path)
        elif isinstance(i, torch.Tensor):
            out.missing.append(path)
        elif isinstance(o, (LazyStateDict, dict)) and isinstance(i, Mapping):
            # (the top level's other parts are not asked for: {"model": ...} loads the model; a
            # top level of tensors, a bare model.state_dict(), is a part like any other)
            named = bool(path) or any(isinstance(w, torch.Tensor) for w in i.values())
            for k, v in o.items():
                if k in i:
                    walk(v, i[k], at(path, k))
                elif named:
                    out.unexpected += [at(path, k) + p for p in _tensor_places(v)]
            for k, w in i.items():
                if k not in o:
                    out.missing += [at(path, k) + p for p in _tensor_places(w)]
        elif type(o) in (list, tuple) and isinstance(i, (list, tuple)):
            for n, (v, w) in enumerate(zip(o, i)):
                walk(v, w, f"{path}[{n}]")
            out.unexpected += [f"{path}[{n}]" + p for n in range(len(i), len(o)) for p in _tensor_places(o[n])]
            out.missing += [f"{path}[{n}]" + p for n in range(len(o), len(i)) for p in _tensor_places(i[n])]

    if into is not None:
        walk(obj, into, "")
    return out


def _tensor_places(obj: Any) -> list[str]:
    """The places of tensors (lazy or not) below ``obj``, relative to it ('' for ``obj`` itself)."""
    if isinstance(obj, (LazyTensor, torch.Tensor)):
        return [""]
    if isinstance(obj, (LazyStateDict, Mapping)):
        return [f".{k}{p}" for k, v in obj.items() for p in _tensor_places(v)]
    if type(obj) in (list, tuple):
        return [f"[{n}]{p}" for n, v in enumerate(obj) for p in _tensor_places(v)]
    return []


def _copy_into(tos: list[torch.Tensor], t: torch.Tensor) -> None:
    with torch.no_grad():
        for to in tos:
            to.copy_(t)


# The containers a state tree rebuilds (exact types: a torch.Size is a tuple but holds no tensors).
_SEQUENCES = (list, tuple, set, frozenset)


def _lazy_leaves(obj: Any) -> Iterator[LazyTensor]:
    if isinstance(obj, LazyTensor):
        yield obj
    elif isinstance(obj, (LazyStateDict, dict)):
        for v in obj.values():
            yield from _lazy_leaves(v)
    elif type(obj) in _SEQUENCES:
        for v in obj:
            yield from _lazy_leaves(v)


def materialize(obj: Any, device: torch.device | str | None = None, *, damaged: dict[str, str] | None = None,
                into: Destinations | None = None) -> Any:
    """Replace every :class:`LazyTensor` in a tree by its tensor; containers become plain.

    ``damaged``: if given, a tensor whose stored data is damaged (:class:`CorruptDataError`)
    is left out (its dict key dropped, its list or tuple item ``None``) and recorded here, key
    -> error, instead of failing the whole read. ``into``: the tensors to fill in place
    (:func:`destinations`)."""
    leaves = list({id(lt): lt for lt in _lazy_leaves(obj)}.values())  # tied weights: read once
    dest = {} if into is None else into.tensors

    target = None if device is None else torch.device(device)
    # An accelerator's copies run on a thread of their own, each as soon as its tensor is decoded:
    # the link's transfers overlap the decoding of the rest instead of following all of it.
    moving = target is not None and target.type != "cpu"

    async def read_all() -> list[torch.Tensor | None]:
        sem = asyncio.Semaphore(_MAX_CONCURRENT_TENSORS)
        session = ReadSession()

        async def one(lt: LazyTensor) -> torch.Tensor | None:
            tos = dest.get(id(lt), [])
            fit = next((to for to in tos if lt.fits(to)), None)
            async with sem:
                try:
                    t = await lt._read(Ellipsis, session, fit)
                except CorruptDataError as e:
                    if damaged is None:
                        raise
                    damaged[lt.key] = str(e)
                    return None
            rest = [to for to in tos if to is not fit]  # (on another device, strided, or tied)
            if rest:
                await in_thread(_transfer_thread(), _copy_into, rest, t)
            if tos:
                return tos[0]
            if moving:
                t = await in_thread(_transfer_thread(), t.to, target)
            return t

        return await gather(one(lt) for lt in leaves)

    values = {id(lt): t for lt, t in zip(leaves, sync(read_all()))}  # (reads land on the CPU)

    def rebuild(o: Any) -> Any:
        if isinstance(o, LazyTensor):
            return values[id(o)]
        if isinstance(o, (LazyStateDict, dict)):
            # copy.copy keeps the saved mapping type and an OrderedDict's _metadata
            out = copy.copy(o._items if isinstance(o, LazyStateDict) else o)
            for k in list(out):
                if isinstance(out[k], LazyTensor) and values[id(out[k])] is None:
                    del out[k]  # damaged, left out
                else:
                    out[k] = rebuild(out[k])
            return out
        if type(o) in _SEQUENCES:
            return type(o)(rebuild(v) for v in o)
        return o

    return rebuild(obj)
