"""Bit-exact save/load on every backend: dtypes, trees, deltas, chains."""

from __future__ import annotations

import base64
import io
import json
import math
import pathlib
import random
import resource

import numpy as np
import pytest
import torch

import amber_store as amber
from amber_store import format as fmt
from conftest import assert_bit_equal, assert_tree_bit_equal

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        if t.numel() >= 4:  # specials whose bits must survive: NaN, infinities, negative zero
            t.view(-1)[:4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=torch.float64).to(dtype)
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (33, 17), (4, 5, 6)], ids=str)
def test_every_dtype_and_shape_round_trips_bit_exact_through_full_and_delta(make_store, dtype, shape):
    store = make_store(chunk_bytes=64)  # tiny chunks: many chunks, partial edge chunks
    first = sample(dtype, shape, 0)
    second = first.clone()
    if second.numel():
        second.view(-1)[-1:] = sample(dtype, (1,), 1)
    store.save(1, {"t": first})
    info = store.save(2, {"t": second})
    assert info.kind == "delta"
    assert_bit_equal(store.load(1)["t"].materialize(), first)
    assert_bit_equal(store.load(2)["t"].materialize(), second)
    assert_bit_equal(make_store(mode="r").load(2, lazy=False)["t"], second)


def test_nested_state_with_plain_leaves_round_trips_exactly(make_store):
    state = {
        "model": {"layer.0.weight": torch.randn(4, 3), "odd/key with spaces": torch.arange(5)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0], "name": None,
                                    "amsgrad": False, "eps": 1e-8, "weird": float("nan")}]},
        "step": 7,
        "history": [1.5, -0.0, float("inf"), "text", None, True],
        "__dunder": torch.ones(2),
        ".": torch.zeros(1),
    }
    store = make_store()
    store.save(10, state)
    assert_tree_bit_equal(store.load(10, lazy=False), state)
    lazy = store.load(10)
    assert isinstance(lazy, amber.LazyStateDict)
    assert lazy["step"] == 7 and lazy["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(lazy["optim"]["state"]) == [0]


def real_checkpoint_leaves(seed: int) -> dict:
    """What Lightning hyper-parameters, HF trainer states and RNG snapshots put in a checkpoint."""
    rng = np.random.default_rng(seed)
    np.random.seed(seed)
    random.seed(seed)
    return {
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "numpy": {"f4": rng.standard_normal((3, 4), dtype=np.float32), "u64": rng.integers(0, 2**63, 5, dtype=np.uint64),
                  "big_endian": np.arange(4, dtype=">f8"), "strings": np.array(["a", "bcd"]),
                  "record": np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")]), "complex": np.ones(2, np.complex64),
                  "scalars": [np.float64(seed + 0.5), np.float32(-0.0), np.int64(-seed), np.bool_(True), np.uint8(7)]},
        "hparams": {"data_dir": pathlib.Path(f"/data/run{seed}"), "windows": pathlib.PureWindowsPath("C:/ckpt"),
                    "dtype": torch.bfloat16, "device": torch.device("cpu"), "shape": torch.Size([2, seed]),
                    "token": b"\x00\xff", "buffer": bytearray(b"ab"), "tags": {"a", "b", seed},
                    "frozen": frozenset({(1, 2)})},
        "keys": {(0, "wte"): 1, 3: "int", True: "bool", None: "none", 2.5: "float", b"k": "bytes",
                 frozenset({1}): "frozenset"},
    }


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_leaves_of_real_checkpoints_round_trip_as_the_same_types(make_store, lazy):
    store = make_store()
    states = {1: real_checkpoint_leaves(1), 2: real_checkpoint_leaves(2)}
    for step, state in states.items():
        store.save(step, state)
    assert store.manifest(2).kind == "delta"
    assert store.manifest(2).tensors["rng/numpy/1"].encoding == "diff"  # numeric numpy arrays are tensors
    for step, state in states.items():
        got = store.load(step, lazy=lazy)
        got = got.materialize() if lazy else got
        assert_tree_bit_equal(got, state)
        for key in ("hparams", "keys"):
            assert [type(k) for k in got[key]] == [type(k) for k in state[key]]
        assert [type(v) for v in got["numpy"]["scalars"]] == [type(v) for v in state["numpy"]["scalars"]]
        assert type(got["hparams"]["data_dir"]) is pathlib.PosixPath


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_what_no_safe_format_can_hold_is_refused_before_anything_is_written(make_store):
    store = make_store()
    for bad, match in ((np.array([{}], dtype=object), "numpy array of dtype object"),
                       ({torch.ones(1): 1}, "holds a tensor"), ({"fn": print}, "cannot store a builtin"),
                       (torch.ones(2).to_sparse(), "only strided"),
                       (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
                       (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged), "nested tensor"),
                       (torch.empty(3, device="meta"), "meta device holds no data")):
        with pytest.raises(amber.UnsupportedStateError, match=match):
            store.save(1, {"x": bad})
    assert store.steps() == []


def test_a_tampered_numpy_leaf_that_needs_pickle_is_refused_on_load_never_unpickled(local_store, tmp_path):
    local_store().save(1, {"x": np.array(["a"])})
    key = tmp_path / "ckpt" / "commits" / "000000000001.json"
    manifest = json.loads(key.read_text())
    hostile = io.BytesIO()  # an object array only pickle can make, as a hostile writer would put it
    np.lib.format.write_array(hostile, np.array([print], dtype=object), allow_pickle=True)
    manifest["tree"]["dict"][0][1] = {"npy": base64.b64encode(hostile.getvalue()).decode()}
    key.write_text(json.dumps(manifest))
    with pytest.raises(amber.CorruptDataError, match="cannot be read safely"):
        local_store(mode="r").load(1)


def tied_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64, bias=False))
    model[1].weight = model[0].weight  # lm_head tied to the embedding, as GPT-2 does
    return model


