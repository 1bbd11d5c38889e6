"""Consecutive training steps overlap under the Trainer: no collective inside a step, the loss and logs
arrive without one, and clipping by post-validation gives bitwise the parameters of checking first."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_twobp import TwoBPStrategy

import conftest
from conftest import Regressor, launch, lightning_env, own_weights, quiet_trainer, regression_data

pytestmark = pytest.mark.dist


class Net(Regressor):
    """The shared regressor under AdamW with the learning rate moving every step, logging its batch index
    too, and an overflow on the last stage only at step ``inf_at``: every rank must skip that step."""

    def __init__(self, inf_at: int | None = None) -> None:
        super().__init__(optimizer=torch.optim.AdamW, lr=0.05)
        self.inf_at = inf_at

    def training_step(self, batch, batch_idx):
        self.log("batch_idx", batch_idx)
        return super().training_step(batch, batch_idx)

    def on_after_backward(self):
        if self.global_step == self.inf_at and self.trainer.strategy.is_last_stage:
            q = next(q for q in self.layers.parameters() if not q.is_meta and q.grad is not None)
            q.grad.view(-1)[0] = float("inf")

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.8), "interval": "step"},
        }


class _CountCollectives(pl.Callback):
    """Counts collective calls from the second training step on (the first agrees on shapes). Lightning's
    own broadcast of its SIGTERM flag from rank 0 before every batch is left out: only the other ranks
    wait on it, for rank 0, which holds the first stage they wait on anyway. So is the preemption flags'
    all-reduce (lightning/preemption.py): asynchronous, on a gloo group of its own, read a step later."""

    NAMES = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object", "barrier")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.groups: dict[str, set[str]] = {}  # the post-validation reduce's and the shape signature's groups
        self._undo: list[tuple[object, str, object]] = []  # (module, name, what it held), restored in reverse

    def _patch(self, module: object, name: str, fn: object) -> None:
        self._undo.append((module, name, getattr(module, name)))
        setattr(module, name, fn)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self._watch_groups(trainer.strategy)
            for name in self.NAMES:
                fn = getattr(dist, name)

                def counted(*a, _fn=fn, _name=name, **k):
                    if not _left_out():
                        self.calls[_name] = self.calls.get(_name, 0) + 1
                    return _fn(*a, **k)

                self._patch(dist, name, counted)

    def _watch_groups(self, strategy) -> None:
        """The group each all-reduce and stage 0's shape signature travel on, by the strategy's name for it:
        on NCCL a group's operations run in order, so on ``"pp"`` they held the step's sends back
        (lightning/layout.py, SideGroups). The signature's sends and receives are seen where torch's
        point-to-point calls are made (``isend`` / ``irecv`` in both of torch's modules: a batch's ``P2POp``
        checks its op against them)."""
        from lightning_twobp.engine.p2p import _SIGNATURE_TAG

        names = {"pp": strategy.group("pp"), "checks": strategy.check_group, "shapes": strategy.shape_group}
        names |= {"logs": strategy.log_group, "io": strategy.io_group}

        def seen(kind: str, group) -> None:
            name = next((n for n, g in names.items() if g is group), "other")
            self.groups.setdefault(kind, set()).add(name)

        reduce = dist.all_reduce

        def all_reduce(*a, **k):
            if not _left_out():
                seen("all_reduce", k.get("group"))
            return reduce(*a, **k)

        self._patch(dist, "all_reduce", all_reduce)
        for name in ("isend", "irecv"):
            fn = getattr(dist.distributed_c10d, name)

            def p2p(*a, _fn=fn, **k):
                if k.get("tag") == _SIGNATURE_TAG:
                    seen("signature", k.get("group"))
                return _fn(*a, **k)

            self._patch(dist, name, p2p)
            self._patch(dist.distributed_c10d, name, p2p)

    def on_train_end(self, trainer, pl_module):
        for module, name, fn in reversed(self._undo):
            setattr(module, name, fn)
        self._undo = []


def _left_out() -> bool:
    """Lightning's SIGTERM broadcast and the preemption flags' all-reduce (see _CountCollectives)."""
    import traceback

    return any(f.name in ("_broadcast_sigterm_tensor", "agree") for f in traceback.extract_stack(limit=5))


class _Logged(pl.Callback):
    """The train_loss every rank sees after each step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _fit(rank: int, world: int, strategy_kwargs: dict, clip: float | None, inf_at: int | None) -> dict:
    lightning_env(rank, world)
    model, counter, logged = Net(inf_at), _CountCollectives(), _Logged()
    strategy = TwoBPStrategy(**strategy_kwargs)
    trainer = quiet_trainer(strategy, world, max_steps=6, gradient_clip_val=clip, callbacks=[counter, logged])
    trainer.fit(model, regression_data(scale=3.0))
    return {
        "params": own_weights(model),
        "calls": counter.calls,
        "groups": counter.groups,
        "losses": logged.losses,
        "checks": trainer.strategy.step_checks,
    }


