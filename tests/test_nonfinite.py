"""A NaN or inf anywhere in the pipeline is seen by every rank in the same step: training stops on every
rank naming the step, the stages and the micro-batch (``on_nonfinite="stop"``, the default), or the
step is skipped everywhere (``"skip"``); the weights never drift apart."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import NonFiniteError, TwoBPStrategy
from lightning_twobp.testing import free_port, rank_env, run_distributed

pytestmark = pytest.mark.dist

BATCH, M, BAD_STEP, BAD_MB = 8, 4, 2, 1


class Net(pl.LightningModule):
    def __init__(self, inf_on_first_stage_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
        self.inf_at = inf_on_first_stage_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self):
        # an overflow in one gradient of the first stage only (the loss stays finite)
        strategy = self.trainer.strategy
        if self.global_step == self.inf_at and getattr(strategy, "is_first_stage", True):
            grad = self.layers[0].weight.grad
            grad = grad.to_local() if isinstance(grad, DTensor) else grad  # data_parallel="shard": its rows
            grad.view(-1)[0] = float("inf")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class SkipAt(pl.Callback):
    """One process: what skipping the step means (no parameter has a gradient at that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            for q in pl_module.parameters():
                q.grad = None


def _data(nan: bool) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
    if nan:  # one sample of micro-batch BAD_MB of the batch at global step BAD_STEP
        x[BAD_STEP * BATCH + BAD_MB * (BATCH // M), 3] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def _trainer(devices, strategy, max_steps, callbacks=(), **kw):
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=list(callbacks),
        **{"enable_checkpointing": False, **kw},
    )


def _weights(model) -> dict:
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


def _fit(rank: int, world: int, port: int, kwargs: dict, nan_data: bool, inf_at: int | None) -> dict:
    rank_env(rank, world, port)
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


def _anomaly(rank: int, world: int, port: int) -> str:
    rank_env(rank, world, port)
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


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2"])  # checked before the step; after it (post-validation)
def test_a_nan_loss_stops_every_rank_naming_step_stages_and_microbatch(schedule):
    out = run_distributed(_fit, 2, free_port(), dict(schedule=schedule), True, None, timeout=180)
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


@pytest.mark.parametrize("data_parallel", ["replicate", "shard"])
def test_skip_drops_the_step_on_every_stage_and_replica(data_parallel):
    # 2 pipelines x 2 stages; the inf is on the first stage of both replicas' pipelines (sharded: in
    # each replica's own rows of the weight, seen by the check's sum over every rank)
    out = run_distributed(
        _fit,
        4,
        free_port(),
        dict(schedule="1f1b", pipeline_degree=2, on_nonfinite="skip", data_parallel=data_parallel),
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
    seen = run_distributed(_anomaly, 2, free_port(), timeout=180)
    assert "trained on" not in seen, seen
    assert any("returned nan values" in s for s in seen), seen  # torch's anomaly message, on the rank it arose


def test_on_nonfinite_is_checked_at_construction():
    with pytest.raises(ValueError, match="on_nonfinite='ignore': choose 'stop'"):
        TwoBPStrategy(on_nonfinite="ignore")


def _fit_saving(rank: int, world: int, port: int, folder: str) -> str:
    from lightning.pytorch.callbacks import ModelCheckpoint

    rank_env(rank, world, port)
    saving = ModelCheckpoint(
        dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last=True, save_on_exception=True
    )
    trainer = _trainer(
        world, TwoBPStrategy(num_microbatches=M, schedule="zb-h2"), 5, [saving], enable_checkpointing=True
    )
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(Net(), _data(True))
    return str(info.value)


def test_weights_known_not_finite_are_never_saved(tmp_path):
    """zb-h2 without clipping takes the NaN step before its check: neither the step's checkpoint nor
    save_on_exception's nor last.ckpt may hold those weights, and the error says what is on disk."""
    from lightning_twobp.lightning import checkpoint as ckpt

    errors = run_distributed(_fit_saving, 2, free_port(), str(tmp_path), timeout=180)
    for err in errors:
        assert "the step was taken before the check" in err and "no checkpoint is written from them" in err, err
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"], saved  # nothing after step 2
    for name in saved:
        weights = ckpt.consolidate(tmp_path / name, tmp_path / f"{name}.pt")["state_dict"]
        (tmp_path / f"{name}.pt").unlink()
        assert all(torch.isfinite(t).all() for t in weights.values()), name
