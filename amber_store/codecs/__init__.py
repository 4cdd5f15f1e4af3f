"""Delta and compression codecs, as zarr v3 codecs recorded in every array's metadata.

A delta codec has two faces. On the writer's side, :meth:`DeltaCodec.diff` turns a tensor and
the *reconstructed* value of its base into the stored delta with torch ops on the tensor's
device (a lossy delta of a CPU tensor: fused kernels, :mod:`amber_store.codecs.kernels`, with the same
result), and returns the new reconstruction (what a reader will materialize), which becomes the
next base: lossy error therefore never accumulates along a chain. On the reader's side,
:meth:`DeltaCodec.decode_into` applies one stored chunk onto the base chunk.

Inside zarr's codec pipeline the chunk already *is* the delta (zarr codecs see one chunk
without its coordinates, so they cannot fetch the base chunk). There a delta codec passes data
through unchanged; its configuration names the base array, so the array is self-describing
(docs/FORMAT.md). The serializers :class:`SparseBytesCodec` and :class:`Pack4BytesCodec` do
real per-chunk work: they store a mostly-zero chunk as indices and values, and 4-bit codes two
per byte.

Codecs per dtype and delta kind:

==============  ================  =============================================================
``diff``        lossless          ``zigzag(bits(value) - bits(base))`` (the default)
``xor``         lossless          ``bits(value) XOR bits(base)``; unchanged chunks are zero
``sparse``      lossy, floats     XOR kept only where ``|value - base| > threshold * |base|``
                                  (or the ``topk`` largest updates); the rest keep the base
``quant8/4``    lossy, floats     ``round((value - base) / scale)``, one scale per chunk
``block``       lossy, floats     per-block quantized updates, rANS-coded (the ``lossy`` preset)
``ratio``       lossy, floats     ``value / base`` on a log scale, rANS-coded (Adam's 2nd moment)
==============  ================  =============================================================

Modules: :mod:`~.base` (the contract), :mod:`~.lossless`, :mod:`~.sparse`, :mod:`~.quantized`,
:mod:`~.entropy` (with :mod:`~.ans`, the rANS coder, and :mod:`~.kernels`, fused host kernels),
:mod:`~.device` (where deltas are taken), :mod:`~.compression` (blosc framing), and
:mod:`~.registry` (names, presets, which codec a tensor gets).
"""

from .base import Delta, DeltaCodec, ElementwiseDeltaCodec, Finish, HostDiff, Serializer, Shuffle
from .compression import Compression, decompress, fuses, intact, scratch
from .device import to_host
from .entropy import ESCAPE, AnsBytesCodec, BlockDeltaCodec, CodedDelta, RatioDeltaCodec
from .lossless import DiffDeltaCodec, LosslessDeltaCodec, XorDeltaCodec
from .quantized import Pack4BytesCodec, QuantizedDeltaCodec, dequantize, pack4_decode, pack4_encode
from .registry import (DELTA_ENCODINGS, ENTRY_POINTS, PRESETS, SERIALIZERS, CodecLike, CodecPolicy, Policy, codec_named,
                       delta_codec, register)
from .sparse import SparseBytesCodec, SparseDeltaCodec, sparse_decode, sparse_encode, sparse_pack

__all__ = [
    "DELTA_ENCODINGS", "ENTRY_POINTS", "ESCAPE", "PRESETS", "SERIALIZERS", "AnsBytesCodec", "BlockDeltaCodec", "CodecLike",
    "CodecPolicy", "CodedDelta", "Compression", "Delta", "DeltaCodec", "DiffDeltaCodec", "ElementwiseDeltaCodec",
    "Finish", "HostDiff", "LosslessDeltaCodec", "Pack4BytesCodec", "Policy", "QuantizedDeltaCodec", "RatioDeltaCodec",
    "Serializer", "Shuffle", "SparseBytesCodec", "SparseDeltaCodec", "XorDeltaCodec", "codec_named", "decompress", "delta_codec",
    "dequantize", "fuses", "intact", "pack4_decode", "pack4_encode", "register", "scratch", "sparse_decode", "sparse_encode", "sparse_pack",
    "to_host",
]