def _reference(clip: float | None) -> list[float]:
    logged = _Logged()
    quiet_trainer(max_steps=6, gradient_clip_val=clip, callbacks=[logged]).fit(Net(), regression_data(scale=3.0))
    return logged.losses


def _both_ways(rank: int, world: int, kwargs: dict, clip: float | None, inf_at: int | None) -> tuple[dict, dict]:
    """Checking first, then stepping first and checking after."""
    first = _fit(rank, world, dict(kwargs, post_validation=False), clip, inf_at)
    return first, _fit(rank, world, dict(kwargs, post_validation=True), clip, inf_at)


ZB_H2 = dict(schedule="zb-h2", num_microbatches=4)
ASYNC = "test_one_async_check_per_step_and_the_logged_loss_is_one_process_loss"
CLIP = "test_clipping_by_post_validation_rides_on_the_same_reduce"
BITWISE = "test_post_validation_is_bitwise_checking_first"
SCHEDULES = ["zb-h2", "zb-v"]
CHECKS = [(0.3, None), (0.3, 2), (None, None)]


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """Every case in one launch of 2 ranks: a test's first call may wait for all of them."""
    cases = {ASYNC: (_fit, (ZB_H2, None, None)), CLIP: (_fit, (ZB_H2, 0.5, None))}
    for schedule in SCHEDULES:
        kwargs = dict(schedule=schedule, num_microbatches=4, on_nonfinite="skip")
        for clip, inf_at in CHECKS:
            cases[f"{BITWISE}[{clip}-{inf_at}-{schedule}]"] = (_both_ways, (kwargs, clip, inf_at))
    return launch(request, 2, cases, timeout=840)


def test_one_async_check_per_step_and_the_logged_loss_is_one_process_loss(two_ranks):
    out = two_ranks[ASYNC]
    for r in out:
        # steps 2..6: the pipeline's own messages, and the non-finite check's all-reduce, started
        # asynchronously right before each optimizer step and waited for after the next pipeline step
        assert r["calls"] == {"all_reduce": 5}, r["calls"]
        # neither waits on the schedule's group, where on NCCL it would hold the next step's sends back
        assert r["groups"] == {"all_reduce": {"checks"}, "signature": {"shapes"}}, r["groups"]
    ref = _reference(None)
    for r in out:  # every rank logs the last stage's loss, for every step
        assert r["losses"] == pytest.approx(ref, rel=1e-5)


def test_clipping_by_post_validation_rides_on_the_same_reduce(two_ranks):
    for r in two_ranks[CLIP]:
        assert r["calls"] == {"all_reduce": 5}, r["calls"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("clip, inf_at", CHECKS)
def test_post_validation_is_bitwise_checking_first(two_ranks, request, schedule, clip, inf_at):
    # Steps that clip, a step with an overflow on one stage, and the learning rate moving every step:
    # stepping first and checking after gives bitwise the parameters of checking first.
    runs = two_ranks[request.node.name]
    first, after = [a for a, _ in runs], [b for _, b in runs]
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
    if clip is not None and inf_at is None:
        # and both equal one process (which clips by the same global norm) up to float order
        assert first[0]["losses"] == pytest.approx(_reference(clip), rel=1e-5)
