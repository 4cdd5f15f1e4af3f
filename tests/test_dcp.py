"""torch.distributed.checkpoint through amber-store: sharded saves on 2-3 gloo ranks, resharded
loads, failures, and incremental DCP saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import amber_store as amber
from amber_store.dcp import AmberStorageReader, AmberStorageWriter
from backends.process import free_port
from conftest import BUCKET, assert_bit_equal

WORKER = Path(__file__).parent / "dcp_workers.py"


def launch(job: str, world: int, uri: str, options: dict | None = None) -> list[str]:
    """Run ``job`` on ``world`` ranks (gloo on loopback); world 0 means one process, no group."""
    port = free_port()
    procs = []
    for rank in range(max(world, 1)):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
        if world:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), job, uri, json.dumps(options or {})], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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
