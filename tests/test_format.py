"""The on-disk format is a contract: stores written earlier keep reading back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr

import amber_store as amber
import dcp_workers
from amber_store.dcp import AmberStorageReader
from amber_store.codecs import ans as entropy
from amber_store import format as fmt
from conftest import assert_bit_equal, assert_tree_bit_equal
from make_format_fixture import expected, sharded_expected, write

DATA = Path(__file__).parent / "data"


def check_reference_store(path: Path, version: int) -> None:
    store = amber.open(path, mode="r")
    assert store.steps() == [1, 2, 3] + ([4, 5] if version >= 9 else [])
    assert [store.manifest(s).kind for s in (1, 2, 3)] == ["full", "delta", "delta"]
    assert {store.manifest(s).format_version for s in (1, 2, 3)} == {version}
    for step, state in expected(version).items():
        got = store.load(step, lazy=False)
        lossy = state.pop("lossy", None)
        assert_tree_bit_equal({k: v for k, v in got.items() if k != "lossy"}, state)
        if lossy is not None:
            assert torch.allclose(got["lossy"]["q"], lossy["q"], atol=0.2)
            assert torch.allclose(got["lossy"]["s"], lossy["s"], rtol=0.021)
            if "p" in lossy:
                assert torch.allclose(got["lossy"]["p"], lossy["p"], atol=0.01)
            if "blk" in lossy:
                assert torch.allclose(got["lossy"]["blk"], lossy["blk"], atol=0.2, equal_nan=True)
                assert torch.allclose(got["lossy"]["ratio"], lossy["ratio"], rtol=0.026)
            if "few" in lossy:
                assert torch.allclose(got["lossy"]["few"], lossy["few"], atol=0.2)
            for exact in ("fine", "odd"):  # whole steps: restored exactly
                if exact in lossy:
                    assert_bit_equal(got["lossy"][exact], lossy[exact])
    encodings = {k: e.encoding for k, e in store.manifest(3).tensors.items()}
    assert encodings["model/w"] == "same" and encodings["model/b"] == "full" and encodings["new"] == "full"
    lossless = "xor" if version < 6 else "diff"
    assert store.manifest(2).tensors["model/w"].encoding == lossless
    if version >= 2:
        assert encodings["lossy/q"] == "quant" and encodings["lossy/s"] == "sparse"
    if version >= 3:
        entries = store.manifest(3).tensors
        assert entries["small"].encoding == lossless and entries["small"].pack is not None
        assert entries["lossy/p"].encoding == "quant" and entries["lossy/p"].pack is not None
        assert entries["lossy/q"].index is not None and len(entries["lossy/q"].chunks) == 2
    if version >= 4:
        got = store.load(2, lazy=False)
        assert got["tied"] is got["model"]["w"] and "tied" not in store.manifest(2).tensors
        assert store.manifest(2).tensors["leaves/rng"].encoding == lossless
    if version >= 5:
        entries = store.manifest(3).tensors
        assert entries["lossy/blk"].encoding == "block" and entries["lossy/blk"].index is not None
        assert entries["lossy/ratio"].encoding == "ratio" and entries["lossy/ratio"].pack is not None
    if version >= 6:
        entries = store.manifest(2).tensors
        assert entries["xor/big"].encoding == "xor" and entries["xor/big"].index is not None
        assert entries["xor/small"].encoding == "xor" and entries["xor/small"].pack is not None
        assert entries["signs"].encoding == "diff"
    if version >= 7:
        entries = store.manifest(2).tensors
        assert entries["lossy/few"].encoding == "block" and entries["lossy/few"].params["sparse_codes"] is True
    if version >= 8:
        entries = store.manifest(3).tensors
        assert entries["lossy/fine"].index is not None and entries["lossy/odd"].pack is not None
    if version >= 9:
        check_sharded_steps(path, store, version)


def check_sharded_steps(path: Path, store: amber.Store, version: int) -> None:
    """Steps 4 and 5, saved through DCP from 2 ranks: one state, and what dcp.load plans with;
    from version 10 on, an index of grids and the ranks' fragments."""
    for step, state in sharded_expected().items():
        m = store.manifest(step)
        assert m.format_version == version and set(m.extra["dcp"]) == {"state"}  # no pickled metadata
        if version >= 10:
            index = m.extra["dcp"]["state"]
            assert [f["key"].rsplit("/", 1)[1] for f in m.fragments] == ["fragment-r0", "fragment-r1"]
            assert index["tensors"]["model/w"]["grid"] == [3, 8] and index["tensors"]["model/emb"]["grid"] == [4, 3]
            assert index["owners"][index["tensors"]["model/w"]["owners"]] == [0, 1]
        assert_tree_bit_equal(store.load(step, lazy=False), state)
        lazy = store.load(step)
        assert "shards=2" in repr(lazy["model"]["w"]) and "shards=2" in repr(lazy["model"]["emb"])
        assert_bit_equal(lazy["model"]["w"][2:5, 1:3], state["model"]["w"][2:5, 1:3])  # across the shards
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                  "optim": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(6, 8)}}}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
            dcp.load(target, storage_reader=AmberStorageReader(str(path), step=step))
        assert_tree_bit_equal(target["model"], state["model"])
        assert_tree_bit_equal(target["optim"]["state"], state["optim"]["state"])
    entries = store.manifest(5).tensors
    assert entries["model.w/3_0"].encoding == "diff" and entries["model.w/0_0"].encoding == "same"


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
def test_every_committed_format_version_reads_back_with_the_current_code(tmp_path, version):
    copy = tmp_path / f"v{version}"
    shutil.copytree(DATA / f"format-v{version}", copy)  # reads need no write access; keep the fixture pristine
    check_reference_store(copy, version)


