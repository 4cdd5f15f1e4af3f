"""Shared fixtures: store locations (local, memory, real S3, GCS and Azure servers) and helpers."""

from __future__ import annotations

import os
import threading
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import pytest
import torch
from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

import amber_store as amber
from amber_store import codecs as amber_codecs
from amber_store import format as fmt
from backends.azurite import Azurite
from backends.gcs import FakeGCS
from backends.process import ServerProcess
from backends.s3servers import S3Endpoint, SeaweedFS

BUCKET = "amber-test"
#: the object stores of the tests: each kind's server, and the mark its tests carry
OBJECT_STORES = {"s3": SeaweedFS, "gcs": FakeGCS, "azure": Azurite}


@pytest.fixture(scope="session", autouse=True)
def no_developer_cloud_environment(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Hide the developer's AWS, Google Cloud and Azure configuration from every test: a store
    opened without explicit credentials must never send real ones to a test server."""
    with pytest.MonkeyPatch.context() as mp:
        for var in list(os.environ):
            if var.startswith(("AWS_", "AZURE_", "GOOGLE_", "GCSFS_", "CLOUDSDK_")) or var == "STORAGE_EMULATOR_HOST":
                mp.delenv(var)
        none = str(tmp_path_factory.mktemp("cloud") / "none")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", none)
        mp.setenv("AWS_CONFIG_FILE", none)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("CLOUDSDK_CONFIG", none)  # gcloud's application-default credentials
        mp.setenv("NO_GCE_CHECK", "true")  # no metadata server to ask (google-auth)
        yield


#: the servers started by the fixtures below and still running
_SERVERS: list[ServerProcess] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed object-store test's report ends with the tail of each running server's log (a
    server that stalled says why there, and CI keeps nothing else of it)."""
    report = yield
    if report.failed and any(item.get_closest_marker(kind) is not None for kind in OBJECT_STORES):
        for server in _SERVERS:
            report.sections.append((f"{server.name} at {server.endpoint}: log tail", server.log_tail(4000)))
    return report


@pytest.fixture(scope="module", autouse=True)
def servers_that_serve() -> Iterator[None]:
    """Each test module starts with session servers that serve: one that stopped serving during an
    earlier module (its disk filled, its process died) is started afresh, so one bad moment fails
    the tests that met it, not every later one."""
    for server in list(_SERVERS):
        if not server.healthy():
            warnings.warn(f"{server.name} at {server.endpoint} stopped serving; started afresh", RuntimeWarning)
            server.reset()
    yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Why tests were skipped, one line per reason (the 46 CUDA cases on a machine without one)."""
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reasons[longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)] += 1
    for reason, n in reasons.most_common():
        terminalreporter.write_line(f"{n} skipped: {reason.removeprefix('Skipped: ')}")


@contextmanager
def running(kind: str) -> Iterator[Any]:
    """A fresh server of the object store ``kind`` with the tests' bucket."""
    with OBJECT_STORES[kind]() as server:
        server.create_bucket(BUCKET)
        _SERVERS.append(server)
        try:
            yield server
        finally:
            _SERVERS.remove(server)


@pytest.fixture(scope="session")
def s3_server() -> Any:
    """The S3 endpoint of the s3-marked tests: a SeaweedFS process started for the session, or
    the server at AMBER_S3_ENDPOINT (MinIO, AWS) when that is set."""
    endpoint = os.environ.get("AMBER_S3_ENDPOINT")
    if endpoint:
        # its own variables, never the developer's AWS_* credentials
        server = S3Endpoint(endpoint, os.environ.get("AMBER_S3_ACCESS_KEY", "minioadmin"),
                            os.environ.get("AMBER_S3_SECRET_KEY", "minioadmin"))
        server.create_bucket(BUCKET)
        yield server
        return
    with running("s3") as server:
        yield server


@pytest.fixture
def own_s3_server() -> Any:
    """A SeaweedFS process of this test alone, which it may kill, freeze and restart."""
    with running("s3") as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Any:
    """The GCS endpoint of the gcs-marked tests: fake-gcs-server, started for the session."""
    with running("gcs") as server:
        yield server


@pytest.fixture(scope="session")
def azure_server() -> Any:
    """The Azure Blob endpoint of the azure-marked tests: Azurite, started for the session."""
    with running("azure") as server:
        yield server


OBJECT_STORE_PARAMS = [pytest.param(kind, marks=getattr(pytest.mark, kind)) for kind in OBJECT_STORES]


#: each object store's clients, the default first: the conformance suite runs on every one
CLIENTS = {"s3": ("obstore", "s3fs"), "gcs": ("gcsfs",), "azure": ("obstore", "adlfs")}
CLIENT_PARAMS = [pytest.param((kind, client), id=kind if client == CLIENTS[kind][0] else f"{kind}-{client}",
                              marks=getattr(pytest.mark, kind)) for kind in OBJECT_STORES for client in CLIENTS[kind]]


class Through:
    """A server reached through one of its clients: its options name that client, unless it
    is the default (which users reach without naming it)."""

    def __init__(self, server: Any, kind: str, client: str) -> None:
        self.server, self.via = server, None if client == CLIENTS[kind][0] else client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    def _named(self, options: dict[str, Any]) -> dict[str, Any]:
        return options if self.via is None else {**options, "client": self.via}

    def storage_options(self) -> dict[str, Any]:
        return self._named(self.server.storage_options())

    def quick_options(self) -> dict[str, Any]:
        return self._named(self.server.quick_options())

    def wrong_credentials(self, secret: str) -> dict[str, Any]:
        return self._named(self.server.wrong_credentials(secret))


@pytest.fixture(params=CLIENT_PARAMS)
def object_server(request: pytest.FixtureRequest) -> Any:
    """The session's server of each object store (S3, GCS, Azure), through each of its clients."""
    kind, client = request.param
    return Through(request.getfixturevalue(f"{kind}_server"), kind, client)


@pytest.fixture(params=CLIENT_PARAMS)
def own_object_server(request: pytest.FixtureRequest) -> Any:
    """A server of each object store for this test alone, which it may kill, freeze and
    restart, through each of its clients."""
    kind, client = request.param
    with running(kind) as server:
        yield Through(server, kind, client)


def store_uri(server: Any) -> str:
    """A fresh store location in the tests' bucket of ``server``."""
    return f"{server.scheme}://{BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(params=["local", "memory", *OBJECT_STORE_PARAMS])
def location(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any] | None]:
    """(uri, storage_options) of a fresh, empty store location of each backend kind."""
    kind = request.param
    if kind == "local":
        return str(tmp_path / "ckpt"), None
    if kind == "memory":
        return f"memory://test-{uuid.uuid4().hex}", None
    server = request.getfixturevalue(f"{kind}_server")
    return store_uri(server), server.storage_options()


