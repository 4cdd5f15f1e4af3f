"""A store's options, validated once: :class:`Options` holds the keyword arguments of
:func:`amber_store.open` and :class:`~amber_store.store.Store`, and the Writer and each step
writer read them from it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from . import format as fmt
from .bases import BASE_CACHES, BaseCacheMode
from .codecs import CodecPolicy, Compression, Policy
from .chains import BASE_POLICIES
from .validation import MAX_CHUNK_BYTES

BasePolicy = Literal["auto", "log", "chain", "full"]
SaveTimeout = float | Literal["auto"] | None


@dataclass(frozen=True)
class Options:
    """How a store saves and reads.

    Args:
        full_every: a segment holds one full step and then up to ``full_every - 1`` deltas; the
            next save is full again. Larger values store less.
        base_policy: which earlier step of its segment a delta diffs against. ``"auto"``
            (default): ``"full"`` for tensors with a lossless codec, ``"log"`` for lossy ones
            (whose codes grow fastest with the distance to their base). ``"full"``: the full
            step (reads touch two objects per tensor; deltas grow as training drifts: measured
            on AdamW every 10 steps, 2.7% more bytes than ``"log"`` for 1.5x faster deepest
            loads). ``"log"``: skip-list bases (position ``p`` diffs against ``p`` with its
            lowest set bit cleared), so reading any step touches at most
            ``log2(full_every) + 1`` objects. ``"chain"``: the previous step (smallest deltas;
            reads walk up to ``full_every`` objects).
        full_above: a tensor is stored full in a delta step once its delta does not pay for the
            layer it adds to every read: when, in the step before, its delta stored more than
            this share of the full layer its chain starts from, and in the segment's later steps
            that would diff against an older base (deltas against a fixed base only grow as
            training drifts; measured, benchmarks/policies.py). Its reads then decode one layer
            fewer, for a few more stored bytes. Tensors under ``pack_threshold`` always diff
            (their pack is read whole either way). ``None``: never.
        chunk_bytes: size of one chunk (the unit of lazy reads and of parallel compression).
            ``None`` (default): 4 MiB for tensors with a lossless codec, 1 MiB for lossy ones
            (a quantizer's scale is per chunk) and for a pack's parts. A delta keeps its base's
            chunks.
        pack_threshold: tensors smaller than this (bytes) are packed into one object per step.
        compressor, compression_level: blosc compressor and its level: ``"auto"`` (default:
            lz4 for full steps and large tensors' lossless deltas, zstd for packs of small
            tensors' deltas and for XOR and lossy deltas), ``"lz4"`` or ``"zstd"`` (smaller
            lossless deltas, slower saves); see :class:`~amber_store.codecs.Compression`.
        verify_checksums: check each materialized chunk's crc32c on read. Stored chunks carry
            their own: checked before they are decoded, but for those the native decoder takes
            (bounds-checked whatever their bytes) while this is on, checked only if the
            materialized one differs, to name the damaged step.
        durable: make every data object durable (fsync) before the commit, on local disks.
        progress: show a tqdm bar while saving.
        max_inflight_bytes: bound on tensor bytes encoded but not yet written (128 MiB: the
            encoded chunks a save holds while storage lags, 32 requests of 4 MiB chunks; at 1 GiB
            a save to SeaweedFS held 1.8x the state at its peak, and was no faster). On object
            stores, whose puts hold a copy of each object's bytes, the copy counts too.
        base_cache: where this process keeps the values its next delta saves diff against
            (:mod:`~amber_store.bases`): ``"spill"`` (default: a local temporary file, written
            as a save encodes and read back by chunk, in the page cache while it fits; a few
            chunks of the process's memory), ``"memory"`` (host memory: the fastest saves, the
            state's size resident) or ``"none"`` (each base read back from the store).
        spill_dir: the directory of ``base_cache="spill"``'s files (``None``: ``$TMPDIR``); a
            local disk with room for twice the state. A tmpfs holds them in memory.
        codec: the delta codec of each tensor: ``"lossless"`` (default: the integer difference
            of the raw bits, :class:`~amber_store.codecs.DiffDeltaCodec`), ``"xor"`` (lossless:
            raw bits XOR the base's), ``"lossy"`` (the recommended lossy preset: block-quantized,
            entropy-coded deltas; ratio-coded second moments; first moments kept at their base),
            ``"block"``, ``"ratio"``, ``"sparse"``, ``"quant8"``, ``"quant4"``, a
            :class:`~amber_store.codecs.DeltaCodec`, or rules ``[(key pattern, codec), ...]``
            such as ``[("optim/*", "sparse")]``; see :class:`~amber_store.codecs.Policy`. Full
            steps are always lossless.
        max_pending: how many ``save_async`` calls may be unfinished at once.
        snapshot: where ``save_async`` copies the state: ``"host"`` (pinned host buffers;
            deltas encoded on the host) or ``"device"`` (the tensors' device; deltas encoded
            there, one more copy of the state in device memory).
        save_timeout: seconds a save may take until its data is written and sealed, after which
            it fails with :class:`~amber_store.errors.StorageAccessError` (nothing committed; the
            next save may go on), so a hung storage server cannot hang training. ``"auto"``
            (default): 300 s plus 1 s per 20 MB of state; ``None``: no deadline. Every object
            store request is bounded as well (e.g. :data:`amber_store.storage.obstorestore.CLIENT_OPTIONS`),
            the commit and other metadata writes by the backend's ``put_timeout``.
        single_writer: on an object store, skip the check at ``open`` that the server honours
            conditional writes (``If-None-Match``, GCS's ``ifGenerationMatch``), which keep two
            writers from both committing one step. Set it only for a server without them
            (rclone, MinIO before late 2024) and a store that one process writes at a time.
    """

    full_every: int = 10
    base_policy: BasePolicy = "auto"
    full_above: float | None = 0.9
    chunk_bytes: int | None = None
    pack_threshold: int = fmt.DEFAULT_PACK_THRESHOLD
    compressor: str = "auto"
    compression_level: int = 1
    verify_checksums: bool = True
    durable: bool = True
    progress: bool = False
    max_inflight_bytes: int = 128 << 20
    base_cache: BaseCacheMode = "spill"
    spill_dir: str | None = None
    codec: CodecPolicy = "lossless"
    max_pending: int = 1
    snapshot: str = "host"
    save_timeout: SaveTimeout = "auto"
    single_writer: bool = False
    #: the compression and codec policy these options name (made, and so checked, at once)
    compression: Compression = field(init=False, repr=False, compare=False)
    policy: Policy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.full_every < 1:
            raise ValueError("full_every must be >= 1")
        if self.base_policy not in BASE_POLICIES:
            raise ValueError(f"base_policy must be one of {sorted(BASE_POLICIES)}, not {self.base_policy!r}")
        if self.full_above is not None and not self.full_above > 0:
            raise ValueError(f"full_above must be a positive share or None, not {self.full_above!r}")
        if not (self.save_timeout in ("auto", None)
                or (isinstance(self.save_timeout, (int, float)) and self.save_timeout > 0)):
            raise ValueError(f"save_timeout must be 'auto', None or a positive number of seconds, not "
                             f"{self.save_timeout!r}")
        # (what readers accept: amber_store.validation)
        if self.chunk_bytes is not None and not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be between 1 and {MAX_CHUNK_BYTES} bytes, not {self.chunk_bytes!r}")
        if not 0 <= self.pack_threshold <= MAX_CHUNK_BYTES:
            raise ValueError(f"pack_threshold must be between 0 and {MAX_CHUNK_BYTES} bytes, not {self.pack_threshold!r}")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if self.base_cache not in BASE_CACHES:
            raise ValueError(f"base_cache must be one of {', '.join(BASE_CACHES)}, not {self.base_cache!r}")
        if self.spill_dir is not None and not os.path.isdir(self.spill_dir):
            raise ValueError(f"spill_dir {self.spill_dir!r} is not a directory")
        if self.snapshot not in ("host", "device"):
            raise ValueError(f"snapshot must be 'host' or 'device', not {self.snapshot!r}")
        object.__setattr__(self, "compression", Compression(self.compressor, self.compression_level))
        object.__setattr__(self, "policy", Policy(self.codec))
