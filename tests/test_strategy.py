"""Trainer(strategy="twobp") against strategy="auto" on one process, and the errors before compute."""

from __future__ import annotations

import functools
import math
import os
import random
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp import TwoBPStrategy
from lightning_twobp.processes import run_distributed

import conftest
from conftest import launch, lightning_env, own_weights, quiet_trainer, regression_data

# The tests of one world size share one launch of ranks (the fixtures below): a test's first call may
# wait for the whole launch.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


class Regressor(conftest.Regressor):
    """Four linear layers on inputs doubled: nothing in it knows about pipelines."""

    def __init__(self, lr: float = 0.1, layers: Callable[[], nn.Module] | None = None) -> None:
        super().__init__((6, 16, 16, 16, 2), lr=lr, scale=2.0, layers=layers)


_trained = own_weights


def _eval_data() -> DataLoader:
    """20 samples in batches of 6: uneven micro-batches, and a last batch of 2 (< m)."""
    return regression_data(20, batch_size=6, seed=2)


def _evaluate(model, strategy, devices) -> tuple[float, torch.Tensor | None]:
    trainer = _trainer(strategy, devices)
    metrics = trainer.validate(model, _eval_data(), verbose=False)
    preds = trainer.predict(model, _eval_data())
    joined = None if preds is None or any(p is None for p in preds) else torch.cat(preds)
    return metrics[0]["val_loss"], joined


def _eval_pipelined(rank: int, world: int, strategy_kwargs: dict) -> tuple:
    lightning_env(rank, world)
    return _evaluate(Regressor(), TwoBPStrategy(**strategy_kwargs), world)


EVALS = {"1f1b": dict(), "zb-v": dict(schedule="zb-v")}


@pytest.mark.parametrize("case", list(EVALS))
def test_validate_and_predict_match_one_process(two_ranks, request, case):
    ref_loss, ref_preds = _evaluate(Regressor(), "auto", 1)
    results = two_ranks[request.node.name]
    for val_loss, _preds in results:
        assert val_loss == pytest.approx(ref_loss, rel=1e-5), "val_loss must be the mean over each batch"
    # predictions come back on the rank holding the last stage (rank 0 on the V, else the last rank)
    last = [p for _, p in results if p is not None]
    assert len(last) == 1
    torch.testing.assert_close(last[0], ref_preds, rtol=1e-5, atol=1e-6)


_data = regression_data


def _trainer(strategy, devices: int, **kw) -> pl.Trainer:
    if kw.get("plugins") == "fp16-scaler":
        from lightning.pytorch.plugins import MixedPrecision

        kw["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))]
    # Lightning shuffles training data whenever it installs a DistributedSampler; the comparison needs
    # the reference's order (every rank of one pipeline reads the same batches either way).
    return quiet_trainer(strategy, devices, max_steps=kw.pop("max_steps", 3), **kw)


class _Deferred(pl.Callback):
    """The strategy's deferred_fraction as a callback reads it during training."""

    value = None

    def on_train_batch_end(self, trainer, *args) -> None:
        self.value = trainer.strategy.deferred_fraction


def _fit_pipelined(rank: int, world: int, strategy_kwargs: dict, trainer_kwargs: dict) -> dict:
    lightning_env(rank, world)
    model, deferred = Regressor(), _Deferred()
    loader = trainer_kwargs.pop("loader", {})
    trainer = _trainer(TwoBPStrategy(**strategy_kwargs), world, callbacks=[deferred], **trainer_kwargs)
    trainer.fit(model, _data(**loader))
    params = _trained(model)
    return {"params": params, "train_loss": float(trainer.callback_metrics["train_loss"]), "deferred": deferred.value}


def _reference(**trainer_kwargs) -> tuple[dict, float]:
    model = Regressor()
    loader = trainer_kwargs.pop("loader", {})
    trainer = _trainer("auto", 1, **trainer_kwargs)
    trainer.fit(model, _data(**loader))
    return {n: q.detach() for n, q in model.named_parameters()}, float(trainer.callback_metrics["train_loss"])


FITS = {
    # Lightning's default use_distributed_sampler=True: with one data replica the loader (shuffle=False)
    # is read in its own order, as one process reads it (not by a shuffling DistributedSampler)
    "1f1b-2bp": (dict(), dict(use_distributed_sampler=True), 1e-5),
    "zb-h1": (dict(schedule="zb-h1", num_microbatches=4), dict(), 1e-5),
    "gpipe-accumulate": (
        dict(schedule="gpipe", split_backward=False),
        dict(accumulate_grad_batches=2, max_steps=2),
        1e-5,
    ),
    "zb-v-clip-value": (
        dict(schedule="zb-v", num_microbatches=2),
        dict(gradient_clip_val=0.05, gradient_clip_algorithm="value"),
        1e-5,
    ),
    "zb-h2-clip-norm": (dict(schedule="zb-h2"), dict(gradient_clip_val=0.05), 1e-5),  # by norm: the global norm
    # bf16 autocast: the pipeline and one process round differently (per micro-batch vs whole
    # batch matmuls), so 2e-2 relative, as bf16's 8-bit mantissa allows after 3 steps.
    "bf16-mixed": (dict(), dict(precision="bf16-mixed"), 2e-2),
    # fp16 with a GradScaler (Lightning attaches one on GPU; here given explicitly on CPU)
    "fp16-scaler": (dict(schedule="zb-h1"), dict(plugins="fp16-scaler", gradient_clip_val=0.05), 1e-2),
    "interleaved-2bp": (dict(schedule="interleaved-1f1b"), dict(), 1e-5),
    "1f1b-fused": (dict(schedule="1f1b", split_backward=False), dict(), 1e-5),
    # capped deferral (issue 20): at most one W waits per stage, so some W run before later F
    "1f1b-2bp-capped": (dict(schedule="1f1b", num_microbatches=4, max_pending_w=1), dict(), 1e-5),
    # every block under torch.utils.checkpoint(use_reentrant=False) for the Trainer call (issue 21)
    "zb-h1-checkpointed": (dict(schedule="zb-h1", activation_checkpointing="full"), dict(), 1e-5),
    # a loader with worker processes, in ranks run_distributed started (daemonic ranks could not start them)
    "zb-h1-loader-workers": (dict(schedule="zb-h1"), dict(loader=dict(num_workers=1)), 1e-5),
}


@pytest.mark.parametrize("case", list(FITS))
def test_fit_matches_one_process(two_ranks, request, case):
    strategy_kwargs, trainer_kwargs, rtol = FITS[case]
    ref, ref_loss = _reference(**trainer_kwargs)
    results = two_ranks[request.node.name]
    seen = set()
    for out in results:
        # a fused schedule has no W: NaN, not a 1.0 that reads as "all deferred"
        assert math.isnan(out["deferred"]) == (strategy_kwargs.get("split_backward") is False), out["deferred"]
        assert out["train_loss"] == pytest.approx(ref_loss, rel=rtol), "logged train_loss is not the batch mean"
        for name, value in out["params"].items():
            seen.add(name)
            torch.testing.assert_close(value, ref[name], rtol=rtol, atol=rtol / 10, msg=name)
    assert seen == set(ref), "every parameter lives on exactly one rank"
    assert all(set(results[0]["params"]).isdisjoint(r["params"]) for r in results[1:])


class _Fp32Linear(nn.Linear):
    """A Linear computed in fp32 with autocast off, as mixed-precision code keeps a router or a head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return super().forward(x.float())


def _island() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), _Fp32Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


class _TimeMajor(nn.Module):
    """(batch, 16) as (batch, 4, 4) laid out time-major, as an LSTM's batch-first output is (permuted strides)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 4, 4).transpose(0, 1).contiguous().transpose(0, 1)


def _time_major_at_the_cut() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), _TimeMajor(), nn.Linear(4, 8), nn.Tanh(), nn.Flatten(), nn.Linear(32, 2)
    )


# bf16 against one process on the pipeline's own micro-batches (batch 2, accumulate_grad_batches=4: the
# same products in bf16 and the same sums, in the same order): equal, measured 0.0 ("bf16-true": the
# weights and their sums in bf16 too)
SAME_MICROBATCHES = {
    "mlp-bf16-mixed": (None, "bf16-mixed"),
    "fp32-island-bf16-mixed": (_island, "bf16-mixed"),
    "mlp-bf16-true": (None, "bf16-true"),
    # the first stage ends on a time-major activation: sent in its memory order and received so, as the next
    # layer's bf16 kernel rounds by layout (made contiguous, a trial's LSTM model was 7.1e-5 off one process)
    "time-major-at-the-cut-bf16-mixed": (_time_major_at_the_cut, "bf16-mixed"),
}


