"""Consecutive training steps overlap under the Trainer: no collective inside a step, the loss and logs
arrive without one, and clipping by post-validation gives bitwise the parameters of checking first."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_twobp import TwoBPStrategy

import conftest
from conftest import Regressor, launch, lightning_env, quiet_trainer, regression_data

# The tests share one launch of ranks (the fixture at the end): a test's first call may wait for it.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


class Net(Regressor):
    def __init__(self, inf_at: int | None = None) -> None:
        super().__init__()
        self.inf_at = inf_at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("batch_idx", batch_idx)
        return loss

    def on_after_backward(self):
        # An overflow on the last stage only, at one step: every rank must skip that step.
        if self.global_step == self.inf_at and self.trainer.strategy.is_last_stage:
            q = next(q for q in self.layers.parameters() if not q.is_meta and q.grad is not None)
            q.grad.view(-1)[0] = float("inf")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.8), "interval": "step"},
        }


def _data() -> DataLoader:
    return regression_data(scale=3.0)


class _CountCollectives(pl.Callback):
    """Counts collective calls from the second training step on (the first agrees on shapes). Lightning's
    own broadcast of its SIGTERM flag from rank 0 before every batch is left out: only the other ranks
    wait on it, for rank 0, which holds the first stage they wait on anyway."""

    NAMES = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object", "barrier")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._saved: dict[str, object] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            for name in self.NAMES:
                fn = getattr(dist, name)
                self._saved[name] = fn

                def counted(*a, _fn=fn, _name=name, **k):
                    import traceback

                    if not any(f.name == "_broadcast_sigterm_tensor" for f in traceback.extract_stack(limit=4)):
                        self.calls[_name] = self.calls.get(_name, 0) + 1
                    return _fn(*a, **k)

                setattr(dist, name, counted)

    def on_train_end(self, trainer, pl_module):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _fit(rank: int, world: int, strategy_kwargs: dict, clip: float | None, inf_at: int | None) -> dict:
    lightning_env(rank, world)
    model = Net(inf_at)
    counter = _CountCollectives()
    seen: list[float] = []

    class _Logged(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(trainer.callback_metrics["train_loss"]))

    trainer = quiet_trainer(
        TwoBPStrategy(**strategy_kwargs), world, max_steps=6, gradient_clip_val=clip, callbacks=[counter, _Logged()]
    )
    trainer.fit(model, _data())
    return {
        "params": {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta},
        "calls": counter.calls,
        "losses": seen,
        "checks": trainer.strategy.step_checks,
    }


def _reference(clip: float | None) -> list[float]:
    model = Net()
    losses: list[float] = []

    class _Logged(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train_loss"]))

    trainer = quiet_trainer(max_steps=6, gradient_clip_val=clip, callbacks=[_Logged()])
    trainer.fit(model, _data())
    return losses


OVERLAPPED = dict(schedule="zb-h2", num_microbatches=4)


def test_one_async_check_per_step_and_the_logged_loss_is_one_process_loss(two_ranks, request):
    out = two_ranks[request.node.name]
    for r in out:
        # steps 2..6: the pipeline's own messages, and the non-finite check's all-reduce, started
        # asynchronously right before each optimizer step and waited for after the next pipeline step
        assert r["calls"] == {"all_reduce": 5}, r["calls"]
    ref = _reference(None)
    for r in out:  # every rank logs the last stage's loss, for every step
        assert r["losses"] == pytest.approx(ref, rel=1e-5)


def test_clipping_by_post_validation_rides_on_the_same_reduce(two_ranks, request):
    out = two_ranks[request.node.name]
    for r in out:
        assert r["calls"] == {"all_reduce": 5}, r["calls"]


SCHEDULES = ["zb-h2", "zb-v"]
CLIPS = [(0.3, None), (0.3, 2), (None, None)]


def _checked_first_and_after(rank: int, world: int, schedule: str, clip: float | None, inf_at: int | None) -> dict:
    kwargs = dict(schedule=schedule, num_microbatches=4, on_nonfinite="skip")
    return {
        "first": _fit(rank, world, dict(kwargs, post_validation=False), clip, inf_at),
        "after": _fit(rank, world, dict(kwargs, post_validation=True), clip, inf_at),
    }


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("clip, inf_at", CLIPS)
def test_post_validation_is_bitwise_checking_first(two_ranks, request, schedule, clip, inf_at):
    # Steps that clip, a step with an overflow on one stage, and the learning rate moving every step:
    # stepping first and checking after gives bitwise the parameters of checking first.
    runs = two_ranks[request.node.name]
    first, after = [r["first"] for r in runs], [r["after"] for r in runs]
    for a, b in zip(first, after, strict=False):
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["losses"] == b["losses"]
        assert all(torch.isfinite(q).all() for q in b["params"].values())
        assert a["checks"]["redone"] == 0 and a["checks"]["skipped"] == b["checks"]["skipped"] == (inf_at is not None)
        assert a["checks"]["clipped"] == b["checks"]["clipped"]
        if clip is not None:
            assert (
                b["checks"]["clipped"] > 0 and b["checks"]["redone"] == b["checks"]["clipped"] + b["checks"]["skipped"]
            )
    if clip is not None:
        # and both equal one process (which clips by the same global norm) up to float order
        ref = _reference(clip) if inf_at is None else None
        if ref is not None:
            assert first[0]["losses"] == pytest.approx(ref, rel=1e-5)


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """Every case of this module, in one launch of 2 ranks."""
    cases = {
        "test_one_async_check_per_step_and_the_logged_loss_is_one_process_loss": (_fit, (OVERLAPPED, None, None)),
        "test_clipping_by_post_validation_rides_on_the_same_reduce": (_fit, (OVERLAPPED, 0.5, None)),
    }
    for clip, inf_at in CLIPS:
        for schedule in SCHEDULES:  # pytest's id: the last parametrize's values first
            name = f"test_post_validation_is_bitwise_checking_first[{clip}-{inf_at}-{schedule}]"
            cases[name] = (_checked_first_and_after, (schedule, clip, inf_at))
    return launch(request, 2, cases, timeout=840)
