"""Bad configurations refused before any compute, each message naming the numbers and the fix
(docs/troubleshooting.md has the table)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.train import resume_path


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """These fits run in the test process: Lightning starts a one-rank process group there and sets
    MASTER_PORT, which later tests' subprocesses would inherit (and find the port taken)."""
    env = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("name", ["num_microbatches", "pipeline_degree", "stages_per_rank"])
@pytest.mark.parametrize("value", [0, -2, 1.5])
def test_counts_must_be_positive_integers(name, value):
    with pytest.raises(ValueError, match=rf"TwoBPStrategy\({name}={value}\): it must be a positive integer"):
        TwoBPStrategy(**{name: value})


def _fit(samples: int, batch: int, m: int, drop_last: bool) -> int:
    model = Net()
    data = DataLoader(TensorDataset(torch.randn(samples, 6), torch.randn(samples, 2)), batch_size=batch,
                      drop_last=drop_last)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=TwoBPStrategy(num_microbatches=m), max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, data)
    return trainer.global_step


@pytest.mark.parametrize("samples, batch, m, drop_last, match", [
    (20, 8, 4, False, r"last batch holds 4 samples .* pass drop_last=True"),  # 4 splits into 4: accepted
    (22, 8, 4, False, r"last batch holds 6 samples \(22 samples in batches of 8\), which do not split into 4 "
                      r"micro-batches: pass drop_last=True"),
    (16, 2, 4, True, r"training batch size 2 is smaller than num_microbatches=4"),
    (18, 6, 4, True, r"training batch size 6 does not split into 4 micro-batches"),
])
def test_batches_that_cannot_split_are_refused_before_the_first_step(samples, batch, m, drop_last, match):
    if samples == 20:  # the control: every batch splits, training runs
        assert _fit(samples, batch, m, drop_last) == 3
        return
    with pytest.raises(ValueError, match=match):
        _fit(samples, batch, m, drop_last)


def test_ckpt_path_last_names_where_it_looked(tmp_path):
    run = tmp_path / "outputs" / "cpu-tiny-llama" / "2026-12-01_10-00-00"
    run.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"ckpt_path=last: no complete checkpoint under .*cpu-tiny-llama/\*"
                                                r"/checkpoints/ .* quoted for Hydra"):
        resume_path("last", str(run))
    older = tmp_path / "outputs" / "cpu-tiny-llama" / "2026-11-30_10-00-00" / "checkpoints" / "epoch=0-step=5.ckpt"
    older.mkdir(parents=True)
    (older / "twobp-manifest.json").write_text("{}")
    assert resume_path("last", str(run)) == str(older)
    assert resume_path("some/path", str(run)) == "some/path" and resume_path(None, str(run)) is None