def _fit_bf16_pipelined(rank: int, world: int, case: str) -> dict:
    lightning_env(rank, world)
    layers, precision = SAME_MICROBATCHES[case]
    model = Regressor(layers=layers)
    cut = dict(balance=[3, 4]) if layers is _time_major_at_the_cut else {}
    _trainer(TwoBPStrategy(**cut), world, precision=precision).fit(model, _data())
    return _trained(model)


@pytest.mark.parametrize("case", list(SAME_MICROBATCHES))
def test_bf16_matches_one_process_on_the_same_micro_batches(two_ranks, request, case):
    """The backward runs outside the forward's autocast, as in one process: run inside it (the pipeline's
    step is), autograd applied autocast to the backward's own matmuls, and the fp32 Linear's gradients
    were computed in bf16 (2e-4 off after 3 steps). Under "bf16-true" W adds a Linear's gradient as the
    fused backward does (an addmm_ rounded once: 4.9e-4 off)."""
    layers, precision = SAME_MICROBATCHES[case]
    model = Regressor(layers=layers)
    _trainer("auto", 1, precision=precision, accumulate_grad_batches=4).fit(model, regression_data(batch_size=2))
    for out in two_ranks[request.node.name]:
        for name, value in out.items():
            torch.testing.assert_close(value, model.get_parameter(name).detach(), rtol=1e-5, atol=1e-7, msg=name)


class _Flat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def _sparse_layers() -> nn.Module:
    return nn.Sequential(nn.Embedding(20, 4, sparse=True), _Flat(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 2))


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randint(0, 20, (24, 3), generator=g), torch.randn(24, 2, generator=g)), 8)


SPARSE = {"1f1b-2bp": "1f1b", "zb-h2": "zb-h2"}  # zb-h2: the check after the step (post-validation)


class _SparseRegressor(conftest.Regressor):
    """An overridden on_before_optimizer_step: the strategy watches what the hooks do to each gradient."""

    def __init__(self) -> None:
        super().__init__(layers=_sparse_layers)

    def on_before_optimizer_step(self, optimizer) -> None:
        pass


def _fit_sparse_pipelined(rank: int, world: int, schedule: str) -> dict:
    lightning_env(rank, world)
    model = _SparseRegressor()
    _trainer(TwoBPStrategy(schedule=schedule, num_microbatches=4), world).fit(model, _tokens())
    return _trained(model)


@pytest.mark.parametrize("case", list(SPARSE))
def test_sparse_embedding_gradients_match_one_process(two_ranks, request, case):
    """An nn.Embedding(sparse=True) in the pipelined layers (SGD takes sparse gradients): the global check of
    each step reads the norm of its sparse gradient by its values; before, torch's norm raised
    NotImplementedError there on the embedding's rank and the other rank waited on it (PeerLost)."""
    model = conftest.Regressor(layers=_sparse_layers)
    _trainer("auto", 1).fit(model, _tokens())
    outs = two_ranks[request.node.name]
    untrained = conftest.Regressor(layers=_sparse_layers).layers[0].weight
    assert not torch.equal(model.layers[0].weight, untrained), "the embedding trained"
    for out in outs:
        for name, value in out.items():
            torch.testing.assert_close(value, model.get_parameter(name).detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert set(outs[0]) | set(outs[1]) == {n for n, _ in model.named_parameters()}


class _UsesOutAndState(nn.Module):
    """Takes a bare nn.LSTM's ``(out, (h, c))`` whole and uses every part of it: each gets a gradient."""

    def forward(self, x: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        out, (h, c) = x
        return torch.cat([out.flatten(1), h.transpose(0, 1).flatten(1), c.transpose(0, 1).flatten(1)], 1)


def _bare_lstm() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 12),
        nn.Unflatten(1, (3, 4)),
        nn.LSTM(4, 4, batch_first=True),
        _UsesOutAndState(),
        nn.Linear(20, 16),
        nn.Tanh(),
        nn.Linear(16, 2),
    )


# the nested tuple crosses a cut between ranks (1F1B, ZB-H1) and between two stages of one rank (ZB-V's 1 and 2)
NESTED = {
    "1f1b": dict(schedule="1f1b", balance=[3, 4]),
    "zb-h1": dict(schedule="zb-h1", balance=[3, 4]),
    "zb-v": dict(schedule="zb-v", balance=[2, 1, 2, 2], num_microbatches=2),
    # the layers timed one by one, each given the one before's output: the profile handed on the top tuple alone
    "zb-h1-time": dict(schedule="zb-h1", balance="time"),
}


class _Grads(pl.Callback):
    """Each step's gradients of this rank's parameters, as the optimizer gets them."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        named = pl_module.named_parameters()
        self.steps.append({n: q.grad.clone() for n, q in named if not q.is_meta and q.grad is not None})


def _fit_nested(strategy: Any, devices: int) -> tuple[list[dict], float, float]:
    """Gradients of every step, the last step's loss, and the validation loss after the fit."""
    model, grads = Regressor(layers=_bare_lstm), _Grads()
    trainer = _trainer(strategy, devices, callbacks=[grads])
    trainer.fit(model, _data())
    loss = float(trainer.callback_metrics["train_loss"])  # before validate, which clears it
    return grads.steps, loss, float(trainer.validate(model, _eval_data(), verbose=False)[0]["val_loss"])


def _fit_nested_pipelined(rank: int, world: int, case: str) -> tuple[list[dict], float, float]:
    lightning_env(rank, world)
    return _fit_nested(TwoBPStrategy(**NESTED[case]), world)


@pytest.mark.parametrize("case", list(NESTED))
def test_a_nested_tuple_between_stages_trains_as_one_process(two_ranks, request, case):
    """A bare nn.LSTM ends a stage with ``(out, (h, c))``: training refused it (only tensors and flat tuples
    travelled) while validate passed it; its leaves travel now and the structure is rebuilt on the next stage,
    gradients flowing back to each, so the loss, every gradient of every step and the validation loss are one
    process's."""
    ref, ref_loss, ref_val = _fit_nested("auto", 1)
    seen: set[str] = set()
    for steps, loss, val in two_ranks[request.node.name]:
        assert loss == pytest.approx(ref_loss, rel=1e-5) and val == pytest.approx(ref_val, rel=1e-5)
        assert len(steps) == len(ref)
        for step, ref_step in zip(steps, ref, strict=True):
            for name, grad in step.items():
                seen.add(name)
                torch.testing.assert_close(grad, ref_step[name], rtol=1e-5, atol=1e-7, msg=name)
    assert seen == set(ref[0]), "every parameter's gradient is compared"


class _SAM(torch.optim.SGD):
    """Sharpness-aware minimization's step (ascent to w + rho g / ||g||, the closure again, descent from w),
    its ||g|| summed over ``group`` (the pipeline's: each rank's optimizer holds its own stages only)."""

    def __init__(self, params, group, rho: float = 0.05) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.group, self.rho = group, rho

    def step(self, closure):
        closure()
        with torch.no_grad():
            grads = [q.grad for g in self.param_groups for q in g["params"] if q.grad is not None]
            squared = sum(g.pow(2).sum() for g in grads)
            if self.group is not None:
                dist.all_reduce(squared, group=self.group)
            moves = [g * (self.rho / (squared.sqrt() + 1e-12)) for g in grads]
            params = [q for g in self.param_groups for q in g["params"] if q.grad is not None]
            torch._foreach_add_(params, moves)
        with torch.enable_grad():
            closure()
        with torch.no_grad():
            torch._foreach_sub_(params, moves)
        return super().step()


class _SAMRegressor(conftest.Regressor):
    def configure_optimizers(self):
        pipelined = isinstance(self.trainer.strategy, TwoBPStrategy)
        return _SAM(self.parameters(), self.trainer.strategy.group("pp") if pipelined else None)


def _fit_sam_pipelined(rank: int, world: int) -> tuple[dict, list[str]]:
    lightning_env(rank, world)
    model = _SAMRegressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(TwoBPStrategy(num_microbatches=4), world).fit(model, _data())
    return _trained(model), [str(w.message) for w in caught if "closure again" in str(w.message)]


def test_sam_calls_the_closure_twice_as_one_process_does(two_ranks, request):
    """SAM's second closure call reruns the pipelined step (exact); its ||g|| is each rank's own stages' unless
    summed over the pipeline, which a warning names once (before it, silently 0.0074 off after 6 steps)."""
    model = _SAMRegressor()
    _trainer("auto", 1).fit(model, _data())
    for params, said in two_ranks[request.node.name]:
        assert len(said) == 1 and "group=trainer.strategy.group('pp')" in said[0], said
        for name, value in params.items():
            torch.testing.assert_close(value, model.get_parameter(name).detach(), rtol=1e-5, atol=1e-6, msg=name)


