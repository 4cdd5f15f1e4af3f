"""Async saves: snapshot semantics, back-pressure, failures, and the CheckpointManager."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import warnings

import pytest
import torch
from zarr.core.buffer import Buffer
from zarr.storage import LocalStore, WrapperStore

import amber_store as amber
from amber_store.demo import GPTConfig, Trainer, corpus
from conftest import all_keys, is_data_key, assert_bit_equal, assert_tree_bit_equal


class SlowStore(WrapperStore):
    """Every chunk write takes ``delay`` seconds (an overloaded disk or link); can be made to fail."""

    def __init__(self, store, delay: float = 0.05):
        super().__init__(store)
        self.delay = delay
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()  # set once a write waits at the closed gate

    async def set(self, key: str, value: Buffer) -> None:
        if is_data_key(key):
            if not self.gate.is_set():
                self.held.set()
            await asyncio.to_thread(self.gate.wait)
            await asyncio.sleep(self.delay)
            if self.fail:
                raise OSError(f"injected failure writing {key}")
        await self._store.set(key, value)


def state(seed: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(128, 128, generator=g) for i in range(n)}


def test_save_async_returns_before_the_writes_finish(tmp_path):
    slow = SlowStore(LocalStore(tmp_path / "ckpt"), delay=0.2)
    store = amber.open(slow)
    t0 = time.perf_counter()
    fut = store.save_async(1, state(1))
    returned = time.perf_counter() - t0
    assert not fut.done()
    info = fut.result(timeout=60)
    total = time.perf_counter() - t0
    assert returned < total / 4, (returned, total)
    assert info.step == 1 and store.steps() == [1]


@pytest.mark.parametrize("snapshot", ["host", "device"])
@pytest.mark.parametrize("n", [4, 300])  # 300 small tensors: copied on helper threads
def test_tensors_mutated_right_after_save_async_do_not_leak_into_the_step(tmp_path, snapshot, n):
    slow = SlowStore(LocalStore(tmp_path / "ckpt"))
    store = amber.open(slow, snapshot=snapshot)
    live = state(2, n)
    expected = {k: v.clone() for k, v in live.items()}
    slow.gate.clear()  # hold the writes until the caller has scribbled over its tensors
    fut = store.save_async(1, live)
    for t in live.values():
        t.mul_(-3).add_(1)
    slow.gate.set()
    fut.result(timeout=60)
    assert_tree_bit_equal(amber.open(tmp_path / "ckpt", mode="r").load(1, lazy=False), expected)


@pytest.mark.parametrize("snapshot", ["host", "device"])
@pytest.mark.parametrize("layers", [1, 150])  # 300 parameters: copied on helper threads
def test_parameters_that_require_grad_are_snapshotted_without_autograd(tmp_path, snapshot, layers):
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(layers)))
    store = amber.open(tmp_path / "ckpt", snapshot=snapshot)
    params = dict(model.named_parameters())  # requires_grad, not state_dict()'s detached views
    store.save_async(1, params).result(timeout=60)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    store.save_async(2, params).result(timeout=60)
    got = store.load(2, lazy=False)
    assert_bit_equal(got["0.weight"], model[0].weight.detach())
    assert not any(t.requires_grad for t in got.values()) and model[0].weight.grad is None


def take(snapshots, tensors: dict) -> dict:
    return snapshots.take(lambda: (None, tensors))[1]


def test_snapshot_buffers_are_reused_while_the_layout_holds_and_replaced_where_it_changes():
    from amber_store.snapshot import Snapshots

    snapshots = Snapshots()
    live = state(3, 300)
    first = take(snapshots, live)
    addresses = {k: v.data_ptr() for k, v in first.items()}
    snapshots.give_back(first)
    live["t0"].add_(1)
    again = take(snapshots, live)
    assert {k: v.data_ptr() for k, v in again.items()} == addresses
    assert_tree_bit_equal(again, live)
    snapshots.give_back(again)
    # one tensor changes shape, one dtype, one key is new and one is gone: each is still copied exactly
    live["t1"] = torch.randn(3, 5)
    live["t2"] = live["t2"].double()
    live["t300"] = torch.arange(7)
    del live["t3"]
    changed = take(snapshots, live)
    assert_tree_bit_equal(changed, live)
    assert changed["t4"].data_ptr() == addresses["t4"]  # unchanged tensors keep their buffers
    assert all(changed[k].data_ptr() != live[k].data_ptr() for k in live)


@pytest.mark.parametrize("change", ["none", "new objects", "some new objects", "resized", "reordered", "one more",
                                    "one less"])
def test_a_snapshot_holds_exactly_what_the_walk_found_whatever_was_copied_ahead(change):
    from amber_store.snapshot import Snapshots

    snapshots = Snapshots()
    live = {f"t{i}": torch.randn(400, 400) for i in range(40)}
    for _ in range(2):  # the next snapshot copies these ahead of the walk, on two threads at the pace of the 2nd
        snapshots.give_back(take(snapshots, live))
    assert snapshots._free[0].pace is not None
    before = live  # alive, so copied ahead: the wrong guess when the state holds new objects
    live = {k: t + 1 for k, t in before.items()} if change == "new objects" else live
    if change == "some new objects":  # a model's state_dict() (new tensors) beside an optimizer's (kept)
        for k in list(live)[1::2]:
            live[k] = live[k] + 1  # the tensor replaced is gone: copied ahead are only those still alive
    if change == "resized":
        live["t39"].resize_(3)
    elif change == "reordered":
        live = dict(reversed(live.items()))
    elif change == "one more":
        live["t40"] = torch.randn(5)
    elif change == "one less":
        del live["t39"]
    for t in (live["t0"], live[list(live)[-1]]):  # the first and last: copied by one thread and the other
        t.add_(1)
    assert_tree_bit_equal(take(snapshots, live), live)


def test_a_walk_that_fails_lends_nothing_and_the_next_snapshot_is_exact():
    from amber_store.snapshot import Snapshots

    snapshots = Snapshots()
    live = {f"t{i}": torch.randn(400, 400) for i in range(40)}
    snapshots.give_back(take(snapshots, live))

    def fails():
        raise ValueError("walk failed")

    with pytest.raises(ValueError, match="walk failed"):
        snapshots.take(fails)
    live["t6"].mul_(3)
    assert_tree_bit_equal(take(snapshots, live), live)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_snapshot_walks_with_the_garbage_collector_paused_and_leaves_it_as_it_was(enabled):
    import gc

    from amber_store.snapshot import Snapshots

    snapshots, seen = Snapshots(), []
    live = {"t": torch.randn(8)}

    def walk(fail: bool = False):
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("walk failed")
        return None, live

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        snapshots.give_back(snapshots.take(walk)[1])
        after_take = gc.isenabled()
        with pytest.raises(ValueError):
            snapshots.take(lambda: walk(fail=True))
        after_failure = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False] and after_take is enabled and after_failure is enabled


def test_a_snapshot_keeps_no_tensor_of_the_state_alive():
    import gc
    import weakref

    from amber_store.snapshot import Snapshots

    snapshots = Snapshots()
    live = state(5, 100)
    snapshots.give_back(take(snapshots, live))
    watch = weakref.ref(live["t0"])
    del live
    gc.collect()
    assert watch() is None
    other = state(6, 100)  # a new state of the same layout once the old one is gone
    assert_tree_bit_equal(take(snapshots, other), other)


def test_a_state_dropped_after_its_snapshot_is_freed_without_waiting_for_the_garbage_collector():
    import functools
    import gc
    import weakref

    from amber_store import format as fmt
    from amber_store.snapshot import Snapshots

    snapshots = Snapshots()
    live = {"model": state(3, 100), "step": 7}
    gc.disable()  # a reference cycle would keep the tensors until a collection
    try:
        memo = fmt.FlattenMemo()  # kept, as a store keeps it
        walk = functools.partial(fmt.flatten, live, memo)  # the walk save_async runs
        for _ in range(2):  # the second recalls the first's
            tree, snapshot = snapshots.take(walk)
            snapshots.give_back(snapshot)
        del walk
        watch = weakref.ref(live["model"]["t0"])
        del live
        assert watch() is None
    finally:
        gc.enable()


def test_snapshots_of_parameters_record_no_autograd_history_on_any_thread():
    from amber_store.snapshot import Snapshots

    params = {f"p{i}": torch.nn.Parameter(torch.randn(16)) for i in range(300)}  # helper threads copy these
    snapshots = Snapshots()
    for _ in range(3):  # the second is copied ahead of the walk, the third by two threads at the second's pace
        taken = take(snapshots, params)
        assert_tree_bit_equal(taken, {k: p.detach() for k, p in params.items()})
        assert not any(t.requires_grad or t.grad_fn is not None for t in taken.values())
        snapshots.give_back(taken)
        with torch.no_grad():
            params["p0"].add_(1)
            params["p299"].add_(1)


@pytest.mark.parametrize("max_pending", [1, 2])
@pytest.mark.filterwarnings("ignore:.*training has waited:RuntimeWarning")  # the point of this test
def test_back_pressure_holds_at_most_max_pending_unfinished_saves(tmp_path, max_pending):
    slow = SlowStore(LocalStore(tmp_path / "ckpt"), delay=0.02)
    store = amber.open(slow, max_pending=max_pending)
    slow.gate.clear()
    futures = [store.save_async(1, state(1))]
    for step in range(2, max_pending + 1):
        futures.append(store.save_async(step, state(step)))
    blocked = threading.Thread(target=lambda: futures.append(store.save_async(max_pending + 1, state(9))))
    blocked.start()
    blocked.join(timeout=1.0)
    assert blocked.is_alive(), "save_async should wait while max_pending saves are unfinished"
    assert sum(not f.done() for f in futures) == max_pending
    slow.gate.set()
    blocked.join(timeout=60)
    assert not blocked.is_alive()
    store.wait()
    assert store.steps() == list(range(1, max_pending + 2))
    assert len(store._snapshots._free) <= max_pending  # snapshot buffers are reused, not piled up


def held_up_warnings(store: amber.Store, slow: SlowStore, steps: range, hold: float, train: float) -> list:
    """``save_async`` of each step, each save finishing ``hold`` s after it starts, with
    ``train`` s of "training" between; the back-pressure warnings raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in steps:
            slow.gate.clear()
            store.save_async(step, state(step))
            threading.Timer(hold, slow.gate.set).start()
            time.sleep(train)
        store.wait()
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "waited" in str(w.message)]


