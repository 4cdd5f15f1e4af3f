"""Retention, chain-folding GC, orphan cleanup, export and import."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors.torch import load_file
from zarr.core.buffer import Buffer
from zarr.storage import LocalStore, WrapperStore

import amber_store as amber
from amber_store import stepwriter
from amber_store.demo import GPTConfig, TinyGPT
from conftest import all_keys, assert_tree_bit_equal


def trajectory(store: amber.Store, steps: int = 30) -> dict[int, dict]:
    """A 30-step run with fulls every 7 steps, a frozen tensor and a tensor that appears late."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g)
    frozen = torch.randn(100, generator=g)
    expected = {}
    for step in range(1, steps + 1):
        w += 1e-3 * torch.randn(w.shape, generator=g)
        state = {"model": {"w": w, "frozen": frozen}, "step": step}
        if step >= 12:
            state["model"]["late"] = torch.full((3,), float(step // 5))
        store.save(step, state)
        expected[step] = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": step}
    return expected


def test_gc_keeps_every_retained_step_bit_exact_and_bounds_storage(make_store):
    store = make_store(full_every=7, chunk_bytes=2048)
    expected = trajectory(store)
    store.pin(4, "best")
    objects_before = len(all_keys(store))
    plan = store.gc(keep_last=5, keep_every=10, dry_run=True)
    assert plan.keep == [4, 10, 20, 26, 27, 28, 29, 30]
    assert store.steps() == list(range(1, 31)) and len(all_keys(store)) == objects_before  # dry run
    report = store.gc(keep_last=5, keep_every=10)
    assert report.keep == plan.keep and report.delete == plan.delete and report.rewrite == plan.rewrite
    assert report.rewrite  # the kept steps did depend on deleted ones
    reader = make_store(mode="r")
    assert reader.steps() == plan.keep
    for step in plan.keep:
        assert_tree_bit_equal(reader.load(step, lazy=False), expected[step])
        assert set(reader.info(step)["chain"]) <= set(plan.keep)
    assert len(all_keys(store)) < objects_before
    assert store.gc(keep_last=5, keep_every=10).rewrite == []  # nothing left to fold
    # and saving continues on the folded chain
    state = {"model": {k: v + 1 for k, v in expected[30]["model"].items()}, "step": 31}
    store.save(31, state)
    assert_tree_bit_equal(make_store(mode="r").load(31, lazy=False), state)


def adam_like_run(store: amber.Store, steps: range) -> dict[int, dict]:
    """Weights drifting a little each saved step, their moments, a frozen tensor, small ones."""
    g = torch.Generator().manual_seed(1)
    w, m = torch.randn(96, 96, generator=g), torch.zeros(96, 96)
    frozen, bias = torch.randn(64, 64, generator=g), torch.zeros(96)
    expected = {}
    for step in steps:
        m = 0.9 * m + 0.1 * torch.randn(m.shape, generator=g)
        w, bias = w - 1e-3 * m, bias + 1e-3 * torch.randn(96, generator=g)
        state = {"model": {"w": w, "frozen": frozen, "bias": bias}, "optim": {"m": m}}
        store.save(step, state)
        expected[step] = {"model": {k: v.clone() for k, v in state["model"].items()}, "optim": {"m": m.clone()}}
    return expected


def layers_read(store: amber.Store, step: int) -> tuple[list[int], int]:
    """The steps a load of ``step`` reads, and the most layers one of its tensors reads."""
    info = store.info(step)
    return info["chain"], max(len(t["chain"]) for t in info["tensors"].values())


@pytest.mark.parametrize("codec,keep_last", [("lossless", 2), ("lossy", 5)])
def test_gc_keeps_kept_steps_within_a_saves_chain_bound_and_its_dry_run_is_exact(local_store, tmp_path, codec,
                                                                              keep_last):
    store = local_store(codec=codec)  # default bases: a full step every 10 saves
    expected = adam_like_run(store, range(10, 310, 10))
    store.pin(100, "best")
    keep = [100, *store.steps()[-keep_last:]]
    before = {s: layers_read(store, s) for s in keep}
    values = {s: store.load(s, lazy=False) for s in keep}  # (lossy: not the values saved)
    plan = store.gc(keep_last=keep_last, dry_run=True)
    report = store.gc(keep_last=keep_last)
    assert report.rewrite == plan.rewrite and report.rewrite
    assert report.orphans == plan.orphans and report.objects_removed == plan.objects_removed == len(plan.orphans)
    for s in keep:
        assert_tree_bit_equal(store.load(s, lazy=False), values[s])
        steps_read, deepest = layers_read(store, s)
        # no tensor reads more layers than before, no load more steps (the frozen tensor
        # does not become "same as step 100", a step of another segment)
        assert deepest <= before[s][1] and len(steps_read) <= len(before[s][0]), (s, before[s], steps_read)
    if codec == "lossless":
        assert layers_read(store, 300)[0] == [290, 300]  # 290 lost its base: full now, 300 diffs against it
        fresh = amber.open(tmp_path / "fresh", codec=codec)
        fresh.save(290, expected[290], full=True)
        assert store.manifest(290).nbytes_stored <= 1.01 * fresh.manifest(290).nbytes_stored
    empty = [d for d in (tmp_path / "ckpt" / "steps").rglob("*") if d.is_dir() and not any(d.iterdir())]
    assert not empty, empty[:3]


def test_lazy_steps_opened_before_gc_read_their_rewritten_data_or_say_the_step_was_deleted(make_store):
    store = make_store(full_every=3)
    states = {i: {"w": torch.full((600, 600), float(i)), "b": torch.full((5,), float(i))} for i in range(1, 8)}
    for i, state in states.items():
        store.save(i, state)
    reader = make_store(mode="r")
    kept, gone = reader.load(6), reader.load(2)
    assert_tree_bit_equal({"b": gone["b"].materialize()}, {"b": states[2]["b"]})  # its chain's manifests read
    report = store.gc(keep_last=2)
    assert report.keep == [6, 7] and report.rewrite == [6]  # 6 was a delta on 4: folded onto itself
    assert_tree_bit_equal({k: kept[k].materialize() for k in states[6]}, states[6])
    with pytest.raises(amber.StepNotFoundError, match="step 2 was deleted .* after it was opened"):
        gone["w"].materialize()


class FailAfter(WrapperStore):
    """Fails the n-th mutation (write or delete) once armed, like a crash at that point."""

    def __init__(self, store):
        super().__init__(store)
        self.left: int | None = None
        self.error: OSError | None = None

    def _tick(self, key: str) -> None:
        if self.left is not None:
            self.left -= 1
            if self.left < 0:
                raise self.error or OSError(f"injected crash at {key}")

    async def set(self, key: str, value: Buffer) -> None:
        self._tick(key)
        await self._store.set(key, value)

    async def delete(self, key: str) -> None:
        self._tick(key)
        await self._store.delete(key)


@pytest.mark.parametrize("crash_after", [0, 1, 5, 12, 30, 60, 150])
def test_gc_interrupted_at_any_point_leaves_every_kept_step_loadable(tmp_path, crash_after):
    failing = FailAfter(LocalStore(tmp_path / "ckpt"))
    store = amber.open(failing, full_every=7, chunk_bytes=2048)
    expected = trajectory(store)
    failing.left = crash_after
    try:
        store.gc(keep_last=4, keep_every=10)
        crashed = False
    except OSError:
        crashed = True
    failing.left = None
    reader = amber.open(LocalStore(tmp_path / "ckpt"), mode="r")
    survivors = reader.steps()
    assert {10, 20, 27, 28, 29, 30} <= set(survivors)
    for step in survivors:  # kept steps, and any step not yet deleted, all load exactly
        assert_tree_bit_equal(reader.load(step, lazy=False), expected[step])
    amber.open(LocalStore(tmp_path / "ckpt")).gc(keep_last=4, keep_every=10)  # finishing the job
    final = amber.open(LocalStore(tmp_path / "ckpt"), mode="r")
    assert final.steps() == [10, 20, 27, 28, 29, 30]
    for step in final.steps():
        assert_tree_bit_equal(final.load(step, lazy=False), expected[step])
    assert crashed or crash_after >= 150


def test_orphaned_data_of_a_crashed_save_is_removed_by_gc(tmp_path):
    failing = FailAfter(LocalStore(tmp_path / "ckpt"))
    store = amber.open(failing)
    store.save(1, {"w": torch.randn(64, 64)})
    failing.left = 1  # the pack is written, the step group's metadata is not
    with pytest.raises(amber.StorageAccessError):
        store.save(2, {"w": torch.randn(64, 64), "b": torch.randn(64, 64)})
    failing.left = None
    orphans = [k for k in all_keys(store) if k.startswith("steps/000000000002-")]
    assert orphans
    assert not store.gc().orphans  # young, and newer than the latest commit: maybe still saving
    report = store.gc(grace_seconds=0)
    assert set(orphans) <= set(report.orphans)
    assert not [k for k in all_keys(store) if k.startswith("steps/000000000002-")]
    assert store.steps() == [1]


def test_a_save_failing_on_a_full_disk_or_by_a_bug_removes_its_own_data_at_once(tmp_path, monkeypatch):
    failing = FailAfter(LocalStore(tmp_path / "ckpt"))
    store = amber.open(failing, pack_threshold=0)
    store.save(1, {"w": torch.randn(64, 64)})

    def attempts() -> list[str]:
        return [k for k in all_keys(store) if k.startswith("steps/000000000002-")]

    failing.left, failing.error = 2, OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(amber.StorageAccessError, match="No space left on device"):
        store.save(2, {"w": torch.randn(64, 64), "b": torch.randn(64, 64)})
    failing.left = None
    assert not attempts()  # deleting frees the space the failure wanted
    original = stepwriter.StepWriter.add

    def bug_on_second_tensor(self, key, *args, **kwargs):
        if key == "b":
            raise RuntimeError("a bug in the middle of a save")
        return original(self, key, *args, **kwargs)

    monkeypatch.setattr(stepwriter.StepWriter, "add", bug_on_second_tensor)
    with pytest.raises(RuntimeError, match="a bug"):
        store.save(2, {"w": torch.randn(64, 64), "b": torch.randn(64, 64)})
    assert not attempts()
    monkeypatch.undo()
    store.save(2, {"w": torch.randn(64, 64)})
    assert store.steps() == [1, 2]


class FullDisk(WrapperStore):
    """A disk of ``capacity`` bytes (``None``: unbounded); a write past it fails with ENOSPC."""

    def __init__(self, store):
        super().__init__(store)
        self.capacity: int | None = None

    async def used(self) -> int:
        return sum([await self._store.getsize(k) async for k in self._store.list_prefix("")])

    async def set(self, key: str, value: Buffer) -> None:
        if self.capacity is not None:
            old = await self._store.getsize(key) if await self._store.exists(key) else 0
            if await self.used() - old + len(value) > self.capacity:
                raise OSError(errno.ENOSPC, "No space left on device")
        await self._store.set(key, value)


def test_gc_on_a_full_disk_deletes_what_no_fold_reads_first_and_says_when_a_fold_cannot_fit(tmp_path):
    from amber_store.runtime import sync

    disk = FullDisk(LocalStore(tmp_path / "ckpt"))
    store = amber.open(disk, full_every=3, base_policy="chain", pack_threshold=0)
    g = torch.Generator().manual_seed(0)
    states = {k: {"w": torch.randn(64, 64, generator=g)} for k in range(1, 7)}  # fulls at 1 and 4
    for k, st in states.items():
        store.save(k, st)
    disk.capacity = sync(disk.used()) + 512  # full: folding step 5 off step 4 needs room
    report = store.gc(keep_last=2)  # deletes 1-3 (nobody reads them) before folding 5 off 4 (6 reads 5)
    assert report.rewrite == [5] and store.steps() == [5, 6]
    for k in (5, 6):
        assert_tree_bit_equal(store.load(k, lazy=False), states[k])

    tight = FullDisk(LocalStore(tmp_path / "tight"))
    other = amber.open(tight, pack_threshold=0)
    for k in (1, 2):  # a full step and a delta on it: dropping 1 means folding 2, with nothing to free first
        other.save(k, states[k])
    tight.capacity = sync(tight.used()) + 512
    with pytest.raises(amber.StorageAccessError, match=r"out of space folding step 2 off deleted steps \[1\]"):
        other.gc(keep_last=1)
    assert other.steps() == [1, 2]  # nothing lost, and the failed fold gave its space back
    assert sync(tight.used()) <= tight.capacity
    for k in (1, 2):
        assert_tree_bit_equal(other.load(k, lazy=False), states[k])


def test_deleting_one_step_keeps_every_other_step_bit_exact_and_the_writer_saving(make_store):
    store = make_store(full_every=4, base_policy="chain")
    g = torch.Generator().manual_seed(3)
    states = {}
    for k in range(1, 7):
        states[k] = {"w": torch.randn(64, 64, generator=g), "step": k}
        store.save(k, states[k])
    report = store.delete(2)  # 3 diffs against it; 4 against 3, whole again once 3 is folded
    assert report.rewrite == [3] and store.steps() == [1, 3, 4, 5, 6]
    store.delete(6)  # this writer's newest step
    states[7] = {"w": torch.randn(64, 64, generator=g), "step": 7}
    store.save(7, states[7])
    reader = make_store(mode="r")
    for k in (1, 3, 4, 5, 7):
        assert_tree_bit_equal(reader.load(k, lazy=False), states[k])
    store.pin(5, "best")
    with pytest.raises(amber.AmberError, match="step 5 is pinned \\(best\\); unpin it first"):
        store.delete(5)
    with pytest.raises(amber.StepNotFoundError):
        store.delete(2)


def test_retention_policies_compose_and_rank_by_saved_metrics():
    from amber_store.retention import AnyOf, BestN, EveryNSteps, LatestN, StepInfo

    infos = [StepInfo(s, {"loss": loss} if loss is not None else {}, False)
             for s, loss in [(10, 3.0), (20, 1.0), (30, None), (40, 2.0), (50, 1.0), (60, 4.0)]]
    assert LatestN(2).should_preserve(infos) == [False] * 4 + [True] * 2
    assert EveryNSteps(20).should_preserve(infos) == [False, True, False, True, False, True]
    assert BestN(2, "loss").should_preserve(infos) == [False, True, False, False, True, False]
    assert BestN(1, "loss").should_preserve(infos) == [False, True] + [False] * 4  # a tie: the older step
    assert BestN(1, "loss", "max").should_preserve(infos) == [False] * 5 + [True]
    assert BestN(1, lambda m: -m.get("loss", 0.0)).should_preserve(infos) == [False] * 5 + [True]
    assert AnyOf(LatestN(1), BestN(1, "loss")).should_preserve(infos) == [False, True, False, False, False, True]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        LatestN(0)


def test_gc_keeps_the_best_steps_by_metric_plus_pinned_and_latest_bit_exact(make_store):
    from amber_store.retention import BestN

    store = make_store(full_every=3)
    g = torch.Generator().manual_seed(5)
    losses = {1: 3.0, 2: 1.5, 3: 2.5, 4: 0.5, 5: 2.0, 6: 4.0, 7: 3.5}
    states = {}
    for k, loss in losses.items():
        states[k] = {"w": torch.randn(32, 32, generator=g)}
        store.save(k, states[k], metrics={"loss": loss})
    store.pin(1, "first")
    report = store.gc(policy=BestN(2, "loss"))
    assert report.keep == [1, 2, 4, 7]  # the two best (4, 2), the pinned 1, the latest 7
    for k in report.keep:
        assert_tree_bit_equal(store.load(k, lazy=False), states[k])
    assert store.manifest(4).extra["metrics"] == {"loss": 0.5}
    with pytest.raises(ValueError, match="cannot rank it"):
        store.save(8, states[7], metrics={"loss": float("nan")})


def test_gc_spares_the_data_of_a_save_that_may_still_be_running(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    store.save(1, {"w": torch.ones(8)})
    in_flight = tmp_path / "ckpt" / "steps" / "000000000002-abcdef01" / "w" / "c" / "0"
    in_flight.parent.mkdir(parents=True)
    in_flight.write_bytes(b"partial")
    store.gc()
    assert in_flight.exists()  # no group metadata yet: a save that has only just begun
    store.save(2, {"w": torch.zeros(8)})
    store.gc()  # once a newer step is committed, nothing can still be writing that attempt
    assert not in_flight.exists()


def test_pins_survive_gc_and_bad_policies_are_refused(make_store):
    store = make_store(full_every=3)
    for step in range(1, 8):
        store.save(step, {"x": torch.full((4,), float(step))})
    store.pin(2, "release-1")
    assert store.pins() == {"release-1": 2}
    store.gc(keep_last=1)
    assert store.steps() == [2, 7]
    store.unpin("release-1")
    store.gc(keep_last=1)
    assert store.steps() == [7]
    with pytest.raises(ValueError, match="keep_last"):
        store.gc(keep_last=0)
    with pytest.raises(ValueError, match="pin name"):
        store.pin(7, "bad/name")
    with pytest.raises(amber.StepNotFoundError):
        store.pin(99, "nope")


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_loads_into_a_fresh_model_with_identical_outputs(local_store, tmp_path, suffix):
    cfg = GPTConfig(context=8, width=16, layers=1, heads=2)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters())
    store = local_store()
    store.save(1, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    store.save(2, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2})
    out = store.export(2, tmp_path / f"export{suffix}")
    torch.manual_seed(1)
    fresh = TinyGPT(cfg)
    if suffix == ".safetensors":
        fresh.load_state_dict(load_file(out))
    else:
        state = torch.load(out, weights_only=True)
        assert state["step"] == 2 and "optim" in state
        fresh.load_state_dict(state["model"])
    x = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_import_of_torch_save_and_safetensors_files_as_full_steps(local_store, tmp_path):
    from safetensors.torch import save_file

    state = {"model": {"w": torch.randn(5, 5)}, "step": 3, "betas": (0.9, 0.99)}
    torch.save(state, tmp_path / "ckpt.pt")
    save_file({"w": torch.arange(6.0)}, str(tmp_path / "w.safetensors"))
    store = local_store()
    assert amber.import_checkpoint(store, 3, tmp_path / "ckpt.pt").kind == "full"
    assert amber.import_checkpoint(store, 4, tmp_path / "w.safetensors").kind == "full"
    assert_tree_bit_equal(store.load(3, lazy=False), state)
    assert_tree_bit_equal(store.load(4, lazy=False), {"w": torch.arange(6.0)})
    with pytest.raises(ValueError, match="format"):
        amber.import_checkpoint(store, 5, tmp_path / "ckpt.unknown")


def test_du_reports_bytes_by_step_and_group(make_store):
    store = make_store()
    store.save(1, {"model": {"w": torch.randn(100)}, "optim": {"m": torch.randn(50)}})
    store.save(2, {"model": {"w": torch.randn(100)}, "optim": {"m": torch.randn(50)}})
    du = store.du()
    assert set(du["steps"]) == {1, 2} and set(du["groups"]) == {"model", "optim"}
    assert du["total"] == sum(du["steps"].values()) == sum(du["groups"].values()) > 0


def test_a_long_run_keeps_only_a_bounded_number_of_manifests_in_memory(tmp_path):
    from amber_store.history import MANIFEST_CACHE

    store = amber.open(tmp_path / "ckpt", full_every=5, durable=False)
    g = torch.Generator().manual_seed(0)
    states = {}
    for step in range(3 * MANIFEST_CACHE):
        states[step] = {"w": torch.randn(64, generator=g), "b": torch.randn(8, generator=g)}
        store.save(step, states[step])
    assert len(store.history._manifests) <= MANIFEST_CACHE
    for step in (0, MANIFEST_CACHE, 3 * MANIFEST_CACHE - 1):  # evicted ones are read again
        assert_tree_bit_equal(store.load(step, lazy=False), states[step])
    assert len(store.history._manifests) <= MANIFEST_CACHE


def test_loading_a_chain_longer_than_the_manifest_cache_reads_each_manifest_once(tmp_path, monkeypatch):
    from amber_store import history
    from amber_store.history import MANIFEST_CACHE

    depth = MANIFEST_CACHE + 8
    store = amber.open(tmp_path / "ckpt", full_every=depth + 1, base_policy="chain", codec="lossy", durable=False)
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(300, generator=g) for i in range(4)}
    for step in range(depth + 1):
        state = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in state.items()}
        store.save(step, state)
    reads: list[int] = []
    original = history.History._read_manifest

    async def counted(self, step):
        reads.append(step)
        return await original(self, step)

    monkeypatch.setattr(history.History, "_read_manifest", counted)
    reader = amber.open(tmp_path / "ckpt", mode="r")
    reader.load(depth, lazy=False)
    assert sorted(reads) == list(range(depth + 1))  # each step of the chain once, for every tensor


