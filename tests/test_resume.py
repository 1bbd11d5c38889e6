"""Resuming from a mid-epoch checkpoint reproduces the uninterrupted run bitwise: the same batches
(torchdata's StatefulDataLoader and StatefulDistributedSampler, whose position Lightning saves), each
rank's random streams (dropout on both stages) and the step counters."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.data.modules import _DataModule
from lightning_twobp.testing import free_port, run_distributed

pytestmark = pytest.mark.dist


class Dropout(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 32), nn.Dropout(0.5),
                                    nn.Tanh(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Data(_DataModule):
    """The package's data modules' loaders (the recipes'), over 128 random samples: 16 steps an epoch."""

    def __init__(self) -> None:
        super().__init__(batch_size=8, seed=3, num_workers=0)

    def _build(self):
        g = torch.Generator().manual_seed(1)
        return TensorDataset(torch.randn(128, 6, generator=g), torch.randn(128, 2, generator=g)), None


def _fit(world: int, max_steps: int, folder: str | None = None, ckpt_path: str | None = None) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    losses: dict[int, float] = {}

    class _Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])

    cbs = [_Losses()]
    if folder:
        cbs.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1))
    pl.seed_everything(7, verbose=False)
    model = Dropout()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=TwoBPStrategy(schedule="zb-h1", num_microbatches=4, balance=[3, 4]),
                         max_steps=max_steps, logger=False, enable_checkpointing=bool(folder), enable_progress_bar=False,
                         enable_model_summary=False, callbacks=cbs)
    trainer.fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    return {"losses": losses, "weights": {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}}


def _runs(rank: int, world: int, port: int, folder: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    straight = _fit(world, 7)
    _fit(world, 3, folder=folder)  # stops at step 3 of 16, mid-epoch, with a checkpoint there
    resumed = _fit(world, 7, ckpt_path=f"{folder}/epoch=0-step=3.ckpt")
    return {"straight": straight, "resumed": resumed}


def test_resume_mid_epoch_is_bitwise(tmp_path):
    for rank, r in enumerate(run_distributed(_runs, 2, free_port(), str(tmp_path), timeout=240)):
        straight, resumed = r["straight"], r["resumed"]
        assert sorted(resumed["losses"]) == [4, 5, 6, 7]
        for step, loss in resumed["losses"].items():
            assert loss == straight["losses"][step], f"rank {rank}: step {step}'s loss differs after resuming"
        for name, value in straight["weights"].items():
            assert torch.equal(resumed["weights"][name], value), f"rank {rank}: {name} differs after resuming"
