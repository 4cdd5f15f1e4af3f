"""What a delta step costs: unchanged data is never written."""

from __future__ import annotations

import torch

from amber_store import format as fmt
from conftest import assert_bit_equal


def stored_chunk_keys(store, step: int, key: str) -> list[str]:
    array = store.manifest(step).tensors[key].array
    keys = [k for k in _list(store, array) if "/c/" in k[len(array):] or k[len(array):].startswith("/c")]
    return keys


def _list(store, prefix):
    from zarr.core.sync import collect_aiterator
    return list(collect_aiterator(store._zstore.list_prefix(prefix + "/")))


def test_frozen_tensor_costs_zero_bytes_and_no_array_in_a_delta_step(make_store):
    store = make_store()
    frozen = torch.randn(256, 256)
    live = torch.randn(256)
    store.save(1, {"frozen": frozen, "live": live})
    live += 1
    store.save(2, {"frozen": frozen, "live": live})
    entry = store.manifest(2).tensors["frozen"]
    assert entry.encoding == "same" and entry.stored == 0 and entry.array is None
    assert entry.base == 1
    assert not _list(store, f"{store.manifest(2).group}/frozen")
    assert_bit_equal(store.load(2)["frozen"].materialize(), frozen)


def test_a_tensor_that_changes_again_after_unchanged_steps_diffs_against_its_data(make_store):
    store = make_store()
    w = torch.randn(32, 32)
    store.save(1, {"w": w})
    store.save(2, {"w": w})  # same as 1
    store.save(3, {"w": w})  # same as 1 (not as 2: no chain through empty steps)
    w2 = w.clone()
    w2[0, 0] = 5.0
    store.save(4, {"w": w2})
    entries = [store.manifest(s).tensors["w"] for s in (2, 3, 4)]
    assert [(e.encoding, e.base) for e in entries] == [("same", 1), ("same", 1), ("xor", 1)]
    assert store.info(4)["chain"] == [1, 4]
    reader = make_store(mode="r")
    assert_bit_equal(reader.load(4)["w"].materialize(), w2)
    reader2 = make_store()  # a fresh writer has no cached base: it reads step 4 back to diff against it
    store2_state = w2.clone()
    store2_state[1, 1] = 7.0
    reader2.save(5, {"w": store2_state})
    assert reader2.manifest(5).tensors["w"].base == 4
    assert_bit_equal(make_store(mode="r").load(5)["w"].materialize(), store2_state)


def test_only_changed_chunks_of_a_tensor_are_written(make_store):
    store = make_store(chunk_bytes=4 * 1024)  # 4 KiB chunks of a (64, 64) float32: one per 16 rows
    w = torch.randn(64, 64)
    store.save(1, {"w": w})
    w[20] += 1.0  # touches chunk 1 of 4
    store.save(2, {"w": w})
    entry = store.manifest(2).tensors["w"]
    assert entry.chunks == [16, 64] and entry.encoding == "xor"
    chunk_keys = [k for k in _list(store, entry.array) if not k.endswith("zarr.json")]
    assert [k.rsplit("/c/", 1)[1] for k in chunk_keys] == ["1/0"]
    assert_bit_equal(store.load(2)["w"].materialize(), w)


def test_small_update_delta_is_much_smaller_than_a_full_step(make_store):
    store = make_store()
    w = torch.randn(512, 512)
    full = store.save(1, {"w": w})
    w[::50] += 1e-3
    delta = store.save(2, {"w": w})
    assert delta.nbytes_raw == full.nbytes_raw == w.numel() * 4
    assert delta.nbytes_stored * 20 < full.nbytes_stored


def test_chunk_shape_keeps_trailing_dims_whole_and_targets_the_chunk_size():
    assert fmt.choose_chunks((1000, 1024), 4, 1 << 20) == (256, 1024)
    assert fmt.choose_chunks((10, 3, 1 << 20), 4, 1 << 20) == (1, 1, 1 << 18)
    assert fmt.choose_chunks((), 4, 1 << 20) == ()
    assert fmt.choose_chunks((0, 5), 4, 1 << 20) == (1, 5)