@pytest.mark.parametrize("max_pending", [1, 2])
def test_training_held_up_a_real_share_of_its_time_is_warned_once_at_the_callers_line(tmp_path, max_pending):
    slow = SlowStore(LocalStore(tmp_path / "ckpt"), delay=0.0)
    store = amber.open(slow, max_pending=max_pending)
    held = held_up_warnings(store, slow, range(1, 12), hold=0.5, train=0.0)
    assert len(held) == 1 and held[0].filename == __file__, [(str(w.message), w.filename) for w in held]
    assert f"max_pending={max_pending}" in str(held[0].message)
    assert store.steps() == list(range(1, 12))


def test_slow_first_two_saves_are_warm_up_not_warned_about(tmp_path):
    # a full step, then the first delta: on a fresh install its kernels compile (7 s here)
    slow = SlowStore(LocalStore(tmp_path / "ckpt"), delay=0.0)
    store = amber.open(slow, max_pending=1)
    assert held_up_warnings(store, slow, range(1, 3), hold=3.5, train=0.0) == []
    assert held_up_warnings(store, slow, range(3, 8), hold=0.0, train=0.1) == []
    assert store.steps() == list(range(1, 8))


def test_back_pressure_is_warned_about_by_its_share_of_the_training_time(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(40):  # 0.3 s of every 5 s: 6%, 12 s in all
            store._warn_if_held_up(i, 0.3, 5.0 * i)
        assert caught == []
        for i in range(40, 50):  # now 3 s of every 5 s: once the waits pass 10% of the time, warned
            store._warn_if_held_up(i, 3.0, 5.0 * i)
    # (the clock starts at the third call, once the first two saves are done)
    assert len(caught) == 1 and "by step 42, training has waited 20.1 s of 200.0 s" in str(caught[0].message)


def test_a_background_failure_surfaces_on_the_future_and_on_the_next_call(tmp_path):
    slow = SlowStore(LocalStore(tmp_path / "ckpt"), delay=0.0)
    store = amber.open(slow)
    store.save(1, state(1))
    slow.fail = True
    fut = store.save_async(2, state(2))
    assert isinstance(fut.exception(timeout=60), amber.StorageAccessError)
    slow.fail = False
    with pytest.raises(amber.AsyncSaveError, match="background save of step 2 failed") as err:
        store.save_async(3, state(3))
    assert err.value.step == 2
    store.save_async(3, state(3)).result(timeout=60)  # reported once; the store carries on
    assert store.steps() == [1, 3]
    slow.fail = True
    store.save_async(4, state(4))
    with pytest.raises(amber.AsyncSaveError):
        store.wait()
    slow.fail = False
    with pytest.raises(amber.StepOrderError):
        store.save_async(3, state(3))


def test_sync_save_waits_for_pending_async_saves_in_order(tmp_path):
    slow = SlowStore(LocalStore(tmp_path / "ckpt"), delay=0.01)
    store = amber.open(slow)
    s1, s2 = state(1), state(2)
    store.save_async(1, s1)
    info = store.save(2, s2)
    assert info.kind == "delta" and info.base == 1
    reader = amber.open(tmp_path / "ckpt", mode="r")
    assert_tree_bit_equal(reader.load(1, lazy=False), s1)
    assert_tree_bit_equal(reader.load(2, lazy=False), s2)


def test_a_save_interrupted_by_ctrl_c_deletes_its_data_before_the_interrupt_returns(tmp_path, request):
    # A suite run as a background job (`make test &`) inherits SIGINT ignored, and Python keeps
    # it so: Ctrl-C then does nothing, and this test's save waited out its 300 s deadline.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, handler))
    slow = SlowStore(LocalStore(tmp_path / "ckpt"), delay=0.0)
    store = amber.open(slow)
    s1, s2 = state(1), state(2)
    store.save(1, s1)
    slow.gate.clear()  # the next save's data writes wait: Ctrl-C comes while they do
    main = threading.main_thread().ident

    def interrupt() -> None:
        # to the main thread, where a terminal's Ctrl-C lands; then the storage answers again
        if slow.held.wait(120):
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.2)
        slow.gate.set()  # (never held: the save finishes and the test fails, rather than hangs)

    ctrl_c = threading.Thread(target=interrupt)
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            store.save(2, s2)
        assert not [k for k in all_keys(store) if k.startswith("steps/000000000002-")]
    finally:
        ctrl_c.join()
        slow.gate.set()
    time.sleep(0.5)  # the interrupted save must not commit, nor write, later
    assert store.steps() == [1] and not [k for k in all_keys(store) if k.startswith("steps/000000000002-")]
    assert store.save(2, s2).step == 2
    reader = amber.open(tmp_path / "ckpt", mode="r")
    assert_tree_bit_equal(reader.load(1, lazy=False), s1)
    assert_tree_bit_equal(reader.load(2, lazy=False), s2)


