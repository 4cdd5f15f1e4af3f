"""The codecs as zarr v3 codecs, for zarr-python reading an amber-store's arrays: each class here
is the codec of the same name plus zarr's codec base, which zarr finds through the entry points
of the group ``zarr.codecs`` (pyproject.toml) when it first meets the codec's name. Imported by
zarr alone: amber-store's own reads and writes do not go through zarr's codec pipeline, and a
load imports no zarr.

Inside zarr's pipeline a delta codec passes a chunk through unchanged (zarr codecs see a chunk
without its coordinates, so they cannot fetch the base chunk); the serializers decode for real.
"""

from __future__ import annotations

from typing import Any

from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec

from .base import DeltaCodec
from .registry import BUILT_IN, SERIALIZERS


async def _pass_through(self: Any, chunk_array: Any, chunk_spec: Any) -> Any:
    return chunk_array


def _same_size(self: Any, input_byte_length: int, _chunk_spec: Any) -> int:
    return input_byte_length


def zarr_codec(cls: type[Any]) -> type[Any]:
    """``cls`` (a delta codec or a serializer) as a zarr codec class. A package providing its own
    codec names ``zarr_codec(ItsCodec)``, assigned in one of its modules, under the entry point
    group ``zarr.codecs`` by the codec's ``name``, for zarr's own readers."""
    if issubclass(cls, DeltaCodec):
        methods = {"_encode_single": _pass_through, "_decode_single": _pass_through,
                   "compute_encoded_size": _same_size}
        return type(cls.__name__, (cls, ArrayArrayCodec), {"__module__": __name__, "__doc__": cls.__doc__, **methods})
    return type(cls.__name__, (cls, ArrayBytesCodec), {"__module__": __name__, "__doc__": cls.__doc__})


#: zarr codec name -> its zarr codec class
ZARR_CODECS: dict[str, type[Any]] = {c.name: zarr_codec(c) for c in (*BUILT_IN, *SERIALIZERS)}
# (each an attribute of this module by its class name: what the entry points name)
globals().update({c.__name__: c for c in ZARR_CODECS.values()})