def test_the_newest_fixture_holds_codes_stored_as_nibbles(tmp_path, monkeypatch):
    # version 8's layout must be in the newest committed store, or no test would freeze how it reads
    decoded = []
    real = entropy._nibbles_decode

    def spy(raw, n):
        decoded.append(n)
        return real(raw, n)

    monkeypatch.setattr(entropy, "_nibbles_decode", spy)
    shutil.copytree(DATA / f"format-v{fmt.FORMAT_VERSION}", tmp_path / "newest")
    amber.open(tmp_path / "newest", mode="r").load(2, lazy=False)
    assert sorted(decoded) == [16, 16, 16, 16, 39]  # lossy/fine's four chunks, lossy/odd (packed)


def test_what_the_fixture_script_writes_today_reads_back(tmp_path):
    write(str(tmp_path / "today"))
    check_reference_store(tmp_path / "today", fmt.FORMAT_VERSION)


def test_lossy_reconstruction_is_bit_stable_across_code_versions(tmp_path):
    write(str(tmp_path / "today"))
    today = amber.open(tmp_path / "today", mode="r")
    committed = amber.open(DATA / f"format-v{fmt.FORMAT_VERSION}", mode="r")
    for step in (1, 2, 3):
        assert_tree_bit_equal(committed.load(step, lazy=False)["lossy"], today.load(step, lazy=False)["lossy"])


def test_stock_zarr_walks_the_root_and_reads_full_step_arrays_and_packs_bit_exactly(tmp_path):
    write(str(tmp_path / "s"))
    root = json.loads((tmp_path / "s" / "zarr.json").read_text())
    assert root["attributes"][fmt.ROOT_ATTR] == {"format": "amber-store", "format_version": fmt.FORMAT_VERSION}
    store = amber.open(tmp_path / "s", mode="r")
    m = store.manifest(1)
    steps = zarr.open_group(tmp_path / "s", mode="r")["steps"]
    assert m.group.split("/")[1] in [name for name, _ in steps.members()]
    group = zarr.open_group(tmp_path / "s" / m.group, mode="r", use_consolidated=True)
    w = group[fmt.array_name("model/w")]
    assert w.attrs[fmt.ROOT_ATTR]["dtype"] == "float32"
    assert_bit_equal(torch.from_numpy(w[:].view("float32")), expected()[1]["model"]["w"])
    pack = group["pack"][:]
    name, offset, length = m.tensors["ids"].pack
    assert name == "pack" and torch.equal(torch.from_numpy(pack[offset:offset + length].view("int64")),
                                          expected()[1]["ids"])


def test_stock_zarr_reads_the_codes_of_an_entropy_coded_delta(tmp_path):
    write(str(tmp_path / "s"))
    store = amber.open(tmp_path / "s", mode="r")
    m = store.manifest(2)
    group = zarr.open_group(tmp_path / "s" / m.group, mode="r", use_consolidated=True)
    codes = torch.from_numpy(group[fmt.array_name("lossy/blk")][:])
    assert codes.dtype == torch.int8 and codes.shape == (6, 10) and bool(codes.any())
    moved = store.load(2, lazy=False)["lossy"]["blk"] - store.load(1, lazy=False)["lossy"]["blk"]
    assert torch.equal(codes.sign(), moved.sign().to(torch.int8))  # restored = base + codes * 2^e


def test_delta_arrays_name_their_codec_and_base_and_resolve_without_importing_amber_store(tmp_path):
    write(str(tmp_path / "s"))
    m = amber.open(tmp_path / "s", mode="r").manifest(2)
    name = fmt.array_name("model/w")
    group = zarr.open_group(tmp_path / "s" / m.group, mode="r", use_consolidated=True)
    (sharding,) = group[name].metadata.codecs
    delta = sharding.codecs[0]
    assert isinstance(delta, amber.DiffDeltaCodec) and delta.base_step == 1
    code = ("import sys, zarr\n"
            "g = zarr.open_group(sys.argv[1], mode='r', use_consolidated=True)\n"
            "print(type(g[sys.argv[2]].metadata.codecs[0].codecs[0]).__module__)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s" / m.group), name],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "amber_store.codecs.zarr_codecs"  # found through the zarr.codecs entry point


