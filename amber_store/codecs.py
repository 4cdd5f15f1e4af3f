"""Delta and compression codecs, as zarr v3 codecs recorded in every array's metadata.

A delta codec has two faces. On the device, :meth:`XorDeltaCodec.encode` turns a tensor and its
base into the delta with torch ops, so only encoded bytes leave the device. Inside zarr's codec
pipeline the chunk already *is* the delta (zarr codecs see one chunk without its coordinates,
so they cannot fetch the base chunk); there the codec passes data through unchanged and its
job is to make the array self-describing: its configuration names the base array that a reader
must XOR with, chunk by chunk, to materialize the value (see docs/FORMAT.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from zarr.abc.codec import ArrayArrayCodec
from zarr.core.common import parse_named_configuration
from zarr.registry import register_codec

from .format import itemsize

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import NDBuffer

XOR_DELTA = "amber.xor_delta"


@dataclass(frozen=True)
class XorDeltaCodec(ArrayArrayCodec):
    """Bit-exact delta: the chunk holds ``raw_bits(value) XOR raw_bits(base)``.

    ``base_step`` and ``base_array`` (store-relative path) name the array whose materialized
    value is the base. A chunk that did not change is all zero bits, the array's fill value,
    and is therefore never written.
    """

    base_step: int
    base_array: str
    is_fixed_size = True

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        _, config = parse_named_configuration(data, XOR_DELTA)
        return cls(base_step=int(config["base_step"]), base_array=str(config["base_array"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": XOR_DELTA,
            "configuration": {"base_step": self.base_step, "base_array": self.base_array},
        }

    @staticmethod
    def diff(value_bits: torch.Tensor, base_bits: torch.Tensor) -> torch.Tensor:
        """Delta of two same-shape integer bit views, computed on ``value_bits``' device."""
        return torch.bitwise_xor(value_bits, base_bits.to(value_bits.device, non_blocking=True))

    @staticmethod
    def apply_into(delta: np.ndarray, base: np.ndarray) -> np.ndarray:
        """Materialize in place: ``delta`` becomes the value's bits."""
        return np.bitwise_xor(delta, base, out=delta)

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> NDBuffer:
        return chunk_array

    async def _decode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> NDBuffer:
        return chunk_array

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return input_byte_length


register_codec(XOR_DELTA, XorDeltaCodec)


def storage_codecs(dtype: str, level: int, delta: XorDeltaCodec | None) -> list[dict[str, Any]]:
    """The codec chain of one tensor array, as zarr v3 metadata.

    Blosc's SIMD byte shuffle groups the sign/exponent bytes of each element, which barely
    change between steps and XOR to zero runs; zstd level 1 inside 1 MiB blosc blocks measured
    as ratio-equal to level 3 on XOR deltas and 3-4x faster (numcodecs' standalone shuffle ran
    at 0.38 GB/s, blosc's at over 1 GB/s on 2 cores). crc32c last catches a damaged object
    before it is decoded.
    """
    width = itemsize(dtype)
    chain: list[dict[str, Any]] = [delta.to_dict()] if delta is not None else []
    chain.append({"name": "bytes", "configuration": {"endian": "little"}})
    chain.append({
        "name": "blosc",
        "configuration": {
            "typesize": width,
            "cname": "zstd",
            "clevel": level,
            "shuffle": "shuffle" if width > 1 else "noshuffle",
            "blocksize": 1 << 20,
        },
    })
    chain.append({"name": "crc32c"})
    return chain
