"""Lazy state dicts: slices read the same bits as full reads, and only the chunks they need."""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from zarr.abc.store import RangeByteRequest
from amber_store.runtime import sync
from zarr.storage import LocalStore

import amber_store as amber
from amber_store import lazy as lazy_module
from amber_store import reader as reader_module
from conftest import CountingStore, assert_bit_equal, assert_tree_bit_equal, is_data_key

INDICES = [
    0, -1, slice(None), slice(3, 40), slice(5, 60, 7), (slice(None), 3), (..., slice(2, 9)),
    (10, ..., 4), (slice(60, 10),), (slice(2, 3), slice(None), slice(0, 5, 2)), (...,),
]


@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_lazy_slice_reads_the_same_bits_as_a_full_read(make_store, index):
    store = make_store(chunk_bytes=512)
    w = torch.randn(64, 12, 8)
    store.save(1, {"w": w})
    w2 = w.clone()
    w2[7:30] *= 1.5
    store.save(2, {"w": w2})  # a delta step: slices are reconstructed across the chain
    lazy = make_store(mode="r").load(2)["w"]
    assert lazy.shape == w2.shape and lazy.dtype == w2.dtype and len(lazy) == 64
    assert_bit_equal(lazy[index], w2[index])
    assert_bit_equal(lazy[index], lazy.materialize()[index])


def test_bad_lazy_indices_raise_like_torch(make_store):
    store = make_store()
    store.save(1, {"w": torch.zeros(4, 4)})
    lazy = store.load(1)["w"]
    with pytest.raises(IndexError):
        lazy[4]
    with pytest.raises(IndexError):
        lazy[0, 0, 0]
    with pytest.raises(ValueError):
        lazy[::-1]
    with pytest.raises(TypeError, match="materialize"):
        lazy[torch.tensor([0, 1])]


def test_lazy_read_of_one_slice_range_reads_only_its_chunk_of_each_step_of_the_chain(tmp_path):
    counting = CountingStore(LocalStore(tmp_path / "ckpt"))
    store = amber.open(counting, chunk_bytes=16 * 1024, pack_threshold=0)  # 4 rows of 1024 float32 per chunk
    state = {"big": torch.randn(64, 1024), "other": torch.randn(64, 1024)}
    store.save(1, state)
    state["big"] += 1
    state["other"] += 1
    store.save(2, state)

    reader = amber.open(counting, mode="r")
    lazy = reader.load(2)
    counting.reads.clear()
    counting.ranges.clear()
    got = lazy["big"][9:11]  # rows 9-10: chunk 2 only
    assert_bit_equal(got, state["big"][9:11])
    expected = []
    for step in (1, 2):
        e = reader.manifest(step).tensors["big"]
        offset, n = e.index[2]
        expected.append((f"{e.array}/0.0", RangeByteRequest(offset, offset + n)))
    data_reads = [(k, r) for k, r in counting.ranges if is_data_key(k)]
    assert sorted(data_reads, key=str) == sorted(expected, key=str)


def test_an_eager_load_reads_small_objects_whole_once_and_big_ones_by_chunk_ranges(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_module, "WHOLE_OBJECT_BYTES", 100 * 1024)
    counting = CountingStore(LocalStore(tmp_path / "ckpt"))
    store = amber.open(counting, chunk_bytes=16 * 1024, pack_threshold=0)
    state = {"big": torch.randn(64, 1024), "small": torch.randn(8, 1024)}  # 256 KiB and 32 KiB
    store.save(1, state)
    state = {k: v + 1 for k, v in state.items()}
    store.save(2, state)

    reader = amber.open(counting, mode="r")
    counting.ranges.clear()
    assert_tree_bit_equal(reader.load(2, lazy=False), state)
    expected = []
    for step in (1, 2):
        big, small = (reader.manifest(step).tensors[k] for k in ("big", "small"))
        expected.append((f"{small.array}/0.0", None))
        expected += [(f"{big.array}/0.0", RangeByteRequest(o, o + n)) for o, n in big.index]
    data_reads = [(k, r) for k, r in counting.ranges if is_data_key(k)]
    assert sorted(data_reads, key=str) == sorted(expected, key=str)


