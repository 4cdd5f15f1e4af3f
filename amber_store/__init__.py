"""amber-store: fast, small, incremental LLM training checkpoints on zarr v3.

>>> import amber_store as amber
>>> store = amber.open("/tmp/ckpt")                     # or "s3://bucket/run", "memory://x"
>>> info = store.save(100, {"model": model.state_dict(), "optim": opt.state_dict()})
>>> sd = store.load(100)                                # lazy; nothing read yet
>>> w = sd["model"]["layer.0.weight"][:16]              # reads only the chunks it needs
"""

from .codecs import DeltaCodec, Policy, QuantizedDeltaCodec, SparseDeltaCodec, XorDeltaCodec
from .errors import (
    AmberError,
    AsyncSaveError,
    ConcurrentWriterError,
    CorruptDataError,
    FormatVersionError,
    InvalidURIError,
    NotAnAmberStoreError,
    StepNotFoundError,
    StepOrderError,
    StorageAccessError,
    UnsafeStorageError,
    UnsupportedStateError,
)
from .format import FORMAT_VERSION
from .lazy import LazyStateDict, LazyTensor, materialize
from .store import CommitInfo, Store, open
from .manager import CheckpointManager

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "AmberError",
    "AsyncSaveError",
    "CheckpointManager",
    "CommitInfo",
    "ConcurrentWriterError",
    "CorruptDataError",
    "DeltaCodec",
    "FormatVersionError",
    "InvalidURIError",
    "LazyStateDict",
    "LazyTensor",
    "NotAnAmberStoreError",
    "Policy",
    "QuantizedDeltaCodec",
    "SparseDeltaCodec",
    "StepNotFoundError",
    "StepOrderError",
    "StorageAccessError",
    "UnsafeStorageError",
    "Store",
    "UnsupportedStateError",
    "XorDeltaCodec",
    "materialize",
    "open",
]