def test_tied_weights_are_stored_once_and_load_back_tied(make_store):
    model = tied_model()
    store = make_store()
    store.save(1, {"model": model.state_dict()})
    with torch.no_grad():
        model[0].weight.add_(1.0)
    store.save(2, {"model": model.state_dict()})
    for step in (1, 2):
        m = store.manifest(step)
        assert list(m.tensors) == ["model/0.weight"]
        assert m.nbytes_raw == 64 * 16 * 4
    eager = store.load(2, lazy=False)["model"]
    assert eager["1.weight"] is eager["0.weight"]
    assert_bit_equal(eager["1.weight"], model[1].weight.detach())
    lazy = store.load(2)["model"]
    assert lazy["1.weight"] is lazy["0.weight"]
    fresh = tied_model()
    fresh.load_state_dict(lazy)
    assert fresh[1].weight is fresh[0].weight
    assert_bit_equal(fresh[1].weight.detach(), model[0].weight.detach())


def test_overlapping_views_that_are_not_the_same_tensor_are_each_stored(make_store):
    base = torch.arange(12.0)
    state = {"all": base, "tail": base[4:], "same": base.view(12), "reshaped": base.view(3, 4),
             "reshaped again": base.view(3, 4)}
    store = make_store()
    store.save(1, state)
    # "same" is an alias of "all", "reshaped again" of "reshaped" (the second tensor at that address)
    assert sorted(store.manifest(1).tensors) == ["all", "reshaped", "tail"]
    got = store.load(1, lazy=False)
    assert got["same"] is got["all"] and got["reshaped again"] is got["reshaped"]
    assert_tree_bit_equal(got, state)


def walked(state, memo=None):
    tree, tensors = amber.format.flatten(state, memo)
    return tree, list(tensors), list(tensors.values())


def test_walking_a_state_again_with_its_memo_finds_exactly_what_a_fresh_walk_finds():
    g = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(4, generator=g) for i in range(6)}
    optim = {i: {"exp_avg": torch.zeros(4), "step": torch.tensor(1.0)} for i in range(6)}
    state = {"model": params, "optim": {"state": optim, "param_groups": [{"lr": 0.1, "params": list(range(6))}]}}
    memo = amber.format.FlattenMemo()
    first = walked(state, memo)

    def same_as_fresh():
        with_memo, fresh = walked(state, memo), walked(state)
        assert json.dumps(with_memo[0]) == json.dumps(fresh[0]) and with_memo[1] == fresh[1]  # (1 == True, not in JSON)
        assert all(a is b for a, b in zip(with_memo[2], fresh[2])) and len(with_memo[2]) == len(fresh[2])
        return with_memo

    again = same_as_fresh()
    # an unchanged dict of tensors is not walked tensor by tensor: its node is the last walk's
    assert again[0]["dict"][0][1]["dict"] is first[0]["dict"][0][1]["dict"]
    state["optim"]["param_groups"][0]["lr"] = 0.05  # a scheduler's step: the tensors' dicts are still recalled
    assert same_as_fresh()[0]["dict"][0][1]["dict"] is first[0]["dict"][0][1]["dict"]
    params["p1"] = torch.randn(4, generator=g)  # a new tensor object
    same_as_fresh()
    params["p9"] = torch.randn(4, generator=g)  # a new key
    del params["p0"]
    same_as_fresh()
    a, b = optim[1]["exp_avg"], optim[1]["step"]
    optim[1] = {1: a, 2: b}
    same_as_fresh()
    optim[1] = {True: a, 2: b}  # equal keys of another type (1 == True)
    same_as_fresh()
    params["p3"].data = params["p2"]  # the same object, now tied to another: stored once
    tree, keys, _ = same_as_fresh()
    assert "model/p3" not in keys
    params["p2"].data = torch.randn(4, generator=g)  # and untied again: the first of the pair moved
    tree, keys, _ = same_as_fresh()
    assert {"model/p2", "model/p3"} <= set(keys)
    last = same_as_fresh()
    state["model"] = {k: v.detach() for k, v in params.items()}  # model.state_dict(): new tensors, same addresses
    assert same_as_fresh()[0]["dict"][0][1]["dict"] is last[0]["dict"][0][1]["dict"]
    state["model"]["p4"] = params["p4"].view(torch.int32)  # another dtype at the same address
    same_as_fresh()
    state["model"]["p4"] = params["p4"].view(torch.complex64)  # one that cannot be stored: refused as before
    with pytest.raises(amber.UnsupportedStateError, match="complex64"):
        walked(state, memo)
    state["model"]["p4"] = 0.5  # not a tensor any more
    same_as_fresh()
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    state["module"] = module.state_dict()  # an OrderedDict, and its _metadata a dict of plain dicts
    same_as_fresh()
    state["module"] = module.state_dict()
    assert same_as_fresh()[0]["dict"][-1][1]["metadata"]["odict"] is walked(state, memo)[0]["dict"][-1][1]["metadata"]["odict"]
    state["module"]._metadata["0"]["version"] = True  # equal to 1, yet another leaf
    same_as_fresh()
    state["module"]._metadata["0"]["version"] = 2
    same_as_fresh()


