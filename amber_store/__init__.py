"""amber-store: fast, small, incremental LLM training checkpoints on zarr v3.

>>> import amber_store as amber
>>> store = amber.open("/tmp/ckpt")                     # or "s3://bucket/run", "gs://...", "az://...", "memory://x"
>>> info = store.save(100, {"model": model.state_dict(), "optim": opt.state_dict()})
>>> sd = store.load(100)                                # lazy; nothing read yet
>>> w = sd["model"]["layer.0.weight"][:16]              # reads only the chunks it needs
"""

import importlib
from typing import Any

from .errors import (
    AmberError,
    AsyncSaveError,
    ConcurrentWriterError,
    CorruptDataError,
    FormatVersionError,
    InvalidURIError,
    NotAnAmberStoreError,
    PinNotFoundError,
    StepNotFoundError,
    StepOrderError,
    StorageAccessError,
    UnsafeStorageError,
    StateMismatchError,
    UnsafeValueError,
    UnknownCodecError,
    UnsupportedStateError,
)

# The rest is imported on first use (PEP 562), so that `amber-store --help` and the error types
# do not pay for importing torch.
_LAZY = {
    "BlockDeltaCodec": "codecs", "DeltaCodec": "codecs", "DiffDeltaCodec": "codecs", "Policy": "codecs", "RatioDeltaCodec": "codecs",
    "QuantizedDeltaCodec": "codecs", "SparseDeltaCodec": "codecs",
    "XorDeltaCodec": "codecs", "FORMAT_VERSION": "format", "LazyStateDict": "lazy", "LazyTensor": "lazy",
    "materialize": "lazy", "CommitInfo": "store", "Store": "store", "open": "store",
    "CheckpointManager": "manager", "Options": "options", "import_checkpoint": "importer",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "AmberError",
    "AsyncSaveError",
    "BlockDeltaCodec",
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
    "Options",
    "Policy",
    "QuantizedDeltaCodec",
    "DiffDeltaCodec",
    "RatioDeltaCodec",
    "SparseDeltaCodec",
    "StepNotFoundError",
    "PinNotFoundError",
    "StepOrderError",
    "StorageAccessError",
    "UnsafeStorageError",
    "StateMismatchError",
    "UnsafeValueError",
    "UnknownCodecError",
    "Store",
    "UnsupportedStateError",
    "XorDeltaCodec",
    "import_checkpoint",
    "materialize",
    "open",
]
