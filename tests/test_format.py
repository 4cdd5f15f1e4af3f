"""The on-disk format is a contract: stores written earlier keep reading back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zarr

import amber_store as amber
from amber_store import format as fmt
from conftest import assert_tree_bit_equal
from make_format_fixture import expected, write

DATA = Path(__file__).parent / "data"


def check_reference_store(path: Path, version: int) -> None:
    store = amber.open(path, mode="r")
    assert store.steps() == [1, 2, 3]
    assert [store.manifest(s).kind for s in (1, 2, 3)] == ["full", "delta", "delta"]
    assert {store.manifest(s).format_version for s in (1, 2, 3)} == {version}
    for step, state in expected(version).items():
        got = store.load(step, lazy=False)
        lossy = state.pop("lossy", None)
        assert_tree_bit_equal({k: v for k, v in got.items() if k != "lossy"}, state)
        if lossy is not None:
            assert torch.allclose(got["lossy"]["q"], lossy["q"], atol=0.2)
            assert torch.allclose(got["lossy"]["s"], lossy["s"], rtol=0.021)
    encodings = {k: e.encoding for k, e in store.manifest(3).tensors.items()}
    assert encodings["model/w"] == "same" and encodings["model/b"] == "full" and encodings["new"] == "full"
    assert store.manifest(2).tensors["model/w"].encoding == "xor"
    if version >= 2:
        assert encodings["lossy/q"] == "quant" and encodings["lossy/s"] == "sparse"


@pytest.mark.parametrize("version", [1, 2])
def test_every_committed_format_version_reads_back_with_the_current_code(tmp_path, version):
    copy = tmp_path / f"v{version}"
    shutil.copytree(DATA / f"format-v{version}", copy)  # reads need no write access; keep the fixture pristine
    check_reference_store(copy, version)


def test_what_the_fixture_script_writes_today_reads_back(tmp_path):
    write(str(tmp_path / "today"))
    check_reference_store(tmp_path / "today", fmt.FORMAT_VERSION)


def test_lossy_reconstruction_is_bit_stable_across_code_versions(tmp_path):
    write(str(tmp_path / "today"))
    today = amber.open(tmp_path / "today", mode="r")
    committed = amber.open(DATA / f"format-v{fmt.FORMAT_VERSION}", mode="r")
    for step in (1, 2, 3):
        assert_tree_bit_equal(committed.load(step, lazy=False)["lossy"], today.load(step, lazy=False)["lossy"])


def test_the_root_and_arrays_are_plain_zarr_v3_with_self_describing_delta_codecs(tmp_path):
    write(str(tmp_path / "s"))
    root = json.loads((tmp_path / "s" / "zarr.json").read_text())
    assert root["attributes"][fmt.ROOT_ATTR] == {"format": "amber-store", "format_version": fmt.FORMAT_VERSION}
    store = amber.open(tmp_path / "s", mode="r")
    m = store.manifest(2)
    arr = zarr.open_array(tmp_path / "s" / m.tensors["model/w"].array, mode="r")
    (delta,) = [c for c in arr.metadata.codecs if isinstance(c, amber.XorDeltaCodec)]
    assert delta.base_step == 1 and delta.base_array == store.manifest(1).tensors["model/w"].array
    assert arr.attrs[fmt.ROOT_ATTR]["dtype"] == "float32"


def test_a_reader_that_never_imported_amber_store_still_knows_the_codec(tmp_path):
    write(str(tmp_path / "s"))
    array = amber.open(tmp_path / "s", mode="r").manifest(2).tensors["model/w"].array
    code = ("import sys, zarr\n"
            "a = zarr.open_array(sys.argv[1], mode='r')\n"
            "print(type(a.metadata.codecs[0]).__module__)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s" / array)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "amber_store.codecs"


@pytest.mark.parametrize("bad", ['{"format": "other"}', "[]"])
def test_a_zarr_hierarchy_that_is_not_amber_store_is_refused(tmp_path, bad):
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "zarr.json").write_text(
        json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {fmt.ROOT_ATTR: json.loads(bad)}}))
    with pytest.raises(amber.NotAnAmberStoreError):
        amber.open(tmp_path / "z", mode="r")
