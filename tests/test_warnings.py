"""What a newcomer sees before the first step: no deprecation warnings from our dependencies that the user
cannot act on (torchdata's ``set_vital``, Lightning's pytree ``LeafSpec``), and only for the Trainer call."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.data.modules import _DataModule
from lightning_twobp.lightning.quiet import KNOWN_WARNINGS

from conftest import Regressor, quiet_trainer

# Lightning starts a one-rank process group in this process and sets MASTER_PORT: undone after each test.
pytestmark = pytest.mark.usefixtures("no_leftover_process_group")


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
        quiet_trainer(TwoBPStrategy(), 1, max_steps=2, use_distributed_sampler=True).fit(
            Regressor((6, 8, 2), log=False), datamodule=Data()
        )
        assert _known(caught) == []
        # after the call the filters are the user's again: the same two warnings show
        data = Data()
        data.setup("fit")
        data.train_dataloader()
        from lightning.pytorch.utilities._pytree import _tree_flatten

        _tree_flatten([torch.ones(1)])
    assert len(_known(caught)) == 2, [str(w.message) for w in caught]
