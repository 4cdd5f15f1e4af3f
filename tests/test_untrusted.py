"""A store is untrusted input (docs/SECURITY.md): crafted stores open, load, reshard and gc without
running their code, touching files outside them or allocating what their size does not justify,
and end in a clear amber error; a lost commit answer or two racing jobs never lose or
double-commit a step."""

from __future__ import annotations

import asyncio
import fractions
import json
import os
import pickle
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import amber_store as amber
from amber_store import format as fmt
from amber_store import history as history_mod
from amber_store.dcp import AmberStorageReader, AmberStorageWriter
from backends.faultproxy import FaultProxy
from conftest import BUCKET, assert_tree_bit_equal

DATA = Path(__file__).parent / "data"


def state(k: int) -> dict:
    """A state whose step holds a shard object (the big tensor) and a pack (the rest)."""
    g = torch.Generator().manual_seed(k)
    return {"big": torch.randn(600, 600, generator=g), "small": torch.randn(16, generator=g), "step": k,
            "np": np.arange(4)}


@pytest.fixture
def crafted(tmp_path):
    """A local store of two steps, and a function that rewrites a step's manifest JSON."""
    root = tmp_path / "ckpt"
    with amber.open(root) as store:
        store.save(1, state(1))
        store.save(2, state(2))

    def rewrite(step: int, change) -> None:
        path = root / fmt.commit_key(step)
        d = json.loads(path.read_bytes())
        change(d)
        path.write_bytes(json.dumps(d).encode())

    return root, rewrite


def load_all(root, step: int = 2):
    with amber.open(root, mode="r") as store:
        return store.load(step, lazy=False)


def big(d: dict) -> dict:
    return d["tensors"]["big"]


CRAFTED = {
    "absolute array key": (lambda d: big(d).update(array="/etc/passwd"), "not a key inside the store"),
    "array key leaving the store": (lambda d: big(d).update(array="steps/../../../etc/passwd"), "leaves its folder"),
    "pack key leaving the store": (lambda d: next(iter(d["packs"].values())).update(array="steps/x/../../.."),
                                   "leaves its folder"),
    "backslash in a key": (lambda d: big(d).update(array="steps\\..\\x"), "not a key inside the store"),
    "group outside steps": (lambda d: d.update(group="commits"), "not a key inside the store"),
    "a terabyte shape": (lambda d: big(d).update(shape=[10**12], chunks=[10**12], nbytes=4 * 10**12, crc32c=[0],
                                                 index=[None]), "over the"),
    "shape and nbytes disagree": (lambda d: big(d).update(shape=[600, 601]), "nbytes"),
    "chunk grid and checksums disagree": (lambda d: big(d).update(crc32c=big(d)["crc32c"] * 2), "checksums"),
    "a pack's index of a petabyte": (lambda d: next(iter(d["packs"].values())).update(nbytes=10**15),
                                     "index does not list"),
    "a delta based on itself": (lambda d: big(d).update(base=2), "not an earlier step"),
    "the tree names a tensor the step lacks": (lambda d: d["tree"]["dict"].append(["x", {"tensor": "nope"}]),
                                               "lacks"),
    "a node where a list belongs": (lambda d: d.update(tree={"dict": 5}), "not a list"),
    "a numpy value claiming a terabyte": (lambda d: d["tree"]["dict"].append(["n", {"npy": _npy_claiming(10**12)}]),
                                          "cannot be read safely"),
    "an unknown dtype": (lambda d: big(d).update(dtype="complex256"), "dtype"),
    "a manifest of another step": (lambda d: d.update(step=7), "names step 7"),
}


