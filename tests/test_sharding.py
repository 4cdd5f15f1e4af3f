"""A sharded step's bookkeeping (format 10): shardings described once as grids, one binary
fragment of records per rank, and readers that fetch only the fragments they need."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import zstandard

import amber_store as amber
from amber_store import validation
from amber_store.errors import CorruptDataError
from amber_store.format import TensorEntry, fragments, sharding
from conftest import CountingStore
from amber_store.runtime import sync
from zarr.storage import LocalStore

DATA = Path(__file__).parent / "data"


def chunked(n: int, pieces: int) -> list[tuple[int, int]]:
    """(start, length) of ``torch.chunk``'s pieces."""
    return [(int(t[0]), len(t)) for t in torch.arange(n).chunk(pieces)]


@pytest.mark.parametrize("shape, splits", [
    ((10, 7), (4, 1)),      # Shard(0) over 4: pieces of 3, the last of 1
    ((10, 7), (3, 2)),      # FSDP2 x TP: rows over 3 ranks, columns over 2
    ((4096, 256), (1024, 1)),
    ((5,), (1,)),           # replicated: one shard
])
def test_a_torch_chunk_grid_is_described_by_its_piece_lengths_and_gives_back_every_shard(shape, splits):
    shards = [((r0, c0), (rn, cn)) if len(shape) == 2 else ((r0,), (rn,))
              for r0, rn in chunked(shape[0], splits[0])
              for c0, cn in (chunked(shape[1], splits[1]) if len(shape) == 2 else [(0, 0)])]
    random.Random(0).shuffle(shards)  # (DCP lists them in the ranks' order)
    grid, cells = sharding.describe(shape, shards)
    assert all(isinstance(c, int) for c in grid)
    listed = list(sharding.cells(shape, grid))
    assert sorted(listed) == sorted(shards) and len(listed) == sharding.count(shape, grid)
    for (offset, size), cell in zip(shards, cells):
        assert listed[cell] == (offset, size) and sharding.cell(shape, grid, cell) == (offset, size)
        assert sharding.cell_of(shape, grid, offset) == cell
    assert sharding.check(list(shape), grid) is None


def test_uneven_pieces_are_listed_and_shards_that_make_no_grid_are_not_described():
    grid, _ = sharding.describe((10,), [((0,), (2,)), ((2,), (5,)), ((7,), (3,))])
    assert grid == [[0, 2, 7]] and list(sharding.cells((10,), grid))[1] == ((2,), (5,))
    assert sharding.cell_of((10,), grid, (3,)) is None
    # an L shape: three blocks of a 2x2 grid, one of them twice as wide
    assert sharding.describe((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))]) is None
    assert sharding.describe((), [((), ())]) == ([], [0])
    assert sharding.check([10], [[0, 7, 2]]) and sharding.check([10], [0]) and sharding.check([10, 2], [5])


def entries() -> dict[str, TensorEntry]:
    """Records of every kind a fragment holds: packed (changed, unchanged), an object of its own
    with an unstored chunk, ``same``, lossy parameters, a scalar and a value."""
    return {
        "w/0_0": TensorEntry("float32", [4, 8], [4, 8], "diff", 3, None, [11], 128, 60,
                             pack=["pack-r0", 64, 60]),
        "w2/0_0": TensorEntry("float32", [4, 8], [4, 8], "diff", 3, None, [12], 128, 0, pack=["pack-r0", 0, 0]),
        "big/0_0": TensorEntry("bfloat16", [64, 8], [16, 8], "full", None, "steps/000000000005-ab/big%2F0_0",
                               [1, 2, 3, 4], 1024, 700, index=[[0, 300], None, [300, 200], [500, 200]]),
        "same/0": TensorEntry("float32", [3], [3], "same", 2, None, [7], 12, 0),
        "q/0_0": TensorEntry("float32", [4, 8], [4, 8], "quant", 3, None, [9], 128, 20,
                             params={"scale": [0.5]}, pack=["pack-r0", 128, 20]),
        "s/scalar": TensorEntry("float32", [], [], "full", None, None, [5], 4, 4, pack=["pack-r0", 192, 4]),
        "v/bytes": TensorEntry("uint8", [37], [37], "full", None, None, [8], 37, 37, pack=["pack-r0", 256, 37]),
    }


def items_of(es: dict[str, TensorEntry]) -> list[fragments.Item]:
    return [fragments.Item(k, e.dtype, None if k.endswith("/bytes") else tuple(e.shape)) for k, e in sorted(es.items())]


LIMITS = {"max_chunk": validation.MAX_CHUNK_BYTES, "known": validation.known_encoding}
PACKS = {"pack-r0": {"array": "steps/000000000005-ab/pack-r0", "chunk": 1 << 20, "nbytes": 293, "index": [[0, 250]]}}


def test_a_fragment_gives_back_every_record_it_was_written_with():
    es = entries()
    data = fragments.encode(es, PACKS)
    got, packs = fragments.decode(data, items_of(es), "steps/000000000005-ab", 5, **LIMITS)
    assert packs == PACKS
    for key, e in es.items():
        g = got[key]
        if e.pack is not None and e.pack[2] == 0:
            assert g.pack[1:] == e.pack[1:]  # (an empty location names no pack)
            g.pack = e.pack
        if e.encoding == "same":
            assert g.crc32c == []  # (its base's are its own: History fills them in)
            g.crc32c = e.crc32c
        assert g == e, key


