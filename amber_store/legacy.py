"""Reading steps of format versions 1 and 2: one zarr array, with its own zarr.json, per tensor.

Kept so that every store ever written stays readable (docs/FORMAT.md); nothing writes this
layout any more. A chain of such steps is walked array by array through zarr-python.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.core.array import AsyncArray
from zarr.storage import StorePath

from . import format as fmt
from .codecs import ElementwiseDeltaCodec
from .errors import CorruptDataError
from .format import TensorEntry

if TYPE_CHECKING:
    from .history import History


class LegacyReader:
    def __init__(self, history: History) -> None:
        self.history = history
        self._arrays: dict[str, AsyncArray[Any]] = {}

    def _corrupt(self, step: int, key: str, what: str, chunk: tuple[int, ...] | None = None) -> CorruptDataError:
        return CorruptDataError.at(self.history.uri, step, key, what, chunk)

    async def read(self, step: int, key: str, region: tuple[slice, ...], check: bool) -> np.ndarray:
        e = (await self.history.manifest(step)).tensors[key]
        data = await self._read_chain(step, key, e, region)
        if check:
            for flat, idx, got in fmt.region_crcs(data, region, tuple(e.shape), tuple(e.chunks)):
                if got != e.crc32c[flat]:
                    raise self._corrupt(step, key, "checksum mismatch (materialized data differs from what was "
                                                   "saved)", idx)
        return data

    async def _array(self, path: str, step: int, key: str) -> AsyncArray[Any]:
        arr = self._arrays.get(path)
        if arr is None:
            try:
                arr = await AsyncArray.open(StorePath(self.history.backend.store, path))
            except (FileNotFoundError, KeyError, ValueError) as e:
                raise self._corrupt(step, key, f"array {path} is missing or unreadable ({e})") from None
            self._arrays[path] = arr
        return arr

    async def _read_chain(self, step: int, key: str, e: TensorEntry, region: tuple[slice, ...]) -> np.ndarray:
        if e.encoding == "same":
            assert e.base is not None
            return await self._read_chain(e.base, key, (await self.history.manifest(e.base)).tensors[key], region)
        assert e.array is not None
        arr = await self._array(e.array, step, key)

        async def own() -> np.ndarray:
            try:
                return np.asarray(await arr.getitem(region))
            except (ValueError, RuntimeError) as err:
                raise self._corrupt(step, key, f"stored chunk failed its checksum or decoding ({err})") from None

        if e.encoding == "full":
            return await own()
        assert e.base is not None
        base_entry = (await self.history.manifest(e.base)).tensors[key]
        delta, base = await asyncio.gather(own(), self._read_chain(e.base, key, base_entry, region))
        codec = arr.metadata.codecs[0]
        if not isinstance(codec, ElementwiseDeltaCodec):
            raise self._corrupt(step, key, f"array {e.array} has no delta codec")
        return codec.apply(delta, base, region, e)
