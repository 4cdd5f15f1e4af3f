"""CheckpointManager: checkpointing policy for a training loop in three calls.

>>> manager = CheckpointManager("s3://bucket/run", every=100, keep_last=5, codec=[("optim/*", "sparse")])
>>> start = manager.restore(model, optimizer) or 0      # latest step, or None on a fresh run
>>> for step in range(start + 1, steps + 1):
...     train_step()
...     manager.maybe_save(step, model=model, optimizer=optimizer, extra={"data_pos": pos})
>>> manager.close()                                     # waits for the last save

In a sharded job (torch.distributed initialized with several ranks: FSDP2, DTensor) every rank
makes the same calls; saves go through torch.distributed.checkpoint (:mod:`amber_store.dcp`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable, Literal, Mapping

import torch

from . import retention
from .errors import AmberError, AsyncSaveError, warn
from .lazy import materialize
from .store import CommitInfo, Store, _first_rank, open

_log = logging.getLogger("amber_store")


class CheckpointManager:
    """Saves every ``every`` steps (in the background by default), keeps storage bounded with
    ``keep_last``/``keep_every`` retention (plus the ``keep_best`` steps by ``best_fn`` of the
    ``metrics`` given to :meth:`maybe_save`, ``best_mode`` "min" or "max", as Orbax and
    Lightning's top-k do), and restores model and optimizer.

    The saved state is ``{"model": ..., "optim": ..., "extra": ..., "step": step}``. Retention
    runs on the save thread right after each commit, so it never stalls training. Other keyword
    arguments are :class:`~amber_store.Store` options (``codec``, ``chunk_bytes``, ...). A
    failed save or retention is raised by the next call.

    ``sharded`` (default: whether torch.distributed is initialized with more than one rank):
    every rank calls the manager alike, in step; the state is taken with
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` (FSDP2 / DTensor shards as they
    are) and saved by ``dcp.save``, or by ``dcp.async_save`` on a process group of the
    manager's own (training's collectives go on meanwhile); one save is pending at most, so a
    save waits for the previous one. Retention runs once, on the coordinator, after the commit
    and before the save completes. :meth:`restore` reshards the step onto the current ranks.
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
        sharded: bool | None = None,
        **store_options: Any,
    ) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.every = every
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.best = None if keep_best is None else retention.BestN(keep_best, best_fn, best_mode)
        self.async_save = async_save
        self.extra: Any = None
        self.sharded = _distributed() if sharded is None else sharded
        options = {"full_every": full_every, "codec": codec, **store_options}
        if not self.sharded:
            self.store: Store = open(uri, storage_options, mode="a", **options)
            return
        from . import dcp
        import torch.distributed as dist

        # async saves run their collectives on a group of their own (created by every rank now)
        self._group = dist.new_group(backend="gloo") if async_save else None
        self._uri, self._storage_options, self._options = uri, storage_options, options
        self._pending: Future[Any] | None = None
        self._pending_step: int | None = None
        # The store DCP saves go through in this process (one writer identity for all of them).
        # The coordinator opens it first, creating it if need be; ranks opening a new store at
        # once would find each other's half-written root. Every rank learns of every rank's
        # failure (an interrupt included), so that none waits for a collective that never comes.
        def open_here() -> None:
            self.store = dcp.store_for(uri, storage_options, **options)

        coordinator = dist.get_rank() == 0
        _together(open_here if coordinator else lambda: None, src=0,
                  what=f"{uri}: the coordinator (rank 0) could not open the store")
        _together(lambda: None if coordinator else open_here(), src=None, what=f"{uri}: rank(s) could not open the store")

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
        if self.sharded:
            return self._save_sharded(step, model, optimizer, extra, metrics)
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

    def _save_sharded(self, step: int, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                      extra: Any, metrics: Mapping[str, float] | None) -> Future[Any] | None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as torch_dcp

        from .dcp import AmberStorageWriter, AmberSavePlanner

        self.wait()  # one pending save: training waits here when saves take longer than steps
        state: dict[str, Any] = {"step": step, **_sharded_state(model, optimizer)}
        if extra is not None:
            state["extra"] = extra
        # Retention runs on the coordinator once the save's collectives have returned: inside
        # DCP's finish, every other rank would wait in a collective for it, and a long gc would
        # time out a save that had committed.
        writer = AmberStorageWriter(self.store, step=step, metrics=metrics)
        coordinator = dist.get_rank() == 0
        if not self.async_save:
            torch_dcp.save(state, storage_writer=writer, planner=AmberSavePlanner())
            if coordinator:
                self._retain(None)
            return None
        saving = torch_dcp.async_save(state, storage_writer=writer, planner=AmberSavePlanner(),
                                      process_group=self._group)
        done: Future[Any] = Future()

        def retain(f: Future[Any]) -> None:  # (on DCP's thread, after its last collective)
            try:
                result = f.result()
                if coordinator:
                    self._retain(None)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                done.set_exception(e)
            else:
                done.set_result(result)

        saving.add_done_callback(retain)
        self._pending, self._pending_step = done, step
        return done

    def _retain(self, info: CommitInfo | None) -> None:
        if self.keep_last is not None or self.best is not None:
            self.store.gc(self.keep_last, self.keep_every, policy=self.best)

    def restore(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                step: int | None = None) -> int | None:
        """Load ``step`` (default: the latest) into ``model`` and ``optimizer``; returns the
        restored step, or ``None`` when the store has no step yet. ``extra`` holds the saved
        extra state. A store that does not exist yet (nothing saved there: a new run, or a
        mistyped URI) is said once, in a warning and the log, as the run then starts fresh."""
        self.wait()
        if step is None and not self.store.exists and _first_rank():
            message = f"no checkpoint at {self.store.uri}: starting fresh"
            _log.warning(message)
            warn(message)
        if self.sharded:
            return self._restore_sharded(model, optimizer, step)
        if step is None and self.store.latest() is None:
            return None
        # the model's tensors are decoded into directly; load_state_dict then checks its keys
        state = self.store.load(step, lazy=False, into=None if model is None else {"model": model.state_dict()})
        if model is not None:
            model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optim"])
        self.extra = state.get("extra")
        return int(state["step"])

    def _restore_sharded(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                         step: int | None) -> int | None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as torch_dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from .dcp import AmberStorageReader

        chosen = [self.store.latest() if step is None else step]
        dist.broadcast_object_list(chosen, src=0)  # every rank restores the coordinator's choice
        if chosen[0] is None:
            return None
        step = int(chosen[0])
        state = _sharded_state(model, optimizer)
        if state:
            torch_dcp.load(state, storage_reader=AmberStorageReader(self._uri, self._storage_options, step=step,
                                                                    **self._options))
            set_state_dict(model, [optimizer] if optimizer is not None else [],
                           model_state_dict=state.get("model", {}), optim_state_dict=state.get("optim", {}))
        saved = self.store.load(step)  # the rest, from the step's logical view: no collective
        self.extra = materialize(saved["extra"]) if "extra" in saved else None
        return int(saved["step"])

    def wait(self) -> None:
        """Wait for pending saves (and their retention); raise any failure."""
        if not self.sharded:
            self.store.wait()
            return
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise AsyncSaveError(f"{self.store.uri}: the sharded save of step {self._pending_step} failed: "
                                     f"{e}") from e

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
            if not self.sharded:  # a sharded job's store is the process's DCP store: it lives on
                self.store.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _together(run: Callable[[], None], src: int | None, what: str) -> None:
    """``run()`` on every rank, then each rank's failure told to all (``src``: only that rank's
    is awaited): every rank raises if any failed, an interrupt included (raised where it struck)."""
    import torch.distributed as dist

    mine: str | None = None
    own: BaseException | None = None
    try:
        run()
    except BaseException as e:
        mine, own = f"{type(e).__name__}: {e}", e
    if src is None:
        failures: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, mine)
    else:
        failures = [mine if dist.get_rank() == src else None]
        dist.broadcast_object_list(failures, src=src)
        failures = [None] * src + failures
    if own is not None:
        raise own
    failed = {r: f for r, f in enumerate(failures) if f is not None}
    if failed:
        raise AmberError(f"{what}: " + "; ".join(f"rank {r}: {f}" for r, f in failed.items()))


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _sharded_state(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as torch.distributed.checkpoint's ``get_state_dict``
    gives them (an optimizer's state is created if it has none yet, so that it loads)."""
    if model is None:
        if optimizer is not None:
            raise ValueError("a sharded job's optimizer is saved and restored with its model: pass model= too")
        return {}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, [optimizer] if optimizer is not None else [])
    return {"model": msd, "optim": osd} if optimizer is not None else {"model": msd}
