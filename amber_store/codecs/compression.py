"""Framing of stored chunks: blosc (compressor and shuffle by what the chunk holds), then a
crc32c; their decompression into reused buffers."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blosc
import crc32c
import numpy as np
from blosc.blosc_extension import error as BloscError

from ..format import host_empty, itemsize
from .base import Shuffle

try:  # built at install where a C compiler is (pyproject's ext-modules); else c-blosc decodes all
    from . import _blosc1
except ImportError:
    _blosc1 = None

#: The native decoder's path every decode takes (``AMBER_DECODE_PATH``: one of ``_blosc1.paths``,
#: or ``c-blosc`` to run as a machine without the native extension does: c-blosc decodes every
#: chunk, torch's ops apply the lossless diffs; to time or test a path on a CPU that runs a
#: faster one); ``None``: the fastest this CPU runs for each chunk's elements.
_PATH = os.environ.get("AMBER_DECODE_PATH") or None
if _PATH == "c-blosc":
    _blosc1 = _PATH = None
elif _PATH is not None and (_blosc1 is None or _PATH not in _blosc1.paths):
    raise ImportError(f"AMBER_DECODE_PATH={_PATH!r}: this machine decodes by "
                      f"{['c-blosc', *(_blosc1.paths if _blosc1 else ())]}")

if TYPE_CHECKING:
    from .base import DeltaCodec


BLOSC_BLOCK = 1 << 20

# Chunks are framed by python-blosc, the Blosc project's binding of c-blosc 1.x: the frames zarr's
# "blosc" codec (numcodecs) reads, but with c-blosc's AVX2 shuffles, which numcodecs' wheels
# compile out (measured, 2 codec threads, 4 MiB of fp32 values: bit-unshuffle + lz4 0.72 vs
# 1.07 ms, compression 1.31 vs 1.61 ms). Its settings are process-wide, so set once here: calls
# release the GIL and run one thread each (the codec pools run them in parallel), blocks of
# BLOSC_BLOCK. Another setting (a user's own) changes only speed; frames name their own block.
blosc.set_releasegil(True)
blosc.set_nthreads(1)
blosc.set_blocksize(BLOSC_BLOCK)


@dataclass(frozen=True)
class Compression:
    """How stored chunks are compressed: blosc, with a compressor and shuffle chosen by what
    the chunk holds (:meth:`blosc`), at ``level``, then a crc32c (the zarr codecs ``blosc``,
    ``crc32c``). Decompression needs no configuration: a blosc header names its compressor and
    shuffle.

    ``compressor``: ``"auto"`` (default) compresses the raw values of full steps with lz4, the
    lossless deltas of large tensors with their codec's choice (:class:`DiffDeltaCodec`: lz4,
    bit-shuffled; :class:`XorDeltaCodec`: zstd) and packs of small tensors' deltas with zstd
    (a small share of a large model's bytes, where the ratio is worth more than the speed: the
    pack compresses beside the encoding of the next tensors); ``"lz4"`` or ``"zstd"`` use that
    one for all. Measured on fp32 AdamW state (2 cores): raw values bit-shuffled compress 1.15x
    with lz4 at 0.97 GB/s a core, 1.17-1.20x with zstd at 0.34-0.67 GB/s; XOR deltas
    byte-shuffled 1.75x with zstd at 0.30 GB/s, 1.56x with lz4 at 0.64 GB/s; integer-difference
    deltas 1.63x with lz4 (bit-shuffled) at 0.9 GB/s, 1.78x with zstd. Lossy codes are always zstd:
    their near-zero codes need its entropy coder (lz4 stores quant4 deltas 1.6x larger).
    """

    compressor: str = "auto"
    level: int = 1

    def __post_init__(self) -> None:
        if self.compressor not in ("auto", "zstd", "lz4"):
            raise ValueError(f"compressor must be 'auto', 'lz4' or 'zstd', not {self.compressor!r}")

    def blosc(self, delta: DeltaCodec | None, packed: bool = False) -> tuple[str, Shuffle, int]:
        """(compressor, shuffle, level) of a chunk stored with ``delta`` (``None``: raw values
        of a full step, bit-shuffled so that sign and exponent bits line up across elements),
        ``packed``: a part of a pack. Entropy-coded chunks are only framed (level 0)."""
        if delta is None:
            return ("lz4" if self.compressor == "auto" else self.compressor), "bitshuffle", self.level
        if delta.entropy_coded:
            return "lz4", "noshuffle", 0
        if not delta.lossless:
            return "zstd", delta.shuffle, self.level
        cname = self.compressor if self.compressor != "auto" else "zstd" if packed else delta.auto_compressor
        return cname, delta.shuffle_for(cname), self.level

    def config(self, typesize: int, delta: DeltaCodec | None, packed: bool = False) -> dict[str, Any]:
        """The zarr ``blosc`` codec metadata matching :meth:`compress`."""
        cname, shuffle, level = self.blosc(delta, packed)
        return {"name": "blosc", "configuration": {
            "typesize": typesize, "cname": cname, "clevel": level,
            "shuffle": _effective(shuffle, typesize), "blocksize": BLOSC_BLOCK}}

    def inner_codecs(self, dtype: str, delta: DeltaCodec | None) -> list[dict[str, Any]]:
        """The codec chain of one stored chunk of a ``dtype`` tensor, as zarr v3 metadata
        (inside ``sharding_indexed``)."""
        serializer = {"name": "bytes", "configuration": {"endian": "little"}} if delta is None else delta.serializer(dtype)
        chain = [delta.to_dict()] if delta is not None else []
        return chain + [serializer, self.config(itemsize(dtype), delta), {"name": "crc32c"}]

    def compress(self, payload: Any, typesize: int, delta: DeltaCodec | None, packed: bool = False) -> list[bytes]:
        """One stored chunk of ``delta`` (``None``: raw values; ``packed``: a pack's part), as
        the parts to lay end to end: the blosc frame and its crc32c (kept apart: writers gather
        them without a copy). Releases the GIL, so chunks compress in parallel."""
        cname, shuffle, level = self.blosc(delta, packed)
        packed = blosc.compress(payload, typesize, level, _BLOSC_SHUFFLE[_effective(shuffle, typesize)], cname)
        return [packed, crc32c.crc32c(packed).to_bytes(4, "little")]


_BLOSC_SHUFFLE = {"noshuffle": blosc.NOSHUFFLE, "shuffle": blosc.SHUFFLE, "bitshuffle": blosc.BITSHUFFLE}


def _effective(shuffle: Shuffle, typesize: int) -> Shuffle:
    return "noshuffle" if shuffle == "shuffle" and typesize == 1 else shuffle


#: A blosc 1.x frame's header: version, versionlz, flags, typesize, then its uncompressed size,
#: block size and frame size (little-endian uint32 each).
_BLOSC_HEADER = 16


#: What the native decoder can do with a chunk's values as it decodes them: store them, or apply
#: them onto the values ``out`` holds (a codec names its own: ``DeltaCodec.fused_op``); each is
#: the decoder's constant of that name in capitals.
FUSED_OPS = ("store", "unzigzag_add")


def fuses(stored: Any, out: np.ndarray, op: str = "store") -> bool:
    """Whether the native decoder takes this stored chunk for ``out`` (its exact size and, to
    apply ``op`` onto it, elements of the chunk's width): the raw values of full steps and the
    lossless diffs of large tensors (2- or 4-byte elements, bit-shuffled, lz4). It decodes them
    in one pass per block, against c-blosc's three and numpy's apply: a delta step's load in a
    fresh process takes 0.6x the time (measured: docs/PERFORMANCE.md)."""
    return (_blosc1 is not None and op in FUSED_OPS and out.flags.c_contiguous
            and _blosc1.takes(stored, out.nbytes, 0 if op == "store" else out.itemsize, _PATH))


def decode_path() -> str:
    """The path that decodes the chunks the native decoder takes (2- and 4-byte elements) on this
    machine: ``avx512``, ``avx2``, ``portable`` (NEON on aarch64) or ``c-blosc``."""
    return (_blosc1.path_for(_PATH) if _blosc1 else None) or "c-blosc"


def intact(stored: Any) -> bool:
    """Whether a stored chunk's bytes match the crc32c stored after them."""
    view = memoryview(stored).cast("B")
    return len(view) >= _BLOSC_HEADER + 4 and crc32c.crc32c(view[:-4]) == int.from_bytes(view[-4:], "little")


def decompress(stored: Any, out: np.ndarray | None = None, op: str = "store",
               checked_after: bool = False) -> np.ndarray | None:
    """Check a stored chunk's crc32c and decompress it (into the front of ``out``, a contiguous
    buffer at least the chunk's size, when given); with an ``op`` of :data:`FUSED_OPS` other
    than ``"store"``, apply its values onto ``out``'s instead (only for chunks :func:`fuses`
    takes). ``checked_after``: the caller checks the crc32c of the bits it decodes, and each
    chunk's :func:`intact` if they differ; a chunk the native decoder takes (bounds-checked
    whatever its bytes) is then decoded without a pass over it first: that pass was a tenth of
    a delta step's load in a fresh process (benchmarks/RESULTS.md).

    Returns the payload (``out`` when given, else uint8), or ``None`` if the checksum or the
    decoding failed.
    """
    view = memoryview(stored).cast("B")
    if len(view) < _BLOSC_HEADER + 4:
        return None
    body = view[:-4]
    native = out is not None and fuses(body, out, op)
    if not (native and checked_after) and not intact(view):
        return None
    if native:
        try:
            _blosc1.decode(body, out, getattr(_blosc1, op.upper()), _PATH)
        except ValueError:
            return None
        return out
    if op != "store":
        raise ValueError(f"the native decoder applies {op!r}, and it does not take this chunk (see fuses)")
    try:
        if out is None:
            return np.frombuffer(blosc.decompress(body), dtype=np.uint8)
        if not out.flags.c_contiguous:
            raise ValueError("decompress needs a contiguous output buffer")
        # python-blosc writes as many bytes as the frame's header says, unchecked
        if int.from_bytes(body[4:8], "little") > out.nbytes:
            return None
        blosc.decompress_ptr(body, out.ctypes.data)
        return out
    except BloscError:
        return None


_SCRATCH = threading.local()


def scratch(nbytes: int, slot: int = 0) -> np.ndarray:
    """A reusable byte buffer of the calling (codec) thread, so chunks are encoded and decoded
    without a fresh allocation each; valid until that thread's next call for the same ``slot``
    (a chunk's stored bytes take slot 0; codecs' temporaries the others)."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = bufs[slot] = host_empty(max(nbytes, 1 << 20), np.uint8)
    return buf[:nbytes]


