"""Peak resident memory of a 2-rank Trainer fit (1F1B, m = 4, six Linear(2048, 2048), SGD) above the built
model, per rank: with the previous step's gradients dropped at the pipeline step's start (the default since
stop 57) and kept through it (as before), alternated in fresh processes.

    PYTHONPATH=. python docs/results/memory/old_grads.py [rounds]
"""

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp import TwoBPStrategy
from lightning_twobp.engine.memory import return_freed_memory
from lightning_twobp.monitor import peak_rss_mb, reset_peak_rss, rss_mb
from lightning_twobp.processes import run_distributed

WIDTH = 2048


class Big(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Peak(pl.Callback):
    before = peak = 0.0

    def on_train_end(self, trainer, pl_module) -> None:
        self.peak = peak_rss_mb() - self.before


def fit_peak(rank: int, world: int, schedule: str) -> tuple[float, float]:
    """One rank of the 2-rank fit under ``schedule``: (peak MB above the built model, this rank's gradients MB)."""
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # run_distributed exported MASTER_PORT
    model, peak = Big(), Peak()
    x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
    return_freed_memory()
    peak.before = rss_mb()
    reset_peak_rss()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=TwoBPStrategy(schedule=schedule, num_microbatches=4),
        max_steps=4,
        callbacks=[peak],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    grads_mb = sum(4 * q.numel() for q in model.parameters() if not q.is_meta) / 1e6
    return round(peak.peak, 1), round(grads_mb, 1)


def worker(rank: int, world: int, kept: bool) -> tuple[float, float]:
    torch.set_num_threads(1)
    if kept:  # as before stop 57: nothing dropped before the pipeline step
        from lightning_twobp.lightning import grads

        grads.dropped_after_step = lambda trainer: frozenset()
    return fit_peak(rank, world, "1f1b")


if __name__ == "__main__":
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        for kept in (True, False):
            peaks = run_distributed(worker, 2, kept, timeout=300)
            print("kept   " if kept else "dropped", "(peak MB above the model, the whole model's gradients MB):", peaks)
