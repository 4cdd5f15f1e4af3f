"""Object-store behaviour on real S3 servers: commits, crashes, hangs, refusals, bad configuration.

They run against the session's SeaweedFS process (or AMBER_S3_ENDPOINT); the tests that kill or
freeze a server start their own SeaweedFS, and the refusal test an rclone ``serve s3``, a server
that ignores conditional writes.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import wait
from pathlib import Path

import pytest
import torch

import amber_store as amber
from amber_store import pipeline
from amber_store.storage.s3 import S3Backend, s3_options
from backends.s3servers import RcloneS3, free_port
from conftest import BUCKET, assert_tree_bit_equal, save_at_once

pytestmark = pytest.mark.s3
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def s3_uri() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(64, 64, generator=g) for i in range(6)}


def after_first_object(monkeypatch: pytest.MonkeyPatch, action) -> None:
    """Run ``action`` once, right after a save's first data object has been written."""
    original = pipeline.StepWriter._put
    done = []

    def put(self, key, payload, weight):
        original(self, key, payload, weight)
        if not done:
            done.append(key)
            wait(list(self._writes))
            action()

    monkeypatch.setattr(pipeline.StepWriter, "_put", put)


def test_a_write_to_a_frozen_server_fails_within_its_request_timeouts_also_after_close(own_s3_server, s3_uri,
                                                                                          monkeypatch):
    # aiohttp waits for a "100 Continue" with no timeout; the client that close() lets a
    # store make again must not ask for one either.
    quick = {**own_s3_server.storage_options(),
             "config_kwargs": {"read_timeout": 1, "connect_timeout": 1, "retries": {"max_attempts": 1}}}
    store = amber.open(s3_uri, quick, pack_threshold=0, save_timeout=60)
    store.save(1, state(1))
    store.close()
    after_first_object(monkeypatch, own_s3_server.freeze)
    try:
        t0 = time.monotonic()
        with pytest.raises(amber.StorageAccessError, match="saving step 2 failed"):
            store.save(2, state(2))
        assert time.monotonic() - t0 < 30
    finally:
        own_s3_server.thaw()


def test_server_killed_mid_save_loses_nothing_and_the_same_writer_saves_again_after_restart(own_s3_server, s3_uri,
                                                                                          monkeypatch):
    opts = own_s3_server.storage_options()
    store = amber.open(s3_uri, opts, pack_threshold=0)  # an object per tensor: a save is many requests
    s1, s2 = state(1), state(2)
    store.save(1, s1)
    after_first_object(monkeypatch, own_s3_server.kill)
    with pytest.raises(amber.StorageAccessError, match=rf"{s3_uri}: saving step 2 failed") as err:
        store.save(2, s2)
    assert opts["secret"] not in str(err.value)
    monkeypatch.undo()
    own_s3_server.restart()
    assert store.steps() == [1]
    assert_tree_bit_equal(amber.open(s3_uri, opts, mode="r").load(1, lazy=False), s1)
    assert store.save(2, s2).kind == "delta"
    assert_tree_bit_equal(amber.open(s3_uri, opts, mode="r").load(2, lazy=False), s2)


