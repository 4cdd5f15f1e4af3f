"""Chunk geometry: grids, regions, runs and their checksums."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

import crc32c
import numpy as np


from .dtypes import bits_to_numpy, to_bits

if TYPE_CHECKING:
    import torch


def choose_chunks(shape: tuple[int, ...], item: int, target_bytes: int) -> tuple[int, ...]:
    """Chunk shape of about ``target_bytes``: trailing dims whole, leading dims split (to a
    multiple of 8 elements where that leaves a whole slab).

    Keeping trailing dimensions whole makes each chunk one contiguous run of the C-order
    tensor, so a slice of leading rows touches the fewest chunks. blosc bit-shuffles (full
    steps) only a block of a multiple of 8 elements and stores any other as is, which leaves
    float values about 1.14x larger (measured): the split dimension is rounded down to make the
    count a multiple of 8, where at least one slab remains (with fewer than 8 slabs of an odd
    size per chunk, the chunk stays as it is).
    """
    budget = max(1, target_bytes // item)
    chunks = [1] * len(shape)
    split = 0  # the dimension split (or, if none is, the leading one)
    for d in range(len(shape) - 1, -1, -1):
        n = max(1, shape[d])
        if n <= budget:
            chunks[d] = n
            budget //= n
        else:
            chunks[d], split = budget, d
            break
    if chunks and chunks[split] < shape[split]:
        step = 8 // math.gcd(8, math.prod(chunks[split + 1:]))
        chunks[split] = chunks[split] - chunks[split] % step or chunks[split]
    return tuple(chunks)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple


def chunk_grid(shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.ceil(s / c) for s, c in zip(shape, chunks))


def iter_chunk_indices(grid: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Chunk grid indices in C order (the order of a tensor entry's ``crc32c`` list)."""
    return iter(np.ndindex(*grid)) if grid else iter([()])


def chunk_slices(index: tuple[int, ...], shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunks, shape))


def region_chunks(
    region: tuple[slice, ...], shape: tuple[int, ...], chunks: tuple[int, ...]
) -> Iterator[tuple[int, tuple[int, ...], tuple[slice, ...]]]:
    """For each chunk of a chunk-aligned ``region``: its flat index in the tensor's chunk grid
    (C order), its grid index, and its slices relative to the region."""
    grid = chunk_grid(shape, chunks)
    first = tuple(r.start // c for r, c in zip(region, chunks))
    counts = tuple(-(-(r.stop - r.start) // c) for r, c in zip(region, chunks))
    for rel in iter_chunk_indices(counts):
        idx = tuple(f + r for f, r in zip(first, rel))
        flat = int(np.ravel_multi_index(idx, grid)) if grid else 0
        local = tuple(slice(s.start - r.start, s.stop - r.start) for s, r in zip(chunk_slices(idx, shape, chunks), region))
        yield flat, idx, local


def chunk_runs(shape: tuple[int, ...], chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """Flat C-order element range ``[start, stop)`` of each chunk, chunks in C order.

    Chunks of this format keep trailing dimensions whole and split one dimension (dimensions
    before it have chunk size 1), so every chunk is one contiguous run of the tensor.
    """
    if not shape:
        return [(0, 1)]
    split = max((d for d, (s, c) in enumerate(zip(shape, chunks)) if c != s), default=0)
    if any(c != 1 for c in chunks[:split]):
        raise ValueError(f"chunks {chunks} of shape {shape} are not contiguous runs")
    outer, n, c, inner = math.prod(shape[:split]), shape[split], chunks[split], math.prod(shape[split + 1:])
    runs = []
    for o in range(outer):
        for j in range(0, n, c):
            start = (o * n + j) * inner
            runs.append((start, start + min(c, n - j) * inner))
    return runs


def whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, s) for s in shape)


def region_crcs(
    data: np.ndarray, region: tuple[slice, ...], shape: tuple[int, ...], chunks: tuple[int, ...]
) -> Iterator[tuple[int, tuple[int, ...], int]]:
    """(flat index, grid index, crc32c) of each chunk of ``data``, the bits of a chunk-aligned
    ``region``: the checksum of a chunk is that of its in-bounds elements in C order."""
    for flat, idx, local in region_chunks(region, shape, chunks):
        yield flat, idx, crc32c.crc32c(np.ascontiguousarray(data[local]).data)


def tensor_crcs(t: torch.Tensor, chunks: list[int] | tuple[int, ...]) -> list[int]:
    """The per-chunk checksums a manifest lists for ``t`` stored with ``chunks``."""
    data = bits_to_numpy(to_bits(t.detach().cpu()))
    shape = tuple(t.shape)
    return [crc for _, _, crc in region_crcs(data, whole(shape), shape, tuple(chunks))]


