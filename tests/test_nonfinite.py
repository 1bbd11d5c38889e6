"""A NaN or inf anywhere in the pipeline is seen by every rank in the same step: training stops on every
rank naming the step, the stages and the micro-batch (``on_nonfinite="stop"``, the default), or the
step is skipped everywhere (``"skip"``); the weights never drift apart."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import NonFiniteError, TwoBPStrategy
from lightning_twobp.testing import run_distributed

import conftest
from conftest import Regressor, launch, lightning_env, own_weights, quiet_trainer, regression_data

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

BATCH, M, BAD_STEP, BAD_MB = 8, 4, 2, 1


class Net(Regressor):
    def __init__(self, inf_on_first_stage_at: int | None = None) -> None:
        super().__init__(optimizer=torch.optim.Adam, lr=0.01)
        self.inf_at = inf_on_first_stage_at

    def on_after_backward(self):
        # an overflow in one gradient of the first stage only (the loss stays finite)
        strategy = self.trainer.strategy
        if self.global_step == self.inf_at and getattr(strategy, "is_first_stage", True):
            self.layers[0].weight.grad.view(-1)[0] = float("inf")


class SkipAt(pl.Callback):
    """One process: what skipping the step means (no parameter has a gradient at that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            for q in pl_module.parameters():
                q.grad = None


def _data(nan: bool) -> DataLoader:
    loader = regression_data(64, batch_size=BATCH)
    if nan:  # one sample of micro-batch BAD_MB of the batch at global step BAD_STEP
        loader.dataset.tensors[0][BAD_STEP * BATCH + BAD_MB * (BATCH // M), 3] = float("nan")
    return loader


def _trainer(devices, strategy, max_steps, callbacks=(), **kw):
    return quiet_trainer(strategy, devices, max_steps=max_steps, callbacks=list(callbacks), **kw)


_weights = own_weights


def _fit(rank: int, world: int, kwargs: dict, nan_data: bool, inf_at: int | None) -> dict:
    lightning_env(rank, world)
    model = Net(inf_at)
    logged: list[float] = []

    class _Skipped(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append(float(trainer.callback_metrics.get("pipeline/skipped_steps", 0.0)))

    trainer = _trainer(world, TwoBPStrategy(num_microbatches=M, **kwargs), 5, [_Skipped()])
    try:
        trainer.fit(model, _data(nan_data))
        error = None
    except NonFiniteError as err:
        error = str(err)
    return {
        "error": error,
        "weights": _weights(model),
        "step": trainer.global_step,
        "checks": trainer.strategy.step_checks,
        "logged": logged,
    }


def _anomaly(rank: int, world: int) -> str:
    lightning_env(rank, world)
    trainer = _trainer(world, TwoBPStrategy(num_microbatches=M, pipeline_timeout=60), 5, detect_anomaly=True)
    try:
        trainer.fit(Net(), _data(True))
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(err).__name__}: {err}"
    return "trained on"


def _reference(steps: int, skip_at: int | None = None) -> dict:
    model = Net()
    _trainer(1, "auto", steps, [SkipAt(skip_at)] if skip_at is not None else []).fit(model, _data(False))
    return _weights(model)


NAN_SCHEDULES = ["1f1b", "zb-h2"]  # checked before the step; after it (post-validation)


@pytest.mark.parametrize("schedule", NAN_SCHEDULES)
def test_a_nan_loss_stops_every_rank_naming_step_stages_and_microbatch(nan_losses, request, schedule):
    out = nan_losses[request.node.name]
    ref = _reference(BAD_STEP)  # the weights before the bad step: it changed nothing
    for rank, r in enumerate(out):
        err = r["error"]
        assert err is not None, f"rank {rank} trained on"
        assert f"global step {BAD_STEP}" in err and "pipeline rank(s) [0, 1]" in err, err
        assert f"micro-batch {BAD_MB}" in err and "on_nonfinite='skip'" in err and "detect_anomaly" in err, err
        if schedule == "zb-h2":  # post-validation without clipping keeps no copy: the step stood
            assert "the step was taken before the check" in err, err
            continue
        assert "the step was not taken on any rank" in err, err
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


def test_skip_drops_the_step_on_every_stage_and_replica():
    # 2 pipelines x 2 stages; the inf is on the first stage of both replicas' pipelines
    out = run_distributed(
        _fit,
        4,
        dict(schedule="1f1b", pipeline_degree=2, on_nonfinite="skip"),
        False,
        BAD_STEP,
        timeout=240,
    )
    ref = _reference(5, skip_at=BAD_STEP)
    for rank, r in enumerate(out):
        assert r["error"] is None and r["step"] == 5
        assert r["checks"]["skipped"] == 1, r["checks"]
        assert r["logged"][BAD_STEP + 1 :] == [1.0] * (5 - BAD_STEP - 1), r["logged"]
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    for rank in (2, 3):  # the replicas hold bitwise the same weights
        for name, value in out[rank]["weights"].items():
            assert torch.equal(value, out[rank - 2]["weights"][name]), f"replica of rank {rank - 2}: {name}"


def test_detect_anomaly_names_the_operation_and_stops_every_rank():
    seen = run_distributed(_anomaly, 2, timeout=180)
    assert "trained on" not in seen, seen
    assert any("returned nan values" in s for s in seen), seen  # torch's anomaly message, on the rank it arose


def test_on_nonfinite_is_checked_at_construction():
    with pytest.raises(ValueError, match="on_nonfinite='ignore': choose 'stop'"):
        TwoBPStrategy(on_nonfinite="ignore")


@pytest.fixture(scope="module")
def nan_losses(request) -> conftest.Launch:
    """The NaN-loss cases in one launch: each stops every rank at the same step, leaving the group usable."""
    cases = {
        f"test_a_nan_loss_stops_every_rank_naming_step_stages_and_microbatch[{s}]": (
            _fit,
            (dict(schedule=s), True, None),
        )
        for s in NAN_SCHEDULES
    }
    return launch(request, 2, cases, timeout=600)