def test_a_walk_memo_keeps_no_tensor_of_the_state_alive():
    import weakref

    memo = amber.format.FlattenMemo()
    state = {"model": {"w": torch.randn(8)}}
    amber.format.flatten(state, memo)
    amber.format.flatten(state, memo)
    watch = weakref.ref(state["model"]["w"])
    del state
    assert watch() is None


def test_tensors_tied_and_untied_in_place_between_saves_load_back_as_saved(make_store):
    g = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(64, generator=g) for i in range(4)}
    store = make_store()
    saved = {}
    for step in range(1, 5):
        if step == 2:
            params["p1"].data = params["p0"]  # tied in place: the same objects at every save
        if step == 3:
            params["p0"].data = params["p0"] + 1  # its partner keeps the old storage
        saved[step] = {k: v.clone() for k, v in params.items()}
        store.save_async(step, {"model": params})
        store.wait()
    for step, state in saved.items():
        assert_tree_bit_equal(store.load(step, lazy=False)["model"], state)
    assert list(store.manifest(2).tensors) == ["model/p0", "model/p2", "model/p3"]
    assert "model/p1" in store.manifest(3).tensors


def test_keys_named_like_zarr_metadata_are_stored_as_tensors(make_store):
    state = {"zarr.json": torch.randn(8), "model": {"zarr.json": torch.randn(3)}, ".zattrs": torch.ones(2)}
    store = make_store(pack_threshold=0)  # an array per tensor, named after its key
    store.save(1, state)
    store.save(2, {k: v + 1 if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    assert_tree_bit_equal(make_store(mode="r").load(1, lazy=False), state)


@pytest.mark.parametrize("policy, chain", [("chain", [16, 17, 18, 19]), ("log", [16, 18, 19]), ("full", [16, 19])])
def test_chain_of_twenty_deltas_with_periodic_fulls_reads_every_step_bit_exact(make_store, policy, chain):
    store = make_store(full_every=5, chunk_bytes=1024, base_policy=policy)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 33, generator=g)
    frozen = torch.randn(50, generator=g)
    expected = {}
    for step in range(1, 21):
        w.add_(torch.randn(w.shape, generator=g) * 1e-3)
        if step % 3 == 0:
            w[step] = 0  # a row that changes drastically
        state = {"w": w, "frozen": frozen, "step": step}
        store.save(step, state)
        expected[step] = {"w": w.clone(), "frozen": frozen.clone(), "step": step}
    kinds = [store.manifest(s).kind for s in store.steps()]
    assert kinds == (["full"] + ["delta"] * 4) * 4
    reopened = make_store(mode="r")
    for step, want in expected.items():
        assert_tree_bit_equal(reopened.load(step, lazy=False), want)
    info = reopened.info(19)
    assert info["chain"] == chain
    assert info["tensors"]["frozen"]["chain"] == [16]


def test_log_bases_bound_every_read_to_log2_full_every_plus_one_objects(make_store):
    store = make_store(full_every=16, pack_threshold=0, base_policy="log")
    w = torch.randn(256, 256)
    for step in range(16):
        w[step] += 1
        store.save(step, {"w": w})
    depths = [len(store.info(s)["chain"]) for s in range(16)]
    assert depths == [bin(p).count("1") + 1 for p in range(16)] and max(depths) == 5
    assert [store.manifest(s).base for s in (1, 2, 3, 4, 6, 7, 8, 12, 15)] == [0, 0, 2, 0, 4, 6, 0, 8, 14]
    assert_bit_equal(make_store(mode="r").load(15)["w"].materialize(), w)


def test_auto_bases_diff_lossless_tensors_against_the_full_step_and_lossy_ones_on_a_skip_list(make_store):
    store = make_store(full_every=8, pack_threshold=0, codec=[("lossy", "quant8")])
    assert store.options.base_policy == "auto"  # the default
    g = torch.Generator().manual_seed(0)
    state = {"exact": torch.randn(64, 64, generator=g), "lossy": torch.randn(64, 64, generator=g)}
    for step in range(8):
        for t in state.values():
            t.add_(torch.randn(t.shape, generator=g) * 1e-2)
        store.save(step, state)
    m = store.manifest(7)
    assert m.tensors["exact"].base == 0 and m.tensors["lossy"].base == 6
    assert m.base == 0 and m.depth == 7
    assert store.info(7)["tensors"]["exact"]["chain"] == [0, 7]
    assert store.info(7)["tensors"]["lossy"]["chain"] == [0, 4, 6, 7]
    got = make_store(mode="r").load(7, lazy=False)
    assert_bit_equal(got["exact"], state["exact"])
    assert (got["lossy"] - state["lossy"]).abs().max() < 0.05 * state["lossy"].abs().max()


@pytest.mark.parametrize("first, then", [("log", "auto"), ("auto", "chain"), ("chain", "log")])
def test_a_store_continued_under_another_base_policy_reads_every_step_bit_exact(local_store, first, then):
    # base_policy is the writer's choice, not the format's: a run may resume with another one,
    # mid-segment, and every step still reads back exactly (backend-independent: local only).
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 64, generator=g)
    expected = {}
    for step in range(12):
        policy = first if step < 5 else then
        w.add_(torch.randn(w.shape, generator=g) * 1e-3)
        local_store(full_every=8, pack_threshold=0, base_policy=policy).save(step, {"w": w})
        expected[step] = w.clone()
    assert [local_store(mode="r").manifest(s).kind for s in range(12)] == ["full"] + ["delta"] * 7 + ["full"] + ["delta"] * 3
    reader = local_store(mode="r")
    for step, want in expected.items():
        assert_bit_equal(reader.load(step, lazy=False)["w"], want)