def test_close_waits_for_a_save_that_another_thread_runs(tmp_path):
    slow = SlowStore(LocalStore(tmp_path / "ckpt"), delay=0.0)
    store = amber.open(slow)
    store.save(1, state(1))
    slow.gate.clear()
    saving = threading.Thread(target=store.save, args=(2, state(2)))
    saving.start()
    assert slow.held.wait(30)  # that save now waits for its data writes
    threading.Timer(0.3, slow.gate.set).start()
    store.close()
    assert amber.open(tmp_path / "ckpt", mode="r").steps() == [1, 2]
    saving.join()


def test_a_closed_store_saves_again_in_the_foreground_and_the_background(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    states = {i: state(i) for i in (1, 2, 3)}
    store.save_async(1, states[1])
    store.close()
    store.save(2, states[2])
    assert store.save_async(3, states[3]).result(timeout=60).step == 3
    store.close()
    reader = amber.open(tmp_path / "ckpt", mode="r")
    for i, s in states.items():
        assert_tree_bit_equal(reader.load(i, lazy=False), s)


CFG = GPTConfig(context=16, width=32, layers=1, heads=2)


def test_checkpoint_manager_resume_continues_bit_identically(make_store, location):
    uri, opts = location
    text = corpus(100_000)
    reference = Trainer(CFG, batch=4, data=text)
    with amber.CheckpointManager(uri, storage_options=opts, every=3, full_every=3, keep_last=2) as manager:
        assert manager.restore(reference.model, reference.opt) is None
        for step in range(1, 10):
            reference.step(step)
            manager.maybe_save(step, model=reference.model, optimizer=reference.opt, extra={"data_pos": step * 4})
    assert make_store(mode="r").steps() == [6, 9]  # retention ran after each save

    resumed = Trainer(CFG, batch=4, data=text, init_seed=99)
    manager = amber.CheckpointManager.from_config({"uri": uri, "storage_options": opts, "every": 3})
    start = manager.restore(resumed.model, resumed.opt, step=6)
    assert start == 6 and manager.extra == {"data_pos": 24}
    for step in range(7, 10):
        resumed.step(step)
    assert_tree_bit_equal(resumed.state(9), reference.state(9))
    manager.close()


def test_manager_answers_to_orbax_names(tmp_path):
    manager = amber.CheckpointManager(str(tmp_path / "ckpt"), every=2)
    model = torch.nn.Linear(3, 3)
    for step in range(1, 7):
        assert manager.should_save(step) == (step % 2 == 0)
        manager.maybe_save(step, model=model)
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 4, 6] and manager.latest_step() == 6
    manager.delete(4)
    assert manager.all_steps() == [2, 6]
    manager.close()


