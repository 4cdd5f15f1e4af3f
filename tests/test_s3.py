"""What only S3 does: its two clients (obstore, the default, and s3fs), the AWS environment and
profiles, botocore's requests, a server that ignores conditional writes (rclone's ``serve s3``).
The behaviour every object store shares is in test_object_stores.py.

They run against the session's SeaweedFS process (or AMBER_S3_ENDPOINT).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

import amber_store as amber
from amber_store.storage.s3 import s3_options
from backends.s3servers import RcloneS3
from conftest import BUCKET, assert_tree_bit_equal, layer_state

pytestmark = pytest.mark.s3
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def s3_uri() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(params=["obstore", "s3fs"])
def client(request: pytest.FixtureRequest) -> dict:
    """Each S3 client, as storage_options name it."""
    return {"client": request.param}


def s3fs(server) -> dict:
    """Options of the s3fs client, whose requests a test can watch through botocore's events."""
    return {**server.storage_options(), "client": "s3fs"}


def test_s3_goes_through_obstore_unless_s3fs_is_asked_for_or_its_options_are_given(s3_server, s3_uri):
    opts = s3_server.storage_options()
    assert type(amber.open(s3_uri, opts).history.backend).__name__ == "ObstoreS3Backend"
    assert type(amber.open(s3_uri, s3fs(s3_server)).history.backend).__name__ == "S3Backend"
    assert type(amber.open(s3_uri, {**opts, "config_kwargs": {}}).history.backend).__name__ == "S3Backend"
    with pytest.raises(amber.InvalidURIError, match="unknown storage_options .'bogus'. for s3://"):
        amber.open(s3_uri, {**opts, "bogus": 1})
    with pytest.raises(amber.InvalidURIError, match="client must be 'obstore' .the default. or 's3fs'"):
        amber.open(s3_uri, {**opts, "client": "boto"})


def test_objects_above_the_part_size_are_uploaded_in_parts_and_read_back_bit_exact(s3_server, s3_uri, monkeypatch):
    from amber_store.storage import obstorestore

    monkeypatch.setattr(obstorestore, "PART_BYTES", 5 << 20)  # (S3's smallest part)
    state = {"big": torch.randn(4 << 20, generator=torch.Generator().manual_seed(0)), **layer_state(2)}  # 16 MiB
    with amber.open(s3_uri, s3_server.storage_options(), pack_threshold=1 << 20) as store:
        store.save(1, state)
    with amber.open(s3_uri, s3_server.storage_options(), mode="r") as reader:
        assert_tree_bit_equal(reader.load(1, lazy=False), state)


def test_a_commit_whose_answer_was_lost_and_whose_retry_finds_its_own_manifest_succeeds(s3_server, s3_uri,
                                                                                       monkeypatch):
    opts = s3fs(s3_server)
    store = amber.open(s3_uri, opts)
    fs = store.history.backend.fs
    real = fs._call_s3
    retried = []

    async def lost_answer(method, *args, **kwargs):
        out = await real(method, *args, **kwargs)
        if method == "put_object" and "IfNoneMatch" in kwargs and "/commits/" in kwargs["Key"] and not retried:
            retried.append(kwargs["Key"])  # the answer never arrived: the client sends it again
            out = await real(method, *args, **kwargs)
        return out

    monkeypatch.setattr(fs, "_call_s3", lost_answer)
    s1 = layer_state(1)
    assert store.save(1, s1).step == 1
    assert retried and "commits/" in retried[0]
    assert_tree_bit_equal(amber.open(s3_uri, opts, mode="r").load(1, lazy=False), s1)


def test_a_server_that_ignores_conditional_writes_is_refused_for_writing_unless_single_writer(client):
    with RcloneS3() as server:
        server.create_bucket(BUCKET)
        uri, opts = f"s3://{BUCKET}/run", {**server.storage_options(), **client}
        s = layer_state(4)
        with pytest.raises(amber.UnsafeStorageError, match=rf"{uri}: the server at {server.endpoint} ignores "
                                                           r"conditional writes .* single_writer=True"):
            amber.open(uri, opts).save(1, s)  # (a new store is checked at its first save: opening creates nothing)
        with amber.open(uri, opts, single_writer=True) as store:
            store.save(1, s)
        with amber.open(uri, opts, mode="r") as reader:  # reading needs no guarantee
            assert_tree_bit_equal(reader.load(1, lazy=False), s)
        with pytest.raises(amber.UnsafeStorageError):
            amber.open(uri, opts)  # the verdict is remembered per endpoint, and still no