def test_a_frozen_server_fails_saves_within_their_deadline_and_reads_within_request_timeouts(own_s3_server, s3_uri,
                                                                                             monkeypatch):
    opts = own_s3_server.storage_options()
    store = amber.open(s3_uri, opts, pack_threshold=0, save_timeout=3)
    quick = {**opts, "config_kwargs": {"read_timeout": 1, "connect_timeout": 1, "retries": {"max_attempts": 1}}}
    reader = amber.open(s3_uri, quick, mode="r")
    s1 = state(1)
    store.save(1, s1)
    lazy = reader.load(1)  # its manifest is read now, its tensors when used
    after_first_object(monkeypatch, own_s3_server.freeze)
    try:
        t0 = time.monotonic()
        with pytest.raises(amber.StorageAccessError, match=r"saving step 2 did not finish within save_timeout=3 s, "
                                                         r"stopped while writing its data \(\d+ writes? still unanswered"):
            store.save(2, state(2))
        assert time.monotonic() - t0 < 3 + 5
        # In the background: the failure is the future's and the next call's.
        t0 = time.monotonic()
        future = store.save_async(3, state(3))
        assert isinstance(future.exception(timeout=3 + 5), amber.StorageAccessError)
        with pytest.raises(amber.AsyncSaveError, match="step 3"):
            store.wait()
        assert time.monotonic() - t0 < 3 + 5
        t0 = time.monotonic()
        with pytest.raises(amber.StorageAccessError, match=rf"{s3_uri}: reading step 1, tensor 'layer0' failed"):
            lazy["layer0"].materialize()
        with pytest.raises(amber.StorageAccessError, match=rf"{s3_uri}: listing the committed steps failed"):
            reader.load()
        assert time.monotonic() - t0 < 30
    finally:
        own_s3_server.thaw()
    assert store.steps() == [1]
    s2 = state(2)
    store.save(2, s2)
    assert_tree_bit_equal(amber.open(s3_uri, opts, mode="r").load(2, lazy=False), s2)


def test_racing_writers_commit_exactly_one_and_the_loser_gets_concurrent_writer_error(s3_server, s3_uri,
                                                                                      monkeypatch):
    opts = s3_server.storage_options()
    amber.open(s3_uri, opts).save(0, state(0))
    barrier = threading.Barrier(2, timeout=60)
    real = S3Backend.put_if_absent

    async def at_once(self, key, data):  # both writers create the manifest at the same moment
        if key.startswith("commits/"):
            await asyncio.to_thread(barrier.wait)  # not on the event loop both writers share
        return await real(self, key, data)

    monkeypatch.setattr(S3Backend, "put_if_absent", at_once)
    for step in range(1, 9):
        stores = [amber.open(s3_uri, opts), amber.open(s3_uri, opts)]
        states = [state(100 * step), state(100 * step + 1)]
        outcomes = save_at_once(stores, step, states)
        won = [i for i, o in enumerate(outcomes) if isinstance(o, amber.CommitInfo)]
        assert len(won) == 1, (step, outcomes)
        assert isinstance(outcomes[1 - won[0]], amber.ConcurrentWriterError), (step, outcomes)
        assert_tree_bit_equal(amber.open(s3_uri, opts, mode="r").load(step, lazy=False), states[won[0]])


def test_a_commit_whose_answer_was_lost_and_whose_retry_finds_its_own_manifest_succeeds(s3_server, s3_uri,
                                                                                       monkeypatch):
    opts = s3_server.storage_options()
    store = amber.open(s3_uri, opts)
    fs = store.history.backend.fs
    real = fs._call_s3
    retried = []

    async def lost_answer(method, *args, **kwargs):
        out = await real(method, *args, **kwargs)
        if method == "put_object" and "IfNoneMatch" in kwargs and kwargs["Key"].endswith(".json") and not retried:
            retried.append(kwargs["Key"])  # the answer never arrived: the client sends it again
            out = await real(method, *args, **kwargs)
        return out

    monkeypatch.setattr(fs, "_call_s3", lost_answer)
    s1 = state(1)
    assert store.save(1, s1).step == 1
    assert retried and "commits/" in retried[0]
    assert_tree_bit_equal(amber.open(s3_uri, opts, mode="r").load(1, lazy=False), s1)


