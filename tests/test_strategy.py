"""Trainer(strategy="twobp") against strategy="auto" on one process, and the errors before compute."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.testing import run_distributed

pytestmark = pytest.mark.dist


class Regressor(pl.LightningModule):
    """An ordinary LightningModule: nothing in it knows about pipelines."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
        )
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layers(x * 2.0), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    y = torch.randn(64, 2, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _trainer(strategy, devices: int, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=kw.pop("max_steps", 3), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        # Lightning shuffles training data whenever it installs a DistributedSampler; the comparison
        # needs the reference's order (every rank of one pipeline reads the same batches either way).
        use_distributed_sampler=False, **kw,
    )


def _fit_pipelined(rank: int, world: int, strategy_kwargs: dict, trainer_kwargs: dict) -> dict:
    # Processes exist already (as under torchrun): Lightning's environment reads these.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    model = Regressor()
    trainer = _trainer(TwoBPStrategy(**strategy_kwargs), world, **trainer_kwargs)
    trainer.fit(model, _data())
    params = {n: q.detach().clone() for n, q in model.named_parameters()}
    return {"params": params, "train_loss": float(trainer.callback_metrics["train_loss"])}


def _reference(**trainer_kwargs) -> tuple[dict, float]:
    model = Regressor()
    trainer = _trainer("auto", 1, **trainer_kwargs)
    trainer.fit(model, _data())
    return {n: q.detach() for n, q in model.named_parameters()}, float(trainer.callback_metrics["train_loss"])


@pytest.mark.parametrize(
    "strategy_kwargs, trainer_kwargs",
    [
        (dict(), dict()),
        (dict(schedule="zb-h1", num_microbatches=4), dict()),
        (dict(schedule="gpipe", split_backward=False), dict(accumulate_grad_batches=2, max_steps=2)),
        (dict(schedule="zb-v", num_microbatches=2), dict(gradient_clip_val=0.05, gradient_clip_algorithm="value")),
    ],
    ids=["1f1b-2bp", "zb-h1", "gpipe-accumulate", "zb-v-clip-value"],
)
def test_fit_matches_one_process(strategy_kwargs, trainer_kwargs):
    ref, ref_loss = _reference(**trainer_kwargs)
    results = run_distributed(_fit_pipelined, 2, strategy_kwargs, trainer_kwargs, timeout=180)
    seen = set()
    for out in results:
        assert out["train_loss"] == pytest.approx(ref_loss, rel=1e-5), "logged train_loss is not the batch mean"
        for name, value in out["params"].items():
            seen.add(name)
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert seen == set(ref), "every parameter lives on exactly one rank"
    assert all(set(results[0]["params"]).isdisjoint(r["params"]) for r in results[1:])


class TwoSequentials(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(2, 2))


class Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _expect_error(rank: int, world: int, model_cls, strategy_kwargs: dict, trainer_kwargs: dict, batch: int) -> str:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    x = torch.randn(16, 6)
    loader = DataLoader(TensorDataset(x, torch.randn(16, 2)), batch_size=batch)
    try:
        _trainer(TwoBPStrategy(**strategy_kwargs), world, **trainer_kwargs).fit(model_cls(), loader)
    except Exception as e:  # the same error on every rank, before any pipeline step
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "model_cls, strategy_kwargs, trainer_kwargs, batch, match",
    [
        (Regressor, dict(num_microbatches=3), dict(), 8, "batch size 8 does not split into 3 micro-batches"),
        (TwoSequentials, dict(), dict(), 8, r"holds 2 nn.Sequential modules \(head, layers\)"),
        (Manual, dict(), dict(), 8, "automatic optimization only"),
        (Regressor, dict(balance=[4, 4, 1]), dict(), 8, r"balance=\[4, 4, 1\] has 3 entries for 2 stages"),
        (Regressor, dict(), dict(gradient_clip_val=1.0), 8, "global norm across pipeline stages"),
        (Regressor, dict(pipeline_degree=3), dict(), 8, "2 devices cannot be split into pipelines of 3"),
    ],
    ids=["batch", "two-sequentials", "manual", "balance", "clip-norm", "degree"],
)
def test_errors_before_compute(model_cls, strategy_kwargs, trainer_kwargs, batch, match):
    import re

    out = run_distributed(_expect_error, 2, model_cls, strategy_kwargs, trainer_kwargs, batch, timeout=120)
    for msg in out:
        assert re.search(match, msg), msg


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="unknown schedule 'zb-h3'"):
        TwoBPStrategy(schedule="zb-h3")
    with pytest.raises(ValueError, match="split by definition"):
        TwoBPStrategy(schedule="zb-h1", split_backward=False)
