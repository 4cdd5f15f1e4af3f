"""Exceptions raised by amber-store.

Every error a user can cause or meet derives from :class:`AmberError`, so a training loop can
catch checkpoint failures without catching unrelated bugs.
"""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


class AmberError(Exception):
    """Base class of all amber-store errors."""


class InvalidURIError(AmberError, ValueError):
    """The checkpoint URI cannot be resolved to a storage backend."""


class StorageAccessError(AmberError, OSError):
    """The storage backend cannot be reached, or refuses the credentials, or lacks the bucket."""


class UnsafeStorageError(AmberError):
    """The storage works but cannot make a commit exclusive (an S3 server that ignores
    conditional writes), so concurrent writers could overwrite each other's steps."""


class NotAnAmberStoreError(AmberError):
    """The location holds data that is not an amber-store hierarchy (or none, in read mode)."""


class FormatVersionError(AmberError):
    """The store was written by a newer, incompatible on-disk format version."""


class StepNotFoundError(AmberError, LookupError):
    """The requested step is not committed in the store."""


class PinNotFoundError(AmberError, LookupError):
    """No pin of that name exists."""


class StepOrderError(AmberError, ValueError):
    """A save was asked for a step that is not newer than the latest committed step."""


class ConcurrentWriterError(AmberError):
    """Another writer committed the same step first; this save's data was left uncommitted."""


class AsyncSaveError(AmberError):
    """A background save failed; raised by the next call on the store (and set on its future)."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


class UnsupportedStateError(AmberError, TypeError):
    """The state dict holds a value (leaf type or dtype) that amber-store cannot store exactly."""


class StateMismatchError(AmberError, ValueError):
    """A load ``into=`` a state whose tensors do not match the step's: ``missing`` (places of
    ``into`` the step has no tensor at) and ``unexpected`` (the step's tensors, under the parts
    of the state ``into`` names, that ``into`` has no place for). Nothing was read."""

    def __init__(self, message: str, *, missing: list[str], unexpected: list[str]):
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected


class UnsafeValueError(AmberError):
    """A stored Python value (of a sharded step) cannot be read without running code stored
    with it, which loading never does."""


class UnknownCodecError(AmberError, LookupError):
    """A step names a delta codec (an extension encoding, docs/FORMAT.md) that this process does
    not have: the package that provides it is not installed."""


class CorruptDataError(AmberError):
    """Stored data failed its checksum, is missing, or cannot be read safely.

    ``step`` and ``tensor`` name the damaged tensor; ``None`` for a value of the state tree."""

    def __init__(self, message: str, *, step: int | None = None, tensor: str | None = None,
                 chunk: tuple[int, ...] | None = None):
        super().__init__(message)
        self.step = step
        self.tensor = tensor
        self.chunk = chunk

    @classmethod
    def at(cls, uri: str, step: int, tensor: str, what: str, chunk: tuple[int, ...] | None = None) -> "CorruptDataError":
        """The error for damage found in ``tensor`` of ``step`` (and ``chunk``), its message
        naming all of them."""
        where = f"step {step}, tensor {tensor!r}" + ("" if chunk is None else f", chunk {chunk}")
        return cls(f"{uri}: {where}: {what}", step=step, tensor=tensor, chunk=chunk)


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn, naming the first line outside amber-store on the stack (the user's call), however
    deep inside the library the warning arises."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