FOUR_RANK_FITS = {"1f1b-2bp": dict(schedule="1f1b"), "zb-h2": dict(schedule="zb-h2", num_microbatches=4)}


@pytest.mark.parametrize("case", list(FOUR_RANK_FITS))
def test_fit_on_four_pipeline_ranks_matches_one_process(four_ranks, request, case):
    ref, ref_loss = _reference(gradient_clip_val=0.05)
    results = four_ranks[request.node.name]
    merged = {n: v for out in results for n, v in out["params"].items()}
    assert set(merged) == set(ref) and sum(len(out["params"]) for out in results) == len(ref)
    for out in results:
        assert out["train_loss"] == pytest.approx(ref_loss, rel=1e-5)
    for name, value in merged.items():
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=name)


class TwoSequentials(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(2, 2))


class ParamFreeMiddle(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Tanh(), nn.Linear(16, 2))


class Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class FirstStageOptimizer(Regressor):
    def configure_optimizers(self):
        return torch.optim.SGD(self.layers[:3].parameters(), lr=self.lr)


class GroupsByPosition(Regressor):
    """Param groups cut by position in self.parameters(): on rank 1 the first group holds rank 1's first
    layer, not the model's (a cold review at stop 57: 5.8 relative off one process, silently)."""

    def configure_optimizers(self):
        p = list(self.parameters())
        return torch.optim.SGD([{"params": p[:2]}, {"params": p[2:], "lr": self.lr / 10}], lr=self.lr)


class LBFGSRegressor(Regressor):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5)


class ZeroOverTheWorld(Regressor):
    """torch's ZeroRedundancyOptimizer over its default group, the world: both pipeline stages."""

    def configure_optimizers(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)


class StepsLastLayerInBackward(Regressor):
    """Optimizer-in-backward on the last layer, set up once training starts: the hook is on pipeline rank 1 only
    (layers[4] is a placeholder without parameters on rank 0)."""

    def on_train_start(self) -> None:
        for q in self.layers[4].parameters():
            q.register_post_accumulate_grad_hook(lambda q: q.data.add_(q.grad, alpha=-0.1))


class PenaltyOverParameters(Regressor):
    """An L2 penalty over every parameter in the step: each rank summed its own stages' parameters only."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 0.01 * sum(p.pow(2).sum() for p in self.parameters())


def _expect_error(rank: int, world: int, model_cls, strategy_kwargs: dict, trainer_kwargs: dict, batch: int) -> str:
    lightning_env(rank, world)
    torch.manual_seed(0)  # the same batches on every rank: a case refused in the step reads them (a case run first too)
    x = torch.randn(16, 6)
    loader = DataLoader(TensorDataset(x, torch.randn(16, 2)), batch_size=batch)
    try:
        _trainer(TwoBPStrategy(**strategy_kwargs), world, **trainer_kwargs).fit(model_cls(), loader)
    except Exception as e:  # the same error on every rank, before any pipeline step
        return f"{type(e).__name__}: {e}"
    return "no error"


ERRORS = {
    "batch": (Regressor, dict(num_microbatches=3), dict(), 8, "batch size 8 does not split into 3 micro-batches"),
    "two-sequentials": (TwoSequentials, dict(), dict(), 8, r"holds 2 nn.Sequential modules \(head, layers\)"),
    "manual": (Manual, dict(), dict(), 8, "automatic optimization only"),
    "balance": (Regressor, dict(balance=[4, 4, 1]), dict(), 8, r"balance=\[4, 4, 1\] has 3 entries for 2 stages"),
    "degree": (Regressor, dict(pipeline_degree=3), dict(), 8, "2 devices cannot be split into pipelines of 3"),
    "rank-without-parameters": (
        ParamFreeMiddle,
        dict(schedule="zb-v", balance=[1, 1, 1, 1], num_microbatches=2),
        dict(),
        8,
        r"pipeline rank 1 would hold no parameters \(stage 1: layers 1-1, stage 2: layers 2-2\)",
    ),
    # torch's "empty parameter list" on rank 1 alone: both ranks stop at once, naming it
    "optimizer-empty": (
        FirstStageOptimizer,
        dict(),
        dict(),
        8,
        r"configure_optimizers on pipeline rank 1 \(stages \[1\]\) gave an optimizer an empty parameter list",
    ),
    # each rank's LBFGS saw its own stages' parameters only: every parameter off, silently, before the check
    # before this check each rank's weights were overwritten by the other stage's shards (0.48 off one process
    # after 6 steps where the stages' shapes agreed), or gloo aborted on a size mismatch
    "zero-over-stages": (
        ZeroOverTheWorld,
        dict(),
        dict(),
        8,
        r"ZeroRedundancyOptimizer over global ranks \[0, 1\] under strategy='twobp': global rank\(s\) \[[01]\] hold "
        r"other pipeline stages .* process_group=self.trainer.strategy.group\('dp'\)",
    ),
    # each rank's first group held its own first layer: trained with other learning rates, silently
    "optimizer-groups-by-position": (
        GroupsByPosition,
        dict(),
        dict(),
        8,
        r"configure_optimizers on pipeline rank 1 steps 2 of its parameters otherwise than one process does: "
        r"layers\.\d+\.weight is in optimizer 0 \(SGD, lr=0\.1, .*\) here and in optimizer 0 \(SGD, lr=0\.01, "
        r".* choose each group's parameters by name or module",
    ),
    "lbfgs": (
        LBFGSRegressor,
        dict(),
        dict(),
        8,
        r"LBFGS is not supported under strategy='twobp' with pipeline_degree=2",
    ),
    "pending-w-per-stage": (
        Regressor,
        dict(max_pending_w=[1, 1, 1]),
        dict(),
        8,
        r"max_pending_w=\(1, 1, 1\).*one per stage \(2 ints",
    ),
    # a hook on rank 1's stage alone, registered after the setup's check: both ranks refuse, naming it (before
    # this check it ran per micro-batch part, or not at all, silently)
    "parameter-hook-on-one-rank": (
        StepsLastLayerInBackward,
        dict(),
        dict(),
        8,
        r"ValueError: layers.4.weight \(pipeline stage 1\) has a post-accumulate-grad hook .*found before the first "
        r"training step",
    ),
    # Last: refused by the step's code on the last stage, at its first forward, before any weight changes; the
    # other rank names it (PeerFailed). An error of one rank's step closes the links: no case can run after it.
    "penalty-over-parameters": (
        PenaltyOverParameters,
        dict(),
        dict(),
        8,
        r"ElsewhereError: training_step iterated self.parameters\(\) \(or named_parameters\(\)\) to the end",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_before_compute(two_ranks, request, case):
    import re

    match = ERRORS[case][-1]
    out = two_ranks[request.node.name]
    for msg in out:
        assert re.search(match, msg), msg


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="unknown schedule 'zb-h3'"):
        TwoBPStrategy(schedule="zb-h3")
    with pytest.raises(ValueError, match="split by definition"):
        TwoBPStrategy(schedule="zb-h1", split_backward=False)
    with pytest.raises(ValueError, match=r"max_pending_w=-1: .*an int >= 0"):
        TwoBPStrategy(max_pending_w=-1)
    with pytest.raises(ValueError, match=r"split_backward=False .* drop max_pending_w or use split_backward=True"):
        TwoBPStrategy(max_pending_w=1, split_backward=False)


def _fit_dp_pp(rank: int, world: int, schedule: str) -> dict:
    lightning_env(rank, world)
    model = Regressor()
    # Lightning's DistributedSampler shards the data by data-parallel rank (the strategy's
    # distributed_sampler_kwargs); for training it shuffles with seed 0: replica d reads perm[d::2].
    trainer = _trainer(
        TwoBPStrategy(schedule=schedule, pipeline_degree=2), world, gradient_clip_val=0.05, use_distributed_sampler=True
    )
    trainer.fit(model, _data())
    return _trained(model)


DP_X_PP = ["zb-h1", "zb-v"]


def _one_process_batches(x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor) -> DataLoader:
    """``x``, ``y`` as one process reads what two replicas read under DistributedSampler(shuffle=True, seed=0) at
    epoch 0 (replica d takes perm[d::2]): step i is replica 0's batch i of 8, then replica 1's (16 samples)."""
    order = torch.cat([torch.cat([perm[0::2][i * 8 : (i + 1) * 8], perm[1::2][i * 8 : (i + 1) * 8]]) for i in range(4)])
    return DataLoader(TensorDataset(x[order], y[order]), batch_size=16)


def _equal_to(ref: dict, results: list[dict]) -> None:
    """Every rank's parameters (``results``, by rank) equal the one-process ``ref``'s, which pipeline ranks 0
    and 1 hold between them."""
    assert set(results[0]) | set(results[1]) == set(ref)
    for rank, params in enumerate(results):
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("schedule", DP_X_PP)
def test_dp_x_pp_matches_one_process_on_the_union_of_the_shards(four_ranks, request, schedule):
    """4 processes = 2 pipelines x 2 ranks; each step's gradient is the mean over both shards
    (and clipping by norm sees the whole model once). On the V each rank holds two stages, whose
    reduces start at different times during the step."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    model = Regressor()
    _trainer("auto", 1, gradient_clip_val=0.05).fit(model, _one_process_batches(x, y, perm))
    results = four_ranks[request.node.name]
    for rank, params in enumerate(results):
        assert set(params) == set(results[rank % 2]), "replicas hold the same stages"
        assert set(params).isdisjoint(results[1 - rank % 2])
    _equal_to(dict(model.named_parameters()), results)