def _npy_claiming(n: int) -> str:
    """An .npy value whose header claims ``n`` float64s and holds 8 bytes."""
    import base64
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.zeros(1), allow_pickle=False)
    raw = buf.getvalue().replace(b"(1,)", f"({n},)".encode())
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_manifest_is_refused_as_corrupt_before_anything_is_read_or_allocated(crafted, case):
    root, rewrite = crafted
    change, message = CRAFTED[case]
    rewrite(2, change)
    t0 = time.perf_counter()
    with pytest.raises(amber.CorruptDataError, match=message) as err:
        load_all(root)
    assert time.perf_counter() - t0 < 2, "refused only after work its size does not justify"
    assert "step 2" in str(err.value) or "state tree" in str(err.value)
    assert_tree_bit_equal(load_all(root, 1), state(1))  # the other steps are untouched


def test_a_manifest_of_a_newer_format_says_upgrade_before_anything_else_is_parsed(crafted):
    root, rewrite = crafted
    rewrite(2, lambda d: (d.clear(), d.update(format_version=fmt.FORMAT_VERSION + 1, tensors="later")))
    with pytest.raises(amber.FormatVersionError, match="upgrade amber-store"):
        load_all(root)


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_link_or_fifo_planted_in_a_store_is_refused_without_being_followed_or_blocking(crafted, tmp_path, plant):
    root, _ = crafted
    with amber.open(root, mode="r") as store:
        shard = root / fmt.shard_key(store.manifest(2).tensors["big"].array, 2)
    outside = tmp_path / "outside"
    shutil.copy(shard, outside)  # the very bytes: only where they lie is wrong
    shard.unlink()
    if plant == "symlink":
        shard.symlink_to(outside)
    else:
        os.mkfifo(shard)
    t0 = time.perf_counter()
    with pytest.raises(amber.CorruptDataError, match="links outside the store" if plant == "symlink"
                       else "not a regular file"):
        load_all(root)
    assert time.perf_counter() - t0 < 5


def test_gc_refuses_a_crafted_group_outside_the_store_and_deletes_nothing_there(crafted, tmp_path):
    root, rewrite = crafted
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    rewrite(1, lambda d: d.update(group="steps/../../victim"))
    with amber.open(root) as store, pytest.raises(amber.CorruptDataError, match="leaves its folder"):
        store.gc(keep_last=1)
    assert (victim / "keep.txt").read_text() == "precious"


# --- DCP: no code runs on load ----------------------------------------------------------------

MARKER = "amber-untrusted-marker"


