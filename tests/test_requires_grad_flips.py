"""A callback that freezes or unfreezes layers during fit (fine-tuning schedules flip ``requires_grad``
between steps) on a stage that is not the first: the pipeline follows the change, as one process does.
Before, the stage kept the trainable parameters it read at setup: a layer frozen since crashed B
("cannot register a hook on a tensor that doesn't require gradient"), and one unfrozen since was
silently never trained. A first stage frozen from the start (fine-tuning a model's later half) trains
as one process does, the optimizer over self.parameters(); it was refused at setup."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
from torch import nn

from lightning_twobp import TwoBPStrategy
from lightning_twobp.processes import run_distributed

from conftest import Regressor, lightning_env, mlp, quiet_trainer, regression_data

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

LAYER = 2  # Linear(16, 16): on pipeline rank 1 (stage 1) of the Regressor's [1, 4] cut
MODES = ("freeze", "unfreeze", "by-type", "frozen-stage")


class Flip(pl.Callback):
    """``"freeze"``: freeze the layer once fit has started; ``"unfreeze"``: it starts frozen (in the
    model), unfrozen before step 2; ``"by-type"``: as ``"freeze"``, the layer picked by ``isinstance`` among
    the layers, where another rank's are placeholders (they were no Linear: rank 1 froze layers.4)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def on_train_start(self, trainer, pl_module):
        if self.mode == "freeze":
            pl_module.layers[LAYER].requires_grad_(False)
        if self.mode == "by-type":  # the second Linear, picked by type: layers[LAYER] in one process
            [m for m in pl_module.layers if isinstance(m, nn.Linear)][1].requires_grad_(False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.mode == "unfreeze" and trainer.global_step == 2:
            pl_module.layers[LAYER].requires_grad_(True)


def _fit(strategy, devices: int, mode: str) -> dict[str, torch.Tensor]:
    model = Regressor()
    if mode == "unfreeze":
        model.layers[LAYER].requires_grad_(False)  # configure_optimizers still takes it (self.parameters())
    if mode == "frozen-stage":  # all of stage 0 (layers.0 in the [1, 4] cut) frozen: rank 0 trains nothing
        model.layers[0].requires_grad_(False)
    quiet_trainer(strategy, devices, max_steps=4, callbacks=[Flip(mode)]).fit(model, regression_data(n=32))
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


class WithBackbone(Regressor):
    """``layers[0]`` (a Sequential of its own) is the backbone; the optimizer takes the trainable layers."""

    def __init__(self) -> None:
        super().__init__(
            layers=lambda: nn.Sequential(mlp((6, 16, 16)), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), mlp((16, 2)))
        )

    @property
    def backbone(self) -> nn.Module:
        return self.layers[0]

    def configure_optimizers(self):
        return torch.optim.SGD([q for q in self.parameters() if q.requires_grad], lr=self.lr, momentum=0.9)