class _Routed(nn.Module):
    """Two experts of one shape, each sample routed by the sign of its first input, an expert called only when
    it has samples (Hugging Face's mixture-of-experts loop): a micro-batch of one sign leaves the other expert
    without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = x[:, 0] > 0
        out = torch.zeros_like(x)
        for expert, mask in ((self.up, up), (self.down, ~up)):
            if mask.any():
                out = out.index_put((mask.nonzero().squeeze(1),), expert(x[mask]))
        return out


def _routed() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), _Routed(), nn.Tanh(), nn.Linear(16, 2))


def _replica_signed_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_data()``'s samples with the first input positive on replica 0's shard and negative on replica 1's
    (DistributedSampler(shuffle=True, seed=0): replica d reads perm[d::2]), and that permutation."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    x[perm[0::2], 0], x[perm[1::2], 0] = x[perm[0::2], 0].abs() + 0.1, -x[perm[1::2], 0].abs() - 0.1
    return x, y, perm


def _fit_dp_pp_routed(rank: int, world: int, data_parallel: str) -> dict:
    lightning_env(rank, world)
    model = Regressor(layers=_routed)
    model.optimizer = torch.optim.AdamW
    x, y, _ = _replica_signed_data()
    strategy = TwoBPStrategy(schedule="1f1b", pipeline_degree=2, data_parallel=data_parallel)
    trainer = _trainer(strategy, world, use_distributed_sampler=True)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return _trained(model)


@pytest.mark.parametrize("data_parallel", ["replicate", "shard"])
def test_dp_x_pp_reduces_an_expert_only_one_replica_used(four_ranks, request, data_parallel):
    """Replica 0's samples all go to one expert, replica 1's to the other, so each replica's stage has a gradient
    for one expert only. The replicas reduced the parameters that had gradients, by position: here gloo aborted
    a rank (checked with the old selection put back); where the sizes agree, one expert's gradient was summed into
    the other's silently (a cold review's reproduction at the reduce itself), and NCCL, which checks no sizes,
    would hang or read past. Now each replica reduces every parameter (zeros where it has none), as DDP's
    find_unused_parameters does."""
    x, y, perm = _replica_signed_data()
    model = Regressor(layers=_routed)
    model.optimizer = torch.optim.AdamW
    _trainer("auto", 1).fit(model, _one_process_batches(x, y, perm))
    _equal_to(dict(model.named_parameters()), four_ranks[request.node.name])


def _alternating_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_data()``'s samples with the first input's sign alternating by batch and replica: replica d's batch i
    (of 8; DistributedSampler(shuffle=True, seed=0): replica d reads perm[d::2]) is positive when i + d is
    even. Within a window of 3 batches each replica uses both experts, its last micro-step one only."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    for d in range(2):
        for i in range(4):
            rows = perm[d::2][i * 8 : (i + 1) * 8]
            x[rows, 0] = (x[rows, 0].abs() + 0.1) * (1 if (i + d) % 2 == 0 else -1)
    return x, y, perm


def _fit_dp_pp_accumulating(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    model = Regressor(layers=_routed)
    model.optimizer = torch.optim.AdamW
    x, y, _ = _alternating_data()
    strategy = TwoBPStrategy(schedule="zb-v", num_microbatches=4, pipeline_degree=2)
    reduces = conftest.Reduces()
    trainer = _trainer(
        strategy, world, max_steps=2, accumulate_grad_batches=3, callbacks=[reduces], use_distributed_sampler=True
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return {"params": _trained(model), "reduces": reduces.started}


def test_dp_x_pp_reduces_once_per_accumulation_window(four_ranks, request):
    """accumulate_grad_batches=3 over 4 batches a replica: windows of 3 and 1 micro-steps, and one reduce over the
    replicas per stage and window, as DDP's no_sync (4 per stage before), the earlier micro-steps' gradients
    carried into it. The experts alternate by batch and replica, so a window's last micro-step leaves on each
    replica an expert the window used earlier: every parameter against one process under AdamW."""
    x, y, perm = _alternating_data()
    model = Regressor(layers=_routed)
    model.optimizer = torch.optim.AdamW
    _trainer("auto", 1, max_steps=2, accumulate_grad_batches=3).fit(model, _one_process_batches(x, y, perm))
    results = four_ranks[request.node.name]
    for rank, out in enumerate(results):
        stages = 2 if rank % 2 == 0 else 1  # pipeline rank 1's first stage (a Tanh) has nothing to reduce
        assert out["reduces"] == 2 * stages, f"rank {rank}: {out['reduces']} reduces for 2 windows of {stages}"
    _equal_to(dict(model.named_parameters()), [out["params"] for out in results])


class _TrainedFirstInWindow(pl.Callback):
    """Layer 2 trains on each accumulation window's first micro-step only, frozen on the others (a callback
    flipping ``requires_grad`` between batches)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.layers[2].requires_grad_(batch_idx % trainer.accumulate_grad_batches == 0)