def test_a_commit_to_a_server_that_stops_answering_fails_in_bounded_time_and_the_next_save_goes_on(
        own_s3_server, s3_uri, monkeypatch):
    opts = own_s3_server.storage_options()
    store = amber.open(s3_uri, opts)
    store.save(1, state(1))
    backend = store.history.backend
    real = backend.put_if_absent

    async def freeze_first(*args, **kwargs):  # the server hangs just as the commit is sent
        own_s3_server.freeze()
        return await real(*args, **kwargs)

    monkeypatch.setattr(backend, "put_if_absent", freeze_first)
    monkeypatch.setattr(backend, "put_timeout", 2.0)  # a PUT gets no read timeout from botocore
    t0 = time.monotonic()
    with pytest.raises(amber.StorageAccessError, match=r"commit of step 2 got no answer in time: it may or may not "
                                                       r"have landed"):
        store.save(2, state(2))
    assert time.monotonic() - t0 < 30
    own_s3_server.thaw()
    monkeypatch.setattr(backend, "put_if_absent", real)
    store.save(3, state(3))
    reader = amber.open(s3_uri, opts, mode="r")
    assert reader.steps() in ([1, 3], [1, 2, 3])  # step 2 either never landed or landed whole
    for step in reader.steps():
        assert_tree_bit_equal(reader.load(step, lazy=False), state(step))