def test_loading_a_step_reads_nothing_but_its_manifest_until_used(tmp_path):
    counting = CountingStore(LocalStore(tmp_path / "ckpt"))
    store = amber.open(counting)
    store.save(3, {"a": torch.ones(1000), "b": torch.ones(1000)})
    counting.reads.clear()
    lazy = amber.open(counting, mode="r").load(3)
    assert lazy["a"].shape == (1000,)
    assert set(counting.reads) == {"zarr.json", "commits/000000000003.json"}


def test_materialize_returns_plain_containers_on_the_requested_device(make_store):
    store = make_store()
    state = {"m": {"w": torch.randn(3)}, "l": [torch.ones(2), 5], "t": (torch.zeros(1),)}
    store.save(1, state)
    out = store.load(1).materialize(device="cpu")
    assert type(out["m"]) is dict and type(out["l"]) is list and type(out["t"]) is tuple
    assert_bit_equal(out["m"]["w"], state["m"]["w"])
    assert amber.materialize(store.load(1)["l"])[1] == 5


def test_an_eager_load_onto_another_device_puts_every_tensor_there_keeping_ties(make_store):
    # (meta: a device every build has, through the same transfer thread as an accelerator's copies)
    w = torch.randn(64, 32)
    state = {"a": w, "tied": w, "m": {"b": torch.arange(5)}, "l": [torch.ones(2, dtype=torch.bfloat16), 7]}
    make_store().save(1, state)
    out = make_store(mode="r").load(1, lazy=False, device="meta")
    leaves = [out["a"], out["m"]["b"], out["l"][0]]
    assert all(t.device.type == "meta" for t in leaves) and out["l"][1] == 7
    assert [(t.shape, t.dtype) for t in leaves] == [(w.shape, w.dtype), ((5,), torch.int64), ((2,), torch.bfloat16)]
    assert out["tied"] is out["a"]


