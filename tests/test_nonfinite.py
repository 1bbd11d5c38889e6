"""A NaN or inf anywhere in the pipeline is seen by every rank in the same step: training stops on every
rank naming the step, the stages and the micro-batch (``on_nonfinite="stop"``, the default), or the
step is skipped everywhere (``"skip"``); the weights never drift apart. The same reduction tells a hook
that clips by hand, by each rank's own norm, from one that changes the gradients as one process would."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_twobp import HookScaleError, NonFiniteError, TwoBPStrategy
from lightning_twobp.processes import run_distributed

import conftest
from conftest import Regressor, launch, lightning_env, own_weights, quiet_trainer, regression_data

pytestmark = pytest.mark.dist

BATCH, M, BAD_STEP, BAD_MB = 8, 4, 2, 1


class Net(Regressor):
    """The shared regressor (Adam) with an overflow in one gradient of the first stage only, at step
    ``inf_at`` (the loss stays finite)."""

    def __init__(self, inf_at: int | None = None) -> None:
        super().__init__(optimizer=torch.optim.Adam, lr=0.01)
        self.inf_at = inf_at

    def on_after_backward(self):
        strategy = self.trainer.strategy
        if self.global_step == self.inf_at and getattr(strategy, "is_first_stage", True):
            grad = self.layers[0].weight.grad
            grad = grad.to_local() if isinstance(grad, DTensor) else grad  # data_parallel="shard": its rows
            grad.view(-1)[0] = float("inf")


class SkipAt(pl.Callback):
    """One process: what skipping the step means (no parameter has a gradient at that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            for q in pl_module.parameters():
                q.grad = None


class ByHand(Net):
    """Changes the gradients in ``on_before_optimizer_step``: ``"clip-norm"`` by the norm of this module's
    parameters (each rank's own under the pipeline), ``"halve"`` by a constant, ``"clip-value"`` per element;
    ``"frozen-clip-norm"`` clips so with the first stage (layers.0) frozen, ``"drop-first"`` sets layers.0's
    gradients to None first (pipeline rank 0 then has no gradient left: one process's norm is rank 1's);
    ``"bf16-..."`` under precision="bf16-true", ``"bf16-scale"`` by a constant that rounds (0.3);
    ``"tiny-clip-norm"`` far below the norms (factors ~1e-6); ``"drop-mid-clip-norm"`` after setting layers.2's
    gradients to None (the rest of rank 1's still scaled by one factor)."""

    def __init__(self, hand: str) -> None:
        super().__init__()
        self.hand = hand
        if hand == "frozen-clip-norm":
            self.layers[0].requires_grad_(False)

    def on_before_optimizer_step(self, optimizer):
        params = list(self.parameters())
        if self.hand in ("drop-first", "drop-mid-clip-norm"):  # layers.2: beside layers.4 on rank 1
            for q in self.layers[0 if self.hand == "drop-first" else 2].parameters():
                q.grad = None
        if self.hand in (
            "clip-norm",
            "frozen-clip-norm",
            "drop-first",
            "bf16-clip-norm",
            "tiny-clip-norm",
            "drop-mid-clip-norm",
        ):
            torch.nn.utils.clip_grad_norm_(params, 1e-7 if self.hand == "tiny-clip-norm" else 0.05)
        elif self.hand == "clip-value":
            torch.nn.utils.clip_grad_value_(params, 0.005)
        else:
            for q in params:
                if q.grad is not None:
                    q.grad.mul_(0.3 if self.hand == "bf16-scale" else 0.5)


def _by_hand(rank: int, world: int, hand: str, schedule: str) -> dict:
    lightning_env(rank, world)
    model = ByHand(hand)
    precision = "bf16-true" if hand.startswith("bf16") else "32-true"
    strategy = TwoBPStrategy(num_microbatches=M, schedule=schedule)
    trainer = quiet_trainer(strategy, world, max_steps=3, precision=precision)
    try:
        trainer.fit(model, _data(False))
        error = None
    except HookScaleError as err:
        error = str(err)
    return {"error": error, "weights": own_weights(model)}


def _data(nan: bool) -> DataLoader:
    loader = regression_data(batch_size=BATCH)
    if nan:  # one sample of micro-batch BAD_MB of the batch at global step BAD_STEP
        loader.dataset.tensors[0][BAD_STEP * BATCH + BAD_MB * (BATCH // M), 3] = float("nan")
    return loader


def _fit(rank: int, world: int, kwargs: dict, nan_data: bool, inf_at: int | None) -> dict:
    lightning_env(rank, world)
    model = Net(inf_at)
    logged: list[float] = []

    class _Skipped(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append(float(trainer.callback_metrics.get("pipeline/skipped_steps", 0.0)))

    trainer = quiet_trainer(TwoBPStrategy(num_microbatches=M, **kwargs), world, max_steps=5, callbacks=[_Skipped()])
    try:
        trainer.fit(model, _data(nan_data))
        error = None
    except NonFiniteError as err:
        error = str(err)
    return {
        "error": error,
        "weights": own_weights(model),
        "step": trainer.global_step,
        "checks": trainer.strategy.step_checks,
        "logged": logged,
    }


def _anomaly(rank: int, world: int) -> str:
    lightning_env(rank, world)
    strategy = TwoBPStrategy(num_microbatches=M, pipeline_timeout=60)
    trainer = quiet_trainer(strategy, world, max_steps=5, detect_anomaly=True)
    try:
        trainer.fit(Net(), _data(True))
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(err).__name__}: {err}"
    return "trained on"


def _fit_saving(rank: int, world: int, folder: str) -> str:
    from lightning.pytorch.callbacks import ModelCheckpoint

    lightning_env(rank, world)
    saving = ModelCheckpoint(
        dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last=True, save_on_exception=True
    )
    strategy = TwoBPStrategy(num_microbatches=M, schedule="zb-h2")
    trainer = quiet_trainer(strategy, world, max_steps=5, callbacks=[saving], enable_checkpointing=True)
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(Net(), _data(True))
    return str(info.value)


def _reference(steps: int, skip_at: int | None = None, hand: str | None = None) -> dict:
    model = ByHand(hand) if hand is not None else Net()
    quiet_trainer(max_steps=steps, callbacks=[SkipAt(skip_at)] if skip_at is not None else []).fit(model, _data(False))
    return own_weights(model)


STOP = "test_a_nan_loss_stops_every_rank_naming_step_stages_and_microbatch"
SKIP = "test_skip_drops_the_step_on_every_stage_and_replica"
SAVE = "test_weights_known_not_finite_are_never_saved"
HAND = "test_a_hook_clipping_by_each_ranks_own_norm_stops_every_rank"
HANDS = [
    ("clip-norm", "1f1b"),
    ("clip-norm", "zb-h2"),
    ("halve", "zb-h2"),
    ("clip-value", "1f1b"),
    ("frozen-clip-norm", "1f1b"),
    ("drop-first", "zb-h2"),
    ("bf16-clip-norm", "1f1b"),
    ("bf16-scale", "1f1b"),
    ("tiny-clip-norm", "1f1b"),
    ("drop-mid-clip-norm", "1f1b"),
]
DATA_PARALLEL = ["replicate", "shard"]


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nonfinite")


@pytest.fixture(scope="module")
def two_ranks(request, saved_folder) -> conftest.Launch:
    """The cases in which every rank stops in the same step (the check's all-reduce), in one launch."""
    cases = {f"{STOP}[{s}]": (_fit, (dict(schedule=s), True, None)) for s in ("1f1b", "zb-h2")}
    cases[SAVE] = (_fit_saving, (str(saved_folder),))
    cases.update({f"{HAND}[{h}-{s}]": (_by_hand, (h, s)) for h, s in HANDS})
    return launch(request, 2, cases, timeout=600)


@pytest.fixture(scope="module")
def four_ranks(request) -> conftest.Launch:
    # 2 pipelines x 2 stages; the inf is on the first stage of both replicas' pipelines (sharded: in
    # each replica's own rows of the weight, seen by the check's sum over every rank)
    kwargs = dict(schedule="1f1b", pipeline_degree=2, on_nonfinite="skip")
    cases = {f"{SKIP}[{dp}]": (_fit, (dict(kwargs, data_parallel=dp), False, BAD_STEP)) for dp in DATA_PARALLEL}
    return launch(request, 4, cases, timeout=600)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2"])  # checked before the step; after it (post-validation)
def test_a_nan_loss_stops_every_rank_naming_step_stages_and_microbatch(two_ranks, request, schedule):
    out = two_ranks[request.node.name]
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


@pytest.mark.parametrize("data_parallel", DATA_PARALLEL)
def test_skip_drops_the_step_on_every_stage_and_replica(four_ranks, request, data_parallel):
    out = four_ranks[request.node.name]
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


@pytest.mark.parametrize(("hand", "schedule"), HANDS, ids=[f"{h}-{s}" for h, s in HANDS])
def test_a_hook_clipping_by_each_ranks_own_norm_stops_every_rank(two_ranks, request, hand, schedule):
    """``clip_grad_norm_(self.parameters())`` in a hook scales each rank's gradients by its own stages' norm
    (silently not one process's step before the check): every rank stops at the first step,
    naming the fix; under post-validation (zb-h2) that step was taken. A constant factor and a clip by value
    are what one process does: they train as it does. So does that clip where pipeline rank 0 has no gradient
    (its stage frozen, or its gradients set to None before the clip): one process's norm is rank 1's then
    (HookScaleError was raised for them, rank 0 counted as unscaled). Under bf16-true each element's product
    rounds: the clip is seen (it trained on: 3.9e-3 off one process after 3 steps), a constant that rounds trains on.
    Factors far below 1 are told apart (compared as 1 + factor they were not: Adam trained on, 8.7e-3 off), and
    a rank's gradients set to None beside the scaled ones leave its factor (they made it a change per element)."""
    out = two_ranks[request.node.name]
    refused = hand in ("clip-norm", "bf16-clip-norm", "tiny-clip-norm", "drop-mid-clip-norm")
    for rank, r in enumerate(out):
        err = r["error"]
        if not refused:
            assert err is None, err
        else:
            assert err is not None, f"rank {rank} trained on"
            assert "global step 0" in err and "pipeline rank 0: " in err and "pipeline rank 1: " in err, err
            assert "clip_grad_norm_(self.parameters(), max_norm)" in err and "gradient_clip_val" in err, err
            assert f"the step was {'' if schedule == 'zb-h2' else 'not '}taken" in err, err
        if hand.startswith("bf16") or schedule == "zb-h2" and refused:
            continue  # bf16 weights against one process: test_strategy's bf16-true test; a taken step
        ref = _reference(0) if refused else _reference(3, hand=hand)
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


def test_what_the_hooks_did_is_one_number_per_rank():
    """The codes a rank computes: r for every gradient scaled by r, 1 for none touched, -1 for a change of
    another kind (not judged; sent as an infinite tolerance), 0 for no gradient left to scale (a frozen
    stage, all zeros, all set to None: any factor is one process's); gradients dropped beside scaled ones
    leave the factor of the others; a 16-bit rank's tolerance lets a rounded product count as one factor."""
    from lightning_twobp.lightning.optimizer_checks import _hook_code

    before = torch.tensor([1.0, 2.0, 0.0])
    assert _hook_code(before, before * 0.25, 1e-5).item() == 0.25
    assert _hook_code(before, before * 1e-7, 1e-5).item() == pytest.approx(1e-7, rel=1e-6)  # not lost in 1 + r
    assert _hook_code(before, before, 1e-5).item() == 1.0
    assert _hook_code(before, torch.tensor([1.0, 1.0, 0.0]), 1e-5).item() == -1.0  # clip_grad_value_
    assert _hook_code(before, torch.tensor([0.5, 1.0, 3.0]), 1e-5).item() == -1.0  # a zero gradient made nonzero
    assert _hook_code(before, torch.tensor([float("inf"), 2.0, 0.0]), 1e-5).item() == -1.0  # an inf: not judged
    assert _hook_code(before, torch.tensor([0.0, 1.0, 0.0]), 1e-5).item() == 0.5  # layers dropped, the rest halved
    assert _hook_code(before, torch.zeros(3), 1e-5).item() == 0.0  # all dropped
    assert _hook_code(torch.zeros(0), torch.zeros(0), 1e-5).item() == 0.0
    assert _hook_code(torch.zeros(2), torch.zeros(2), 1e-5).item() == 0.0
    rounded = torch.tensor([0.3 * (1 + 2**-9), 0.6, 0.0])  # bf16 products: ratios within 2**-8 of each other
    assert _hook_code(before, rounded, 1e-5).item() == -1.0
    assert _hook_code(before, rounded, 2**-7).item() == pytest.approx(0.3 * (1 + 2**-9))


def test_detect_anomaly_names_the_operation_and_stops_every_rank():
    # Its own launch: the rank whose backward raises stops in the middle of a pipeline step.
    seen = run_distributed(_anomaly, 2, timeout=180)
    assert "trained on" not in seen, seen
    assert any("returned nan values" in s for s in seen), seen  # torch's anomaly message, on the rank it arose


def test_on_nonfinite_is_checked_at_construction():
    with pytest.raises(ValueError, match="on_nonfinite='ignore': choose 'stop'"):
        TwoBPStrategy(on_nonfinite="ignore")


def test_weights_known_not_finite_are_never_saved(two_ranks, saved_folder):
    """zb-h2 without clipping takes the NaN step before its check: neither the step's checkpoint nor
    save_on_exception's nor last.ckpt may hold those weights, and the error says what is on disk."""
    from lightning_twobp.lightning import checkpoint as ckpt

    for err in two_ranks[SAVE]:
        assert "the step was taken before the check" in err and "no checkpoint is written from them" in err, err
    saved = sorted(p.name for p in saved_folder.iterdir())
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"], saved  # nothing after step 2
    for name in saved:
        out = saved_folder.parent / f"{name}.pt"
        weights = ckpt.consolidate(saved_folder / name, out)["state_dict"]
        out.unlink()
        assert all(torch.isfinite(t).all() for t in weights.values()), name
