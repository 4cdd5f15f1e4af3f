"""A sharded tensor's shards, described once (format 10).

A tensor that DTensor or FSDP shards is split along each dimension the way ``torch.chunk``
splits (pieces of ``ceil(size / n)``, the last one shorter), over one or several mesh
dimensions; its shards are the cells of that grid. The index of a sharded step stores such a
tensor as its grid, one number per dimension (the piece length) or, where the pieces differ
otherwise, the list of their starts; the shards and their items are derived on read. A shard
list that is no grid is stored as it is (``shards``: each shard's offset and size).

Which fragment (the rank that wrote it) holds each shard's record is a row of the index's
``owners`` table, one entry per shard in grid order; tensors sharded alike share a row.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Any, Iterator, Sequence, Union

from .tree import escape_segment

#: One dimension of a grid: the piece length (``torch.chunk``'s split), or the pieces' starts.
Cuts = Union[int, list[int]]
Shard = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, size)


def item_key(fqn: str, offset: Sequence[int]) -> str:
    """The amber tensor key of the shard of DCP's flattened key ``fqn`` at ``offset``."""
    return f"{escape_segment(fqn)}/{'_'.join(map(str, offset)) or 'scalar'}"


def value_key(fqn: str) -> str:
    """The amber tensor key of a DCP value (pickled bytes) at ``fqn``."""
    return f"{escape_segment(fqn)}/bytes"  # (fragments.VALUE_SUFFIX)


def starts(size: int, cuts: Cuts) -> list[int]:
    """The pieces' starts along one dimension of ``size``."""
    if isinstance(cuts, int):
        return list(range(0, size, cuts)) or [0]
    return cuts


def describe(shape: Sequence[int], shards: Sequence[Shard]) -> tuple[list[Cuts], list[int]] | None:
    """The grid whose cells are exactly ``shards`` (in any order), and each shard's cell in
    grid (C) order; ``None`` if they make no grid."""
    ndim = len(shape)
    if ndim == 0:
        return ([], [0]) if len(shards) == 1 else None
    starts_of = [sorted({offset[d] for offset, _ in shards}) for d in range(ndim)]
    if math.prod(map(len, starts_of)) != len(shards):
        return None
    where = [{s: i for i, s in enumerate(ss)} for ss in starts_of]
    ends = [ss[1:] + [n] for ss, n in zip(starts_of, shape)]
    strides = [math.prod(len(ss) for ss in starts_of[d + 1:]) for d in range(ndim)]
    cells, seen = [], set()
    for offset, size in shards:
        cell = 0
        for d in range(ndim):
            i = where[d][offset[d]]
            if offset[d] + size[d] != ends[d][i]:
                return None
            cell += i * strides[d]
        if cell in seen:
            return None
        seen.add(cell)
        cells.append(cell)
    grid: list[Cuts] = []
    for ss, n in zip(starts_of, shape):
        step = ss[1] if len(ss) > 1 else n
        regular = step >= 1 and ss == list(range(0, n, step)) and len(ss) == -(-n // step)
        grid.append(step if regular else ss)
    return grid, cells


def cells(shape: Sequence[int], grid: Sequence[Cuts]) -> Iterator[Shard]:
    """The shards of a grid, in grid (C) order."""
    per_dim = []
    for n, cuts in zip(shape, grid):
        ss = starts(n, cuts)
        ends = ss[1:] + [n]
        per_dim.append([(s, e - s) for s, e in zip(ss, ends)])
    for cell in product(*per_dim):
        yield tuple(s for s, _ in cell), tuple(n for _, n in cell)


def cell(shape: Sequence[int], grid: Sequence[Cuts], position: int) -> Shard:
    """The shard at grid ``position`` (C order): its offset and size."""
    offset, size = [], []
    for n, cuts in reversed(list(zip(shape, grid))):
        if isinstance(cuts, int):
            count = max(1, -(-n // cuts))
            position, i = divmod(position, count)
            start, stop = i * cuts, min(n, (i + 1) * cuts)
        else:
            position, i = divmod(position, len(cuts))
            start, stop = cuts[i], cuts[i + 1] if i + 1 < len(cuts) else n
        offset.append(start)
        size.append(stop - start)
    return tuple(reversed(offset)), tuple(reversed(size))


def cell_of(shape: Sequence[int], grid: Sequence[Cuts], offset: Sequence[int]) -> int | None:
    """The grid position of the shard at ``offset`` (``None``: no shard starts there)."""
    if len(offset) != len(shape):
        return None
    cell = 0
    for n, cuts, o in zip(shape, grid, offset):
        if isinstance(cuts, int):
            i, r = divmod(o, cuts)
            count = max(1, -(-n // cuts))
            if r or not 0 <= i < count:
                return None
        else:
            count = len(cuts)
            i = _index(cuts, o)
            if i is None:
                return None
        cell = cell * count + i
    return cell


def _index(cuts: list[int], o: int) -> int | None:
    lo, hi = 0, len(cuts)
    while lo < hi:
        mid = (lo + hi) // 2
        if cuts[mid] < o:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(cuts) and cuts[lo] == o else None


def count(shape: Sequence[int], grid: Sequence[Cuts]) -> int:
    """How many shards a grid has (counted, not listed: a crafted grid may claim 10**12)."""
    return math.prod(max(1, -(-n // cuts)) if isinstance(cuts, int) else len(cuts) for n, cuts in zip(shape, grid))


def check(shape: Sequence[int], grid: Any) -> str | None:
    """What is wrong with ``grid`` as one of a tensor of ``shape`` (``None``: nothing)."""
    if not (isinstance(grid, list) and len(grid) == len(shape)):
        return f"grid {grid!r} does not have one entry per dimension of {list(shape)}"
    for n, cuts in zip(shape, grid):
        if type(cuts) is int:
            if cuts < 1:
                return f"piece length {cuts!r}"
        elif not (isinstance(cuts, list) and cuts and cuts[0] == 0 and all(type(c) is int for c in cuts)
                  and all(a < b for a, b in zip(cuts, cuts[1:])) and cuts[-1] <= n):
            return f"piece starts {cuts!r} do not split {n}"
    return None
