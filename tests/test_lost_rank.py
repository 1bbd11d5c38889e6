"""A rank that dies (SIGKILL) or hangs (SIGSTOP) in the middle of ``Trainer.fit`` is named by the
survivors: its pipeline rank, stage and host, within ``pipeline_timeout``, in the training step being
run; the survivors' fit raises instead of waiting for torch's 30-minute default."""

from __future__ import annotations

import os
import signal
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp import TwoBPStrategy
from lightning_twobp.testing import free_port, run_distributed

pytestmark = pytest.mark.dist


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Vanish(pl.Callback):
    """On ``victim``, sends the process ``sig`` when training step ``at`` starts."""

    def __init__(self, victim: int, sig: int, at: int) -> None:
        self.victim, self.sig, self.at = victim, sig, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.victim and trainer.global_step == self.at:
            os.kill(os.getpid(), self.sig)


def _fit(rank: int, world: int, port: int, victim: int, sig: int) -> float:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=8, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         strategy=TwoBPStrategy(schedule="1f1b", num_microbatches=4, pipeline_timeout=3),
                         callbacks=[_Vanish(victim, sig, at=2)])
    start = time.monotonic()
    trainer.fit(Net(), data)
    return time.monotonic() - start


@pytest.mark.parametrize("world, victim, how", [(2, 1, "SIGSTOP"), (4, 2, "SIGKILL"), (4, 0, "SIGSTOP")])
def test_a_rank_lost_during_fit_is_named_by_every_survivor(world, victim, how):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_distributed(_fit, world, free_port(), victim, getattr(signal, how), timeout=150)
    took = time.monotonic() - start
    msg = str(info.value)
    named = f"pipeline rank {victim} (stage {victim}, global rank {victim}, host "
    # the survivors next to the victim wait on it directly and name it; ranks further away may
    # instead name the neighbour that stopped answering them once it raised
    neighbours = {victim - 1, victim + 1} & set(range(world))
    reports = {int(part.split()[0]): part for part in msg.split("--- rank ")[1:]}
    for r in neighbours:
        assert named in reports[r] and "stopped answering" in reports[r], reports[r][-3000:]
        assert "nothing came for 3 s" in reports[r] if how == "SIGSTOP" else "its connection closed" in reports[r]
        assert ", step 2, " in reports[r], reports[r][-3000:]  # the training step being run (counted from 0)
    assert took < 120, f"the survivors took {took:.0f} s to give up"
