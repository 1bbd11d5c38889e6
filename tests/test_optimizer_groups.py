"""The param groups compared with one process's at setup (``lightning/optimizer_groups.py``): what the two
calls of the same ``configure_optimizers`` differ in without stepping any parameter otherwise is not refused,
and a V's two stages on one rank are compared too."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning.checks import checked_optimizers
from lightning_twobp.lightning.optimizer_groups import whole_model_places

import conftest
from conftest import Regressor, lightning_env, quiet_trainer


class Net(Regressor):
    """Three Linear layers; ``settings()`` gives the group's settings of each call of configure_optimizers."""

    def __init__(self, settings) -> None:
        super().__init__((6, 8, 8, 2), log=False)
        self.settings = settings

    def configure_optimizers(self):
        return torch.optim.AdamW([{"params": list(self.parameters()), **self.settings()}], lr=1e-3)


def _compared(settings_whole, settings_here) -> None:
    """The whole model's call with ``settings_whole``'s settings, then Lightning's with ``settings_here``'s,
    checked as setup checks them on pipeline rank 0 of 2."""
    calls = iter([settings_whole, settings_here])
    net = Net(lambda: next(calls)())
    one_process = whole_model_places(net)
    assert one_process is not None
    optimizers = [net.configure_optimizers()]
    checked_optimizers(lambda: None, net, lambda: optimizers, 0, [0], 2, one_process)


def test_kernels_chosen_by_device_are_not_compared():
    """nanoGPT's ``fused=device_type == "cuda"`` (and foreach, capturable, by ``self.device``): the whole model's
    call runs before the strategy moves the model (self.device is the CPU there, the GPU in Lightning's call):
    the same update by other kernels was refused on every parameter, showing the same settings twice."""
    _compared(lambda: dict(fused=False, foreach=True), lambda: dict(fused=True, foreach=False))
    _compared(lambda: dict(capturable=False), lambda: dict(capturable=True))


def test_settings_made_anew_each_call_compare_alike():
    """A function made in configure_optimizers, a NaN, an array: another object each call, never == the other
    call's (a function, a NaN) or not comparable by == at all (an array raised on the ranks holding it alone)."""
    _compared(lambda: dict(project=lambda t: t), lambda: dict(project=lambda t: t))
    _compared(lambda: dict(clip=float("nan")), lambda: dict(clip=float("nan")))
    _compared(lambda: dict(mask=np.array([1.0, 2.0])), lambda: dict(mask=np.array([1.0, 2.0])))
    _compared(lambda: dict(cfg={"scale": torch.ones(2)}), lambda: dict(cfg={"scale": torch.ones(2)}))
    # made on the device of a weight another rank holds (meta in the whole model's call of a model built there)
    _compared(lambda: dict(lr=torch.tensor(1e-3, device="meta")), lambda: dict(lr=torch.tensor(1e-3)))


def test_a_setting_that_differs_is_refused_and_named():
    """A difference in a setting the message does not usually show is named in it."""
    with pytest.raises(ValueError) as err:
        _compared(lambda: dict(amsgrad=False), lambda: dict(amsgrad=True))
    assert re.search(
        r"in optimizer 0 \(AdamW, amsgrad=True, .*\) here and in optimizer 0 \(AdamW, amsgrad=False", str(err.value)
    )
    with pytest.raises(ValueError, match=r"mask=\(1\.0, 3\.0\), .*\) here and in .*mask=\(1\.0, 2\.0\)"):
        _compared(lambda: dict(mask=np.array([1.0, 2.0])), lambda: dict(mask=np.array([1.0, 3.0])))


def _tied_apart_on_one_rank(rank: int, world: int) -> str:
    """pipeline_degree=1: a V's two stages on one rank, sharded over the 2 replicas, hold GPT-2's tied weight
    as two copies under their own names; HeadApart puts lm_head's copy in a group of its own."""
    from test_sharded import HeadApart, _tokens

    lightning_env(rank, world)
    model = HeadApart()
    strategy = TwoBPStrategy(pipeline_degree=1, schedule="zb-v", data_parallel="shard")
    try:
        quiet_trainer(strategy, world, max_steps=1, use_distributed_sampler=True).fit(model, _tokens())
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_tied_copies_of_a_v_on_one_rank_in_different_groups_are_refused():
    """Compared wherever the model is cut into several stages, not only over several pipeline ranks: with
    pipeline_degree=1 the copies trained apart (0.046 after one step), found only after training."""
    pytest.importorskip("transformers")
    results = conftest.run_distributed(_tied_apart_on_one_rank, 2, timeout=300)
    for rank, said in enumerate(results):
        assert re.search(
            r"model.lm_head.weight is in optimizer 0 \(SGD, lr=0.01, .*\) here and in optimizer 0 \(SGD, lr=0.1, .*"
            r"It is a weight tied to model.transformer.wte.weight",
            said,
        ), (rank, said)


class DrawnLoader(Regressor):
    """A training loader whose building draws from torch's generator (a subset drawn in train_dataloader),
    shuffled by a RandomSampler (which draws its seed from the same generator at iter()), and a scheduler over
    ``trainer.estimated_stepping_batches``, which builds the loader inside configure_optimizers."""

    def __init__(self) -> None:
        super().__init__((6, 8, 8, 2), log=False)
        self.batches: list[float] = []  # each step's batch, by its sum (the pipeline's: its micro-batches' sums)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        data = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g))
        return DataLoader(Subset(data, torch.randperm(64)[:32].tolist()), batch_size=8, shuffle=True)

    def training_step(self, batch, batch_idx):
        self.batches.append(float(batch[0].sum()))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        steps = self.trainer.estimated_stepping_batches
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LinearLR(opt, total_iters=steps)}


def _drawn_loader_batches(rank: int | None, world: int) -> list[float]:
    if rank is not None:
        lightning_env(rank, world)
    torch.manual_seed(1)
    model = DrawnLoader()
    strategy = "auto" if rank is None else TwoBPStrategy(num_microbatches=4)
    quiet_trainer(strategy, world if rank is not None else 1, max_epochs=1).fit(model)
    if rank is None:
        return model.batches
    return [sum(model.batches[k : k + 4]) for k in range(0, len(model.batches), 4)]


@pytest.mark.slow
def test_the_whole_models_call_leaves_the_batches_as_one_process_reads_them():
    """The whole model's call put torch's random state back after building the training loader in it
    (estimated_stepping_batches): its draws undone, the sampler shuffled from another state, and every step
    read other samples than one process's, silently."""
    ours = conftest.run_distributed(_drawn_loader_batches, 2, timeout=300)
    one_process = _drawn_loader_batches(None, 1)
    for rank, batches in enumerate(ours):
        assert batches == pytest.approx(one_process, abs=1e-4), rank