@pytest.fixture
def make_store(location: tuple[str, dict[str, Any] | None]) -> Callable[..., amber.Store]:
    """Open the test's location (again and again: each call is a fresh Store object)."""
    uri, opts = location

    def make(mode: str = "a", **options: Any) -> amber.Store:
        return amber.open(uri, opts, mode=mode, **options)

    return make


@pytest.fixture
def local_store(tmp_path: Any) -> Callable[..., amber.Store]:
    """A local-directory store factory, for tests that poke at files on disk."""

    def make(mode: str = "a", **options: Any) -> amber.Store:
        return amber.open(tmp_path / "ckpt", mode=mode, **options)

    return make


class CountingStore(WrapperStore[Any]):
    """Counts reads per key, and records their byte ranges, so tests can assert what a load touched."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.reads: Counter[str] = Counter()
        self.ranges: list[tuple[str, ByteRequest | None]] = []

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        self.reads[key] += 1
        self.ranges.append((key, byte_range))
        return await self._store.get(key, prototype, byte_range)


def save_at_once(stores: list[amber.Store], step: int, states: list[Any]) -> list[object]:
    """Each store saves its state as ``step`` on its own thread, all started together; returns
    each one's CommitInfo or AmberError."""
    barrier = threading.Barrier(len(stores))
    outcomes: list[object] = [None] * len(stores)

    def save(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = stores[i].save(step, states[i])
        except amber.AmberError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=save, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def layer_state(seed: int) -> dict[str, torch.Tensor]:
    """Six 64x64 layers drawn from ``seed``: a state whose save is several objects."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(64, 64, generator=g) for i in range(6)}


def is_data_key(key: str) -> bool:
    """Whether a store key holds tensor data (a pack or a shard), not metadata (a zarr.json, a
    sharded step's fragment) or a commit."""
    return key.startswith("steps/") and not key.endswith("zarr.json") and "/fragment-r" not in key


def all_keys(store: amber.Store, prefix: str = "") -> list[str]:
    """Every key of a store's location below ``prefix``."""
    return collect(store.history.backend.list_prefix(prefix))


def collect(names: Any) -> list[str]:
    """An async iterator's items (a backend's listing), collected on amber-store's event loop."""
    from amber_store.runtime import sync

    async def listed() -> list[str]:
        return [n async for n in names]

    return sync(listed())


def stored_chunk(root: Any, store: amber.Store, step: int, key: str) -> tuple[Any, int, int]:
    """(file, offset, nbytes) of the first stored chunk holding ``key`` at ``step`` in a local
    store at ``root``: in its shard, or in the step's pack. A chunk is a blosc frame, then its
    crc32c (4 bytes)."""
    m = store.manifest(step)
    e = m.tensors[key]
    if e.pack is not None:
        pack = m.packs[e.pack[0]]
        return root / fmt.shard_key(pack["array"], 1), *pack["index"][e.pack[1] // pack["chunk"]]
    return root / fmt.shard_key(e.array, len(e.shape)), *next(i for i in e.index if i)


def flip_stored_byte(root: Any, store: amber.Store, step: int, key: str) -> None:
    """Damage the middle byte of the first stored chunk holding ``key`` at ``step`` (in its
    shard, or in the step's pack), as a bad disk sector would."""
    path, offset, n = stored_chunk(root, store, step, key)
    data = bytearray(path.read_bytes())
    data[offset + n // 2] ^= 0x10
    path.write_bytes(bytes(data))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a tensor, for bit-exact comparison (NaN payloads and -0.0 included)."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="the CUDA case: no CUDA device here "
                                                                                "(it runs on a GPU machine)"))])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Where a state lives: the CPU, and a CUDA device when the suite runs on a GPU machine
    (there the torch code takes deltas on the device, as in training)."""
    return torch.device(request.param)


@pytest.fixture(params=["kernels", "torch"])
def diff_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Lossy diffs of CPU tensors by the fused host kernels (:mod:`amber_store.codecs.kernels`), or by
    the torch code that tensors on an accelerator take, run here on the CPU."""
    monkeypatch.setattr(amber_codecs.device, "HOST_KERNELS", request.param == "kernels")
    return request.param


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(bits(a), bits(b))


def assert_tree_bit_equal(a: Any, b: Any) -> None:
    """Same containers (types, keys, order), same scalars, bit-equal tensors."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert_bit_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        for k in a:
            assert_tree_bit_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_tree_bit_equal(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b