def test_manager_keeps_the_best_steps_by_a_metric_like_top_k(tmp_path):
    manager = amber.CheckpointManager(str(tmp_path / "ckpt"), every=1, keep_best=2, best_fn="acc", best_mode="max")
    model = torch.nn.Linear(3, 3)
    for step, acc in enumerate([0.5, 0.9, 0.7, 0.8, 0.6], start=1):
        manager.maybe_save(step, model=model, metrics={"acc": acc})
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 4, 5]  # the two best, and the latest
    manager.close()


def test_manager_without_async_and_config_errors(tmp_path):
    with pytest.raises(ValueError, match="uri"):
        amber.CheckpointManager.from_config({"every": 3})
    manager = amber.CheckpointManager(str(tmp_path / "c"), every=2, async_save=False)
    model = torch.nn.Linear(3, 3)
    assert manager.maybe_save(1, model=model) is None
    info = manager.maybe_save(2, model=model)
    assert isinstance(info, amber.CommitInfo) and info.step == 2
    assert_bit_equal(manager.store.load(2)["model"]["weight"].materialize(), model.weight.detach())
    manager.close()


def test_bad_async_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="snapshot"):
        amber.open(tmp_path / "a", snapshot="gpu")
    with pytest.raises(ValueError, match="max_pending"):
        amber.open(tmp_path / "b", max_pending=0)
