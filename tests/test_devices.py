"""States that live on an accelerator: deltas are taken there with torch, only encoded bytes cross
to the host, and what is read back is what was there. Each test runs on the CPU and, when the
suite runs on a GPU machine, on the CUDA device too."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bit_equal, assert_tree_bit_equal

# Own arrays of several chunks (the big ones) and packed tensors (the rest), every dtype a model
# or optimizer has, non-finite values and -0.0.
LAYOUT = dict(chunk_bytes=64 * 1024, pack_threshold=32 * 1024, full_every=3)


def initial(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(256, 256, generator=g),
        "w_bf16": torch.randn(512, 96, generator=g).to(torch.bfloat16),
        "exp_avg_sq": torch.rand(300, 100, generator=g) * 1e-6,
        "bias": torch.randn(48, generator=g).to(torch.float16),  # (under every lossy codec's min_numel)
        "step": torch.tensor(0, dtype=torch.int64),
        "mask": torch.rand(64, generator=g) > 0.5,
    }
    state["w"][0, :2] = -0.0  # (non-finite values: lossy codecs then store sparse and quant tensors exactly)
    state["bias"][:4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")])
    return {k: v.to(device) for k, v in state.items()}


def train_step(state: dict[str, torch.Tensor], step: int) -> None:
    """In place on the state's device, as an optimizer does; rows 0-63 of ``w`` never change
    (a chunk with nothing to store), and -0.0 elements move by less than any code's step."""
    g = torch.Generator().manual_seed(step)
    w = state["w"]
    w[64:] += 0.05 * torch.randn(w[64:].shape, generator=g).to(w.device)
    w[100, :3] = torch.tensor([-1e-30, 1e-30, -0.0], device=w.device)
    state["w_bf16"].mul_(1 + 0.02 * torch.randn(state["w_bf16"].shape, generator=g).to(w.device).to(torch.bfloat16))
    state["exp_avg_sq"].mul_(0.999).add_(1e-9 * torch.rand(state["exp_avg_sq"].shape, generator=g).to(w.device))
    state["bias"][2:] -= 0.001
    state["step"] += 1


def host_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("cpu", copy=True) for k, v in state.items()}


def on_host(state: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    assert all(t.device.type == device.type for t in state.values()), {k: t.device for k, t in state.items()}
    return host_copy(state)


@pytest.mark.parametrize("codec", ["lossless", "xor"])
def test_a_state_on_the_device_round_trips_bit_exact_and_loads_back_onto_it(local_store, device, codec):
    store = local_store(codec=codec, **LAYOUT)
    live, saved = initial(device), []
    for step in range(1, 6):  # a full step, two deltas, a full step, a delta
        train_step(live, step)
        store.save(step, live)
        saved.append(host_copy(live))
    assert store.manifest(2).tensors["w"].encoding != "full"
    reader = local_store(mode="r")
    for step, expected in enumerate(saved, 1):
        assert_tree_bit_equal(on_host(reader.load(step, lazy=False, device=device), device), expected)
    assert torch.equal(reader.load(5)["w"][60:70, 10:20], saved[-1]["w"][60:70, 10:20])  # a lazy slice


@pytest.mark.parametrize("snapshot", ["host", "device"])
def test_save_async_of_a_state_on_the_device_stores_it_as_it_was_when_called(local_store, device, snapshot):
    store = local_store(snapshot=snapshot, **LAYOUT)
    live, saved = initial(device), []
    for step in range(1, 4):
        train_step(live, step)
        saved.append(host_copy(live))
        done = store.save_async(step, live)
        for t in live.values():  # scribbled over before the background save has written anything
            t.zero_()
        done.result(timeout=120)
        live = {k: v.to(device, copy=True) for k, v in saved[-1].items()}
    reader = local_store(mode="r")
    for step, expected in enumerate(saved, 1):
        assert_tree_bit_equal(reader.load(step, lazy=False), expected)


@pytest.mark.parametrize("codec", ["sparse", "quant8", "quant4", "block", "ratio", "lossy"])
def test_lossy_deltas_taken_on_the_device_read_back_as_the_writer_reconstructed_them(local_store, device, codec):
    # Every read checks each chunk against the crc32c of the reconstruction the writer made on
    # the device and diffs the next step against; the reader rebuilds it on the host. A single
    # bit of disagreement (a fused multiply-add on one side, -0.0 against +0.0) fails the load.
    store = local_store(codec=codec, **LAYOUT)
    live, saved = initial(device), []
    for step in range(1, 6):
        train_step(live, step)
        store.save(step, live)
        saved.append(host_copy(live))
    assert store.manifest(2).tensors["w"].encoding in ("sparse", "quant", "block", "ratio")
    reader = local_store(mode="r")
    for step, expected in enumerate(saved, 1):
        got = on_host(reader.load(step, lazy=False, device=device), device)
        for key in ("step", "mask", "bias"):  # integers, bools, small tensors: exact
            assert_bit_equal(got[key], expected[key])
        # (the lossy preset rounds weights stochastically at 0.6 of a block's RMS value: each
        # error below sqrt(2) x 0.6 of it, which is at most the largest value)
        tolerance = 2**0.5 * 0.6 if codec == "lossy" else 0.1
        for key in ("w", "w_bf16", "exp_avg_sq"):
            scale = expected[key].float().abs().max()
            error = (got[key].float() - expected[key].float()).abs().max()
            assert error <= tolerance * scale, (key, step, error, scale)
        assert_bit_equal(got["w"][:64], expected["w"][:64])  # never moved: its base bits
