"""Bad input and failures: clear errors, and nothing committed is ever lost."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import pytest
import torch
from zarr.core.buffer import Buffer
from amber_store.runtime import sync
from zarr.storage import LocalStore, WrapperStore

import amber_store as amber
from amber_store import format as fmt
from amber_store.history import History
from amber_store.runtime import event_loop
from amber_store.storage import resolve
from amber_store.storage import local
from amber_store.storage.local import MAP_MIN_BYTES
from amber_store.usage import Usage
from amber_store.writer import Writer
from conftest import flip_stored_byte, is_data_key, stored_chunk, save_at_once, assert_bit_equal, assert_tree_bit_equal


class FailingStore(WrapperStore):
    """Raises on the n-th chunk write after being armed, like a disk or network failing mid-save."""

    def __init__(self, store, fail_after: int | None = None):
        super().__init__(store)
        self.fail_after = fail_after
        self._lock = threading.Lock()

    async def set(self, key: str, value: Buffer) -> None:
        if self.fail_after is not None and is_data_key(key):
            with self._lock:
                self.fail_after -= 1
                fail = self.fail_after < 0
            if fail:
                raise OSError(f"injected failure writing {key}")
        await self._store.set(key, value)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(32, 32, generator=g) for i in range(6)}


@pytest.mark.parametrize("fail_after", [0, 3])
def test_interrupted_save_leaves_prior_steps_intact_and_the_step_invisible(tmp_path, fail_after):
    failing = FailingStore(LocalStore(tmp_path / "ckpt"))
    store = amber.open(failing, pack_threshold=0)  # an object per tensor: fail between them
    s1, s2 = state(1), state(2)
    store.save(1, s1)
    failing.fail_after = fail_after
    with pytest.raises(OSError, match="injected"):
        store.save(2, s2)
    failing.fail_after = None
    assert store.steps() == [1]
    assert amber.open(tmp_path / "ckpt", mode="r").steps() == [1]
    with pytest.raises(amber.StepNotFoundError):
        store.load(2)
    assert_tree_bit_equal(amber.open(tmp_path / "ckpt", mode="r").load(1, lazy=False), s1)
    # The retry of the same step writes a fresh attempt, never reusing the orphaned chunks.
    info = store.save(2, s2)
    assert info.kind == "delta"
    assert_tree_bit_equal(amber.open(tmp_path / "ckpt", mode="r").load(2, lazy=False), s2)


@pytest.mark.parametrize("pack_threshold", [0, fmt.DEFAULT_PACK_THRESHOLD], ids=["sharded", "packed"])
def test_flipped_byte_in_a_chunk_is_detected_naming_step_and_tensor(local_store, tmp_path, pack_threshold):
    store = local_store(pack_threshold=pack_threshold)
    s = state(0)
    store.save(1, s)
    s["t3"] += 1
    store.save(2, s)
    flip_stored_byte(tmp_path / "ckpt", store, 1, "t3")
    reader = local_store(mode="r")
    for step in (1, 2):  # the damaged base also poisons the delta step built on it
        with pytest.raises(amber.CorruptDataError, match="step 1, tensor 't3'") as err:
            reader.load(step)["t3"].materialize()
        assert err.value.step == 1 and err.value.tensor == "t3"
    if not pack_threshold:  # (packed, its neighbours in the same pack chunk are damaged too)
        assert_bit_equal(reader.load(2)["t2"].materialize(), s["t2"])  # the rest still loads


def test_damage_in_a_pack_is_reported_against_the_tensors_it_holds_and_the_rest_of_the_step_loads(local_store, tmp_path):
    store = local_store(chunk_bytes=4096)  # 1 KiB tensors, packed: 4 to an inner pack chunk of 4 KiB
    s = {f"t{i:02d}": torch.randn(256, generator=torch.Generator().manual_seed(i)) for i in range(20)}
    store.save(1, s)
    flip_stored_byte(tmp_path / "ckpt", store, 1, "t05")  # the pack's chunk 1: t04-t07
    damaged = {"t04", "t05", "t06", "t07"}
    reader = local_store(mode="r")
    report = reader.verify(1)[1]
    assert {k for k, e in report.items() if e} == damaged
    for key in damaged:
        assert f"tensor {key!r}" in report[key] and "pack 'pack' chunk 1 failed its checksum" in report[key]
    with pytest.raises(amber.CorruptDataError, match="tensor 't0[4-7]'"):  # whichever is read first
        reader.load(1, lazy=False)
    with pytest.warns(RuntimeWarning, match="left out 4 damaged tensor.s.: t04, t05, t06, t07"):
        partial = reader.load(1, lazy=False, strict=False)
    assert_tree_bit_equal(partial, {k: v for k, v in s.items() if k not in damaged})
    assert_bit_equal(reader.load(1)["t08"].materialize(), s["t08"])  # and lazily, one tensor
    out = subprocess.run([sys.executable, "-m", "amber_store.cli", "verify", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=120)
    fails = [line for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert out.returncode == 1 and len(fails) == 4 and all(f"tensor {k}:" in " ".join(fails) for k in damaged)
    assert out.stdout.splitlines()[-1] == "DAMAGED: 1 step(s), 20 tensor(s) checked: 16 intact, 4 damaged"


def test_a_chunk_swapped_for_another_valid_one_fails_the_materialized_checksum(local_store, tmp_path):
    store = local_store(pack_threshold=0)
    s = {"t0": torch.full((32, 32), 0.5), "t1": torch.full((32, 32), -2.0)}  # equal-sized objects
    store.save(1, s)
    a, b = (stored_chunk(tmp_path / "ckpt", store, 1, key)[0] for key in ("t0", "t1"))
    assert a.stat().st_size == b.stat().st_size
    a.write_bytes(b.read_bytes())  # a well-formed object, but the wrong data
    with pytest.raises(amber.CorruptDataError, match=r"tensor 't0', chunk \(0, 0\): checksum mismatch"):
        local_store(mode="r").load(1)["t0"].materialize()


@pytest.mark.parametrize("pack_threshold", [0, fmt.DEFAULT_PACK_THRESHOLD], ids=["sharded", "packed"])
def test_a_missing_object_is_reported_as_corruption(local_store, tmp_path, pack_threshold):
    store = local_store(pack_threshold=pack_threshold)
    store.save(1, state(0))
    stored_chunk(tmp_path / "ckpt", store, 1, "t4")[0].unlink()  # its shard, or the step's pack
    with pytest.raises(amber.CorruptDataError, match="pack object .* is missing" if pack_threshold else "t4"):
        local_store(mode="r").load(1, lazy=False)


@pytest.mark.parametrize("damage", [b"", b'{"step": 2, "tens'])
def test_an_empty_or_truncated_commit_object_is_reported_as_corruption_of_its_step(local_store, tmp_path, damage):
    store = local_store()
    store.save(1, state(0))
    store.save(2, state(1))
    (tmp_path / "ckpt" / fmt.commit_key(2)).write_bytes(damage)
    reader = local_store(mode="r")
    with pytest.raises(amber.CorruptDataError, match=rf"manifest of step 2 .*{len(damage)} bytes\) is unreadable") as e:
        reader.load(2)
    assert e.value.step == 2
    assert_tree_bit_equal(reader.load(1, lazy=False), state(0))  # the other steps still read


def test_large_local_objects_are_read_mapped_and_a_truncated_one_is_reported_as_corruption(local_store, tmp_path):
    store = local_store(pack_threshold=0, chunk_bytes=64 << 10)
    w = torch.randn(1024, 1024)  # a 4 MiB object: above MAP_MIN_BYTES
    store.save(1, {"w": w})
    w2 = w + 1e-3 * torch.randn(1024, 1024)  # every element changes: a large delta object too
    store.save(2, {"w": w2})
    path = stored_chunk(tmp_path / "ckpt", store, 2, "w")[0]
    assert path.stat().st_size >= MAP_MIN_BYTES
    backend = local_store(mode="r").history.backend
    got = sync(backend.get(str(path.relative_to(tmp_path / "ckpt"))))
    base = got
    while not isinstance(base, mmap.mmap):  # a view of the mapped file, not a copy
        base = base.obj if isinstance(base, memoryview) else base.base
    reader = local_store(mode="r")
    assert_bit_equal(reader.load(2)["w"][150:170], w2[150:170])  # range reads of mapped objects
    assert_bit_equal(reader.load(2, lazy=False)["w"], w2)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(amber.CorruptDataError, match="step 2, tensor 'w'"):
        local_store(mode="r").load(2, lazy=False)


def test_a_mapped_read_keeps_its_bytes_when_the_object_is_replaced_or_deleted(tmp_path):
    # amber-store writes every object aside and renames it into place, never in place, so a
    # mapping taken by a reader stays valid (and unchanged) whatever happens to the name.
    backend = resolve(tmp_path)
    first, second = os.urandom(MAP_MIN_BYTES + 1), os.urandom(MAP_MIN_BYTES + 1)
    sync(backend.put_object("obj", [first[:1000], first[1000:]], durable=True))
    got = sync(backend.get("obj"))
    sync(backend.put_object("obj", [second], durable=False))
    assert got.tobytes() == first
    assert sync(backend.get("obj")).tobytes() == second
    (tmp_path / "obj").unlink()
    assert got.tobytes() == first and sync(backend.get("obj")) is None


def test_unknown_step_and_empty_store_raise_step_not_found(make_store):
    store = make_store()
    with pytest.raises(amber.StepNotFoundError, match="empty"):
        store.load()
    store.save(5, {"x": torch.ones(1)})
    with pytest.raises(amber.StepNotFoundError, match=r"step 4 is not committed .*\[5\]"):
        store.load(4)
    with pytest.raises(amber.StepNotFoundError):
        store.info(6)


def test_saving_a_step_not_newer_than_the_latest_is_refused(make_store):
    store = make_store()
    store.save(5, {"x": torch.ones(1)})
    for bad in (5, 3):
        with pytest.raises(amber.StepOrderError, match="latest committed step 5"):
            store.save(bad, {"x": torch.ones(1)})
    with pytest.raises(ValueError):
        store.save(-1, {})


def test_unsupported_leaves_and_dtypes_are_refused_before_anything_is_written(make_store):
    store = make_store()
    with pytest.raises(amber.UnsupportedStateError, match="model/fn: cannot store a builtin_function_or_method"):
        store.save(1, {"model": {"fn": print}})
    with pytest.raises(amber.UnsupportedStateError, match="complex64"):
        store.save(1, {"z": torch.zeros(2, dtype=torch.complex64)})
    assert store.steps() == []


def test_read_only_store_refuses_to_save(make_store):
    make_store().save(1, {"x": torch.ones(1)})
    with pytest.raises(PermissionError, match="read-only"):
        make_store(mode="r").save(2, {"x": torch.ones(1)})


def test_wrong_uris_fail_at_open_with_a_clear_error(tmp_path):
    with pytest.raises(amber.InvalidURIError, match="unsupported URI scheme 'nosuch'"):
        amber.open("nosuch://bucket/x")
    with pytest.raises(amber.InvalidURIError, match="needs a bucket"):
        amber.open("s3:///prefix")
    (tmp_path / "file").write_text("x")
    with pytest.raises(amber.InvalidURIError, match="not a directory"):
        amber.open(tmp_path / "file")
    with pytest.raises(amber.NotAnAmberStoreError, match="nothing to read"):
        amber.open(tmp_path / "missing", mode="r")
    with pytest.raises(ValueError, match="mode"):
        amber.open(tmp_path / "x", mode="rw")


def test_opening_what_is_not_a_store_raises_from_one_frame_and_says_what_is_there(tmp_path):
    with pytest.raises(amber.NotAnAmberStoreError, match="nothing to read") as missing:
        amber.open(tmp_path / "missing", mode="r")
    frames = traceback.extract_tb(missing.value.__traceback__)
    assert [f.name for f in frames] == ["test_opening_what_is_not_a_store_raises_from_one_frame_and_says_what_is_there",
                                        "open"]  # not zarr's sync machinery beneath
    files = tmp_path / "files"
    files.mkdir()
    torch.save({"x": torch.ones(1)}, files / "model.pt")
    for mode in ("r", "a"):
        with pytest.raises(amber.NotAnAmberStoreError,
                           match=r"checkpoint files \(model.pt\): save one into a store with `amber-store import"):
            amber.open(files, mode=mode)
    (files / ".metadata").write_bytes(b"")
    with pytest.raises(amber.NotAnAmberStoreError, match="a torch.distributed.checkpoint directory"):
        amber.open(files, mode="r")


def test_foreign_data_is_never_written_into_or_wiped(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    for mode in ("a", "w"):
        with pytest.raises(amber.NotAnAmberStoreError, match="refusing"):
            amber.open(tmp_path / "data", mode=mode)
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"


def test_a_store_from_a_newer_format_version_is_refused(local_store, tmp_path):
    local_store().save(1, {"x": torch.ones(1)})
    root = tmp_path / "ckpt" / "zarr.json"
    meta = json.loads(root.read_text())
    meta["attributes"][fmt.ROOT_ATTR]["format_version"] = fmt.FORMAT_VERSION + 1
    root.write_text(json.dumps(meta))
    with pytest.raises(amber.FormatVersionError, match="upgrade amber-store"):
        local_store(mode="r")


def test_two_writers_saving_the_same_step_at_once_commit_exactly_one(make_store):
    stores = [make_store(), make_store()]
    stores[0].save(1, {"x": torch.ones(3)})
    outcomes = save_at_once(stores, 2, [{"x": torch.full((3,), float(i))} for i in range(2)])
    won = [i for i, o in enumerate(outcomes) if isinstance(o, amber.CommitInfo)]
    assert len(won) == 1, outcomes
    lost = outcomes[1 - won[0]]
    assert isinstance(lost, (amber.ConcurrentWriterError, amber.StepOrderError)), lost
    assert_bit_equal(make_store(mode="r").load(2)["x"].materialize(), torch.full((3,), float(won[0])))


def test_more_stores_saving_at_once_than_the_event_loop_has_threads_all_commit(tmp_path):
    # Local writes run on the event loop's default executor (min(32, cores + 4) threads); the
    # threads that drive the saves must not come from it, or saves that fill it wait forever.
    n = min(32, (os.cpu_count() or 1) + 4) + 2
    stores = [amber.open(tmp_path / f"s{i}", save_timeout=60) for i in range(n)]
    states = [{"w": torch.full((256, 256), float(i)), "b": torch.full((8,), float(i))} for i in range(n)]
    outcomes = save_at_once(stores, 1, states)
    assert all(isinstance(o, amber.CommitInfo) for o in outcomes), outcomes
    for store, state in zip(stores, states):
        assert_tree_bit_equal(store.load(1, lazy=False), state)


def test_threads_saving_through_one_store_take_turns_and_a_step_not_newer_is_refused_as_such(local_store):
    store = local_store()
    states = {i: {"w": torch.full((64,), float(i)), "step": i} for i in range(1, 25)}
    errors: list[Exception] = []

    def save(steps: range) -> None:
        for i in steps:
            try:
                store.save(i, states[i])
            except amber.AmberError as e:
                errors.append(e)

    threads = [threading.Thread(target=save, args=(range(k, 25, 2),)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(e, amber.StepOrderError) and "not newer than the latest committed step" in str(e)
               for e in errors), errors
    assert len(store.steps()) + len(errors) == 24
    for i in store.steps():
        assert_tree_bit_equal(store.load(i, lazy=False), states[i])


def test_a_commit_whose_answer_was_lost_is_adopted_by_its_writer_which_saves_on(make_store, monkeypatch):
    store = make_store()
    states = {k: {"x": torch.full((64,), float(k))} for k in (1, 2, 3)}
    store.save(1, states[1])

    backend = store.history.backend
    real = backend.put_if_absent

    async def stored_then_connection_lost(key, data):
        await real(key, data)
        if key.startswith("commits/"):
            raise ConnectionResetError("the server stored the manifest, then its answer was lost")
        return True

    monkeypatch.setattr(backend, "put_if_absent", stored_then_connection_lost)
    with pytest.raises(amber.StorageAccessError, match="saving step 2 failed"):
        store.save(2, states[2])
    monkeypatch.undo()
    assert store.steps() == [1, 2]  # it did commit
    store.save(3, states[3])  # the same writer goes on: step 2 is its own
    reader = make_store(mode="r")
    for k, s in states.items():
        assert_tree_bit_equal(reader.load(k, lazy=False), s)


@pytest.mark.parametrize("late, following", [(2, 3), (3, 2)], ids=["newer-step-follows", "older-step-follows"])
def test_a_commit_that_timed_out_and_lands_during_the_next_save_is_adopted_by_its_writer(make_store, monkeypatch,
                                                                                        late, following):
    store = make_store()
    states = {k: {"x": torch.full((64,), float(k))} for k in (1, 2, 3, 4)}
    store.save(1, states[1])
    sent = []
    backend = store.history.backend
    real = backend.put_if_absent

    async def no_answer_in_time(key, data):
        if not key.startswith("commits/"):  # (the claim before it lands)
            return await real(key, data)
        sent.append((key, data))  # the request is still on its way
        raise TimeoutError

    monkeypatch.setattr(backend, "put_if_absent", no_answer_in_time)
    with pytest.raises(amber.StorageAccessError, match=f"commit of step {late} got no answer in time"):
        store.save(late, states[late])
    monkeypatch.undo()
    original = History._create

    async def lands_meanwhile(self, manifest, latest):  # after the next save listed the steps
        if sent:
            await real(*sent.pop())
        return await original(self, manifest, latest)

    monkeypatch.setattr(History, "_create", lands_meanwhile)
    if following > late:
        store.save(following, states[following])
    else:  # the writer's own late step, not another writer's, is what makes this one too old
        # (the next save settles the late commit first: sent again, step 3 is committed)
        with pytest.raises(amber.StepOrderError, match=f"step {following} is not newer than the latest committed "
                                                       f"step {late}"):
            store.save(following, states[following])
    store.save(4, states[4])  # either way the writer goes on
    reader = make_store(mode="r")
    assert reader.steps() == sorted({1, late, 4} | ({following} if following > late else set()))
    for k in reader.steps():
        assert_tree_bit_equal(reader.load(k, lazy=False), states[k])


def test_a_writer_stops_once_another_writer_has_committed_after_it(make_store):
    first, second = make_store(), make_store()
    first.save(1, {"x": torch.ones(1)})
    second.save(2, {"x": torch.ones(1)})  # a fresh writer may continue a run (a resumed job)
    with pytest.raises(amber.ConcurrentWriterError, match="step 2 was committed by another writer"):
        first.save(3, {"x": torch.ones(1)})
    assert make_store(mode="r").steps() == [1, 2]


def test_a_commit_by_another_writer_during_a_save_aborts_that_save(make_store, monkeypatch):
    a, rival = make_store(), make_store()
    a.save(1, {"x": torch.ones(3)})
    original = Writer.seal

    async def rival_commits_meanwhile(self, *args):
        if self is a.writer:
            monkeypatch.setattr(Writer, "seal", original)
            await asyncio.to_thread(rival.save, 5, {"x": torch.zeros(3)})
        return await original(self, *args)

    monkeypatch.setattr(Writer, "seal", rival_commits_meanwhile)
    with pytest.raises(amber.ConcurrentWriterError, match="while step 2 was being saved"):
        a.save(2, {"x": torch.zeros(3)})
    assert make_store(mode="r").steps() == [1, 5]


def test_commit_objects_are_created_exclusively_under_racing_writers(make_store):
    from concurrent.futures import ThreadPoolExecutor

    from amber_store.runtime import sync

    store = make_store()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: sync(store.history.backend.put_if_absent("commits/race.json", b"%d" % i)),
                                range(8)))
    assert results.count(True) == 1
    assert sync(store.history.backend.put_if_absent("commits/race.json", b"late")) is False


def test_a_store_reopened_in_a_new_process_reads_everything_back(local_store, tmp_path):
    store = local_store()
    s = state(7)
    store.save(1, s)
    s["t0"][0] = 42
    store.save(2, s)
    torch.save(s, tmp_path / "expected.pt")
    code = (
        "import sys, torch, amber_store as amber\n"
        "st = amber.open(sys.argv[1], mode='r')\n"
        "got = st.load(2, lazy=False)\n"
        "want = torch.load(sys.argv[2])\n"
        "assert st.steps() == [1, 2]\n"
        "assert all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want)\n"
        "print('ok', len(got))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt"), str(tmp_path / "expected.pt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok 6"


def test_every_object_of_a_step_is_fsynced_before_its_commit_is_written(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    root = tmp_path / "ckpt"
    store = amber.open(root, pack_threshold=1024)
    store.save(1, {"big": torch.randn(64, 64), "small": torch.randn(8)})
    m = store.manifest(1)
    objects = [str(root / fmt.shard_key(m.tensors["big"].array, 2)),
               str(root / fmt.shard_key(m.packs["pack"]["array"], 1)),
               str(root / m.group / "zarr.json"), str(root / m.group)]
    commit = next(i for i, p in enumerate(synced) if "000000000001.json" in p)  # the manifest, written aside
    assert all(p in synced[:commit] for p in objects), (objects, synced)


def test_a_412_without_a_condition_in_its_body_means_the_commit_object_exists():
    # SeaweedFS and MinIO answer a losing If-None-Match PUT with 412 and no <Condition>; s3fs then
    # raises OSError(EINVAL) from botocore's ClientError, not FileExistsError (seen on SeaweedFS).
    from botocore.exceptions import ClientError

    from amber_store.storage.s3 import S3Backend

    class LosingS3:
        async_impl = asynchronous = True

        async def _pipe_file(self, path, data, mode, **kwargs):
            error = ClientError({"Error": {"Code": "PreconditionFailed", "Message": "At least one of the "
                                           "pre-conditions you specified did not hold"},
                                 "ResponseMetadata": {"HTTPStatusCode": 412}}, "PutObject")
            raise OSError(22, "At least one of the pre-conditions you specified did not hold") from error

    class BrokenS3:
        async_impl = asynchronous = True

        async def _pipe_file(self, path, data, mode, **kwargs):
            raise OSError(5, "connection reset")

    assert asyncio.run(S3Backend(LosingS3(), "b/x", "s3://b/x", False).put_if_absent("k", b"m")) is False
    with pytest.raises(OSError, match="connection reset"):
        asyncio.run(S3Backend(BrokenS3(), "b/x", "s3://b/x", False).put_if_absent("k", b"m"))


def test_a_damaged_chunk_in_an_eager_load_raises_once_with_its_chunk_and_nothing_else_is_printed(local_store, tmp_path):
    store = local_store(chunk_bytes=1024, pack_threshold=0)
    state = {f"t{i}": torch.randn(64, 64) for i in range(16)}
    store.save(1, state)
    flip_stored_byte(tmp_path / "ckpt", store, 1, "t7")
    code = (
        "import sys, amber_store as amber\n"
        "try:\n"
        "    amber.open(sys.argv[1], mode='r').load(1, lazy=False)\n"
        "except amber.CorruptDataError as e:\n"
        "    print(e.tensor, e.chunk)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "t7 (0, 0)"
    assert out.stderr == ""


@pytest.mark.parametrize("options, message", [
    ({"full_every": 0}, "full_every must be >= 1"),
    ({"base_policy": "nearest"}, "base_policy must be one of"),
    ({"save_timeout": -1}, "save_timeout must be 'auto', None or a positive number"),
    ({"max_pending": 0}, "max_pending must be >= 1"),
    ({"full_above": 0}, "full_above must be a positive share or None"),
    ({"snapshot": "disk"}, "snapshot must be 'host' or 'device'"),
    ({"compressor": "gzip"}, "compressor must be 'auto', 'lz4' or 'zstd'"),
    ({"codec": "zip"}, "unknown codec 'zip'"),
    ({"ful_every": 5}, "unexpected keyword argument 'ful_every'"),
])
def test_bad_store_options_are_refused_at_open_before_anything_is_written(tmp_path, options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        amber.open(tmp_path / "ckpt", **options)
    assert not (tmp_path / "ckpt").exists()


SAVING_LOOP = r"""
import signal, sys, torch, amber_store as amber
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job inherits it ignored)
store = amber.open(sys.argv[1])
g = torch.Generator().manual_seed(0)
state = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(24)}  # 48 MiB
print("saving", flush=True)
for step in range(1, 10_000):
    store.save(step, state, full=True)
