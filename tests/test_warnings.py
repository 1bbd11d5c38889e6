"""What a newcomer sees before the first step: no deprecation warnings from our dependencies that the user
cannot act on (torchdata's ``set_vital``, Lightning's pytree ``LeafSpec``), and only for the Trainer call."""

from __future__ import annotations

import os
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.data.modules import _DataModule
from lightning_twobp.lightning.quiet import KNOWN_WARNINGS


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """Lightning starts a one-rank process group in this process and sets MASTER_PORT: undo both."""
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


class Data(_DataModule):
    """The package's data modules' loaders (torchdata's StatefulDataLoader, which calls set_vital)."""

    def __init__(self) -> None:
        super().__init__(batch_size=8, seed=3, num_workers=0)

    def _build(self):
        return TensorDataset(torch.randn(32, 6), torch.randn(32, 2)), None


def _known(caught: list) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if any(re.match(m, str(w.message)) and issubclass(w.category, c) for m, c, _ in KNOWN_WARNINGS)
    ]


def test_a_fit_shows_neither_known_deprecation_warning_and_only_for_its_length():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=TwoBPStrategy(),
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(Net(), datamodule=Data())
        assert _known(caught) == []
        # after the call the filters are the user's again: the same two warnings show
        data = Data()
        data.setup("fit")
        data.train_dataloader()
        from lightning.pytorch.utilities._pytree import _tree_flatten

        _tree_flatten([torch.ones(1)])
    assert len(_known(caught)) == 2, [str(w.message) for w in caught]