class RunsCode:
    """A value whose unpickling runs a shell command (what a crafted store would hold)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_format_8_dcp_metadata_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    root = tmp_path / "v8"
    shutil.copytree(DATA / "dcp-v8", root)
    marker = tmp_path / MARKER
    for path in root.glob("steps/*/dcp.metadata"):
        path.write_bytes(pickle.dumps(RunsCode(str(marker))))
    reader = AmberStorageReader(str(root), step=1)
    with pytest.raises(amber.CorruptDataError, match="is not part of DCP metadata"):
        reader.read_metadata()
    with warnings.catch_warnings(), pytest.raises(BaseException) as err:
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"w": torch.zeros(1)}, storage_reader=AmberStorageReader(str(root), step=1), no_dist=True)
    assert "posix.system is not part of DCP metadata" in str(err.value)
    assert not marker.exists(), "code from the store ran"


def test_format_8_dcp_metadata_still_reads_as_dcp_saved_it(tmp_path):
    metadata = AmberStorageReader(str(DATA / "dcp-v8"), step=1).read_metadata()
    assert metadata.state_dict_metadata and metadata.storage_data


def test_a_format_8_metadata_key_outside_the_store_is_refused(tmp_path):
    root = tmp_path / "v8"
    shutil.copytree(DATA / "dcp-v8", root)
    path = root / fmt.commit_key(1)
    d = json.loads(path.read_bytes())
    d["extra"]["dcp"]["metadata"] = "../../elsewhere/evil.pkl"
    path.write_bytes(json.dumps(d).encode())
    with pytest.raises(amber.CorruptDataError, match="not a key inside the store"):
        AmberStorageReader(str(root), step=1).read_metadata()


def test_dcp_load_of_a_value_that_runs_code_raises_unsafe_value_and_runs_nothing(tmp_path):
    uri = str(tmp_path / "ckpt")
    marker = tmp_path / MARKER
    saved = {"w": torch.randn(4, 4), "sched": {"frac": fractions.Fraction(1, 3)}, "evil": RunsCode(str(marker))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
        dcp.save(saved, storage_writer=AmberStorageWriter(uri, step=1))
        assert not marker.exists()
        target = {"w": torch.zeros(4, 4), "sched": {"frac": None}, "evil": None}
        with pytest.raises(BaseException) as err:
            dcp.load(target, storage_reader=AmberStorageReader(uri))
        assert "UnsafeValueError" in str(err.value) and "'evil' is a pickled object" in str(err.value)
        assert not marker.exists(), "dcp.load ran code stored with a value"
        # values of allow-listed types load as they were saved
        safe = {"w": torch.zeros(4, 4), "lr": None}
        dcp.save({"w": saved["w"], "lr": 0.5}, storage_writer=AmberStorageWriter(uri, step=2))
        dcp.load(safe, storage_reader=AmberStorageReader(uri, step=2))
        assert safe["lr"] == 0.5 and torch.equal(safe["w"], saved["w"])
        # the only way round: allow_pickle=True, said out loud (the Fraction needs it)
        trusted = {"w": torch.zeros(4, 4), "sched": {"frac": None}}
        dcp.load(trusted, storage_reader=AmberStorageReader(uri, step=1, allow_pickle=True))
    assert trusted["sched"]["frac"] == fractions.Fraction(1, 3)
    with pytest.raises(amber.UnsafeValueError, match="allow_pickle=True"):
        amber.open(uri, mode="r").load(1)


# --- commits: lost answers and racing jobs ----------------------------------------------------

@pytest.mark.s3
@pytest.mark.parametrize("through", ["dcp", "store"])
def test_a_commit_whose_answer_is_dropped_on_every_retry_keeps_its_step_and_every_later_one(s3_server, through):
    """A proxy in front of SeaweedFS relays the commit of step 2 and drops every answer to it:
    the manifest lands, the save reports an unknown outcome, and the next saves keep step 2."""
    drop = {"on": False}
    with FaultProxy(s3_server.endpoint, lambda m, p: drop["on"] and m == "PUT" and "/commits/" in p) as proxy:
        opts = {**s3_server.storage_options(), "endpoint_url": proxy.endpoint}
        uri = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        states = {k: {"w": torch.full((300, 300), float(k)), "b": torch.arange(10) * k} for k in (1, 2, 3, 4)}
        store = amber.open(uri, opts, base_policy="chain") if through == "store" else None

        def save(k: int) -> None:
            if store is not None:
                store.save(k, states[k])
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.save(states[k], storage_writer=AmberStorageWriter(uri, opts, step=k, base_policy="chain"),
                             no_dist=True)

        save(1)
        drop["on"] = True
        with pytest.raises(BaseException, match="StorageAccessError|commit"):
            save(2)
        assert len(proxy.dropped) >= 2, proxy.dropped  # the request and its retries all reached the server
        drop["on"] = False
        save(3)
        save(4)
    reader = amber.open(uri, s3_server.storage_options(), mode="r")
    assert reader.steps() == [1, 2, 3, 4]
    for k in reader.steps():
        assert_tree_bit_equal(reader.load(k, lazy=False), states[k])


def test_of_two_jobs_that_listed_the_same_latest_step_exactly_one_commits(make_store, monkeypatch):
    """The race window forced: both jobs list the steps before either commits, so only the
    commit's claim on their shared base can tell them apart."""
    first = make_store()
    first.save(1, {"x": torch.ones(8)})
    jobs = [make_store(), make_store()]
    for job in jobs:
        async def stale() -> list[int]:
            return [1]

        monkeypatch.setattr(job.history, "steps", stale)
    barrier = threading.Barrier(2)
    outcomes: list[object] = [None, None]

    def save(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = jobs[i].save(2 + i, {"x": torch.full((8,), 2.0 + i)})
        except amber.AmberError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lost = [o for o in outcomes if isinstance(o, amber.AmberError)]
    assert len(lost) == 1 and isinstance(lost[0], amber.ConcurrentWriterError), outcomes
    assert "two jobs are writing one store" in str(lost[0])
    monkeypatch.undo()
    reader = make_store(mode="r")
    winner = 2 + outcomes.index(next(o for o in outcomes if not isinstance(o, amber.AmberError)))
    assert reader.steps() == [1, winner]
    assert torch.equal(reader.load(winner)["x"].materialize(), torch.full((8,), float(winner)))


def test_a_claim_left_by_a_writer_that_died_committing_is_passed_over(local_store, tmp_path, monkeypatch):
    store = local_store()
    store.save(1, {"x": torch.ones(8)})
    dead = {"step": 2, "attempt": "deadbeef", "writer": "someone", "group": "steps/000000000002-deadbeef",
            "time": time.time()}
    (tmp_path / "ckpt" / fmt.claim_key(1, 0)).write_text(json.dumps(dead))  # its attempt is gone
    other = local_store()
    other.save(3, {"x": torch.zeros(8)})
    assert other.steps() == [1, 3]
    # a claim whose attempt is still there is taken for a save in progress until it is old
    (tmp_path / "ckpt" / "steps" / "000000000004-cafe").mkdir()
    (tmp_path / "ckpt" / "steps" / "000000000004-cafe" / "zarr.json").write_text(
        json.dumps(fmt.step_group_metadata(4, time.time(), {})))
    alive = {**dead, "step": 4, "attempt": "cafe", "group": "steps/000000000004-cafe"}
    (tmp_path / "ckpt" / fmt.claim_key(3, 0)).write_text(json.dumps(alive))
    with pytest.raises(amber.ConcurrentWriterError, match="two jobs are writing one store"):
        local_store().save(5, {"x": torch.zeros(8)})
    monkeypatch.setattr(history_mod, "CLAIM_GRACE_SECONDS", 0.0)
    local_store().save(5, {"x": torch.zeros(8)})
    assert local_store(mode="r").steps() == [1, 3, 5]


# --- a fuzz of real manifests ------------------------------------------------------------------

def test_a_fuzz_of_real_manifests_ends_each_load_bit_exact_or_in_an_amber_error_and_opens_nothing_outside(tmp_path):
    from benchmarks.fuzz_manifests import fuzz

    cases = 300
    tally = fuzz(cases, 20261207, tmp_path, assert_tree_bit_equal)  # (raises on any other outcome)
    print(f"\n{cases} mutated manifests: {tally}")
    assert tally.get("CorruptDataError", 0) > cases // 3  # (the fuzz does reach the checks)


# --- uploads in parts -------------------------------------------------------------------------

@pytest.mark.s3
def test_a_cancelled_upload_in_parts_is_aborted_and_a_killed_ones_are_reported_and_removed_by_gc(s3_server, capsys):
    from amber_store.runtime import sync

    from amber_store.cli import main as cli
    from amber_store.storage import obstorestore

    uri = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    store = amber.open(uri, s3_server.storage_options())
    store.save(1, {"x": torch.ones(4)})
    backend = store.history.backend
    client = s3_server.client()
    prefix = uri.split(f"{BUCKET}/", 1)[1]

    async def cancelled_midway() -> None:
        task = asyncio.ensure_future(backend.put_object("steps/x/big", [bytes(obstorestore.PART_BYTES)] * 3))
        while not client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads"):
            await asyncio.sleep(0.05)  # (until its upload has begun)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.gather(*backend._aborting)

    sync(cancelled_midway())
    assert sync(backend.incomplete_uploads()) == []
    # a killed process's upload: begun, a part sent, never completed nor aborted
    client.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}/steps/000000000002-dead/big/0.0")
    assert cli(["du", uri, *_s3_args(s3_server)]) == 0
    assert "1 upload(s) in parts never completed" in capsys.readouterr().out
    assert store.gc(keep_last=1).uploads == []  # younger than the grace period: maybe a save in progress
    assert store.gc(keep_last=1, grace_seconds=0).uploads == ["steps/000000000002-dead/big/0.0"]
    assert client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []) == []