class Unfreeze(BaseFinetuning):
    """A fine-tuning schedule of one's own: the backbone frozen in setup (before the split), unfrozen into a
    param group of its own at epoch 1. BaseFinetuning iterates ``pl_module.backbone``, on rank 1 the
    placeholder of a Sequential of rank 0, whose Linear's placeholder claimed to be iterable: TypeError."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.01)


class BackboneRates(BackboneFinetuning):
    """What the refusal of ``BackboneFinetuning`` says to do: after the unfreezing epoch, set the rate of the
    groups that hold the backbone's parameters, found by id (none on rank 1), not of ``param_groups[-1]``
    (rank 1's head). Lightning's own schedule otherwise: it was refused too, as a BackboneFinetuning."""

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch <= self.unfreeze_backbone_at_epoch:
            return super().finetune_function(pl_module, epoch, optimizer)
        lr = min(self.lambda_func(epoch + 1) * self.previous_backbone_lr, optimizer.param_groups[0]["lr"])
        ids = {id(q) for q in pl_module.backbone.parameters()}
        for group in optimizer.param_groups:
            if any(id(q) in ids for q in group["params"]):
                group["lr"] = lr
        self.previous_backbone_lr = lr
        return None


def _fit_backbone(strategy, devices: int, rates: bool = False) -> dict[str, torch.Tensor]:
    model = WithBackbone()
    schedule = BackboneRates(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 0.5) if rates else Unfreeze()
    trainer = quiet_trainer(strategy, devices, max_epochs=3 if rates else 2, callbacks=[schedule])
    trainer.fit(model, regression_data(n=32))
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


def _ranks(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {mode: _fit(TwoBPStrategy(schedule="1f1b"), world, mode) for mode in MODES}
    # rank 0 holds the backbone and a trainable Linear
    strategy = dict(schedule="1f1b", balance=[3, 2])
    out["backbone"] = _fit_backbone(TwoBPStrategy(**strategy), world)
    return out | {"backbone-rates": _fit_backbone(TwoBPStrategy(**strategy), world, rates=True)}


def test_a_layer_frozen_or_unfrozen_during_fit_trains_as_in_one_process(no_leftover_process_group):
    init = {n: q.detach().clone() for n, q in Regressor().named_parameters()}
    ref = {mode: _fit("auto", 1, mode) for mode in MODES}
    ref |= {"backbone": _fit_backbone("auto", 1), "backbone-rates": _fit_backbone("auto", 1, rates=True)}
    outs = run_distributed(_ranks, 2, timeout=240)
    for mode in (*MODES, "backbone", "backbone-rates"):
        seen = set()
        for out in outs:
            for name, value in out[mode].items():
                seen.add(name)
                torch.testing.assert_close(value, ref[mode][name], rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
        assert seen == set(ref[mode])
        if mode.startswith("backbone"):
            continue
        if mode == "frozen-stage":  # refused at setup before ("would hold no trainable parameters")
            assert torch.equal(ref[mode]["layers.0.weight"], init["layers.0.weight"])
            assert not torch.equal(ref[mode][f"layers.{LAYER}.weight"], init[f"layers.{LAYER}.weight"])
            continue
        frozen = f"layers.{LAYER}.weight"
        moved = not torch.equal(ref[mode][frozen], init[frozen])
        assert moved == (mode == "unfreeze")  # frozen from step 0: untouched; unfrozen at step 2: trained


class UnfreezeSecond(pl.Callback):
    """Gradual unfreezing: ``layers.2`` (on stage 1, with ``layers.0`` on stage 0 frozen throughout) is
    unfrozen before step 2, so stage 1's output starts to require grad; ``reset`` tells the strategy."""

    def __init__(self, reset: bool) -> None:
        self.reset = reset

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            pl_module.layers[2].requires_grad_(True)
            if self.reset and isinstance(trainer.strategy, TwoBPStrategy):
                trainer.strategy.reset_shapes()


def _gradual(strategy, devices: int, reset: bool) -> dict:
    model = Regressor((6, 16, 16, 16, 2))
    model.layers[0].requires_grad_(False)
    model.layers[2].requires_grad_(False)
    trainer = quiet_trainer(strategy, devices, max_steps=4, callbacks=[UnfreezeSecond(reset)])
    try:
        trainer.fit(model, regression_data(n=32))
    except Exception as err:  # noqa: BLE001 - the refusal is the result
        return {"error": str(err)}
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


def _gradual_ranks(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    # the V: rank 1 holds stages 1 (layers 1-2) and 2 (layers 3-4), handed over without a message
    v = dict(schedule="zb-v", balance=[1, 2, 2, 2])
    # the refusal last: it closes the process groups (engine/failure.py) for any later Trainer call
    return {reset: _gradual(TwoBPStrategy(**v), world, reset) for reset in (True, False)}


def test_a_stage_unfrozen_behind_frozen_ones_is_refused_or_followed_after_reset_shapes(no_leftover_process_group):
    """Unfreezing a stage behind frozen ones changes what the stages exchange (its output now requires
    grad), which only the first stage's rank would see: between two stages of one rank its gradient was
    dropped and the layer silently never trained. Now refused, naming ``reset_shapes()``; with it, exact."""
    ref = _gradual("auto", 1, False)
    outs = run_distributed(_gradual_ranks, 2, timeout=240)
    assert any("trainer.strategy.reset_shapes()" in out[False].get("error", "") for out in outs), outs
    seen = set()
    for out in outs:
        for name, value in out[True].items():
            seen.add(name)
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert seen == set(ref)
