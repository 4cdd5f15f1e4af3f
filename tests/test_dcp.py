"""torch.distributed.checkpoint through amber-store: sharded saves on 2-3 gloo ranks, resharded
loads, failures, and incremental DCP saves."""

from __future__ import annotations

import fractions
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import amber_store as amber
from amber_store import format as fmt
from amber_store import shards
from amber_store.cli import main as cli
from amber_store.dcp import AmberStorageReader, AmberStorageWriter
from backends.process import free_port
from conftest import (BUCKET, CountingStore, all_keys, assert_bit_equal, assert_tree_bit_equal, flip_stored_byte,
                      is_data_key)
from zarr.abc.store import RangeByteRequest
from amber_store.runtime import sync
from amber_store.usage import Usage
from zarr.storage import LocalStore

WORKER = Path(__file__).parent / "dcp_workers.py"


def launch(job: str, world: int, uri: str, options: dict | None = None) -> list[str]:
    """Run ``job`` on ``world`` ranks (gloo on loopback); world 0 means one process, no group."""
    return wait_for(start(job, world, uri, options), job)


def start(job: str, world: int, uri: str, options: dict | None = None) -> list[subprocess.Popen]:
    """Start ``job`` on ``world`` ranks without waiting for it (see :func:`launch`)."""
    port = free_port()
    procs = []
    for rank in range(max(world, 1)):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
        if world:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), job, uri, json.dumps(options or {})], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_for(procs: list[subprocess.Popen], job: str) -> list[str]:
    """Every rank's output, once all have finished (each must succeed)."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{job} rank failed:\n{err[-3000:]}"
        outs.append(out)
    return outs


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def dcp_location(request, tmp_path) -> tuple[str, dict]:
    if request.param == "local":
        return str(tmp_path / "ckpt"), {}
    server = request.getfixturevalue("s3_server")
    return f"s3://{BUCKET}/{uuid.uuid4().hex}", server.storage_options()


def test_sharded_save_on_2_ranks_loads_bit_exact_on_3_ranks_and_in_one_process(dcp_location):
    uri, opts = dcp_location
    launch("save", 2, uri, opts)
    store = amber.open(uri, opts or None, mode="r")
    assert store.steps() == [0, 1]
    first, second = store.manifest(0), store.manifest(1)
    assert (first.kind, second.kind) == ("full", "delta")
    # each rank wrote its own shards: two row blocks of w, two column blocks of emb, one bias
    assert sorted(first.tensors) == ["bias/0", "emb/0_0", "emb/0_16", "meta.lr/bytes", "meta.version/bytes",
                                     "w/0_0", "w/5_0"]
    assert second.nbytes_stored * 10 < first.nbytes_stored
    assert {k for k, e in second.tensors.items() if e.encoding != "same"} == {"w/0_0"}
    for world, extra in ((3, {}), (0, {}), (0, {"version": 1, "step": 0})):
        outs = launch("load", world, uri, {**opts, **extra})
        assert all("loaded bit-exact" in o for o in outs)


def test_a_rank_failing_mid_save_leaves_the_step_uncommitted_and_earlier_steps_intact(tmp_path):
    uri = str(tmp_path / "ckpt")
    launch("save", 2, uri)
    outs = launch("fail", 2, uri)
    assert all("failed as expected" in o for o in outs)
    store = amber.open(uri, mode="r")
    assert store.steps() == [0, 1]
    assert all("loaded bit-exact" in o for o in launch("load", 2, uri))


def test_two_consecutive_dcp_saves_in_one_process_make_the_second_a_small_delta(tmp_path):
    uri = str(tmp_path / "ckpt")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    dcp.save({"model": model.state_dict()}, storage_writer=AmberStorageWriter(uri))
    with torch.no_grad():
        model[1].weight[0, 0] += 1
    dcp.save({"model": model.state_dict()}, storage_writer=AmberStorageWriter(uri))
    store = amber.open(uri, mode="r")
    first, second = (store.manifest(s) for s in store.steps())
    assert second.kind == "delta" and second.nbytes_stored * 20 < first.nbytes_stored
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    state = {"model": fresh.state_dict()}
    dcp.load(state, storage_reader=AmberStorageReader(uri))
    fresh.load_state_dict(state["model"])
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert_bit_equal(a, b)
    old = {"model": fresh.state_dict()}
    dcp.load(old, storage_reader=AmberStorageReader(uri, step=store.steps()[0]))
    assert not torch.equal(old["model"]["1.weight"], model[1].weight.detach())


def test_per_step_checkpoint_ids_are_steps_of_one_incremental_store(tmp_path):
    root = str(tmp_path / "run")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    writer = AmberStorageWriter(root)
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{root}/step_100", storage_writer=writer)
    with torch.no_grad():
        model[1].weight[0, 0] += 1
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{root}/step_200", storage_writer=writer)
    store = amber.open(root, mode="r")
    assert store.steps() == [100, 200] and store.manifest(200).kind == "delta"
    old = {"model": torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).state_dict()}
    dcp.load(old, checkpoint_id=f"{root}/step_100", storage_reader=AmberStorageReader(root))
    assert not torch.equal(old["model"]["1.weight"], model[1].weight.detach())
    assert torch.equal(old["model"]["0.weight"], model[0].weight.detach())
    with pytest.warns(RuntimeWarning, match="nothing is incremental"):
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "elsewhere"), storage_writer=writer)


def test_dcp_async_save_works_through_the_writer(tmp_path):
    uri = str(tmp_path / "ckpt")
    state = {"w": torch.randn(128, 128)}
    dcp.async_save(state, storage_writer=AmberStorageWriter(uri)).result()
    state["w"][5] = 0
    dcp.async_save(state, storage_writer=AmberStorageWriter(uri)).result()
    out = {"w": torch.zeros(128, 128)}
    dcp.load(out, storage_reader=AmberStorageReader(uri))
    assert_bit_equal(out["w"], state["w"])
    assert amber.open(uri, mode="r").manifest(1).kind == "delta"


def test_a_step_saved_without_dcp_is_refused_by_the_reader(tmp_path):
    amber.open(tmp_path / "c").save(1, {"w": torch.ones(2)})
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="not written through torch.distributed.checkpoint"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=AmberStorageReader(tmp_path / "c"))


def test_a_second_job_writing_the_store_between_a_multi_rank_jobs_saves_makes_its_next_save_fail(dcp_location,
                                                                                                  tmp_path):
    uri, opts = dcp_location
    go = tmp_path / "go"
    job = start("interleaved", 2, uri, {**opts, "go": str(go)})
    store = amber.open(uri, opts or None)
    deadline = time.monotonic() + 120
    while store.steps() != [1] and time.monotonic() < deadline:  # the job's first save
        time.sleep(0.1)
    store.save(2, {"w": torch.ones(3)})  # another job commits in between
    go.touch()
    outs = wait_for(job, "interleaved")
    assert all("save failed as expected" in o and "ConcurrentWriterError" in o and "two jobs are writing one store"
               in o for o in outs), outs
    assert store.steps() == [1, 2]


def test_a_rank_failing_after_writing_deletes_its_objects_and_the_next_save_the_rest_of_the_attempt(dcp_location):

    uri, opts = dcp_location
    outs = launch("fail_after_write", 2, uri, {**opts, "store": {"pack_threshold": 0}})
    assert all("save failed as expected" in o and "rank 1 fails after writing" in o for o in outs), outs
    failed = next(line.split() for line in outs[0].splitlines() if line.startswith("FAILED"))
    group, keys = failed[1], failed[2:]
    # rank 0's items (rows 0-4 of w, the first columns of emb, the replicated bias) and its
    # fragment are there; rank 1's one written object is gone
    assert keys and all(any(f"{fmt.array_name(k)}/" in key for k in ("w/0_0", "emb/0_0", "bias/0")) or
                        key.endswith(("zarr.json", "/fragment-r0")) for key in keys), keys
    store = amber.open(uri, opts or None, mode="r")
    assert store.steps() == [2]
    # deleted by the next save (SeaweedFS may keep an empty folder marker named as the group)
    assert [k for k in all_keys(store, group + "/") if k != group] == []
    assert all("loaded bit-exact" in o for o in launch("load", 2, uri, opts))


def test_a_multi_rank_save_whose_storage_stops_answering_fails_within_its_deadline(tmp_path):
    uri = str(tmp_path / "ckpt")
    launch("save", 2, uri)
    t0 = time.monotonic()
    outs = launch("hang", 2, uri, {"store": {"save_timeout": 3}})
    assert time.monotonic() - t0 < 60
    assert all("save failed as expected" in o and "did not finish within save_timeout=3 s" in o for o in outs), outs
    assert amber.open(uri, mode="r").steps() == [0, 1]
    assert all("loaded bit-exact" in o for o in launch("load", 2, uri))


def test_dcp_saves_carry_the_training_step_refuse_an_older_one_and_say_once_when_they_have_none(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    uri = str(tmp_path / "ckpt")
    state = {"w": torch.randn(64, 64)}
    dcp.save(state, storage_writer=AmberStorageWriter(uri, step=100))
    dcp.save(state, checkpoint_id=f"{uri}/step_200", storage_writer=AmberStorageWriter(uri))
    with pytest.raises(CheckpointException, match="step 150 is not newer than the latest committed step 200"):
        dcp.save(state, storage_writer=AmberStorageWriter(uri, step=150))
    with pytest.warns(RuntimeWarning, match="saved as step 201, the latest"):
        dcp.save(state, storage_writer=AmberStorageWriter(uri))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save(state, storage_writer=AmberStorageWriter(uri))
    assert not [w for w in caught if "without a step" in str(w.message)]  # said once
    assert amber.open(uri, mode="r").steps() == [100, 200, 201, 202]


def test_a_request_timing_out_before_the_save_deadline_fails_the_dcp_save_with_that_error(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    from amber_store.storage.local import LocalBackend

    original = LocalBackend.put_object

    async def times_out(self, key, parts, durable=False):
        if not key.endswith("zarr.json"):  # a rank's data, not the coordinator's group metadata
            raise TimeoutError("one request's own timeout")
        return await original(self, key, parts, durable)

    monkeypatch.setattr(LocalBackend, "put_object", times_out)
    for timeout in (None, 600):  # no deadline, and one far away: the error is the request's, as it came
        with pytest.raises(CheckpointException, match="one request's own timeout") as err:
            dcp.save({"w": torch.randn(64, 64)}, storage_writer=AmberStorageWriter(tmp_path / f"c{timeout}", step=1,
                                                                                  save_timeout=timeout))
        assert "did not finish within" not in str(err.value)


# --- sharded steps as the state the ranks saved -------------------------------------------

FSDP_STORE = {"chunk_bytes": 4096, "pack_threshold": 4096}  # 16 rows of a 256x64 weight per chunk


def run_fsdp(uri: str, opts: dict, out: Path) -> tuple[str, dict, Path]:
    """Two ranks train an FSDP2 MLP with AdamW, saving steps 10 and 20 into ``uri`` (and step
    20 as DCP's own files under ``out/dcp``); the full states go to ``out/expected_<step>.pt``."""
    launch("fsdp", 2, uri, {**opts, "out": str(out), "store": FSDP_STORE})
    return uri, opts, out


@pytest.fixture(scope="module")
def fsdp_local(tmp_path_factory) -> tuple[str, dict, Path]:
    out = tmp_path_factory.mktemp("fsdp")
    return run_fsdp(str(out / "ckpt"), {}, out)


@pytest.fixture(scope="module", params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def fsdp_run(request, tmp_path_factory) -> tuple[str, dict, Path]:
    if request.param == "local":
        return request.getfixturevalue("fsdp_local")
    server = request.getfixturevalue("s3_server")
    return run_fsdp(f"s3://{BUCKET}/{uuid.uuid4().hex}", server.storage_options(), tmp_path_factory.mktemp("fsdp"))


def expected_state(out: Path, step: int) -> dict:
    return torch.load(out / f"expected_{step}.pt", weights_only=True)


def test_an_fsdp2_step_opens_in_one_process_as_the_nested_state_its_ranks_saved(fsdp_run):
    uri, opts, out = fsdp_run
    store = amber.open(uri, opts or None, mode="r")
    assert store.steps() == [10, 20] and store.manifest(20).kind == "delta"
    for step in (10, 20):
        expected = expected_state(out, step)
        lazy = store.load(step)
        weight = lazy["model"]["0.weight"]
        assert isinstance(weight, amber.LazyTensor) and "shards=2" in repr(weight)
        assert (weight.shape, weight.dtype) == (torch.Size([256, 64]), torch.float32)
        assert lazy["step"] == step and lazy["run"] == {"name": "mlp", "seed": 0}
        assert lazy["optim"]["param_groups"][0]["lr"] == 1e-2
        assert_bit_equal(weight[100:140, 3:9], expected["model"]["0.weight"][100:140, 3:9])  # across both shards
        assert_bit_equal(lazy["optim"]["state"]["2.weight"]["exp_avg_sq"][-1], expected["optim"]["state"]["2.weight"]["exp_avg_sq"][-1])
        assert_tree_bit_equal(amber.materialize(lazy), expected)
        assert_tree_bit_equal(store.load(step, lazy=False, device="cpu"), expected)


def test_a_sharded_step_loads_into_a_state_dict_in_place_as_a_single_process_step_does(fsdp_local):
    uri, _, out = fsdp_local
    expected = expected_state(out, 20)
    into = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    got = amber.open(uri, mode="r").load(20, into=into)
    assert_tree_bit_equal(got, expected)
    assert all(got["model"][k] is t for k, t in into["model"].items())
    assert_tree_bit_equal(into["model"], expected["model"])


def test_a_slice_of_a_sharded_tensor_reads_only_the_chunks_it_overlaps_in_each_shard(fsdp_local):
    uri, _, out = fsdp_local
    counting = CountingStore(LocalStore(uri, read_only=True))
    store = amber.open(counting, mode="r")
    weight = store.load(20)["model"]["0.weight"]  # rows 0-127 on rank 0, 128-255 on rank 1; 16 rows a chunk
    for rows, touched in ((slice(2, 5), [("model.0.weight/0_0", 0)]),
                          (slice(120, 136), [("model.0.weight/0_0", 7), ("model.0.weight/128_0", 0)])):
        counting.ranges.clear()
        assert_bit_equal(weight[rows], expected_state(out, 20)["model"]["0.weight"][rows])
        expected = []
        for step in (10, 20):  # the full step and the delta on it
            for key, chunk in touched:
                e = store.manifest(step).tensors[key]
                offset, n = e.index[chunk]
                expected.append((f"{e.array}/0.0", RangeByteRequest(offset, offset + n)))
        assert sorted((r for r in counting.ranges if is_data_key(r[0])), key=str) == sorted(expected, key=str)


def test_a_sharded_value_that_needs_code_to_load_is_refused_naming_it_and_the_items_stay_readable(tmp_path):
    uri = str(tmp_path / "ckpt")
    state = {"w": torch.randn(4, 4), "sched": {"frac": fractions.Fraction(1, 3), "lr": 0.5}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
        dcp.save(state, storage_writer=AmberStorageWriter(uri, step=1))
    store = amber.open(uri, mode="r")
    with pytest.raises(amber.UnsafeValueError, match=r"step 1: 'sched/frac' is a pickled object"):
        store.load(1)
    items = store.load(1, tree=shards.items_tree(store.manifest(1)))
    assert_bit_equal(items["w/0_0"].materialize(), state["w"])


def test_info_du_verify_and_export_show_a_sharded_step_as_its_tensors(fsdp_local, tmp_path, capsys):
    uri, _, out = fsdp_local
    expected = expected_state(out, 20)
    assert cli(["info", uri, "20", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tensors"]["model/0.weight"]["shape"] == [256, 64] and info["tensors"]["model/0.weight"]["shards"] == 2
    assert info["tensors"]["step"]["dtype"] == "object"
    assert {k for k in info["tensors"] if k.startswith("optim/state/0.weight/")} == {
        "optim/state/0.weight/step", "optim/state/0.weight/exp_avg", "optim/state/0.weight/exp_avg_sq"}
    assert cli(["du", uri, "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["groups"]) == {"model", "optim", "step", "run"}

    assert cli(["export", uri, "20", str(tmp_path / "model.safetensors")]) == 0
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "model.safetensors"))  # (keys sorted)
    assert_tree_bit_equal(exported, {k: expected["model"][k] for k in exported})
    assert set(exported) == set(expected["model"])
    capsys.readouterr()

    damaged = tmp_path / "damaged"
    shutil.copytree(uri, damaged)
    flip_stored_byte(damaged, amber.open(damaged, mode="r"), 10, "model.0.weight/128_0")
    assert cli(["verify", str(damaged), "10"]) == 1
    lines = capsys.readouterr().out.splitlines()
    fails = [line for line in lines if line.startswith("FAIL")]
    assert len(fails) == 1 and "tensor model/0.weight: shard 'model.0.weight/128_0'" in fails[0]
    assert lines[-1].startswith("DAMAGED") and "1 damaged" in lines[-1]


def test_a_dcp_checkpoint_directory_imports_as_a_sharded_step_that_loads_and_reshards(fsdp_run, tmp_path, capsys):
    uri, opts, out = fsdp_run
    target = str(tmp_path / "imported") if not opts else f"{uri}-imported"
    store = amber.open(target, opts or None)
    info = amber.import_checkpoint(store, 30, out / "dcp")
    assert info.kind == "full" and store.steps() == [30]
    expected = expected_state(out, 20)
    assert_tree_bit_equal(store.load(30, lazy=False), expected)
    store.save(31, {"after": torch.ones(3)})  # the importing store's writer goes on saving
    # DCP reads the imported step into any layout: here whole tensors in one process
    state = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=AmberStorageReader(target, opts or None, step=30))
    assert_tree_bit_equal(state["model"], dict(expected["model"]))
    if not opts:
        assert cli(["import", str(tmp_path / "cli"), "7", str(out / "dcp")]) == 0
        assert "imported" in capsys.readouterr().out
        assert_tree_bit_equal(amber.open(tmp_path / "cli", mode="r").load(7, lazy=False), expected)
        with pytest.raises(amber.NotAnAmberStoreError, match="without DCP's .metadata"):
            amber.import_checkpoint(store, 40, tmp_path)


def test_the_private_dcp_names_it_uses_were_checked_against_this_torch():
    # A tripwire: on a torch release not in the list, check amber_store/dcp_private.py's names
    # (signatures, behaviour as used), then add the release.
    from amber_store.dcp_private import TORCH_CHECKED

    assert torch.__version__.split("+")[0] in TORCH_CHECKED


def test_gc_of_a_sharded_store_keeps_each_kept_step_loadable_by_dcp_and_as_one_state(fsdp_local, tmp_path):
    uri, _, out = fsdp_local
    copy = tmp_path / "ckpt"
    shutil.copytree(uri, copy)
    report = amber.open(copy).gc(keep_last=1)
    assert (report.delete, report.rewrite) == ([10], [20])  # step 20 loses its base: folded
    expected = expected_state(out, 20)
    assert_tree_bit_equal(amber.open(copy, mode="r").load(20, lazy=False), expected)
    state = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=AmberStorageReader(str(copy), step=20))  # planned from the folded layout
    assert_tree_bit_equal(state["model"], dict(expected["model"]))


def test_a_sharded_checkpoint_manager_saves_on_every_rank_and_restores_onto_another_world_size(dcp_location, tmp_path):
    uri, opts = dcp_location
    job = {**opts, "out": str(tmp_path)}
    launch("manager", 2, uri, {**job, "phase": "train"})  # async saves of steps 2, 4, 6; keep_last=2
    store = amber.open(uri, opts or None, mode="r")
    assert store.steps() == [4, 6]
    assert store.load(6)["model"]["0.weight"].shape == (256, 64)
    # AmberSavePlanner: replicated items (AdamW's steps, values) all in rank 0's fragment
    index = sync(store.history.index(6)).extra["dcp"]["state"]
    single = [index["owners"][t["owners"]] for t in index["tensors"].values() if t["shape"] == []]
    assert single and all(row == [0] for row in single) and {f for _, f in index["values"].values()} == {0}
    saved = torch.load(tmp_path / "state_4.pt", weights_only=True)
    for world in (3, 2):
        launch("manager", world, uri, {**job, "phase": "resume", "restore": 4})
        restored = torch.load(tmp_path / f"restored_{world}.pt", weights_only=True)
        assert restored["step"] == 4 and restored["extra"] == {"data_pos": 32}
        assert_tree_bit_equal(restored["state"], saved)  # model and AdamW state, resharded 2 -> 3
    # resumed from step 4 on as many ranks, steps 5-6 retrace the uninterrupted run bit for bit
    assert_tree_bit_equal(torch.load(tmp_path / "final_resume_2.pt", weights_only=True),
                          torch.load(tmp_path / "final_train_2.pt", weights_only=True))


@pytest.mark.parametrize("failing", [0, 1], ids=["coordinator", "other-rank"])
@pytest.mark.parametrize("how", ["error", "interrupt"])
def test_a_rank_failing_to_open_the_store_makes_every_rank_raise_at_once(tmp_path, failing, how):
    outs = launch("open_fails", 2, str(tmp_path / "ckpt"), {"rank": failing, "how": how})
    for rank, out in enumerate(outs):
        line = out.strip().splitlines()[-1]
        took = float(line.split(" after ")[1].split(" s")[0])
        assert took < 20, line  # not the collective's timeout (60 s here)
        if rank == failing:
            assert ("KeyboardInterrupt" if how == "interrupt" else "PermissionError") in line, line
        else:
            assert "AmberError" in line and f"rank {failing}:" in line, line


def test_a_rank_killed_mid_save_fails_the_others_at_once_and_a_job_on_fewer_ranks_resumes_bit_exact_and_cleans_up(
        tmp_path):
    uri = str(tmp_path / "ckpt")
    procs = start("killed", 4, uri, {"out": str(tmp_path), "victim": 2})
    results = [(p.returncode, out) for p in procs for out, _ in [p.communicate(timeout=300)]]
    assert results[2][0] == -9 and "killed mid-save" in results[2][1]  # SIGKILL: no cleanup of its own
    for rank in (0, 1, 3):
        code, out = results[rank]
        assert code == 0 and "save failed as expected" in out, out
        seconds = float(out.split("failed after ")[1].split(" s")[0])
        assert seconds < 30, out  # the dead peer is noticed, not waited for (gloo: 60 s timeout)
    store = amber.open(uri, mode="r")
    assert store.steps() == [10]
    strays = [a.group for a in sync(Usage(store.history).stray_attempts(grace_seconds=0))]
    assert len(strays) == 1 and strays[0].startswith("steps/000000000020-")
    outs = launch("fsdp_resume", 3, uri, {"out": str(tmp_path)})
    assert "resumed at step 10, saved step 20" in outs[0]
    assert_tree_bit_equal(torch.load(tmp_path / "resumed_3.pt", weights_only=True),
                          torch.load(tmp_path / "expected_10.pt", weights_only=True))
    store = amber.open(uri, mode="r")
    assert store.steps() == [10, 20] and sync(Usage(store.history).stray_attempts(grace_seconds=0)) == []
    assert not (tmp_path / "ckpt" / strays[0]).exists()


def test_dcp_plan_caching_is_refused_with_a_clear_error_rather_than_writing_by_a_stale_plan(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    uri = str(tmp_path / "ckpt")
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
        dcp.save(state, storage_writer=AmberStorageWriter(uri, step=1),
                 planner=DefaultSavePlanner(enable_plan_caching=True), no_dist=True)
        with pytest.raises(CheckpointException, match="enable_plan_caching"):
            dcp.save({"w": state["w"] + 1}, storage_writer=AmberStorageWriter(uri, step=2),
                     planner=DefaultSavePlanner(enable_plan_caching=True), no_dist=True)
    store = amber.open(uri, mode="r")
    assert store.steps() == [1] and torch.equal(store.load(1, lazy=False)["w"], state["w"])