def test_an_eager_load_gets_each_object_once_and_never_asks_for_sizes(s3_server, s3_uri):
    opts = s3fs(s3_server)
    with amber.open(s3_uri, opts, pack_threshold=0) as writer:
        writer.save(1, layer_state(0))
        writer.save(2, layer_state(1))
    with amber.open(s3_uri, opts, mode="r") as reader:
        calls: list[tuple[str, str]] = []
        reader.history.backend.fs.s3.meta.events.register(
            "before-parameter-build.s3", lambda model, params, **_: calls.append((model.name, params.get("Key", ""))))
        assert_tree_bit_equal(reader.load(2, lazy=False), layer_state(1))
    gets = [key for name, key in calls if name == "GetObject"]
    assert {name for name, _ in calls} == {"GetObject"}  # s3fs would HEAD each object first
    assert len(gets) == len(set(gets)) == 2 * len(layer_state(1)) + 2  # per tensor two layers; 2 manifests


def test_a_delta_save_lists_the_commits_twice_and_writes_each_object_once(s3_server, s3_uri):
    opts = s3fs(s3_server)
    with amber.open(s3_uri, opts, pack_threshold=0) as writer:
        writer.save(1, layer_state(0))
        calls: list[tuple[str, str]] = []
        writer.history.backend.fs.s3.meta.events.register(
            "before-parameter-build.s3",
            lambda model, params, **_: calls.append((model.name, params.get("Key", params.get("Prefix", "")))))
        writer.save(2, layer_state(1))
    listings = [prefix for name, prefix in calls if name == "ListObjectsV2"]
    puts = [key for name, key in calls if name == "PutObject"]
    assert len(listings) == 2 and all(p.endswith("/commits/") for p in listings)  # staging, the commit's check
    # the step group's zarr.json twice (opened, then sealed with its arrays); every other object
    # once: the tensors', the claim on step 1 and the manifest
    assert len(puts) == len(set(puts)) + 1 == len(layer_state(1)) + 4
    assert {name for name, _ in calls} == {"ListObjectsV2", "PutObject"}


def test_missing_credentials_fail_at_open(s3_server, s3_uri, client):
    # conftest hides the developer's AWS environment (no keys, no profile, no metadata service)
    opts = {"endpoint_url": s3_server.storage_options()["endpoint_url"], **client}
    with pytest.raises(amber.StorageAccessError, match="no valid credentials"):
        amber.open(s3_uri, opts)


def test_each_open_reads_the_credentials_afresh_from_the_environment(s3_server, s3_uri, monkeypatch, client):
    opts = s3_server.storage_options()
    endpoint = {"endpoint_url": opts["endpoint_url"], **client}
    amber.open(s3_uri, opts).save(1, layer_state(1))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    assert amber.open(s3_uri, endpoint, mode="r").steps() == [1]
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(amber.StorageAccessError, match="no valid credentials"):  # none kept from the last open
        amber.open(s3_uri, endpoint, mode="r")


def test_a_named_profile_of_the_aws_credentials_file_is_used(s3_server, s3_uri, monkeypatch, tmp_path, client):
    opts = s3_server.storage_options()
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[amber]\naws_access_key_id = {opts['key']}\naws_secret_access_key = {opts['secret']}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    amber.open(s3_uri, opts).save(1, layer_state(1))
    reader = amber.open(s3_uri, {"endpoint_url": opts["endpoint_url"], "profile": "amber", **client}, mode="r")
    assert_tree_bit_equal(reader.load(1, lazy=False), layer_state(1))


def test_open_lists_only_within_the_stores_own_prefix(s3_server, s3_uri):
    from aiobotocore.session import AioSession

    opts = s3_server.storage_options()
    amber.open(s3_uri, opts).save(1, layer_state(1))
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


def test_endpoint_and_credentials_come_from_the_standard_aws_environment(s3_server, s3_uri, monkeypatch, client):
    opts = s3_server.storage_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    store = amber.open(s3_uri, client)  # (by default no storage_options at all: the config holds only the URI)
    s = layer_state(3)
    store.save(1, s)
    assert_tree_bit_equal(amber.open(s3_uri, mode="r").load(1, lazy=False), s)


def test_an_http_endpoint_is_used_without_loading_a_ca_bundle(s3_server, s3_uri, monkeypatch, client):
    import ssl

    assert s3_server.storage_options()["endpoint_url"].startswith("http://")
    loaded: list[object] = []
    original = ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda self, *a, **k: (loaded.append(a), original(self, *a, **k))[1])
    s = layer_state(4)
    with amber.open(s3_uri, {**s3_server.storage_options(), **client}) as store:
        store.save(1, s)
    assert_tree_bit_equal(amber.open(s3_uri, {**s3_server.storage_options(), **client}, mode="r").load(1, lazy=False),
                          s)
    assert loaded == []  # plain HTTP has no certificate to check
    https = s3_options({"endpoint_url": "https://s3.example.com"})["client_kwargs"]
    assert "verify" not in https  # TLS endpoints keep botocore's verification