def _s3_args(server) -> list[str]:
    opts = server.storage_options()
    return ["--endpoint-url", opts["endpoint_url"], "--storage-option", f"key={opts['key']}",
            "--storage-option", f"secret={opts['secret']}"]


@pytest.mark.s3
def test_a_commit_answered_409_by_a_racing_conditional_write_is_asked_again(s3_server):
    answered: list[str] = []

    def conflict_twice(method: str, path: str) -> bool:  # (as AWS answers a create racing another)
        if method == "PUT" and "/commits/" in path and len(answered) < 2:
            answered.append(path)
            return True
        return False

    with FaultProxy(s3_server.endpoint, fail=conflict_twice, status=409) as proxy:
        opts = {**s3_server.storage_options(), "endpoint_url": proxy.endpoint}
        store = amber.open(f"s3://{BUCKET}/{uuid.uuid4().hex}", opts)
        assert store.save(1, {"x": torch.ones(4)}).step == 1
    assert len(answered) == 2 and store.steps() == [1]


def test_gc_deletes_the_claims_no_commit_will_consult_again(local_store, tmp_path):
    store = local_store()
    for step in (1, 2, 3):
        store.save(step, {"x": torch.full((4,), float(step))})
    claims = tmp_path / "ckpt" / "claims"
    assert sorted(p.name for p in claims.iterdir()) == ["000000000001-0.json", "000000000002-0.json", "start-0.json"]
    for name in ("start-0.json", "000000000001-0.json"):  # as if made long ago
        claim = json.loads((claims / name).read_text())
        (claims / name).write_text(json.dumps({**claim, "time": claim["time"] - 3600}))
    report = store.gc()
    assert {f"claims/{n}" for n in ("start-0.json", "000000000001-0.json")} <= set(report.orphans)
    # step 3's claim on step 2 is young: a job that listed before step 3 landed may still race it
    assert sorted(p.name for p in claims.iterdir()) == ["000000000002-0.json"]
    store.save(4, {"x": torch.zeros(4)})
    assert local_store(mode="r").steps() == [1, 2, 3, 4]