def test_a_server_that_ignores_conditional_writes_is_refused_for_writing_unless_single_writer():
    with RcloneS3() as server:
        server.create_bucket(BUCKET)
        uri, opts = f"s3://{BUCKET}/run", server.storage_options()
        with pytest.raises(amber.UnsafeStorageError, match=rf"{uri}: the server at {server.endpoint} ignores "
                                                           r"conditional writes .* single_writer=True"):
            amber.open(uri, opts)
        s = state(4)
        with amber.open(uri, opts, single_writer=True) as store:
            store.save(1, s)
        with amber.open(uri, opts, mode="r") as reader:  # reading needs no guarantee
            assert_tree_bit_equal(reader.load(1, lazy=False), s)
        with pytest.raises(amber.UnsafeStorageError):
            amber.open(uri, opts)  # the verdict is remembered per endpoint, and still no


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_test_run_killed_hard_leaves_no_server_behind():
    code = ("import sys, time\n"
            "from backends.s3servers import SeaweedFS\n"
            "server = SeaweedFS().start()\n"
            "print(server.pid, server.data_dir, *server.sockets(), flush=True)\n"
            "time.sleep(600)\n")
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    pid, data_dir, *sockets = run.stdout.readline().split()
    try:
        assert alive(int(pid))
        run.kill()  # SIGKILL: no atexit, no fixture teardown
        run.wait()
        deadline = time.monotonic() + 30
        while alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(int(pid)), f"the server (pid {pid}) outlived the process that started it"
    finally:  # what its killed owner could not remove
        shutil.rmtree(data_dir, ignore_errors=True)
        for socket in sockets:
            Path(socket).unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for a reaper (PID 1 here may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_eager_load_gets_each_object_once_and_never_asks_for_sizes(s3_server, s3_uri):
    opts = s3_server.storage_options()
    with amber.open(s3_uri, opts, pack_threshold=0) as writer:
        writer.save(1, state(0))
        writer.save(2, state(1))
    with amber.open(s3_uri, opts, mode="r") as reader:
        calls: list[tuple[str, str]] = []
        reader.history.backend.fs.s3.meta.events.register(
            "before-parameter-build.s3", lambda model, params, **_: calls.append((model.name, params.get("Key", ""))))
        assert_tree_bit_equal(reader.load(2, lazy=False), state(1))
    gets = [key for name, key in calls if name == "GetObject"]
    assert {name for name, _ in calls} == {"GetObject"}  # s3fs would HEAD each object first
    assert len(gets) == len(set(gets)) == 2 * len(state(1)) + 2  # per tensor two layers; 2 manifests


def test_a_delta_save_lists_the_commits_twice_and_writes_each_object_once(s3_server, s3_uri):
    opts = s3_server.storage_options()
    with amber.open(s3_uri, opts, pack_threshold=0) as writer:
        writer.save(1, state(0))
        calls: list[tuple[str, str]] = []
        writer.history.backend.fs.s3.meta.events.register(
            "before-parameter-build.s3",
            lambda model, params, **_: calls.append((model.name, params.get("Key", params.get("Prefix", "")))))
        writer.save(2, state(1))
    listings = [prefix for name, prefix in calls if name == "ListObjectsV2"]
    puts = [key for name, key in calls if name == "PutObject"]
    assert len(listings) == 2 and all(p.endswith("/commits/") for p in listings)  # staging, the commit's check
    # the step group's zarr.json twice (opened, then sealed with its arrays); every other object once
    assert len(puts) == len(set(puts)) + 1 == len(state(1)) + 3
    assert {name for name, _ in calls} == {"ListObjectsV2", "PutObject"}


def test_stores_never_closed_or_used_after_close_leave_no_open_connections_at_exit(s3_server, s3_uri):
    opts = s3_server.storage_options()
    code = (
        "import gc, sys, torch, amber_store as amber\n"
        f"uri, opts = {s3_uri!r}, {opts!r}\n"
        "writer = amber.open(uri, opts)\n"
        "writer.save(1, {'x': torch.arange(10.)})\n"
        "dropped = amber.open(uri, opts, mode='r'); dropped.steps(); del dropped; gc.collect()\n"
        "reused = amber.open(uri, opts, mode='r'); reused.close(); reused.steps(); del reused; gc.collect()\n"
        "reader = amber.open(uri, opts, mode='r')\n"
        "print(reader.load(1)['x'][3:5].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3.0, 4.0]"
    assert "Unclosed" not in out.stderr and "unclosed" not in out.stderr, out.stderr


def test_a_step_with_data_but_no_manifest_is_invisible_and_ignored_by_the_next_save(s3_server, s3_uri, monkeypatch):
    opts = s3_server.storage_options()
    store = amber.open(s3_uri, opts)
    store.save(1, state(1))

    async def crash(*args, **kwargs):
        raise ConnectionResetError("process killed before the commit")

    monkeypatch.setattr(store.history.backend, "put_if_absent", crash)
    with pytest.raises(amber.StorageAccessError):
        store.save(2, state(2))
    monkeypatch.undo()
    prefix = s3_uri[len(f"s3://{BUCKET}/"):]
    listing = s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/steps/", Delimiter="/")
    assert len(listing["CommonPrefixes"]) == 2  # step 1's group and the orphaned attempt of step 2
    reader = amber.open(s3_uri, opts, mode="r")
    assert reader.steps() == [1]
    with pytest.raises(amber.StepNotFoundError):
        reader.load(2)
    s2 = state(2)
    store.save(2, s2)
    assert_tree_bit_equal(amber.open(s3_uri, opts, mode="r").load(2, lazy=False), s2)


def test_flipped_bytes_in_one_object_are_detected_with_step_and_tensor(s3_server, s3_uri):
    opts = s3_server.storage_options()
    store = amber.open(s3_uri, opts, pack_threshold=0)
    store.save(1, state(1))
    array = store.manifest(1).tensors["layer2"].array
    client = s3_server.client()
    key = f"{s3_uri[len(f's3://{BUCKET}/'):]}/{array}/0.0"
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[40] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    reader = amber.open(s3_uri, opts, mode="r")
    with pytest.raises(amber.CorruptDataError, match="step 1, tensor 'layer2'"):
        reader.load(1)["layer2"].materialize()
    assert reader.verify(1)[1]["layer2"] is not None
    assert reader.verify(1)[1]["layer1"] is None


def test_missing_bucket_fails_at_open_naming_the_uri(s3_server):
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(amber.StorageAccessError, match=f"{uri}: bucket .* does not exist"):
        amber.open(uri, s3_server.storage_options())


def test_wrong_credentials_fail_at_open_without_leaking_them(s3_server, s3_uri):
    secret = "wrong-secret-" + uuid.uuid4().hex
    opts = {**s3_server.storage_options(), "key": "AKIAWRONGKEY0000", "secret": secret}
    with pytest.raises(amber.StorageAccessError, match=f"{s3_uri}: access denied") as err:
        amber.open(s3_uri, opts)
    assert secret not in str(err.value)


def test_missing_credentials_fail_at_open(s3_server, s3_uri):
    # conftest hides the developer's AWS environment (no keys, no profile, no metadata service)
    opts = {"endpoint_url": s3_server.storage_options()["endpoint_url"]}
    with pytest.raises(amber.StorageAccessError, match="no valid credentials"):
        amber.open(s3_uri, opts)


def test_unreachable_endpoint_fails_at_open(s3_uri):
    opts = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "k", "secret": "s"}
    with pytest.raises(amber.StorageAccessError, match=f"{s3_uri}: storage not usable"):
        amber.open(s3_uri, opts)


def test_each_open_reads_the_credentials_afresh_from_the_environment(s3_server, s3_uri, monkeypatch):
    opts = s3_server.storage_options()
    endpoint = {"endpoint_url": opts["endpoint_url"]}
    amber.open(s3_uri, opts).save(1, state(1))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    assert amber.open(s3_uri, endpoint, mode="r").steps() == [1]
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(amber.StorageAccessError, match="no valid credentials"):  # none kept from the last open
        amber.open(s3_uri, endpoint, mode="r")


def test_a_named_profile_of_the_aws_credentials_file_is_used(s3_server, s3_uri, monkeypatch, tmp_path):
    opts = s3_server.storage_options()
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[amber]\naws_access_key_id = {opts['key']}\naws_secret_access_key = {opts['secret']}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    amber.open(s3_uri, opts).save(1, state(1))
    reader = amber.open(s3_uri, {"endpoint_url": opts["endpoint_url"], "profile": "amber"}, mode="r")
    assert_tree_bit_equal(reader.load(1, lazy=False), state(1))


def test_open_lists_only_within_the_stores_own_prefix(s3_server, s3_uri):
    from aiobotocore.session import AioSession

    opts = s3_server.storage_options()
    amber.open(s3_uri, opts).save(1, state(1))
    calls: list[tuple[str, dict]] = []
    session = AioSession()  # a caller's own session: its hooks see every request
    session.register("before-parameter-build.s3", lambda model, params, **_: calls.append((model.name, dict(params))))
    reader = amber.open(s3_uri, {**opts, "session": session}, mode="r")
    assert reader.steps() == [1]
    prefix = s3_uri.split("/", 3)[3] + "/"
    listings = [params for name, params in calls if name.startswith("ListObjects")]
    # not the bucket's root: paging through every other run there, and perhaps not allowed
    assert listings and all(p["Prefix"].startswith(prefix) for p in listings), listings
    assert listings[0].get("MaxKeys") == 1  # the probe at open: one question


def test_endpoint_and_credentials_come_from_the_standard_aws_environment(s3_server, s3_uri, monkeypatch):
    opts = s3_server.storage_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    store = amber.open(s3_uri)  # no storage_options at all: the training config holds only the URI
    s = state(3)
    store.save(1, s)
    assert_tree_bit_equal(amber.open(s3_uri, mode="r").load(1, lazy=False), s)


def test_an_http_endpoint_is_used_without_loading_a_ca_bundle(s3_server, s3_uri, monkeypatch):
    import ssl

    assert s3_server.storage_options()["endpoint_url"].startswith("http://")
    loaded: list[object] = []
    original = ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda self, *a, **k: (loaded.append(a), original(self, *a, **k))[1])
    s = state(4)
    with amber.open(s3_uri, s3_server.storage_options()) as store:
        store.save(1, s)
    assert_tree_bit_equal(amber.open(s3_uri, s3_server.storage_options(), mode="r").load(1, lazy=False), s)
    assert loaded == []  # plain HTTP has no certificate to check
    https = s3_options({"endpoint_url": "https://s3.example.com"})["client_kwargs"]
    assert "verify" not in https  # TLS endpoints keep botocore's verification
