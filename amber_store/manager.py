"""CheckpointManager: checkpointing policy for a training loop in three calls.

>>> manager = CheckpointManager("s3://bucket/run", every=100, keep_last=5, codec=[("optim/*", "sparse")])
>>> start = manager.restore(model, optimizer) or 0      # latest step, or None on a fresh run
>>> for step in range(start + 1, steps + 1):
...     train_step()
...     manager.maybe_save(step, model=model, optimizer=optimizer, extra={"data_pos": pos})
>>> manager.close()                                     # waits for the last save
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Literal, Mapping

import torch

from . import retention
from .store import CommitInfo, Store, open


class CheckpointManager:
    """Saves every ``every`` steps (in the background by default), keeps storage bounded with
    ``keep_last``/``keep_every`` retention (plus the ``keep_best`` steps by ``best_fn`` of the
    ``metrics`` given to :meth:`maybe_save`, ``best_mode`` "min" or "max", as Orbax and
    Lightning's top-k do), and restores model and optimizer.

    The saved state is ``{"model": ..., "optim": ..., "extra": ..., "step": step}``. Retention
    runs on the save thread right after each commit, so it never stalls training. Other keyword
    arguments are :class:`~amber_store.Store` options (``codec``, ``chunk_bytes``, ...). A
    failed save or retention is raised by the next call.
    """

    def __init__(
        self,
        uri: str,
        *,
        every: int = 100,
        full_every: int = 10,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_fn: str | Callable[[Mapping[str, float]], float] = "loss",
        best_mode: Literal["min", "max"] = "min",
        codec: Any = "lossless",
        storage_options: dict[str, Any] | None = None,
        async_save: bool = True,
        **store_options: Any,
    ) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.every = every
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.best = None if keep_best is None else retention.BestN(keep_best, best_fn, best_mode)
        self.async_save = async_save
        self.store: Store = open(uri, storage_options, mode="a", full_every=full_every, codec=codec, **store_options)
        self.extra: Any = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "CheckpointManager":
        """From a training config section, e.g. ``{"uri": "s3://b/run", "every": 500, "keep_last": 3}``."""
        options = dict(config)
        try:
            uri = options.pop("uri")
        except KeyError:
            raise ValueError("checkpoint config needs a 'uri'") from None
        return cls(uri, **options)

    def maybe_save(self, step: int, *, model: torch.nn.Module | None = None,
                   optimizer: torch.optim.Optimizer | None = None, extra: Any = None,
                   metrics: Mapping[str, float] | None = None,
                   force: bool = False) -> Future[CommitInfo] | CommitInfo | None:
        """Save if ``step`` is a multiple of ``every`` (or ``force``). ``metrics`` (e.g.
        ``{"loss": ...}``) rank steps for ``keep_best``. Returns the future of an async save,
        the CommitInfo of a synchronous one, or ``None`` when it did not save."""
        if not force and not self.should_save(step):
            return None
        state: dict[str, Any] = {"step": step}
        if model is not None:
            state["model"] = model.state_dict()
        if optimizer is not None:
            state["optim"] = optimizer.state_dict()
        if extra is not None:
            state["extra"] = extra
        if not self.async_save:
            info = self.store.save(step, state, metrics=metrics)
            self._retain(info)
            return info
        return self.store.save_async(step, state, metrics=metrics, after=self._retain)

    def _retain(self, info: CommitInfo) -> None:
        if self.keep_last is not None or self.best is not None:
            self.store.gc(self.keep_last, self.keep_every, policy=self.best)

    def restore(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                step: int | None = None) -> int | None:
        """Load ``step`` (default: the latest) into ``model`` and ``optimizer``; returns the
        restored step, or ``None`` when the store has no step yet. ``extra`` holds the saved
        extra state."""
        self.wait()
        if step is None and self.store.latest() is None:
            return None
        state = self.store.load(step, lazy=False)
        if model is not None:
            model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optim"])
        self.extra = state.get("extra")
        return int(state["step"])

    def wait(self) -> None:
        """Wait for pending saves (and their retention); raise any failure."""
        self.store.wait()

    # Orbax CheckpointManager's names, for those who know them.

    def should_save(self, step: int) -> bool:
        """Whether :meth:`maybe_save` saves at ``step``."""
        return step % self.every == 0

    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self.store.steps()

    def latest_step(self) -> int | None:
        return self.store.latest()

    def delete(self, step: int) -> None:
        """Remove one step (steps that read its data are folded off it first)."""
        self.store.delete(step)

    def wait_until_finished(self) -> None:
        self.wait()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.store.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