def test_a_tensor_stored_full_by_a_fold_is_not_said_to_be_full_above():
    from types import SimpleNamespace

    from amber_store.format import TensorEntry
    from amber_store.usage import _full_in_delta

    was = TensorEntry("float32", [4], [4], "full", None, "steps/000000000001-a/w", [0], 16)
    full = TensorEntry("float32", [4], [4], "full", None, "steps/000000000003-f/w", [0], 16)
    base = SimpleNamespace(step=1)
    fold = {"group": "steps/000000000003-f", "at": 0.0, "from": [2]}
    assert _full_in_delta(full, was, base, fold) == "stored full by gc, which deleted step(s) [2] of its chain"
    saved = TensorEntry("float32", [4], [4], "full", None, "steps/000000000003-s/w", [0], 16)  # its own save's group
    assert "no longer paid (full_above)" in _full_in_delta(saved, was, base, fold)


def test_gc_bookkeeping_reads_keep_at_most_their_limit_in_flight_and_answer_in_order():
    import asyncio

    from amber_store.runtime import gather, sync

    flight = {"now": 0, "most": 0}

    async def read(i: int) -> int:
        flight["now"] += 1
        flight["most"] = max(flight["most"], flight["now"])
        await asyncio.sleep(0.001 * (i % 3))
        flight["now"] -= 1
        return i

    assert sync(gather((read(i) for i in range(100)), limit=7)) == list(range(100))
    assert flight["most"] == 7
    assert sync(gather(read(i) for i in range(100))) == list(range(100))
    assert flight["most"] == 100  # (no limit: all at once)


