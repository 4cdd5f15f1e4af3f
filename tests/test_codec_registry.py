"""Delta codecs from outside the package: registered at run time, or found by an installed
package's entry point when a step names their encoding; what the registry refuses, and what a
process without the codec says."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import amber_store as amber
from amber_store.codecs import DiffDeltaCodec, XorDeltaCodec, registry
from conftest import assert_tree_bit_equal


class AcmeXor(XorDeltaCodec):
    """A site's own codec (here XOR under a name of its own)."""

    name = "acme.xor_delta"
    encoding = "acme.xor"


@pytest.fixture
def codecs() -> dict:
    """The codec registry, restored in place after the test (modules hold it by reference)."""
    before = dict(registry.DELTA_ENCODINGS)
    yield registry.DELTA_ENCODINGS
    registry.DELTA_ENCODINGS.clear()
    registry.DELTA_ENCODINGS.update(before)


def saved_with(path: Path, codec: amber.DeltaCodec) -> dict:
    """A store at ``path`` of a full step and a delta step by ``codec``; the second step's state."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 256, generator=g), "small": torch.randn(100, generator=g)}
    with amber.open(path, mode="w", codec=codec, pack_threshold=4096) as store:
        store.save(1, state)
        for t in state.values():
            t.add_(1e-3 * torch.randn(t.shape, generator=g))
        store.save(2, state)
    return state


def test_a_codec_registered_from_outside_the_package_saves_and_loads_bit_exactly(codecs, tmp_path):
    assert amber.codecs.register(AcmeXor) is AcmeXor
    state = saved_with(tmp_path / "s", AcmeXor())
    assert amber.open(tmp_path / "s", mode="r").info(2)["tensors"]["w"]["encoding"] == "acme.xor"
    assert_tree_bit_equal(amber.open(tmp_path / "s", mode="r").load(2, lazy=False), state)
    lazy = amber.open(tmp_path / "s", mode="r").load(2)
    assert torch.equal(lazy["w"][10:20].view(torch.int32), state["w"][10:20].view(torch.int32))


def test_an_installed_packages_entry_point_gives_a_fresh_process_the_codec_it_reads(codecs, tmp_path):
    # a distribution installed on the path: its module, its metadata and its entry point
    site = tmp_path / "site"
    (site / "acme_codecs").mkdir(parents=True)
    (site / "acme_codecs" / "__init__.py").write_text(textwrap.dedent('''
        from amber_store.codecs import XorDeltaCodec

        class AcmeXor(XorDeltaCodec):
            name = "acme.xor_delta"
            encoding = "acme.xor"
    '''))
    info = site / "acme_codecs-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-codecs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{amber.codecs.ENTRY_POINTS}]\nacme.xor = acme_codecs:AcmeXor\n")
    amber.codecs.register(AcmeXor)  # (this process writes with the test's twin of that class)
    state = saved_with(tmp_path / "s", AcmeXor())
    torch.save(state, tmp_path / "expected.pt")
    code = textwrap.dedent("""
        import json, sys, torch, amber_store as amber
        got = amber.open(sys.argv[1], mode="r").load(2, lazy=False)
        want = torch.load(sys.argv[2])
        print(json.dumps({"equal": all(torch.equal(got[k].view(torch.int8), want[k].view(torch.int8)) for k in want),
                          "codec": amber.codecs.delta_codec("acme.xor").__module__}))
    """)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s"), str(tmp_path / "expected.pt")],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"equal": True, "codec": "acme_codecs"}


def test_a_step_of_a_codec_this_process_lacks_says_which_and_how_to_get_it(codecs, tmp_path):
    amber.codecs.register(AcmeXor)
    saved_with(tmp_path / "s", AcmeXor())
    del codecs["acme.xor"]  # (as a process without the package sees it: no entry point names it)
    store = amber.open(tmp_path / "s", mode="r")
    assert store.steps() == [1, 2]  # (the manifest is valid: only reading its tensors needs the codec)
    # (the first tensor a codec thread meets names it: either)
    with pytest.raises(amber.UnknownCodecError, match=r"step 2, tensor '(w|small)': encoding 'acme.xor' .* "
                                                      r"entry point group 'amber_store.codecs'"):
        store.load(2, lazy=False)
    assert torch.equal(store.load(1, lazy=False)["w"], store.load(1)["w"][:])  # the full step still loads


def test_a_codec_that_is_not_registered_is_refused_before_it_writes_a_step_nothing_could_read(codecs, tmp_path):
    class Unregistered(XorDeltaCodec):
        name = "acme.unregistered"
        encoding = "acme.unregistered"

    class Impostor(XorDeltaCodec):  # (another class under a built-in encoding: decoded by XOR's on load)
        pass

    for codec in (Unregistered(), Impostor()):
        with pytest.raises(ValueError, match="not a registered codec"):
            amber.open(tmp_path / "s", mode="w", codec=codec)
    assert not (tmp_path / "s").exists() or amber.open(tmp_path / "s", mode="r").steps() == []


def test_the_registry_refuses_what_would_not_read_back(codecs):
    class Bare(XorDeltaCodec):
        name = "acme.bare"
        encoding = "bare"

    class Taken(XorDeltaCodec):
        name = "acme.other"
        encoding = "acme.xor"

    with pytest.raises(ValueError, match="'<package>.<codec>'"):
        amber.codecs.register(Bare)
    with pytest.raises(TypeError, match="not a DeltaCodec class"):
        amber.codecs.register(dict)  # type: ignore[arg-type]
    amber.codecs.register(AcmeXor)
    amber.codecs.register(AcmeXor)  # (again: nothing)
    with pytest.raises(ValueError, match="is .*AcmeXor's already"):
        amber.codecs.register(Taken)
    with pytest.raises(amber.UnknownCodecError, match="'acme.nothing'"):
        amber.codecs.delta_codec("acme.nothing")


class AcmeInvertedDiff(DiffDeltaCodec):
    """A codec with its own serializer: the default diffs, stored with every bit inverted."""

    name = "acme.inverted_diff_delta"
    encoding = "acme.inverted_diff"

    def serializer(self, dtype: str) -> dict:
        return {"name": "acme.inverted"}

    def serialize(self, chunk, side=None, recon=None):
        return ~chunk.reshape(-1).view("u1")

    def deserialize(self, raw, shape, dtype):
        return (~raw).view(dtype).reshape(shape)


def test_a_codec_with_a_serializer_of_its_own_reads_back_through_it_not_through_the_fused_decoder(codecs, tmp_path):
    amber.codecs.register(AcmeInvertedDiff)
    state = saved_with(tmp_path / "s", AcmeInvertedDiff())
    store = amber.open(tmp_path / "s", mode="r")
    group = (tmp_path / "s" / store.manifest(2).group / "zarr.json").read_text()  # (arrays' metadata consolidated)
    assert '{"name": "acme.inverted"}' in group.replace(" ", "").replace(":", ": ")
    assert_tree_bit_equal(store.load(2, lazy=False), state)
    assert torch.equal(store.load(2)["w"][3:7].view(torch.int32), state["w"][3:7].view(torch.int32))