def test_a_commit_without_an_answer_is_settled_by_the_next_save_so_a_late_landing_changes_nothing(make_store,
                                                                                                  monkeypatch):
    """A frozen server that thaws may apply a commit long after its writer gave up: the next save
    first sends the create again, so the step is committed (and gc keeps its data) and the late
    request finds its key taken."""
    store = make_store()
    states = {k: {"x": torch.full((64,), float(k))} for k in (1, 2, 3)}
    store.save(1, states[1])
    backend = store.history.backend
    real = backend.put_if_absent
    held: list[tuple[str, bytes]] = []

    async def held_by_a_frozen_server(key, data):
        if key.startswith("commits/"):
            held.append((key, data))  # (applied later, when the server thaws)
            raise TimeoutError
        return await real(key, data)

    monkeypatch.setattr(backend, "put_if_absent", held_by_a_frozen_server)
    with pytest.raises(amber.StorageAccessError, match="commit of step 2 got no answer in time"):
        store.save(2, states[2])
    monkeypatch.undo()
    store.save(3, states[3])  # settles step 2 first
    store.gc()  # no stray attempt to delete: step 2 is committed
    sync_put(real, *held[0])  # the thawed server's request: the key is taken (by these very bytes)
    reader = make_store(mode="r")
    assert reader.steps() == [1, 2, 3]
    for k in (1, 2, 3):
        assert_tree_bit_equal(reader.load(k, lazy=False), states[k])


def sync_put(put, key: str, data: bytes) -> bool:
    from amber_store.runtime import sync

    return sync(put(key, data))