def _fit_dp_pp_frozen_mid_window(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    model = Regressor()
    strategy = TwoBPStrategy(schedule="1f1b", pipeline_degree=2)
    trainer = _trainer(
        strategy,
        world,
        max_steps=2,
        accumulate_grad_batches=2,
        callbacks=[_TrainedFirstInWindow()],
        use_distributed_sampler=True,
    )
    trainer.fit(model, _data())
    return _trained(model)


def test_dp_x_pp_reduces_a_layer_frozen_since_the_windows_first_micro_step(four_ranks, request):
    """A layer trained on a window's first micro-step and frozen on its last still holds that micro-step's
    gradient, which the optimizer steps with: the window's one reduce covers it. Left out (it required no grad
    when the reduce ran), each replica stepped with its own shard's gradient: the replicas apart by 0.009 and
    0.0046 off one process after 2 steps."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    model = Regressor()
    trainer = _trainer("auto", 1, max_steps=2, accumulate_grad_batches=2, callbacks=[_TrainedFirstInWindow()])
    trainer.fit(model, _one_process_batches(x, y, perm))
    _equal_to(dict(model.named_parameters()), four_ranks[request.node.name])


class _GradsSeen(pl.Callback):
    """Each parameter's gradient where the optimizer steps, on this rank's stages."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {n: q.grad.clone() for n, q in pl_module.named_parameters() if q.grad is not None}


def _half_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1024 samples, targets of 15000 (fp16 holds them): 64 batches of 8 a replica, one window of 64."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(1024, 6, generator=g), torch.randn(1024, 2, generator=g) * 15000
    return x, y, torch.randperm(1024, generator=torch.Generator().manual_seed(0))


def _fit_dp_pp_half_accumulating(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    model, seen = Regressor(lr=1e-6), _GradsSeen()
    x, y, _ = _half_data()
    strategy = TwoBPStrategy(schedule="1f1b", pipeline_degree=2)
    trainer = _trainer(
        strategy,
        world,
        max_steps=1,
        accumulate_grad_batches=64,
        precision="16-true",
        callbacks=[seen],
        use_distributed_sampler=True,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    return {"grads": seen.grads, "checks": dict(strategy.step_checks)}


def test_dp_x_pp_16_true_window_gradients_stay_within_one_process_range(four_ranks, request):
    """Under "16-true" with accumulate_grad_batches=64 one process's gradients (the mean of 64 micro-steps' from
    ``loss / 64``) reach 892; the window's one reduce carried the earlier micro-steps' gradients times 64, a
    replica's sum of 64 unscaled micro-steps, which overflowed fp16 (inf in the last layer's bias: the step
    refused as non-finite). Its last micro-step now backpropagates ``loss / 64`` as one process does."""
    x, y, perm = _half_data()
    order = torch.cat([torch.cat([perm[d::2][i * 8 : (i + 1) * 8] for d in (0, 1)]) for i in range(64)])
    model, seen = Regressor(lr=1e-6), _GradsSeen()
    trainer = _trainer("auto", 1, max_steps=1, accumulate_grad_batches=64, precision="16-true", callbacks=[seen])
    trainer.fit(model, DataLoader(TensorDataset(x[order], y[order]), batch_size=16))
    for rank, out in enumerate(four_ranks[request.node.name]):
        assert out["checks"]["skipped"] == 0, f"rank {rank}: {out['checks']}"
        for name, grad in out["grads"].items():
            assert torch.isfinite(grad).all(), f"rank {rank} {name}"
            torch.testing.assert_close(grad.float(), seen.grads[name].float(), rtol=2e-2, atol=0.5, msg=name)


class _Counting(nn.Module):
    """Counts its training calls in an int16 buffer (gloo broadcasts no int16: the buffers travel as bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return x


class _Growing(nn.Module):
    """A cache buffer whose length follows what its replica saw (older rotary caches grew with the sequence
    length): here, by the rank, so that the replicas differ at the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.cache.numel() == 1:
            self.cache = torch.zeros(2 + dist.get_rank())
        return x


def _two_norms(extra: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.BatchNorm1d(16),
        nn.Tanh(),
        extra or _Counting(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16),
        nn.Linear(16, 2),
    )


def _fit_dp_pp_normed(rank: int, world: int, broadcast: bool = True) -> dict:
    lightning_env(rank, world)
    model = Regressor(layers=_two_norms)
    strategy = TwoBPStrategy(schedule="1f1b", pipeline_degree=2, balance=[4, 3], broadcast_buffers=broadcast)
    trainer = _trainer(strategy, world, use_distributed_sampler=True)
    trainer.fit(model, _data())
    (val,) = trainer.validate(model, regression_data(32, batch_size=8, seed=2), verbose=False)
    own = {n: b.clone() for n, b in model.named_buffers() if not b.is_meta and b.numel()}
    return {"params": own_weights(model), "buffers": own, "val_loss": val["val_loss"]}


def test_dp_x_pp_validates_with_replica_zeros_batch_norm_statistics(four_ranks, request):
    """Each replica's batch norms update from the micro-batches it reads. As under DDP's broadcast_buffers
    (Lightning's default), every replica takes replica 0's buffers before each step and evaluation: the
    validation of a DP x PP run equals one process's validation of the model its checkpoint holds (the
    parameters, replica 0's buffers). Before, each replica validated its shard with statistics of its own."""
    results = four_ranks[request.node.name]
    for rank, out in enumerate(results[2:], start=2):  # replica 1 holds replica 0's buffers, bitwise
        assert out["buffers"].keys() == results[rank - 2]["buffers"].keys() and out["buffers"], out["buffers"]
        for name, b in out["buffers"].items():
            assert torch.equal(b, results[rank - 2]["buffers"][name]), f"rank {rank} {name}"
    model = Regressor(layers=_two_norms)
    state = {**results[0]["params"], **results[1]["params"], **results[0]["buffers"], **results[1]["buffers"]}
    model.load_state_dict(state, strict=True)
    (val,) = quiet_trainer("auto", 1).validate(model, regression_data(32, batch_size=8, seed=2), verbose=False)
    assert results[0]["val_loss"] == pytest.approx(val["val_loss"], rel=1e-6)


def test_dp_x_pp_keeps_each_replicas_buffers_when_asked(four_ranks, request):
    """``broadcast_buffers=False`` (DDP's option): each replica keeps the statistics of what it read."""
    results = four_ranks[request.node.name]
    differ = [n for n, b in results[2]["buffers"].items() if not torch.equal(b, results[0]["buffers"][n])]
    assert "layers.1.running_mean" in differ, differ


def _fit_dp_pp_growing(rank: int, world: int) -> str:
    lightning_env(rank, world)
    model = Regressor(layers=functools.partial(_two_norms, _Growing()))
    strategy = TwoBPStrategy(schedule="1f1b", pipeline_degree=2, balance=[4, 3])
    try:
        _trainer(strategy, world, use_distributed_sampler=True).fit(model, _data())
    except Exception as e:  # noqa: BLE001 - the refusal, on every rank
        return f"{type(e).__name__}: {e}"
    return "trained"


def test_dp_x_pp_refuses_a_buffer_that_differs_between_replicas_naming_it(four_ranks, request):
    """A buffer whose size follows the data a replica read cannot take replica 0's: refused, naming the sizes,
    not a gloo abort or an NCCL hang (a review's cache that grew)."""
    for out in four_ranks[request.node.name][::2]:  # the first stage's ranks hold the growing cache
        assert "the data-parallel replicas hold different buffers (global rank 0: " in out, out
        assert "a cache that grows" in out and "layers.3.cache" in out, out


class AdamRegressor(Regressor):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _fit_with_checkpoints(rank: int, world: int, folder: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    lightning_env(rank, world)
    runs = {}
    for name, kw in (("straight", dict(max_steps=4)), ("resumed-to-2", dict(max_steps=2))):
        cb = ModelCheckpoint(dirpath=f"{folder}/{name}", every_n_train_steps=2, save_top_k=-1)
        model = AdamRegressor()
        trainer = quiet_trainer(
            TwoBPStrategy(schedule="zb-h1"),
            world,
            enable_checkpointing=True,
            callbacks=[cb],
            limit_train_batches=2,
            **kw,
        )  # checkpoints at epoch ends
        trainer.fit(model, _data())
        runs[name] = _trained(model)
    # resume the second run from its step-2 checkpoint, up to step 4
    ckpt = sorted(os.listdir(f"{folder}/resumed-to-2"))[-1]
    model = AdamRegressor()
    trainer = quiet_trainer(TwoBPStrategy(schedule="zb-h1"), world, max_steps=4, limit_train_batches=2)
    trainer.fit(model, _data(), ckpt_path=f"{folder}/resumed-to-2/{ckpt}")
    runs["resumed"] = _trained(model)
    return runs


def test_checkpoint_resume_is_bitwise_and_consolidates(two_ranks, request, shared, tmp_path):
    from lightning_twobp.lightning.checkpoint import consolidate

    results = two_ranks[request.node.name]
    for runs in results:
        for name, value in runs["straight"].items():
            assert torch.equal(runs["resumed"][name], value), f"resumed {name} differs from the straight run"
    # the straight run's step-4 checkpoint, merged, loads into the unpipelined module
    step4 = sorted((shared / "checkpoints" / "straight").iterdir())[-1]
    ckpt = consolidate(step4, tmp_path / "full.ckpt")
    model = AdamRegressor()
    model.load_state_dict(torch.load(tmp_path / "full.ckpt", weights_only=False)["state_dict"])
    final = {**results[0]["straight"], **results[1]["straight"]}
    assert set(ckpt["state_dict"]) == set(final)
    for name, q in model.named_parameters():
        assert torch.equal(q.detach(), final[name]), name
    loaded = AdamRegressor.load_from_checkpoint(tmp_path / "full.ckpt")
    assert torch.equal(loaded.layers[0].weight, final["layers.0.weight"])


class Heavy(nn.Module):
    """No parameters, most of the time: what balance="params" cannot see."""

    def __init__(self, steps: int = 300) -> None:
        super().__init__()
        self.steps = steps
        self.register_buffer("m", torch.eye(16) * 0.5)

    def forward(self, x):
        for _ in range(self.steps):
            x = torch.tanh(x @ self.m) * 2.0
        return x


class HeavyRegressor(Regressor):
    def __init__(self) -> None:
        super().__init__(
            layers=lambda: nn.Sequential(
                nn.Linear(6, 16), Heavy(), nn.Linear(16, 16), Heavy(30), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
            )
        )


def _fit_balanced(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for balance in ("time", "params"):
        model = HeavyRegressor()
        strategy = TwoBPStrategy(schedule="zb-h1", balance=balance)
        _trainer(strategy, world).fit(model, _data())
        out[balance] = {"sizes": strategy.stage_sizes, "params": _trained(model)}
    return out


def test_balance_by_time_profiles_the_layers(two_ranks, request):
    """The parameter-free Heavy layer costs most of the time: "time" gives it a stage of its own
    (with the first layer), "params" does not see it; profiling leaves the numerics untouched. The tail holds a
    tenth of Heavy's work: with tiny layers alone there, whether the first layer or the tail weighed more was
    a few microseconds' noise (it failed one CI run in the forked ranks)."""
    model = HeavyRegressor()
    _trainer("auto", 1).fit(model, _data())
    ref = dict(model.named_parameters())
    results = two_ranks[request.node.name]
    by_time, by_params = [r["time"] for r in results], [r["params"] for r in results]
    assert by_time[0]["sizes"] == by_time[1]["sizes"] == [2, 5]
    assert by_params[0]["sizes"] != [2, 5]
    for out in by_time:
        for name, value in out["params"].items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def _fit_then_save(rank: int, world: int, folder: str, max_steps: int) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    lightning_env(rank, world)
    model = AdamRegressor()
    cb = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    trainer = quiet_trainer(
        TwoBPStrategy(schedule="zb-h1", num_microbatches=4),
        world,
        enable_checkpointing=True,
        callbacks=[cb],
        max_steps=max_steps,
        limit_train_batches=2,
    )  # checkpoints at epoch ends: resumable data
    trainer.fit(model, _data())
    return _trained(model)


def _resume_elsewhere(rank: int, world: int, ckpt: str, strategy_kwargs: dict) -> dict:
    lightning_env(rank, world)
    model = AdamRegressor()
    trainer = quiet_trainer(
        TwoBPStrategy(num_microbatches=4, **strategy_kwargs), world, max_steps=4, limit_train_batches=2
    )
    trainer.fit(model, _data(), ckpt_path=ckpt)
    return _trained(model)


def _save_and_resume(rank: int, world: int, folder: str, strategy_kwargs: dict | None) -> dict:
    """The uninterrupted run to step 4, saving at step 2; then, unless ``strategy_kwargs`` is None, its
    resume from step 2 on these ranks too."""
    out = {"straight": _fit_then_save(rank, world, folder, 4)}
    if strategy_kwargs is not None:
        dist.barrier()  # every rank's part of the checkpoint written
        out["resumed"] = _resume_elsewhere(
            rank, world, os.path.join(folder, sorted(os.listdir(folder))[0]), strategy_kwargs
        )
    return out


RESUMES = {"pp2-to-pp1": (1, dict()), "pp2-to-v": (2, dict(schedule="zb-v"))}


@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_under_another_partition_restores_optimizer_state(two_ranks, request, shared, case):
    """Saved at step 2 by a 2-stage pipeline, resumed to step 4 by one process (every stage on one
    rank) or by the V (4 stages, new boundaries): Adam's moments come back by parameter name, so the
    result is the uninterrupted run's (a fresh Adam state would move the weights elsewhere)."""
    world, strategy_kwargs = RESUMES[case]
    runs = two_ranks[request.node.name]
    straight = [r["straight"] for r in runs]
    final = {**straight[0], **straight[1]}
    step2 = sorted((shared / case).iterdir())[0]
    assert "step=2" in step2.name
    if world == 2:  # resumed in the same launch
        resumed = [r["resumed"] for r in runs]
    else:
        resumed = run_distributed(_resume_elsewhere, world, str(step2), strategy_kwargs, timeout=180)
    merged = {k: v for r in resumed for k, v in r.items()}
    assert set(merged) == set(final)
    for name, value in merged.items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-7, msg=name)


def _fit_monitored(model, strategy, devices: int, folder: str) -> dict:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=folder, monitor="val_loss", mode="min", save_top_k=1)
    stop = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02)
    trainer = quiet_trainer(
        strategy, devices, enable_checkpointing=True, callbacks=[ckpt, stop], max_epochs=20, limit_train_batches=2
    )
    trainer.fit(model, _data(), _eval_data())
    return {
        "epoch": trainer.current_epoch,
        "stopped": stop.stopped_epoch,
        "best": float(ckpt.best_model_score),
        "path": ckpt.best_model_path,
    }


def _fit_monitored_pipelined(rank: int, world: int, folder: str) -> dict:
    lightning_env(rank, world)
    return _fit_monitored(Regressor(lr=0.05), TwoBPStrategy(schedule="zb-h1"), world, folder)


def test_model_checkpoint_and_early_stopping_on_a_validation_metric(two_ranks, request, tmp_path):
    """val_loss is the true mean and known on every rank, so EarlyStopping stops every rank at the
    one-process epoch and ModelCheckpoint keeps the one-process best, as a loadable sharded directory."""
    ref = _fit_monitored(Regressor(lr=0.05), "auto", 1, str(tmp_path / "ref"))
    assert 0 < ref["stopped"] < 19, "the reference must stop early for this test to mean something"
    for out in two_ranks[request.node.name]:
        assert (out["epoch"], out["stopped"]) == (ref["epoch"], ref["stopped"])
        assert out["best"] == pytest.approx(ref["best"], rel=1e-5)
        assert os.path.basename(out["path"]) == os.path.basename(ref["path"])
        assert os.path.isfile(os.path.join(out["path"], "meta.pt"))


class _InjectOverflow(pl.Callback):
    """An inf in rank 1's (scaled) gradients at step 1 only; records whether each rank stepped."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = {n: q.detach().clone() for n, q in pl_module.named_parameters()}

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == 1 and trainer.global_rank == 1:
            next(q for q in pl_module.parameters() if q.grad is not None).grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.stepped = any(not torch.equal(q, self.before[n]) for n, q in pl_module.named_parameters())


def _normed() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.BatchNorm1d(16),
        nn.Dropout(0.3),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16),
        nn.Tanh(),
        nn.Linear(16, 2),
    )


def _fit_post_validated(rank: int, world: int) -> dict:
    """ZB-H2 with clipping by norm, post-validated (its default) and checked first: the state_dict of each."""
    lightning_env(rank, world)
    out = {}
    for post in (True, False):
        strategy = TwoBPStrategy(schedule="zb-h2", num_microbatches=2, post_validation=post)
        model = Regressor(layers=_normed)
        _trainer(strategy, world, gradient_clip_val=0.05).fit(model, _data())
        state = {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}
        out[post] = {"state": state, "redone": strategy.step_checks["redone"]}
    return out


def test_a_redone_step_counts_batch_norm_statistics_once(two_ranks, request):
    """A step clipped after all is redone, and so is the pipeline step that ran on its speculative weights:
    that run's BatchNorm statistics were kept too (a trial's conv net: running_var 0.15 off after 3 steps, the
    parameters equal), so evaluation differed from checking first, and the rerun drew other dropout masks
    (parameters 2e-3 off). Buffers and random streams now start the rerun as they were."""
    for out in two_ranks[request.node.name]:
        assert out[True]["redone"] > 0, "the case must redo a step"
        assert set(out[True]["state"]) == set(out[False]["state"])
        for name, value in out[True]["state"].items():
            torch.testing.assert_close(value, out[False]["state"][name], rtol=1e-6, atol=1e-7, msg=name)


class _OldGrads(pl.Callback):
    """Whether the previous step's gradient tensors are still alive while the next step's pipeline runs its
    forwards (weak references taken after each step, looked at by a forward pre-hook on this rank's layers)."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.alive: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        for layer in pl_module.layers:
            if any(not q.is_meta for q in layer.parameters()):
                layer.register_forward_pre_hook(lambda *_: self.alive.append(sum(r() is not None for r in self.refs)))

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.refs = [weakref.ref(q.grad) for q in pl_module.parameters() if q.grad is not None]


class _ReadsOldGrads(Regressor):
    """Reads the gradients in ``on_before_zero_grad`` (after training_step), as Lightning lets it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def on_before_zero_grad(self, optimizer) -> None:
        grads = [q.grad for q in self.parameters() if q.grad is not None]
        self.seen.append(float(sum(g.abs().sum() for g in grads)) if grads else 0.0)


def _fit_dropping_old_grads(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for name, make in (("plain", Regressor), ("reads", _ReadsOldGrads)):
        model, old = make(), _OldGrads()
        _trainer(TwoBPStrategy(schedule="1f1b", num_microbatches=2), world, callbacks=[old]).fit(model, _data())
        out[name] = {"alive": old.alive, "params": _trained(model), "seen": getattr(model, "seen", [])}
    return out


def test_the_previous_steps_gradients_are_dropped_before_the_pipeline_step(two_ranks, request):
    """Lightning zeroes the gradients after training_step, and the pipeline's backward runs inside it: the
    previous step's gradients lived through the whole step beside the new ones, a copy of every gradient more
    than one process holds (a 2-rank fit of 6 Linear(2048, 2048): the last rank's peak resident memory 89-106 MB
    above the built model, 39 MB with them dropped; docs/results/memory/old_grads.py). They are dropped at the
    step's start where nothing reads them before Lightning's zero_grad; an on_before_zero_grad hook still sees
    them, as one process's does."""
    ref = _ReadsOldGrads()
    _trainer("auto", 1).fit(ref, _data())
    for out in two_ranks[request.node.name]:
        plain, reads = out["plain"], out["reads"]
        assert plain["alive"] and not any(plain["alive"]), plain["alive"]
        assert any(reads["alive"]), "with a hook that reads them, the gradients stay until Lightning's zero_grad"
        assert reads["params"].keys() == plain["params"].keys()
        for n, v in reads["params"].items():
            torch.testing.assert_close(v, plain["params"][n], rtol=0, atol=0, msg=n)
        # each rank's hook sees its own stages' gradients; together they are the one process's
    seen = [sum(o["reads"]["seen"][i] for o in two_ranks[request.node.name]) for i in range(len(ref.seen))]
    assert seen == pytest.approx(ref.seen, rel=1e-5)


# an optimizer that unscales its gradients inside its own step (torch's GradScaler then checks them apart)
OVERFLOWS = {"sgd": torch.optim.SGD, "fused-adamw": functools.partial(torch.optim.AdamW, fused=True)}


def _fit_with_overflow(rank: int, world: int, optimizer: str) -> dict:
    lightning_env(rank, world)
    probe = _InjectOverflow()
    trainer = _trainer(TwoBPStrategy(schedule="zb-h1"), world, plugins="fp16-scaler", callbacks=[probe])
    model = Regressor()
    model.optimizer = OVERFLOWS[optimizer]
    trainer.fit(model, _data())
    return {"stepped": probe.stepped, "scale": float(trainer.precision_plugin.scaler.get_scale())}


@pytest.mark.parametrize("optimizer", list(OVERFLOWS))
def test_fp16_overflow_on_one_stage_skips_the_step_everywhere(two_ranks, request, optimizer):
    """A GradScaler that sees inf on one stage skips the step; every other stage must skip it too and
    halve its scale alike, or the stages drift apart (each rank's scaler sees only its own grads). A fused
    AdamW unscales inside its step, where torch reads each rank's inf flags apart: rank 1 skipped and halved
    its scale while rank 0 stepped (a cold review)."""
    out = two_ranks[request.node.name]
    assert [o["stepped"] for o in out] == [False, False], out
    assert out[0]["scale"] == out[1]["scale"] == 2.0**11, out


class GroupedRegressor(AdamRegressor):
    """Two param groups, biases (not decayed) first; the first stage has no biases, so rank 0 has one
    group and rank 1 two: matching groups by position would give rank 1's biases the weights' decay."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 16, bias=False),
            nn.Tanh(),
            nn.Linear(16, 16, bias=False),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, 2),
        )

    def configure_optimizers(self):
        w = [q for n, q in self.named_parameters() if n.endswith("weight")]
        b = [q for n, q in self.named_parameters() if n.endswith("bias")]
        groups = [g for g in ({"params": b, "weight_decay": 0.0}, {"params": w, "weight_decay": 0.1}) if g["params"]]
        opt = torch.optim.AdamW(groups, lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _group_settings(rank: int, world: int, folder: str, resume: bool) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    lightning_env(rank, world)
    model = GroupedRegressor()
    cb = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    strategy = TwoBPStrategy(schedule="1f1b", num_microbatches=4, balance=[3, 4])
    trainer = quiet_trainer(
        strategy,
        world,
        callbacks=[] if resume else [cb],
        enable_checkpointing=not resume,
        max_steps=4 if resume else 2,
        limit_train_batches=2,
    )
    ckpt = os.path.join(folder, sorted(os.listdir(folder))[0]) if resume else None
    trainer.fit(model, _data(), ckpt_path=ckpt)
    names = {id(q): n for n, q in model.named_parameters()}
    # (weight decay, lr) per parameter: the lr follows the schedule 0.01 / (1 + step) in every group
    return {names[id(q)]: (g["weight_decay"], g["lr"]) for g in trainer.optimizers[0].param_groups for q in g["params"]}


def _group_settings_resumed(rank: int, world: int, folder: str) -> dict:
    _group_settings(rank, world, folder, False)
    dist.barrier()  # every rank's part of the checkpoint written
    return _group_settings(rank, world, folder, True)


def test_resume_rebuilds_each_ranks_own_param_groups(two_ranks, request):
    """Every parameter keeps its own group's settings after a resume, whatever the rank's groups."""
    resumed = two_ranks[request.node.name]
    assert not any(n.endswith("bias") for n in resumed[0]) and any(n.endswith("bias") for n in resumed[1])
    for settings in resumed:
        assert settings and all(d == (0.1 if n.endswith("weight") else 0.0) for n, (d, _) in settings.items()), settings
        assert all(lr == pytest.approx(0.01 / 5) for _, lr in settings.values()), settings  # after step 4


# ---------------------------------------------------------------------------------------------- launches
@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """The folder of the launches' checkpoints."""
    return tmp_path_factory.mktemp("strategy")


class ReturnsADict(Regressor):
    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "mae": torch.tensor(0.0)}

    def validation_step(self, batch, batch_idx):
        preds = self._forward(batch[0])
        return {"preds": preds, "loss": torch.nn.functional.mse_loss(preds, batch[1])}  # outputs in one process


class Mixup(Regressor):
    """Mixup drawn in the step, before the pipelined call (torch's lambda, NumPy's and Python's draws as
    timm's Mixup makes them); each micro-batch's draws recorded, or replayed from ``replay`` (one process)."""

    def __init__(self, replay: list | None = None) -> None:
        super().__init__()
        self.drawn: list[tuple] = []
        self.replay = replay

    def _mix(self, x, y, lam):
        return lam * x + (1 - lam) * x.flip(0), lam * y + (1 - lam) * y.flip(0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.replay is None:  # under the pipeline: once per micro-batch on each of the two stages
            lam = torch.rand(x.shape[0], 1)
            self.drawn.append((lam.flatten().tolist(), float(np.random.beta(0.4, 0.4)), random.random()))
            x, y = self._mix(x, y, lam)
            return torch.nn.functional.mse_loss(self.layers(x), y)
        # one process: the same micro-batches with the lambdas the pipeline drew, their mean loss
        losses = []
        for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
            lam = torch.tensor(self.replay.pop(0)[0]).unsqueeze(1)
            xm, ym = self._mix(xm, ym, lam)
            losses.append(torch.nn.functional.mse_loss(self.layers(xm), ym))
        return torch.stack(losses).mean()


def _fit_mixup(rank: int, world: int) -> tuple[list[tuple], dict, list[str]]:
    lightning_env(rank, world)
    pl.seed_everything(7 + rank)  # ranks seeded apart: the step's draws still agree
    model = Mixup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(TwoBPStrategy(num_microbatches=4), world).fit(model, _data())
    return model.drawn, _trained(model), [str(w.message) for w in caught if str(w.message).startswith("twobp:")]


def _fit_warned(rank: int, world: int) -> list[str]:
    lightning_env(rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(TwoBPStrategy(), world).fit(ReturnsADict(), _data(), _eval_data())
    return [str(w.message) for w in caught if str(w.message).startswith("twobp:")]


def _worker_draws(init: Callable[[int], None] | None) -> list[list[float]]:
    """What workers 0 and 1 of a loader with worker_init_fn ``init`` draw first, from one base seed (torch
    gives worker ``i`` the seed ``base + i``, then calls ``init(i)``)."""
    draws, np_state, py_state = [], np.random.get_state(), random.getstate()
    with torch.random.fork_rng():
        for worker in (0, 1):
            torch.manual_seed(1234 + worker)
            if init is not None:
                init(worker)
            draws.append(torch.rand(3).tolist() + [float(np.random.rand()), random.random()])
    np.random.set_state(np_state)
    random.setstate(py_state)
    return draws


def _fit_seeding_workers(rank: int, world: int) -> list[list[float]]:
    lightning_env(rank, world)
    pl.seed_everything(5, workers=True, verbose=False)
    try:
        trainer = _trainer(TwoBPStrategy(), world, max_steps=1)
        trainer.fit(Regressor(), _data())
        return _worker_draws(trainer.train_dataloader.worker_init_fn)
    finally:
        del os.environ["PL_SEED_WORKERS"]


def test_seeded_dataloader_workers_draw_alike_on_every_stage(two_ranks, request):
    """Under seed_everything(workers=True) Lightning seeds each DataLoader worker by global rank, so the
    first stage's workers and the last's drew different noise or masks for the same sample (refused at the
    first batch as different data). The strategy seeds them by data-parallel rank: every stage draws as one
    process's workers (rank 0) draw, torch's, NumPy's and Python's generators alike."""
    from lightning.fabric.utilities.seed import pl_worker_init_function

    first, last = two_ranks[request.node.name]
    one_process = _worker_draws(functools.partial(pl_worker_init_function, rank=0))
    assert first == last == one_process, (first, last, one_process)
    assert one_process != _worker_draws(functools.partial(pl_worker_init_function, rank=1))


def test_random_draws_before_the_pipelined_call_agree_across_stages(two_ranks, request):
    """The first stage runs the step's code before the call for the inputs, the last stage again for the
    loss: mixup's lambda drawn there (torch, NumPy, Python) is the same number on both, per micro-batch,
    also with the ranks seeded apart; so the model trains as one process mixing inputs and targets alike
    with those lambdas. (Before, each stage drew from its own stream: inputs mixed with one lambda,
    targets with another.)"""
    (first, params0, said0), (last, params1, said1) = two_ranks[request.node.name]
    assert len(first) == 3 * 4 and first == last, (first, last)
    assert len({str(d) for d in first}) == len(first), first  # a new draw per micro-batch and step
    assert said0 == said1 == [], (said0, said1)
    ref = Mixup(replay=list(first))
    _trainer("auto", 1).fit(ref, _data())
    want = _trained(ref)
    for name, got in (params0 | params1).items():
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_keys_a_training_step_returns_beside_the_loss_are_named_once(two_ranks, request):
    """Lightning's outputs hold only the loss under the pipeline: the keys left out are named, not dropped
    silently (once, on the last stage, which runs the step per micro-batch); and what a validation_step
    returns, which the pipeline does not carry (on_validation_batch_end's outputs are None), likewise."""
    first, last = two_ranks[request.node.name]
    assert first == [], first
    assert len(last) == 2, last
    trained, validated = sorted(last, key=lambda said: "validation_step" in said)  # the sanity check said first
    assert "training_step returned ['mae'] beside 'loss'" in trained and "self.log" in trained, last
    assert "validation_step returned dict" in validated and "`outputs` is None on every rank" in validated, last


class StopsInTheStep(Regressor):
    """Stops training from its own step code, which runs on the last stage only under the pipeline:
    ``training_step`` at global step 2, or ``validation_step`` in epoch 1's validation."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.where == "training_step" and self.trainer.global_step == 2:
            self.trainer.should_stop = True
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        if self.where == "validation_step" and self.current_epoch == 1 and not self.trainer.sanity_checking:
            self.trainer.should_stop = True


def _fit_stopped(model: pl.LightningModule, strategy: Any, devices: int) -> tuple[int, dict]:
    trainer = _trainer(strategy, devices, max_steps=-1, max_epochs=4)
    trainer.fit(model, _data(), regression_data(16, seed=3))
    return trainer.global_step, _trained(model)


def _fit_stopped_pipelined(rank: int, world: int, where: str, schedule: str) -> tuple[int, dict]:
    lightning_env(rank, world)
    # without the stop shared, the first stage went on alone: a hang until the process group's timeout
    return _fit_stopped(StopsInTheStep(where), TwoBPStrategy(schedule=schedule, pipeline_timeout=60), world)


STOPS = {"training_step": "zb-h2", "validation_step": "1f1b"}


@pytest.mark.parametrize("where", list(STOPS))
def test_should_stop_set_in_the_steps_code_stops_every_rank(two_ranks, request, where):
    """``self.trainer.should_stop = True`` in ``training_step`` or ``validation_step`` is set on the last
    stage only (the step's code after the pipelined call runs there); every rank of the pipeline stops at
    the same step as one process does."""
    ref_step, ref = _fit_stopped(StopsInTheStep(where), "auto", 1)
    assert ref_step == (3 if where == "training_step" else 16), ref_step
    results = two_ranks[request.node.name]
    assert [step for step, _ in results] == [ref_step, ref_step]
    for name, got in (results[0][1] | results[1][1]).items():
        torch.testing.assert_close(got, ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def two_ranks(request, shared) -> conftest.Launch:
    """Every 2-rank case of this module, in one launch; the errors before compute last."""
    cases = {f"test_validate_and_predict_match_one_process[{k}]": (_eval_pipelined, (kw,)) for k, kw in EVALS.items()}
    cases |= {f"test_fit_matches_one_process[{k}]": (_fit_pipelined, (sk, tk)) for k, (sk, tk, _) in FITS.items()}
    cases |= {
        f"test_bf16_matches_one_process_on_the_same_micro_batches[{k}]": (_fit_bf16_pipelined, (k,))
        for k in SAME_MICROBATCHES
    }
    cases |= {
        f"test_sparse_embedding_gradients_match_one_process[{k}]": (_fit_sparse_pipelined, (s,))
        for k, s in SPARSE.items()
    }
    cases |= {
        f"test_a_nested_tuple_between_stages_trains_as_one_process[{k}]": (_fit_nested_pipelined, (k,)) for k in NESTED
    }
    cases["test_sam_calls_the_closure_twice_as_one_process_does"] = (_fit_sam_pipelined, ())
    cases |= {
        "test_checkpoint_resume_is_bitwise_and_consolidates": (_fit_with_checkpoints, (str(shared / "checkpoints"),)),
        "test_balance_by_time_profiles_the_layers": (_fit_balanced, ()),
        "test_model_checkpoint_and_early_stopping_on_a_validation_metric": (
            _fit_monitored_pipelined,
            (str(shared / "pp"),),
        ),
        "test_a_redone_step_counts_batch_norm_statistics_once": (_fit_post_validated, ()),
        "test_the_previous_steps_gradients_are_dropped_before_the_pipeline_step": (_fit_dropping_old_grads, ()),
        "test_keys_a_training_step_returns_beside_the_loss_are_named_once": (_fit_warned, ()),
        "test_random_draws_before_the_pipelined_call_agree_across_stages": (_fit_mixup, ()),
        "test_seeded_dataloader_workers_draw_alike_on_every_stage": (_fit_seeding_workers, ()),
        "test_resume_rebuilds_each_ranks_own_param_groups": (_group_settings_resumed, (str(shared / "groups"),)),
    }
    cases |= {
        f"test_fp16_overflow_on_one_stage_skips_the_step_everywhere[{k}]": (_fit_with_overflow, (k,)) for k in OVERFLOWS
    }
    cases |= {
        f"test_should_stop_set_in_the_steps_code_stops_every_rank[{w}]": (_fit_stopped_pipelined, (w, s))
        for w, s in STOPS.items()
    }
    cases |= {
        f"test_resume_under_another_partition_restores_optimizer_state[{k}]": (
            _save_and_resume,
            (str(shared / k), kw if world == 2 else None),
        )
        for k, (world, kw) in RESUMES.items()
    }
    cases |= {f"test_errors_before_compute[{k}]": (_expect_error, args[:-1]) for k, args in ERRORS.items()}
    return launch(request, 2, cases, timeout=840)


@pytest.fixture(scope="module")
def four_ranks(request) -> conftest.Launch:
    """Every 4-rank case of this module, in one launch."""
    clip = dict(gradient_clip_val=0.05)
    cases = {
        f"test_fit_on_four_pipeline_ranks_matches_one_process[{k}]": (_fit_pipelined, (kw, clip))
        for k, kw in FOUR_RANK_FITS.items()
    }
    cases |= {f"test_dp_x_pp_matches_one_process_on_the_union_of_the_shards[{s}]": (_fit_dp_pp, (s,)) for s in DP_X_PP}
    cases |= {
        f"test_dp_x_pp_reduces_an_expert_only_one_replica_used[{d}]": (_fit_dp_pp_routed, (d,))
        for d in ("replicate", "shard")
    }
    cases["test_dp_x_pp_reduces_once_per_accumulation_window"] = (_fit_dp_pp_accumulating, ())
    cases["test_dp_x_pp_16_true_window_gradients_stay_within_one_process_range"] = (_fit_dp_pp_half_accumulating, ())
    cases["test_dp_x_pp_reduces_a_layer_frozen_since_the_windows_first_micro_step"] = (_fit_dp_pp_frozen_mid_window, ())
    cases["test_dp_x_pp_validates_with_replica_zeros_batch_norm_statistics"] = (_fit_dp_pp_normed, ())
    cases["test_dp_x_pp_keeps_each_replicas_buffers_when_asked"] = (_fit_dp_pp_normed, (False,))
    # last: a step refused on the first stage's ranks only (those holding the cache) leaves the links closed
    cases["test_dp_x_pp_refuses_a_buffer_that_differs_between_replicas_naming_it"] = (_fit_dp_pp_growing, ())
    return launch(request, 4, cases, timeout=840)
