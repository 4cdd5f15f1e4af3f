"""What a new user meets: a resume never silently does nothing, and every error is one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from amber_store.runtime import sync

import amber_store as amber
from amber_store.cli import main as cli
from amber_store.cli import parser
from amber_store.manager import CheckpointManager
from backends.faultproxy import FaultProxy
from conftest import BUCKET, assert_bit_equal


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def test_loading_into_a_model_whose_keys_do_not_match_raises_naming_them_and_restores_nothing(local_store):
    saved = model()
    store = local_store()
    store.save(1, {"model": {f"module.{k}": v for k, v in saved.state_dict().items()}, "step": 1})  # DDP's keys
    fresh = model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(amber.StateMismatchError, match=r"'module.' prefix") as err:
        store.load(1, into={"model": fresh.state_dict()})
    assert err.value.missing == [f"model.{k}" for k in before]
    assert err.value.unexpected == [f"model.module.{k}" for k in before]
    for k, v in fresh.state_dict().items():
        assert_bit_equal(v, before[k])  # nothing read into it
    with pytest.warns(RuntimeWarning, match="4 tensor.s. the step lacks"):
        state = store.load(1, into={"model": fresh.state_dict()}, strict=False)
    assert sorted(state["model"]) == sorted(f"module.{k}" for k in before) and state["step"] == 1


def test_loading_into_a_matching_model_fills_it_and_leaves_the_rest_of_the_state_alone(local_store):
    saved, fresh = model(), model()
    store = local_store()
    store.save(1, {"model": saved.state_dict(), "optim": {"m": torch.ones(3)}, "step": 1})
    state = store.load(1, into={"model": fresh.state_dict()})  # "optim" is not asked for: no mismatch
    for k, v in saved.state_dict().items():
        assert_bit_equal(fresh.state_dict()[k], v)
    assert_bit_equal(state["optim"]["m"], torch.ones(3))
    extra = {**fresh.state_dict(), "new.weight": torch.zeros(2)}  # a bare state_dict is a part too
    store.save(2, saved.state_dict())
    with pytest.raises(amber.StateMismatchError, match=r"into= has 1 tensor.s. the step lacks: new.weight"):
        store.load(2, into=extra)


def test_opening_a_location_creates_nothing_until_the_first_save(make_store):
    store = make_store()
    assert not store.exists and store.steps() == [] and sync(store.history.backend.is_empty())
    with pytest.raises(amber.NotAnAmberStoreError):
        make_store(mode="r")
    store.save(1, {"x": torch.ones(3)})
    assert store.exists and make_store(mode="r").steps() == [1]


def test_a_mistyped_local_path_leaves_no_folder_behind(tmp_path):
    store = amber.open(tmp_path / "quickstrat-ckpt")
    with pytest.raises(amber.StepNotFoundError, match="empty"):
        store.load()
    assert not (tmp_path / "quickstrat-ckpt").exists()


def test_restoring_from_a_store_that_does_not_exist_says_it_starts_fresh_and_creates_nothing(tmp_path):
    manager = CheckpointManager.from_config({"uri": str(tmp_path / "run-cktp")})
    with pytest.warns(RuntimeWarning, match=r"no checkpoint at .*run-cktp: starting fresh"):
        assert manager.restore(model(), None) is None
    assert not (tmp_path / "run-cktp").exists()
    manager.maybe_save(0, model=model(), force=True)
    manager.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a store that exists: nothing to say
        assert CheckpointManager.from_config({"uri": str(tmp_path / "run-cktp")}).restore(model()) == 0


def test_a_step_given_as_a_string_gets_a_clear_error(local_store):
    store = local_store()
    store.save(50, {"x": torch.ones(2)})
    with pytest.raises(amber.StepNotFoundError, match=r"'50' is not a step: steps are non-negative ints \(int\('50'\)"):
        store.load("50")


@pytest.mark.s3
def test_a_server_error_while_opening_is_one_amber_error_line_with_the_servers_code_in_words(s3_server):
    with FaultProxy(s3_server.endpoint, fail=lambda method, path: method == "GET" and "zarr.json" in path) as proxy:
        opts = {**s3_server.storage_options(), "endpoint_url": proxy.endpoint}
        with pytest.raises(amber.StorageAccessError) as err:
            amber.open(f"s3://{BUCKET}/{uuid.uuid4().hex}", opts)
    message = str(err.value)
    assert "\n" not in message and "<" not in message and "Debug" not in message, message
    assert "500 Internal Server Error (InternalError: We encountered an internal error" in message


@pytest.mark.s3
def test_wrong_credentials_are_one_line_naming_the_servers_refusal(s3_server):
    with pytest.raises(amber.StorageAccessError) as err:
        amber.open(f"s3://{BUCKET}/{uuid.uuid4().hex}", s3_server.wrong_credentials("nope"))
    message = str(err.value)
    assert "access denied" in message and "403 Forbidden (InvalidAccessKeyId" in message
    assert "\n" not in message and "<" not in message and "?" not in message, message


def test_exporting_into_a_missing_folder_exits_2_with_one_line(local_store, tmp_path, capsys):
    local_store().save(50, {"model": {"w": torch.ones(2)}})
    assert cli(["export", str(tmp_path / "ckpt"), "50", "/nonexistent/dir/a.safetensors"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/nonexistent/dir is not a directory" in err


@pytest.mark.gcs
def test_cli_commands_on_gcs_exit_without_unclosed_session_noise(gcs_server):
    uri = f"gs://{BUCKET}/{uuid.uuid4().hex}"
    amber.open(uri, gcs_server.storage_options()).save(1, {"x": torch.ones(3)})
    env = {**os.environ, "STORAGE_EMULATOR_HOST": gcs_server.endpoint,
           "PYTHONPATH": str(Path(__file__).parents[1])}
    for command in (["ls", uri], ["info", uri, "1"], ["du", uri]):
        run = subprocess.run([sys.executable, "-m", "amber_store.cli", *command], env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0 and run.stderr == "", (command, run.stderr[-2000:])


def test_every_positional_argument_of_the_cli_says_what_it_is():
    subcommands = next(a for a in parser()._actions if a.dest == "command" or a.choices and isinstance(a.choices, dict))
    for name, sub in subcommands.choices.items():
        for action in sub._actions:
            if not action.option_strings:
                assert action.help, f"amber-store {name}: {action.dest} has no help"


def test_a_server_that_stopped_serving_is_started_afresh_on_its_ports_with_its_buckets():
    from backends.gcs import FakeGCS

    with FakeGCS() as server:
        server.create_bucket(BUCKET)
        endpoint = server.endpoint
        server.kill()
        assert not server.healthy()
        server.reset()
        assert server.healthy() and server.endpoint == endpoint
        store = amber.open(f"gs://{BUCKET}/{uuid.uuid4().hex}", server.storage_options())
        store.save(1, {"x": torch.ones(2)})
        assert store.steps() == [1]


def test_an_unreachable_s3_endpoint_fails_at_open_within_seconds_in_one_line():
    from backends.process import free_port

    t0 = time.monotonic()
    with pytest.raises(amber.StorageAccessError) as err:
        amber.open("s3://bucket/run", {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "k", "secret": "s"})
    assert time.monotonic() - t0 < 10
    message = str(err.value)
    assert "\n" not in message and "retries" not in message and "storage not usable" in message, message
