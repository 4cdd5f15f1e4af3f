"""Object-store behaviour: commit semantics, outages and bad configuration on a real S3 endpoint.

They run against the loopback moto server, or MinIO when AMBER_S3_ENDPOINT is set; the outage
test needs a server it can stop, so it runs on loopback only.
"""

from __future__ import annotations

import uuid
from concurrent.futures import wait

import pytest
import s3fs
import torch

import amber_store as amber
from amber_store import pipeline
from backends.loopback_s3 import LoopbackS3, free_port
from conftest import BUCKET, assert_tree_bit_equal

pytestmark = pytest.mark.s3


@pytest.fixture
def s3_uri() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(64, 64, generator=g) for i in range(6)}


def raw_fs(server) -> s3fs.S3FileSystem:
    opts = server.storage_options()
    return s3fs.S3FileSystem(key=opts["key"], secret=opts["secret"], skip_instance_cache=True,
                             client_kwargs={"endpoint_url": opts["endpoint_url"]},
                             config_kwargs={"s3": {"addressing_style": "path"}})


def test_server_stopped_mid_save_fails_clearly_and_a_retry_after_recovery_succeeds(s3_server, s3_uri, monkeypatch):
    if not isinstance(s3_server, LoopbackS3):
        pytest.skip("needs a server the test can stop (the loopback one)")
    store = amber.open(s3_uri, s3_server.storage_options(), pack_threshold=0)  # an object per tensor
    s1, s2 = state(1), state(2)
    store.save(1, s1)
    original = pipeline.StepWriter._put

    def outage_after_first_object(self, key, payload, weight):
        original(self, key, payload, weight)
        if s3_server.running:
            wait(list(self._writes))
            s3_server.stop()

    monkeypatch.setattr(pipeline.StepWriter, "_put", outage_after_first_object)
    try:
        with pytest.raises(amber.StorageAccessError, match=rf"{s3_uri}: saving step 2 failed") as err:
            store.save(2, s2)
        assert "secret" not in str(err.value) and s3_server.storage_options()["secret"] not in str(err.value)
    finally:
        monkeypatch.setattr(pipeline.StepWriter, "_put", original)
        if not s3_server.running:
            s3_server.start()
    assert store.steps() == [1]
    assert_tree_bit_equal(amber.open(s3_uri, s3_server.storage_options(), mode="r").load(1, lazy=False), s1)
    assert store.save(2, s2).kind == "delta"
    assert_tree_bit_equal(amber.open(s3_uri, s3_server.storage_options(), mode="r").load(2, lazy=False), s2)


def test_a_step_with_data_but_no_manifest_is_invisible_and_ignored_by_the_next_save(s3_server, s3_uri, monkeypatch):
    opts = s3_server.storage_options()
    store = amber.open(s3_uri, opts)
    store.save(1, state(1))

    async def crash(*args, **kwargs):
        raise ConnectionResetError("process killed before the commit")

    monkeypatch.setattr("amber_store.history.put_if_absent", crash)
    with pytest.raises(amber.StorageAccessError):
        store.save(2, state(2))
    monkeypatch.undo()
    fs = raw_fs(s3_server)
    prefix = s3_uri[len("s3://"):]
    groups = [g for g in fs.ls(f"{prefix}/steps", detail=False, refresh=True) if not g.endswith("zarr.json")]
    assert len(groups) == 2  # step 1's and the orphaned attempt of step 2
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
    fs = raw_fs(s3_server)
    key = f"{s3_uri[len('s3://'):]}/{array}/0.0"
    data = bytearray(fs.cat_file(key))
    data[40] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    reader = amber.open(s3_uri, opts, mode="r")
    with pytest.raises(amber.CorruptDataError, match="step 1, tensor 'layer2'"):
        reader.load(1)["layer2"].materialize()
    assert reader.verify(1)[1]["layer2"] is not None
    assert reader.verify(1)[1]["layer1"] is None


def test_missing_bucket_fails_at_open_naming_the_uri(s3_server):
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(amber.StorageAccessError, match=f"{uri}: bucket .* does not exist"):
        amber.open(uri, s3_server.storage_options())


def test_wrong_credentials_fail_at_open_without_leaking_them(s3_server, s3_uri, monkeypatch):
    if isinstance(s3_server, LoopbackS3):
        import moto.settings

        # moto accepts any key unless told to authenticate; the server thread reads this live.
        monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    secret = "wrong-secret-" + uuid.uuid4().hex
    opts = {**s3_server.storage_options(), "key": "AKIAWRONGKEY0000", "secret": secret}
    with pytest.raises(amber.StorageAccessError, match=f"{s3_uri}: access denied") as err:
        amber.open(s3_uri, opts)
    assert secret not in str(err.value)


def test_missing_credentials_fail_at_open(s3_server, s3_uri, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    opts = {"endpoint_url": s3_server.storage_options()["endpoint_url"]}
    with pytest.raises(amber.StorageAccessError, match="no valid credentials"):
        amber.open(s3_uri, opts)


def test_unreachable_endpoint_fails_at_open(s3_uri):
    opts = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "k", "secret": "s"}
    with pytest.raises(amber.StorageAccessError, match=f"{s3_uri}: storage not usable"):
        amber.open(s3_uri, opts)


def test_endpoint_and_credentials_come_from_the_standard_aws_environment(s3_server, s3_uri, monkeypatch):
    opts = s3_server.storage_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    store = amber.open(s3_uri)  # no storage_options at all: the training config holds only the URI
    s = state(3)
    store.save(1, s)
    assert_tree_bit_equal(amber.open(s3_uri, mode="r").load(1, lazy=False), s)