"""


def saving_loop(uri: str) -> subprocess.Popen:
    """A process saving full steps back to back, once it says so on stdout."""
    proc = subprocess.Popen([sys.executable, "-c", SAVING_LOOP, uri], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "saving\n"
    return proc


@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_mid_save_deletes_the_attempt_and_a_second_one_exits_with_one_traceback(tmp_path, signals):
    proc = saving_loop(str(tmp_path / "ckpt"))
    time.sleep(1.0)  # (a few saves in: every later moment is inside one)
    for _ in range(signals):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.005)  # (the second one lands in the save's cleanup, or in Python's exit)
    _, err = proc.communicate(timeout=120)
    # One traceback, of the save interrupted, and no thread of amber-store's still running at
    # exit; a second Ctrl-C that lands in the interpreter's own exit is reported by Python as
    # "Exception ignored in atexit callback" (a torch finalizer, say), which no library prevents.
    first = err.split("Exception ignored in atexit callback")[0]
    assert first.count("Traceback") == 1 and first.rstrip().endswith("KeyboardInterrupt"), err
    assert "During handling" not in err and "Exception ignored in: <module 'threading'>" not in err, err
    # (the cleanup takes milliseconds: a second Ctrl-C, which cuts its wait to 2 s, finds it done)
    assert sync(Usage(History(resolve(str(tmp_path / "ckpt")))).stray_attempts()) == []
    assert amber.open(tmp_path / "ckpt", mode="r").steps()


INTERRUPTED_AT = r"""
import asyncio, os, signal, sys, threading, time, torch, amber_store as amber
from amber_store.history import History
from amber_store.runtime import sync
from amber_store.storage import local, resolve
from amber_store.usage import Usage
uri, stage = sys.argv[1], sys.argv[2]
store = amber.open(uri)
store.save(1, {"w": torch.ones(1000)})
reached = threading.Event()
write_aside, create = local._write_aside, History._create