def _vm_flags(address: int) -> list[str]:
    """The kernel's flags of the mapping holding ``address`` in this process."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise LookupError(hex(address))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc")
def test_a_resume_decodes_straight_into_torch_memory_not_numpys_huge_pages(local_store, tmp_path):
    # numpy asks huge pages for arrays from 4 MiB up (VmFlags "hg"), slow to touch first in a
    # fresh process on a VM; torch asks them only when told to (THP_MEM_ALLOC_ENABLE=1), for
    # torch.load's tensors as for these. A fresh process: a long one reuses advised ranges.
    state = {"w": torch.randn(1024, 2048), "small": torch.randn(8), "scalar": torch.tensor(3.0)}
    store = local_store()
    store.save(1, state)
    state["w"][:3] += 1e-3
    store.save(2, state)
    code = inspect.getsource(_vm_flags) + textwrap.dedent("""
        import json, sys, numpy as np, torch, amber_store as amber
        from pathlib import Path
        def asks(t): return "hg" in _vm_flags(t.data_ptr() + t.nbytes // 2)
        lazy = amber.open(sys.argv[1], mode="r").load(2)
        loaded = [amber.materialize(lazy)["w"], lazy["w"][100:900]]
        numpys = np.empty(1 << 21, np.float32)
        print(json.dumps({"loaded": [asks(t) for t in loaded], "torch": asks(torch.empty(1 << 21)),
                          "numpy": "hg" in _vm_flags(numpys.ctypes.data + numpys.nbytes // 2),
                          "equal": bool(torch.equal(loaded[0], torch.load(sys.argv[2])))}))""")
    torch.save(state["w"], tmp_path / "w.pt")
    out = subprocess.run([sys.executable, "-c", code, store.uri, str(tmp_path / "w.pt")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if not got["numpy"]:
        pytest.skip("this kernel shows no huge-page advice")
    assert got["equal"] and got["loaded"] == [got["torch"]] * 2


def test_a_load_into_a_state_dict_fills_its_tensors_in_place_bit_exactly(local_store, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024))
    extra = {"bf16": torch.randn(300, 7).to(torch.bfloat16), "strided": torch.randn(64, 32), "count": torch.tensor(5)}
    store = local_store()
    store.save(1, {"model": model.state_dict(), "extra": extra})
    with torch.no_grad():
        model[0].weight[:4] += 1e-3
    extra["bf16"][0] += 1
    saved = {"model": copy.deepcopy(model.state_dict()), "extra": extra}
    store.save(2, saved)

    fresh = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024))
    into = {"model": fresh.state_dict(),
            "extra": {"bf16": torch.zeros(300, 7, dtype=torch.bfloat16), "strided": torch.zeros(32, 64).t()}}
    where = {k: v.data_ptr() for k, v in into["model"].items()}
    copied = []  # destinations filled by a copy rather than decoded into
    monkeypatch.setattr(lazy_module, "_copy_into", lambda tos, t: copied.extend(tos) or [to.copy_(t) for to in tos])
    with pytest.warns(RuntimeWarning, match=r"into= has no place for: extra.count"):  # (strict=False: it is told)
        out = local_store(mode="r").load(2, into=into, strict=False)
    assert len(copied) == 1 and copied[0] is into["extra"]["strided"]
    assert_tree_bit_equal(out, saved)
    assert_tree_bit_equal(fresh.state_dict(), saved["model"])  # the model's own parameters
    assert all(out["model"][k] is into["model"][k] and v.data_ptr() == where[k] for k, v in out["model"].items())
    assert out["extra"]["strided"] is into["extra"]["strided"] and not into["extra"]["strided"].is_contiguous()
    assert_bit_equal(into["extra"]["bf16"], extra["bf16"])
    assert out["extra"]["count"].item() == 5  # not in `into`: read into a new tensor


def test_a_load_into_a_tensor_of_another_shape_or_dtype_is_refused_before_anything_is_written(local_store):
    store = local_store()
    store.save(1, {"a": torch.randn(16, 8), "b": torch.randn(4)})
    wrong_shape = {"a": torch.zeros(8, 16), "b": torch.zeros(4)}
    wrong_dtype = {"a": torch.zeros(16, 8), "b": torch.zeros(4, dtype=torch.float64)}
    for wrong, says in ((wrong_shape, r"into\[a\] is torch.float32 \(8, 16\)"),
                        (wrong_dtype, r"into\[b\] is torch.float64")):
        with pytest.raises(ValueError, match=says):
            store.load(1, into=wrong)
        assert all(not t.any() for t in wrong.values())


def test_a_read_into_an_array_of_another_shape_or_dtype_is_refused(local_store):
    store = local_store()
    store.save(1, {"w": torch.randn(4, 8)})
    for wrong in (np.empty((8, 4), np.uint32), np.empty((4, 8), np.int64), np.empty((4, 16), np.uint32)[:, ::2]):
        with pytest.raises(ValueError, match="out must be"):
            sync(store.reader.read(1, "w", out=wrong))
    into = np.empty((4, 8), np.uint32)
    assert sync(store.reader.read(1, "w", out=into)) is into


def test_a_lazy_optimizer_state_loads_into_an_optimizer_as_real_tensors(local_store):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    store = local_store()
    store.save(1, {"optim": optimizer.state_dict()})
    fresh = torch.optim.AdamW(torch.nn.Linear(8, 4).parameters())
    fresh.load_state_dict(store.load(1)["optim"])  # it copies the dict first: the copy is read
    for key, value in optimizer.state_dict()["state"][0].items():
        got = fresh.state_dict()["state"][0][key]
        assert type(got) is torch.Tensor
        assert_bit_equal(got, value)


def test_a_lazy_state_dict_loads_into_a_module_and_lazy_tensors_work_as_tensors(local_store):
    torch.manual_seed(0)

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))

    model = make()
    model(torch.randn(4, 8))  # BatchNorm running statistics move
    store = local_store()
    store.save(1, {"model": model.state_dict()})
    lazy = store.load(1)["model"]
    fresh = make()
    fresh.load_state_dict(lazy)  # no materialize() needed
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert_bit_equal(a, b)
    assert lazy._metadata == model.state_dict()._metadata  # module versions reach load_state_dict
    w, lt = model[0].weight.detach(), lazy["0.weight"]
    assert torch.equal(lt, w) and torch.equal(lt + 1, w + 1) and torch.equal(1 - lt, 1 - w)
    assert torch.equal(torch.cat([lt, w]), torch.cat([w, w])) and lt.sum().item() == w.sum().item()
    assert lt.double().dtype == torch.float64