def test_objects_per_step_are_the_large_tensors_plus_the_pack_and_group_metadata(tmp_path):
    store = amber.open(tmp_path / "s")
    state = {f"small{i}": torch.randn(100) for i in range(500)}
    state.update({f"big{i}": torch.randn(300, 1024) for i in range(3)})
    store.save(1, state)
    m = store.manifest(1)
    files = [p for p in (tmp_path / "s" / m.group).rglob("*") if p.is_file()]
    assert len(files) == 3 + 1 + 1  # three shards, the pack, zarr.json


@pytest.mark.parametrize("bad", ['{"format": "other"}', "[]"])
def test_a_zarr_hierarchy_that_is_not_amber_store_is_refused(tmp_path, bad):
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "zarr.json").write_text(
        json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {fmt.ROOT_ATTR: json.loads(bad)}}))
    with pytest.raises(amber.NotAnAmberStoreError):
        amber.open(tmp_path / "z", mode="r")


def test_a_format_8_dcp_store_opens_as_its_items_loads_through_dcp_and_keeps_doing_so_after_gc(tmp_path):
    # written from 2 ranks by `tests/dcp_workers.py save` with the code of format 8: DCP's
    # Metadata pickled beside each step, the manifest's tree its items
    copy = tmp_path / "dcp-v8"
    shutil.copytree(DATA / "dcp-v8", copy)
    assert amber.open(copy, mode="r").steps() == [0, 1]
    items = amber.open(copy, mode="r").load(1, lazy=False)
    assert sorted(items) == ["bias/0", "emb/0_0", "emb/0_16", "meta.lr/bytes", "meta.version/bytes", "w/0_0", "w/5_0"]

    def dcp_loads(step: int, version: int) -> None:
        want = dcp_workers.expected(version)
        full = {k: torch.zeros_like(v) for k, v in want.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
            dcp.load(full, storage_reader=AmberStorageReader(str(copy), step=step))
        assert_tree_bit_equal(full, want)

    dcp_loads(0, 1)
    dcp_loads(1, 2)
    report = amber.open(copy).gc(keep_last=1)  # step 1 folded off step 0: its pickled metadata stays
    assert (report.delete, report.rewrite) == ([0], [1])
    dcp_loads(1, 2)


@pytest.mark.parametrize("version", [1, 2])
def test_gc_on_an_older_store_folds_its_steps_into_the_current_format_and_they_stay_exact(tmp_path, version):
    copy = tmp_path / f"v{version}"
    shutil.copytree(DATA / f"format-v{version}", copy)
    before = amber.open(copy, mode="r").load(3, lazy=False)
    store = amber.open(copy)
    store.gc(keep_last=1)
    m = amber.open(copy, mode="r").manifest(3)
    assert m.format_version == fmt.FORMAT_VERSION and {e.legacy for e in m.tensors.values()} == {True, False}
    assert_tree_bit_equal(amber.open(copy, mode="r").load(3, lazy=False), before)
    state = {**before, "step": 4}
    store.save(4, state)  # the first save after the upgrade: full, in the current format
    assert store.manifest(4).kind == "full"
    assert_tree_bit_equal(amber.open(copy, mode="r").load(4, lazy=False), state)


def test_an_unknown_state_tree_node_is_refused_not_read_as_a_value():
    tree = {"dict": [["path", {"posixpath": "/data"}], ["lr", {"value": 0.1}]]}
    with pytest.raises(amber.FormatVersionError, match="unknown state tree node 'posixpath'"):
        fmt.unflatten(tree, lambda key: None)


def test_the_torch_free_item_size_table_agrees_with_torch():
    for name, dtype in fmt.DTYPES.items():
        assert fmt.ITEMSIZES[name] == torch.empty((), dtype=dtype).element_size(), name


def test_the_formats_encodings_are_the_registrys_codecs_the_version_tables_and_the_entry_points():
    import re
    from importlib.metadata import entry_points

    from amber_store import codecs
    from amber_store.codecs.zarr_codecs import ZARR_CODECS

    assert {c.encoding: c.name for c in codecs.registry.BUILT_IN} == {e: n for e, (n, _) in fmt.DELTA_ENCODINGS.items()}
    assert {c.name for c in codecs.SERIALIZERS} == set(fmt.SERIALIZERS)
    table = (DATA.parents[1] / "docs" / "FORMAT.md").read_text().split("\n## ")[0]
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.*) \|$", table, re.M)}
    assert sorted(rows) == list(range(1, fmt.FORMAT_VERSION + 1))
    for encoding, (name, version) in fmt.DELTA_ENCODINGS.items():
        assert f"`{encoding}`" in rows[version] and f"`{name}`" in rows[version], (encoding, rows[version])
        assert not fmt.EXTENSION_ENCODING.fullmatch(encoding), encoding
    for name, version in fmt.SERIALIZERS.items():
        assert f"`{name}`" in rows[version], (name, rows[version])
    registered = {ep.name: ep.load() for ep in entry_points(group="zarr.codecs") if ep.name.startswith("amber.")}
    assert registered == ZARR_CODECS
    assert {n: c.__mro__[1] for n, c in ZARR_CODECS.items()} == \
        {c.name: c for c in (*codecs.registry.BUILT_IN, *codecs.SERIALIZERS)}