def slow_group(path, data, durable=True):  # the group's zarr.json: as the group opens, then as it is sealed
    if path.name == "zarr.json" and path.parent.name.startswith("000000000002-") and \
            stage == ("seal" if path.exists() else "open"):
        reached.set()
        time.sleep(0.3)
    return write_aside(path, data, durable)

async def slow_commit(self, manifest, latest):  # begun, the manifest not yet sent
    if stage == "commit":
        reached.set()
        await asyncio.sleep(0.3)
    return await create(self, manifest, latest)

local._write_aside, History._create = slow_group, slow_commit
threading.Thread(target=lambda: (reached.wait(), os.kill(os.getpid(), signal.SIGINT)), daemon=True).start()
try:
    store.save(2, {"w": torch.full((1000,), 2.0)})
except KeyboardInterrupt:
    print("interrupted")
time.sleep(0.5)  # (a write that outlived the save would land meanwhile)
print(amber.open(uri, mode="r").steps(), len(sync(Usage(History(resolve(uri))).stray_attempts())))
"""


@pytest.mark.parametrize("stage, steps", [("open", [1]), ("seal", [1]), ("commit", [1, 2])])
def test_ctrl_c_while_a_thread_writes_the_attempt_or_the_commit_runs_leaves_no_attempt_behind(tmp_path, stage, steps):
    # A thread's write cannot be stopped: the cancelled save waits for it before deleting the
    # attempt (else the file lands after the delete). A commit, once begun, runs to its end.
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_AT, str(tmp_path / "ckpt"), stage], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["interrupted", f"{steps} 0"], out.stdout + out.stderr


def test_a_hung_local_write_holds_a_save_past_its_deadline_only_briefly(tmp_path, monkeypatch):
    # (a cancelled write's caller waits for its thread, so that nothing lands after an
    # interrupted save's cleanup: but not for a mount that hangs)
    monkeypatch.setattr(local, "WRITE_SETTLE_SECONDS", 0.5)
    store = amber.open(tmp_path / "ckpt", save_timeout=1)
    store.save(1, {"w": torch.ones(8)})
    release, write_aside = threading.Event(), local._write_aside

    def hung(path, data, durable=True):  # the group's zarr.json, written again as the group is sealed
        if path.name == "zarr.json" and path.parent.name.startswith("000000000002-") and path.exists():
            release.wait(60)
        return write_aside(path, data, durable)

    monkeypatch.setattr(local, "_write_aside", hung)
    t0 = time.monotonic()
    with pytest.raises(amber.StorageAccessError, match="did not finish within save_timeout=1 s, stopped while sealing"):
        store.save(2, {"w": torch.full((8,), 2.0)})
    assert time.monotonic() - t0 < 15
    release.set()
    store.save(2, {"w": torch.full((8,), 3.0)})
    assert_bit_equal(amber.open(tmp_path / "ckpt", mode="r").load(2)["w"], torch.full((8,), 3.0))


@pytest.mark.parametrize("handed_over", [True, False])
def test_ctrl_c_as_a_save_is_handed_to_the_event_loop_leaves_no_attempt_and_the_store_usable(tmp_path, monkeypatch,
                                                                                          handed_over):
    store = amber.open(tmp_path / "ckpt")
    store.save(1, {"w": torch.ones(8)})
    loop = event_loop()
    hand_over = loop.call_soon_threadsafe

    def interrupted(callback, *args):  # the interrupt lands just after (or before) the save reaches the loop
        if getattr(callback, "__qualname__", "") != "interruptible.<locals>.start":
            return hand_over(callback, *args)
        if handed_over:
            hand_over(callback, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "call_soon_threadsafe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.save(2, {"w": torch.full((8,), 2.0)})
    monkeypatch.undo()
    assert sync(Usage(History(resolve(str(tmp_path / "ckpt")))).stray_attempts()) == []
    store.save(2, {"w": torch.full((8,), 3.0)})
    assert_bit_equal(amber.open(tmp_path / "ckpt", mode="r").load(2)["w"], torch.full((8,), 3.0))


def test_a_second_ctrl_c_as_the_cancel_is_handed_over_still_cancels_the_save_and_waits_for_its_cleanup(tmp_path,
                                                                                                      monkeypatch):
    store = amber.open(tmp_path / "ckpt")
    store.save(1, {"w": torch.ones(8)})
    loop = event_loop()
    hand_over = loop.call_soon_threadsafe
    second: list[str] = []

    def interrupted(callback, *args):  # Ctrl-C once the save reached the loop, again as its cancel is handed over
        name = getattr(callback, "__qualname__", "")
        if name == "interruptible.<locals>.start":
            hand_over(callback, *args)
            raise KeyboardInterrupt
        if name == "interruptible.<locals>.cancel" and not second:
            second.append(name)
            raise KeyboardInterrupt
        return hand_over(callback, *args)

    monkeypatch.setattr(loop, "call_soon_threadsafe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.save(2, {"w": torch.full((8,), 2.0)})
    monkeypatch.undo()
    assert second
    assert store.steps() == [1]  # cancelled, not committed behind the caller's back
    assert sync(Usage(History(resolve(str(tmp_path / "ckpt")))).stray_attempts()) == []
    store.save(2, {"w": torch.full((8,), 3.0)})
    assert_bit_equal(amber.open(tmp_path / "ckpt", mode="r").load(2)["w"], torch.full((8,), 3.0))


def test_ctrl_c_while_gc_folds_a_step_leaves_every_step_loadable_and_none_of_the_folds_data(tmp_path, monkeypatch):
    from amber_store.stepwriter import StepWriter

    store = amber.open(tmp_path / "ckpt", full_every=100, pack_threshold=0)
    g, states = torch.Generator().manual_seed(0), {}
    state = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(3)}
    for step in range(1, 6):
        states[step] = {k: v + 1e-3 * step for k, v in state.items()}  # (deltas, which step 4's fold rewrites)
        store.save(step, states[step])
    add, added = StepWriter.add, []

    def interrupted(self, key, *args, **kwargs):  # Ctrl-C as the fold's writer thread encodes its first tensor
        if not added:
            added.append(key)
            os.kill(os.getpid(), signal.SIGINT)
        return add(self, key, *args, **kwargs)

    monkeypatch.setattr(StepWriter, "add", interrupted)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job inherits it ignored)
    try:
        with pytest.raises(KeyboardInterrupt):
            store.gc(keep_last=2)
    finally:
        signal.signal(signal.SIGINT, handler)
    monkeypatch.undo()
    time.sleep(0.5)  # (a fold that outlived the interrupt would land meanwhile)
    assert added and store.steps() == [1, 4, 5]  # (steps 2 and 3, which no fold reads, went first)
    assert "folded" not in amber.open(tmp_path / "ckpt", mode="r").manifest(4).extra  # stopped, not finished later
    assert sync(Usage(History(resolve(str(tmp_path / "ckpt")))).stray_attempts()) == []  # the fold's group is gone
    for step in store.steps():
        assert_tree_bit_equal(amber.open(tmp_path / "ckpt", mode="r").load(step, lazy=False), states[step])
    store.gc(keep_last=2)
    assert store.steps() == [4, 5]
    for step in (4, 5):
        assert_tree_bit_equal(amber.open(tmp_path / "ckpt", mode="r").load(step, lazy=False), states[step])


def test_a_stray_attempt_in_a_store_opened_on_a_zarr_store_object_names_no_uri_it_cannot_reopen(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    store.save(1, {"w": torch.ones(4)})
    group = store.manifest(1).group
    shutil.copytree(tmp_path / "ckpt" / group, tmp_path / "ckpt" / f"{group.rsplit('-', 1)[0]}-deadbeef")
    with pytest.warns(RuntimeWarning, match=r"1 attempt\(s\) no committed step uses") as caught:
        amber.open(LocalStore(tmp_path / "ckpt"))
    message = str(caught[0].message)
    assert "`store.gc()` or `amber-store gc URI` deletes them (`amber-store du URI` says how much)" in message
    with pytest.warns(RuntimeWarning, match=rf"`amber-store gc {tmp_path / 'ckpt'}` deletes them"):
        amber.open(tmp_path / "ckpt")


def test_what_a_killed_save_leaves_is_reported_by_ls_du_and_the_next_writable_open(tmp_path, monkeypatch):
    uri = str(tmp_path / "ckpt")
    proc = saving_loop(uri)
    time.sleep(1.0)
    proc.kill()
    proc.communicate(timeout=60)
    [stray] = sync(Usage(History(resolve(uri))).stray_attempts())
    assert stray.maybe_saving  # newer than the latest step, young: a save may be writing it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = amber.open(uri)  # (so nothing to say yet)
    store.save(stray.step, {"w": torch.ones(4)})  # the job restarted and saved that step
    with monkeypatch.context() as m, warnings.catch_warnings():  # in a torch.distributed job, rank 0 says it
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        m.setattr(torch.distributed, "get_rank", lambda group=None: 1)
        warnings.simplefilter("error")
        amber.open(uri)
    with pytest.warns(RuntimeWarning, match=rf"1 attempt\(s\) no committed step uses \(step\(s\) "
                                            rf"{stray.step}\).*amber-store gc") as caught:
        amber.open(uri)
    assert caught[0].filename == __file__  # the user's line
    cli = [sys.executable, "-m", "amber_store.cli"]
    ls = subprocess.run([*cli, "ls", uri], capture_output=True, text=True, timeout=120).stdout
    assert "uncommitted: 1 attempt(s) no committed step uses hold" in ls and f"amber-store gc {uri}" in ls
    du = json.loads(subprocess.run([*cli, "du", uri, "--json"], capture_output=True, text=True, timeout=120).stdout)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "ckpt" / stray.group).rglob("*") if f.is_file())
    assert du["uncommitted"] == {"attempts": 1, "maybe_saving": 0, "bytes": on_disk, "uploads": 0}
    store.gc()
    assert sync(Usage(History(resolve(uri))).stray_attempts()) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amber.open(uri)


def test_a_load_that_fails_leaves_no_decode_running_nor_one_to_start_later(local_store, tmp_path, monkeypatch):
    from amber_store import lazy, reader

    n = 2 * lazy._MAX_CONCURRENT_TENSORS  # (tensors read at once: the rest wait for t0's turn to end)
    store = local_store(pack_threshold=0)
    store.save(1, {f"t{i}": torch.randn(256, 1024) for i in range(n)})  # (a 1 MiB chunk each)
    flip_stored_byte(tmp_path / "ckpt", store, 1, "t0")
    lock, running, started = threading.Lock(), [0], []
    apply_layers = reader.Reader._apply_layers

    def slow(self, step, key, *args):
        with lock:
            running[0] += 1
            started.append(key)
        try:
            if key != "t0":
                time.sleep(0.05)
            return apply_layers(self, step, key, *args)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(reader.Reader, "_apply_layers", slow)
    into = {f"t{i}": torch.zeros(256, 1024) for i in range(n)}
    with pytest.raises(amber.CorruptDataError, match="tensor 't0'"):
        amber.open(tmp_path / "ckpt", mode="r").load(1, lazy=False, into=into)
    assert running[0] == 0  # (a decode still running would write into `into` after the error)
    seen = list(started)
    time.sleep(0.3)
    assert started == seen and len(seen) < n  # (the queued decodes were dropped, never run)
