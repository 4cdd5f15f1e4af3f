"""Lightning with AmberCheckpointIO: top-k + last in one store, pruning that frees steps, resume."""

from __future__ import annotations

import pathlib

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import amber_store as amber
from amber_store.integrations import pointers
from amber_store.integrations.lightning import AmberCheckpointIO
from conftest import assert_bit_equal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


class Regression(pl.LightningModule):
    def __init__(self, data_dir: pathlib.Path = pathlib.Path("/data"), dtype: torch.dtype = torch.float32,
                 lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()  # a Path and a torch.dtype among them
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)]


def loader(seed: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


def trainer(io: AmberCheckpointIO, dirpath: pathlib.Path, monitor: str = "val_loss", mode: str = "min",
            **kwargs) -> pl.Trainer:
    checkpoint = ModelCheckpoint(dirpath=dirpath, save_top_k=2, save_last=True, monitor=monitor, mode=mode,
                                 every_n_epochs=1)
    return pl.Trainer(plugins=[io], callbacks=[checkpoint], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", deterministic=True, **kwargs)


def test_top_k_and_last_keep_at_most_k_plus_one_steps_and_every_path_loads(tmp_path, location):
    uri, options = location
    io = AmberCheckpointIO(uri, options)
    t = trainer(io, tmp_path / "lightning", monitor="step", mode="max", max_epochs=6)  # top 2: the latest 2
    model = Regression(data_dir=tmp_path / "data", dtype=torch.bfloat16)
    t.fit(model, loader(), loader(1))
    files = sorted(p.name for p in (tmp_path / "lightning").iterdir())
    assert files == ["epoch=4-step=40.ckpt", "epoch=5-step=48.ckpt", "last.ckpt"]
    assert amber.open(uri, options, mode="r").steps() == [40, 48]  # pruned steps were deleted
    last = io.load_checkpoint(tmp_path / "lightning" / "last.ckpt")
    assert last["global_step"] == 48
    for k, v in model.state_dict().items():
        assert_bit_equal(last["state_dict"][k], v)
    assert last["hyper_parameters"]["data_dir"] == tmp_path / "data"
    assert last["hyper_parameters"]["dtype"] is torch.bfloat16
    best = io.load_checkpoint(t.checkpoint_callback.best_model_path)
    callback_state = next(v for k, v in best["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert callback_state["best_model_path"] == t.checkpoint_callback.best_model_path


def test_last_saved_after_a_top_k_file_of_the_same_step_writes_no_second_step(tmp_path):
    io = AmberCheckpointIO(tmp_path / "store")
    trainer(io, tmp_path / "ckpt", max_epochs=1).fit(Regression(), loader(), loader(1))
    store = amber.open(tmp_path / "store", mode="r")
    assert store.steps() == [8]
    top_k = next(p for p in (tmp_path / "ckpt").iterdir() if p.name != "last.ckpt")
    a, b = pointers.read(top_k), pointers.read(tmp_path / "ckpt" / "last.ckpt")
    assert a.step == b.step == 8 and a.tree is None and b.tree is not None  # last_model_path differs
    assert io.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")["callbacks"] != io.load_checkpoint(top_k)["callbacks"]


def test_the_same_step_saved_again_with_other_weights_is_refused(tmp_path):
    io = AmberCheckpointIO(tmp_path / "store")
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.zeros(4)}}, tmp_path / "a.ckpt")
    with pytest.raises(amber.StepOrderError, match="already committed with other tensors"):
        io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(4)}}, tmp_path / "b.ckpt")
    assert not (tmp_path / "b.ckpt").exists()


def test_resuming_from_last_trains_on_bit_identically_to_an_uninterrupted_run(tmp_path):
    straight = Regression()
    trainer(AmberCheckpointIO(tmp_path / "s1"), tmp_path / "c1", max_epochs=4).fit(straight, loader(), loader(1))

    first = Regression()
    trainer(AmberCheckpointIO(tmp_path / "s2"), tmp_path / "c2", max_epochs=2).fit(first, loader(), loader(1))
    resumed = Regression(lr=0.5)  # the checkpoint's weights, optimizer and scheduler must win
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()
    trainer(AmberCheckpointIO(tmp_path / "s2"), tmp_path / "c2", max_epochs=4).fit(
        resumed, loader(), loader(1), ckpt_path="last")
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert_bit_equal(b, a)
    assert amber.open(tmp_path / "s2", mode="r").latest() == 32


def test_a_plain_lightning_checkpoint_still_loads(tmp_path):
    torch.save({"global_step": 1, "state_dict": {"w": torch.ones(2)}}, tmp_path / "plain.ckpt")
    got = AmberCheckpointIO(tmp_path / "store").load_checkpoint(tmp_path / "plain.ckpt")
    assert_bit_equal(got["state_dict"]["w"], torch.ones(2))


def test_a_pointer_into_another_runs_store_loads_from_that_store(tmp_path):
    AmberCheckpointIO(tmp_path / "run1").save_checkpoint(
        {"global_step": 5, "state_dict": {"w": torch.arange(4.0)}}, tmp_path / "run1.ckpt")
    got = AmberCheckpointIO(tmp_path / "run2").load_checkpoint(tmp_path / "run1.ckpt")
    assert_bit_equal(got["state_dict"]["w"], torch.arange(4.0))
    assert not (tmp_path / "run2").exists()  # nothing copied into this run's store, which opening did not make