def test_gc_uncommits_a_step_only_once_no_step_still_committed_reads_it_and_chains_side_by_side():
    import asyncio

    from amber_store.retention import _uncommit
    from amber_store.runtime import sync

    # two chains (1 <- 2 <- 3, 1 <- 4; 10 <- 11 <- 12) and a step whose index cannot say what it reads
    reads = {1: set(), 2: {1}, 3: {2}, 4: {1}, 10: set(), 11: {10}, 12: {11}, 20: None, 21: None}
    committed = set(reads)
    flight = {"now": 0, "most": 0}

    class Chains:  # (and the history it reads)
        history = property(lambda self: self)

        async def reads(self, step: int) -> set[int] | None:
            return reads[step]

        async def uncommit(self, step: int) -> None:
            readers = {s for s in committed - {step} if step in (reads[s] if reads[s] is not None else range(s))}
            assert not readers, f"step {step} uncommitted while {readers} still read it"
            flight["now"] += 1
            flight["most"] = max(flight["most"], flight["now"])
            await asyncio.sleep(0.01)
            committed.discard(step)
            flight["now"] -= 1

    sync(_uncommit(Chains(), sorted(reads)))
    assert not committed and flight["most"] >= 3  # (3, 4, 12 and 21 need nothing first)


def test_reads_ahead_hand_values_over_in_order_within_their_byte_budget_and_stop_with_the_caller():
    import asyncio

    from amber_store.runtime import Budget, ahead, sync

    flight = {"now": 0, "most": 0, "started": 0}

    async def read(i: int) -> int:
        flight["started"] += 1
        flight["now"] += 1
        flight["most"] = max(flight["most"], flight["now"])
        await asyncio.sleep(0.05 if i % 4 == 0 else 0.001)  # (the next ones start while the first waits)
        flight["now"] -= 1
        return i * i

    assert list(ahead(range(20), read, lambda i: 10, budget=40)) == [(i, i * i) for i in range(20)]
    assert flight["most"] == 4  # 40 bytes of 10-byte values in flight, read side by side
    assert [k for k, _ in ahead(range(3), read, lambda i: 100, budget=40)] == [0, 1, 2]  # each alone above it
    flight.update(started=0)
    values = ahead(range(100), read, lambda i: 10, budget=50)
    assert next(values) == (0, 0)
    values.close()  # the caller stops: nothing more is read
    assert flight["started"] <= 6

    budget = Budget(100)

    async def hold(n: int) -> None:
        async with budget.hold(n):
            flight["now"] += n
            flight["most"] = max(flight["most"], flight["now"])
            await asyncio.sleep(0.005)
            flight["now"] -= n

    async def run(sizes: list[int]) -> None:
        await asyncio.gather(*(hold(n) for n in sizes))

    flight.update(now=0, most=0)
    sync(run([30] * 10 + [250]))
    assert flight["most"] == 250 and budget.free == 100  # the large one alone, the rest three at a time
    flight.update(most=0)
    sync(run([30] * 10))
    assert flight["most"] == 90