def test_a_crafted_fragment_is_refused_before_it_allocates_or_misreads():
    es = entries()
    items = items_of(es)
    data = fragments.encode(es, PACKS)
    with pytest.raises(fragments.Invalid, match="expands past"):  # a zstd bomb: 1 GB of zeros
        fragments.decode(zstandard.ZstdCompressor(level=19).compress(bytes(1 << 30)), items, "steps/x", 5, **LIMITS)
    with pytest.raises(fragments.Invalid, match="it holds 7 items; the index gives it 6"):
        fragments.decode(data, items[:6], "steps/x", 5, **LIMITS)
    raw = zstandard.ZstdDecompressor().decompress(data)
    with pytest.raises(fragments.Invalid, match="ends past"):
        fragments.decode(zstandard.ZstdCompressor().compress(raw[:-40]), items, "steps/x", 5, **LIMITS)
    with pytest.raises(fragments.Invalid, match="follow its last column"):
        fragments.decode(zstandard.ZstdCompressor().compress(raw + b"\0" * 8), items, "steps/x", 5, **LIMITS)
    with pytest.raises(fragments.Invalid, match="not a zstd frame|no magic"):
        fragments.decode(b"\x28\xb5\x2f\xfdgarbage", items, "steps/x", 5, **LIMITS)
    for key, change, message in (("w/0_0", {"pack": ["pack-r0", 280, 60]}, "not inside a pack"),
                                 ("w/0_0", {"base": 5}, "not an earlier step"),
                                 ("same/0", {"encoding": "diff"}, "record of kind 0"),
                                 ("w/0_0", {"encoding": "rot13"}, "unknown")):
        crafted = {k: TensorEntry(**{**vars(e), **(change if k == key else {})}) for k, e in es.items()}
        with pytest.raises(fragments.Invalid, match=message):
            fragments.decode(fragments.encode(crafted, PACKS), items, "steps/x", 5, **LIMITS)


# --- through DCP ----------------------------------------------------------------------------

@pytest.fixture
def fixture_store(tmp_path) -> Path:
    copy = tmp_path / "v10"
    shutil.copytree(DATA / "format-v10", copy)
    return copy


def test_reading_one_ranks_shards_fetches_the_index_and_that_ranks_fragment_only(fixture_store):
    counting = CountingStore(LocalStore(str(fixture_store), read_only=True))
    store = amber.open(counting, mode="r")
    counting.ranges.clear()
    got = sync(store.history.entries(5, ["model.w/3_0", "model.emb/0_3"]))  # rank 1's shards
    fetched = sorted(k for k, _ in counting.ranges)
    # (and, for the checksums of its items that did not change, rank 1's fragment of their base step)
    assert fetched == ["commits/000000000004.json", "commits/000000000005.json",
                       f"{sync(store.history.index(4)).group}/fragment-r1",
                       f"{sync(store.history.index(5)).group}/fragment-r1"]
    emb = got["model.emb/0_3"]
    assert emb.encoding == "same" and emb.crc32c == sync(store.history.entry(4, "model.emb/0_3")).crc32c != []


def test_a_sharded_steps_index_is_small_compressed_json_naming_checked_fragments(fixture_store):
    raw = (fixture_store / "commits" / "000000000005.json").read_bytes()
    index = json.loads(zstandard.ZstdDecompressor().stream_reader(raw).read())
    assert index["tensors"] == {} and index["packs"] == {} and len(index["fragments"]) == 2
    assert len(raw) < 1500  # 7 tensors, 4 values, 2 ranks
    store = amber.open(fixture_store, mode="r")
    group = store.manifest(5).group
    fragment = fixture_store / group / "fragment-r1"
    data = bytearray(fragment.read_bytes())
    data[len(data) // 2] ^= 1
    fragment.write_bytes(bytes(data))
    store = amber.open(fixture_store, mode="r")
    with pytest.raises(CorruptDataError, match="fragment-r1 is damaged"):
        store.load(5, lazy=False)
    assert sync(store.history.entries(5, ["model.w/0_0"]))["model.w/0_0"].shape == [3, 8]  # rank 0's records read


def test_an_index_naming_a_fragment_outside_its_step_or_an_owner_it_lacks_is_refused(fixture_store):
    path = fixture_store / "commits" / "000000000005.json"
    index = json.loads(zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read())
    for tamper, message in ((lambda d: d["fragments"][0].update(key=d["group"] + "/../../../etc/passwd"), "leaves its folder"),
                            (lambda d: d["fragments"][0].update(key="commits/x"), "not a key inside"),
                            (lambda d: d["extra"]["dcp"]["state"]["owners"][0].append(7), "name fragments"),
                            (lambda d: d["extra"]["dcp"]["state"]["tensors"]["model/w"].update(grid=[0, 8]),
                             "piece length")):
        d = json.loads(json.dumps(index))
        tamper(d)
        path.write_bytes(zstandard.ZstdCompressor().compress(json.dumps(d).encode()))
        with pytest.raises(CorruptDataError, match=message):
            amber.open(fixture_store, mode="r").manifest(5)
    path.write_bytes(zstandard.ZstdCompressor().compress(bytes(1 << 30)))
    with pytest.raises(CorruptDataError, match="expands past"):
        amber.open(fixture_store, mode="r").manifest(5)
