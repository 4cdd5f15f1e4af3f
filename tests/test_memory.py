"""Where a process keeps the bases of its next delta saves (``base_cache``), and what it holds
in memory: the same bits stored whichever the choice; a spilled base out of the process's
memory; spill files and snapshot buffers gone at ``close()``; a failed spill costs only a read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import amber_store as amber
from amber_store import format as fmt
from conftest import assert_bit_equal

MODES = ["spill", "memory", "none"]


def states(codec: str) -> list[dict]:
    """Four steps of a small training-like state: large and packed tensors, one left unchanged."""
    g = torch.Generator().manual_seed(0)
    w, m, b = torch.randn(256, 1024, generator=g), torch.randn(128, 512, generator=g), torch.randn(64, generator=g)
    frozen = torch.randn(512, 512, generator=g)
    out = []
    for step in range(4):
        out.append({"w": w.clone(), "opt": {"m": m.clone(), "b": b.clone()}, "frozen": frozen})
        w += torch.randn(w.shape, generator=g) * 1e-3
        m[step] += 1.0
        b[step] -= 0.5
    return out


@pytest.mark.parametrize("codec", ["lossless", "lossy"])
@pytest.mark.parametrize("policy", ["auto", "chain"])
def test_every_base_cache_stores_the_same_bits_and_reads_back_bit_exact(tmp_path, codec, policy):
    seen = {}
    for mode in MODES:
        with amber.open(tmp_path / mode, mode="w", base_cache=mode, spill_dir=str(tmp_path), codec=codec,
                        base_policy=policy, full_every=10) as store:
            for step, state in enumerate(states(codec)):
                store.save(step, state)
            seen[mode] = {step: {k: (e.encoding, e.base, e.crc32c, e.stored) for k, e in store.manifest(step).tensors.items()}
                          for step in store.steps()}
            loaded = store.load(3, lazy=False)
        if codec == "lossless":
            assert_bit_equal(loaded["w"], states(codec)[3]["w"])
            assert_bit_equal(loaded["opt"]["b"], states(codec)[3]["opt"]["b"])
    assert seen["spill"] == seen["memory"] == seen["none"]
    assert seen["spill"][3]["frozen"][0] == "same"


def test_a_fresh_process_delta_save_reads_its_bases_back_alike_in_every_mode(tmp_path):
    steps = states("lossless")
    seen = {}
    for mode in MODES:
        with amber.open(tmp_path / mode, mode="w") as store:
            store.save(0, steps[0])
        with amber.open(tmp_path / mode, base_cache=mode, spill_dir=str(tmp_path)) as store:  # a new process's view
            store.save(1, steps[1])
            store.save(2, steps[2])
            seen[mode] = [store.manifest(s).tensors["w"].crc32c for s in (1, 2)]
            assert_bit_equal(store.load(2, lazy=False)["w"], steps[2]["w"])
    assert seen["spill"] == seen["memory"] == seen["none"]


def _spill_files(directory: Path) -> list[str]:
    """This process's open files in ``directory`` (a spill file is unlinked, but open)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_spill_files_hold_the_kept_bases_then_are_refilled_and_removed_at_close(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    store = amber.open(tmp_path / "store", mode="w", spill_dir=str(spill), base_policy="chain")
    for step, state in enumerate(states("lossless")):
        store.save(step, state)
        # the kept base's file, and the one the next save fills again (the step before's)
        assert len(_spill_files(spill)) == min(step + 1, 2)
    assert list(spill.iterdir()) == []  # unlinked: nothing to clean up after a crash
    kept = store.writer.bases.get(3, "w")
    assert torch.equal(kept.whole(), fmt.to_bits(states("lossless")[3]["w"]))
    del kept
    store.close()
    assert _spill_files(spill) == []


def test_a_spill_that_fails_costs_the_next_save_a_read_not_the_save(tmp_path, monkeypatch):
    from amber_store import bases

    steps = states("lossless")
    store = amber.open(tmp_path / "store", mode="w", spill_dir=str(tmp_path), base_policy="chain")

    def full_disk(fd, buffers, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bases.os, "pwritev", full_disk)
    with pytest.warns(RuntimeWarning, match="could not be spilled"):
        store.save(0, steps[0])
    assert store.writer.bases.get(0, "w") is None
    monkeypatch.undo()
    store.save(1, steps[1])  # its bases read back from the store
    assert_bit_equal(store.load(1, lazy=False)["w"], steps[1]["w"])
    store.close()


def test_a_spill_dir_that_is_not_a_directory_is_refused_at_open(tmp_path):
    with pytest.raises(ValueError, match="spill_dir"):
        amber.open(tmp_path / "store", mode="w", spill_dir=str(tmp_path / "missing"))


PEAK = textwrap.dedent("""
    import gc, json, sys, torch, amber_store as amber
    def field(name):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(name + ":"))
    mode, how, root = sys.argv[1], sys.argv[2], sys.argv[3]
    # the libraries a first delta save loads (numba's compiler, its kernels) are no base copy
    with amber.open(root + "-warm", mode="w", base_cache=mode) as warm:
        for step in range(2):
            warm.save(step, {"w": torch.full((1 << 20,), float(step)), "b": torch.full((100,), float(step))})
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(48)}  # 192 MiB
    size = sum(t.nbytes for t in state.values())
    gc.collect()
    from amber_store.runtime import return_free_memory; return_free_memory()
    open("/proc/self/clear_refs", "w").write("5")
    base = field("VmRSS")
    store = amber.open(root, mode="w", base_cache=mode, spill_dir=root + "-spill")
    save = (lambda s, x: store.save_async(s, x).result()) if how == "async" else store.save
    save(1, state)
    for t in state.values():
        t.add_(1e-3)
    save(2, state)
    peak, left = field("VmHWM") - base, field("VmRSS") - base
    store.close()
    gc.collect()
    print(json.dumps({"peak": peak / size, "left": left / size, "closed": (field("VmRSS") - base) / size}))
""")


def peak(tmp_path: Path, mode: str, how: str) -> dict:
    root = tmp_path / f"{mode}-{how}"
    (tmp_path / f"{mode}-{how}-spill").mkdir()
    out = subprocess.run([sys.executable, "-c", PEAK, mode, how, str(root)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_spilled_base_leaves_the_process_memory_to_the_state_alone(tmp_path):
    # Beyond a 192 MiB state (S), across a full save and a delta save, in a fresh process. (A
    # few tens of MB do not grow with the state, a large share of so small a one: the targets
    # at a 1.17 GB state are benchmarks/memory.py's.)
    spilled, resident = peak(tmp_path, "spill", "sync"), peak(tmp_path, "memory", "sync")
    assert spilled["peak"] < 0.75, spilled  # (0.3-0.55 measured: a base copy alone is 1.0)
    assert resident["left"] - spilled["left"] > 0.85, (resident, spilled)  # the base copy, resident until close
    assert resident["closed"] < 0.25 and spilled["closed"] < 0.25, (resident, spilled)


def test_save_async_holds_one_snapshot_and_gives_it_back_at_close(tmp_path):
    result = peak(tmp_path, "spill", "async")
    assert 1.0 < result["peak"] < 1.6, result  # the snapshot, and no base copy
    assert result["closed"] < 0.25, result