def test_base_policy_full_diffs_every_delta_against_the_last_full_step(make_store):
    store = make_store(full_every=4, base_policy="full")
    w = torch.zeros(100)
    for step in range(1, 9):
        w[step] = step
        store.save(step, {"w": w})
    assert [store.manifest(s).base for s in store.steps()] == [None, 1, 1, 1, None, 5, 5, 5]
    assert store.info(8)["chain"] == [5, 8]
    assert_bit_equal(make_store(mode="r").load(7)["w"].materialize(), torch.cat([torch.arange(8.0), torch.zeros(92)]))


def test_shape_dtype_changes_and_new_or_removed_keys_are_handled(make_store):
    store = make_store()
    store.save(1, {"a": torch.ones(4), "b": torch.ones(3), "gone": torch.ones(2)})
    state = {"a": torch.ones(5), "b": torch.ones(3, dtype=torch.float64), "new": torch.arange(3)}
    info = store.save(2, state)
    assert info.kind == "delta"
    entries = store.manifest(2).tensors
    assert {k: e.encoding for k, e in entries.items()} == {"a": "full", "b": "full", "new": "full"}
    assert_tree_bit_equal(make_store(mode="r").load(2, lazy=False), state)
    assert_tree_bit_equal(store.load(1, lazy=False), {"a": torch.ones(4), "b": torch.ones(3), "gone": torch.ones(2)})


def test_forced_full_and_forced_delta_override_the_policy(make_store):
    store = make_store(full_every=2)
    t = torch.arange(10.0)
    assert store.save(1, {"t": t}).kind == "full"
    assert store.save(2, {"t": t}, full=True).kind == "full"
    assert store.save(3, {"t": t}).kind == "delta"
    assert store.save(4, {"t": t}, full=False).kind == "delta"
    assert store.save(5, {"t": t}).kind == "full"


def test_a_reads_output_memory_is_faulted_in_at_once_and_keeps_what_it_holds():
    a = fmt.host_empty(8 << 20, np.uint8)  # fresh memory, as a resume's first load writes into
    fmt.populate(a)
    if fmt._madvise is False:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a[:] = 7
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 64  # of 2048 pages: they were in
    b = a[5:-3]  # (pages partly outside it are left alone)
    b[:] = np.arange(b.size) % 251
    before = a.copy()
    fmt.populate(b)
    assert np.array_equal(a, before)
