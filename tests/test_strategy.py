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

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layers(x * 2.0), y))

    def predict_step(self, batch, batch_idx):
        return self.layers(batch[0] * 2.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _trained(model) -> dict:
    """The weights this rank trained: after a Trainer call the model is whole again, with the layers
    of other pipeline ranks on the meta device (no weights here)."""
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


def _eval_data() -> DataLoader:
    """20 samples in batches of 6: uneven micro-batches, and a last batch of 2 (< m)."""
    g = torch.Generator().manual_seed(2)
    return DataLoader(TensorDataset(torch.randn(20, 6, generator=g), torch.randn(20, 2, generator=g)), batch_size=6)


def _evaluate(model, strategy, devices) -> tuple[float, torch.Tensor | None]:
    trainer = _trainer(strategy, devices)
    metrics = trainer.validate(model, _eval_data(), verbose=False)
    preds = trainer.predict(model, _eval_data())
    joined = None if preds is None or any(p is None for p in preds) else torch.cat(preds)
    return metrics[0]["val_loss"], joined


def _eval_pipelined(rank: int, world: int, strategy_kwargs: dict) -> tuple:
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    return _evaluate(Regressor(), TwoBPStrategy(**strategy_kwargs), world)


@pytest.mark.parametrize("strategy_kwargs", [dict(), dict(schedule="zb-v")], ids=["1f1b", "zb-v"])
def test_validate_and_predict_match_one_process(strategy_kwargs):
    ref_loss, ref_preds = _evaluate(Regressor(), "auto", 1)
    results = run_distributed(_eval_pipelined, 2, strategy_kwargs, timeout=180)
    for val_loss, _preds in results:
        assert val_loss == pytest.approx(ref_loss, rel=1e-5), "val_loss must be the mean over each batch"
    # predictions come back on the rank holding the last stage (rank 0 on the V, else the last rank)
    last = [p for _, p in results if p is not None]
    assert len(last) == 1
    torch.testing.assert_close(last[0], ref_preds, rtol=1e-5, atol=1e-6)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    y = torch.randn(64, 2, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _trainer(strategy, devices: int, **kw) -> pl.Trainer:
    if kw.get("plugins") == "fp16-scaler":
        from lightning.pytorch.plugins import MixedPrecision

        kw["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))]
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=kw.pop("max_steps", 3),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # Lightning shuffles training data whenever it installs a DistributedSampler; the comparison
        # needs the reference's order (every rank of one pipeline reads the same batches either way).
        use_distributed_sampler=kw.pop("use_distributed_sampler", False),
        **kw,
    )


def _fit_pipelined(rank: int, world: int, strategy_kwargs: dict, trainer_kwargs: dict) -> dict:
    # Processes exist already (as under torchrun): Lightning's environment reads these.
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )
    model = Regressor()
    trainer = _trainer(TwoBPStrategy(**strategy_kwargs), world, **trainer_kwargs)
    trainer.fit(model, _data())
    params = _trained(model)
    return {"params": params, "train_loss": float(trainer.callback_metrics["train_loss"])}


def _reference(**trainer_kwargs) -> tuple[dict, float]:
    model = Regressor()
    trainer = _trainer("auto", 1, **trainer_kwargs)
    trainer.fit(model, _data())
    return {n: q.detach() for n, q in model.named_parameters()}, float(trainer.callback_metrics["train_loss"])


@pytest.mark.parametrize(
    "strategy_kwargs, trainer_kwargs, rtol",
    [
        # Lightning's default use_distributed_sampler=True: with one data replica the loader (shuffle=False)
        # is read in its own order, as one process reads it (not by a shuffling DistributedSampler)
        (dict(), dict(use_distributed_sampler=True), 1e-5),
        (dict(schedule="zb-h1", num_microbatches=4), dict(), 1e-5),
        (dict(schedule="gpipe", split_backward=False), dict(accumulate_grad_batches=2, max_steps=2), 1e-5),
        (
            dict(schedule="zb-v", num_microbatches=2),
            dict(gradient_clip_val=0.05, gradient_clip_algorithm="value"),
            1e-5,
        ),
        (dict(schedule="zb-h2"), dict(gradient_clip_val=0.05), 1e-5),  # by norm: the global norm
        # bf16 autocast: the pipeline and one process round differently (per micro-batch vs whole
        # batch matmuls), so 2e-2 relative, as bf16's 8-bit mantissa allows after 3 steps.
        (dict(), dict(precision="bf16-mixed"), 2e-2),
        # fp16 with a GradScaler (Lightning attaches one on GPU; here given explicitly on CPU)
        (dict(schedule="zb-h1"), dict(plugins="fp16-scaler", gradient_clip_val=0.05), 1e-2),
        (dict(schedule="interleaved-1f1b"), dict(), 1e-5),
        (dict(schedule="1f1b", split_backward=False), dict(), 1e-5),
        # every block under torch.utils.checkpoint(use_reentrant=False) for the Trainer call (issue 21)
        (dict(schedule="zb-h1", activation_checkpointing="full"), dict(), 1e-5),
    ],
    ids=[
        "1f1b-2bp",
        "zb-h1",
        "gpipe-accumulate",
        "zb-v-clip-value",
        "zb-h2-clip-norm",
        "bf16-mixed",
        "fp16-scaler",
        "interleaved-2bp",
        "1f1b-fused",
        "zb-h1-checkpointed",
    ],
)
def test_fit_matches_one_process(strategy_kwargs, trainer_kwargs, rtol):
    ref, ref_loss = _reference(**trainer_kwargs)
    results = run_distributed(_fit_pipelined, 2, strategy_kwargs, trainer_kwargs, timeout=180)
    seen = set()
    for out in results:
        assert out["train_loss"] == pytest.approx(ref_loss, rel=rtol), "logged train_loss is not the batch mean"
        for name, value in out["params"].items():
            seen.add(name)
            torch.testing.assert_close(value, ref[name], rtol=rtol, atol=rtol / 10, msg=name)
    assert seen == set(ref), "every parameter lives on exactly one rank"
    assert all(set(results[0]["params"]).isdisjoint(r["params"]) for r in results[1:])


@pytest.mark.parametrize(
    "strategy_kwargs", [dict(schedule="1f1b"), dict(schedule="zb-h2", num_microbatches=4)], ids=["1f1b-2bp", "zb-h2"]
)
def test_fit_on_four_pipeline_ranks_matches_one_process(strategy_kwargs):
    ref, ref_loss = _reference(gradient_clip_val=0.05)
    results = run_distributed(_fit_pipelined, 4, strategy_kwargs, dict(gradient_clip_val=0.05), timeout=240)
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


def _expect_error(rank: int, world: int, model_cls, strategy_kwargs: dict, trainer_kwargs: dict, batch: int) -> str:
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
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
        (Regressor, dict(pipeline_degree=3), dict(), 8, "2 devices cannot be split into pipelines of 3"),
        (
            ParamFreeMiddle,
            dict(schedule="zb-v", balance=[1, 1, 1, 1], num_microbatches=2),
            dict(),
            8,
            r"pipeline rank 1 would hold no trainable parameters \(stage 1: layers 1-1, stage 2: layers 2-2\)",
        ),
        # torch's "empty parameter list" on rank 1 alone: both ranks stop at once, naming it
        (
            FirstStageOptimizer,
            dict(),
            dict(),
            8,
            r"configure_optimizers on pipeline rank 1 \(stages \[1\]\) gave an optimizer an empty parameter list",
        ),
    ],
    ids=["batch", "two-sequentials", "manual", "balance", "degree", "rank-without-parameters", "optimizer-empty"],
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


def _fit_dp_pp(rank: int, world: int, schedule: str) -> dict:
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    model = Regressor()
    # Lightning's DistributedSampler shards the data by data-parallel rank (the strategy's
    # distributed_sampler_kwargs); for training it shuffles with seed 0: replica d reads perm[d::2].
    trainer = _trainer(
        TwoBPStrategy(schedule=schedule, pipeline_degree=2), world, gradient_clip_val=0.05, use_distributed_sampler=True
    )
    trainer.fit(model, _data())
    return _trained(model)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_dp_x_pp_matches_one_process_on_the_union_of_the_shards(schedule):
    """4 processes = 2 pipelines x 2 ranks; each step's gradient is the mean over both shards
    (and clipping by norm sees the whole model once). On the V each rank holds two stages, whose
    reduces start at different times during the step."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
    # DistributedSampler(shuffle=True, seed=0) at epoch 0: one permutation, replica d takes perm[d::2];
    # step i of one process: replica 0's batch i, then replica 1's batch i (16 samples)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    order = torch.cat([torch.cat([perm[0::2][i * 8 : (i + 1) * 8], perm[1::2][i * 8 : (i + 1) * 8]]) for i in range(4)])
    model = Regressor()
    _trainer("auto", 1, gradient_clip_val=0.05).fit(model, DataLoader(TensorDataset(x[order], y[order]), batch_size=16))
    ref = dict(model.named_parameters())
    results = run_distributed(_fit_dp_pp, 4, schedule, timeout=240)
    for rank, params in enumerate(results):
        assert set(params) == set(results[rank % 2]), "replicas hold the same stages"
        assert set(params).isdisjoint(results[1 - rank % 2]) and set(results[0]) | set(results[1]) == set(ref)
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


class AdamRegressor(Regressor):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _fit_with_checkpoints(rank: int, world: int, folder: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    runs = {}
    for name, kw in (("straight", dict(max_steps=4)), ("resumed-to-2", dict(max_steps=2))):
        cb = ModelCheckpoint(dirpath=f"{folder}/{name}", every_n_train_steps=2, save_top_k=-1)
        model = AdamRegressor()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=TwoBPStrategy(schedule="zb-h1"),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[cb],
            limit_train_batches=2,
            **kw,
        )  # checkpoints at epoch ends
        trainer.fit(model, _data())
        runs[name] = _trained(model)
    # resume the second run from its step-2 checkpoint, up to step 4
    ckpt = sorted(os.listdir(f"{folder}/resumed-to-2"))[-1]
    model = AdamRegressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=TwoBPStrategy(schedule="zb-h1"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        max_steps=4,
        limit_train_batches=2,
    )
    trainer.fit(model, _data(), ckpt_path=f"{folder}/resumed-to-2/{ckpt}")
    runs["resumed"] = _trained(model)
    return runs


def test_checkpoint_resume_is_bitwise_and_consolidates(tmp_path):
    from lightning_twobp.lightning.checkpoint import consolidate

    results = run_distributed(_fit_with_checkpoints, 2, str(tmp_path), timeout=240)
    for runs in results:
        for name, value in runs["straight"].items():
            assert torch.equal(runs["resumed"][name], value), f"resumed {name} differs from the straight run"
    # the straight run's step-4 checkpoint, merged, loads into the unpipelined module
    step4 = sorted((tmp_path / "straight").iterdir())[-1]
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

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("m", torch.eye(16) * 0.5)

    def forward(self, x):
        for _ in range(300):
            x = torch.tanh(x @ self.m) * 2.0
        return x


class HeavyRegressor(Regressor):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 16), Heavy(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
        )


def _fit_balanced(rank: int, world: int, balance: str) -> dict:
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    model = HeavyRegressor()
    strategy = TwoBPStrategy(schedule="zb-h1", balance=balance)
    _trainer(strategy, world).fit(model, _data())
    return {"sizes": strategy.stage_sizes, "params": _trained(model)}


def test_balance_by_time_profiles_the_layers():
    """The parameter-free Heavy layer costs most of the time: "time" gives it a stage of its own
    (with the first layer), "params" does not see it; profiling leaves the numerics untouched."""
    model = HeavyRegressor()
    _trainer("auto", 1).fit(model, _data())
    ref = dict(model.named_parameters())
    by_time = run_distributed(_fit_balanced, 2, "time", timeout=180)
    by_params = run_distributed(_fit_balanced, 2, "params", timeout=180)
    assert by_time[0]["sizes"] == by_time[1]["sizes"] == [2, 5]
    assert by_params[0]["sizes"] != [2, 5]
    for out in by_time:
        for name, value in out["params"].items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def _fit_then_save(rank: int, world: int, folder: str, max_steps: int) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    model = AdamRegressor()
    cb = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=TwoBPStrategy(schedule="zb-h1", num_microbatches=4),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[cb],
        max_steps=max_steps,
        limit_train_batches=2,
    )  # checkpoints at epoch ends: resumable data
    trainer.fit(model, _data())
    return _trained(model)


def _resume_elsewhere(rank: int, world: int, ckpt: str, strategy_kwargs: dict) -> dict:
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    model = AdamRegressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=TwoBPStrategy(num_microbatches=4, **strategy_kwargs),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        max_steps=4,
        limit_train_batches=2,
    )
    trainer.fit(model, _data(), ckpt_path=ckpt)
    return _trained(model)


@pytest.mark.parametrize(
    "world, strategy_kwargs", [(1, dict()), (2, dict(schedule="zb-v"))], ids=["pp2-to-pp1", "pp2-to-v"]
)
def test_resume_under_another_partition_restores_optimizer_state(tmp_path, world, strategy_kwargs):
    """Saved at step 2 by a 2-stage pipeline, resumed to step 4 by one process (every stage on one
    rank) or by the V (4 stages, new boundaries): Adam's moments come back by parameter name, so the
    result is the uninterrupted run's (a fresh Adam state would move the weights elsewhere)."""
    straight = run_distributed(_fit_then_save, 2, str(tmp_path / "straight"), 4, timeout=180)
    final = {**straight[0], **straight[1]}
    step2 = sorted((tmp_path / "straight").iterdir())[0]
    assert "step=2" in step2.name
    resumed = run_distributed(_resume_elsewhere, world, str(step2), strategy_kwargs, timeout=180)
    merged = {k: v for r in resumed for k, v in r.items()}
    assert set(merged) == set(final)
    for name, value in merged.items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-7, msg=name)


def _fit_monitored(model, strategy, devices: int, folder: str) -> dict:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=folder, monitor="val_loss", mode="min", save_top_k=1)
    stop = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[ckpt, stop],
        max_epochs=20,
        limit_train_batches=2,
    )
    trainer.fit(model, _data(), _eval_data())
    return {
        "epoch": trainer.current_epoch,
        "stopped": stop.stopped_epoch,
        "best": float(ckpt.best_model_score),
        "path": ckpt.best_model_path,
    }


def _fit_monitored_pipelined(rank: int, world: int, folder: str) -> dict:
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    return _fit_monitored(Regressor(lr=0.05), TwoBPStrategy(schedule="zb-h1"), world, folder)


def test_model_checkpoint_and_early_stopping_on_a_validation_metric(tmp_path):
    """val_loss is the true mean and known on every rank, so EarlyStopping stops every rank at the
    one-process epoch and ModelCheckpoint keeps the one-process best, as a loadable sharded directory."""
    ref = _fit_monitored(Regressor(lr=0.05), "auto", 1, str(tmp_path / "ref"))
    assert 0 < ref["stopped"] < 19, "the reference must stop early for this test to mean something"
    for out in run_distributed(_fit_monitored_pipelined, 2, str(tmp_path / "pp"), timeout=180):
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


def _fit_with_overflow(rank: int, world: int) -> dict:
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    probe = _InjectOverflow()
    trainer = _trainer(TwoBPStrategy(schedule="zb-h1"), world, plugins="fp16-scaler", callbacks=[probe])
    trainer.fit(Regressor(), _data())
    return {"stepped": probe.stepped, "scale": float(trainer.precision_plugin.scaler.get_scale())}


def test_fp16_overflow_on_one_stage_skips_the_step_everywhere():
    """A GradScaler that sees inf on one stage skips the step; every other stage must skip it too and
    halve its scale alike, or the stages drift apart (each rank's scaler sees only its own grads)."""
    out = run_distributed(_fit_with_overflow, 2, timeout=180)
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

    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    model = GroupedRegressor()
    cb = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    strategy = TwoBPStrategy(schedule="1f1b", num_microbatches=4, balance=[3, 4])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
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


def test_resume_rebuilds_each_ranks_own_param_groups(tmp_path):
    """Every parameter keeps its own group's settings after a resume, whatever the rank's groups."""
    run_distributed(_group_settings, 2, str(tmp_path), False, timeout=180)
    resumed = run_distributed(_group_settings, 2, str(tmp_path), True, timeout=180)
    assert not any(n.endswith("bias") for n in resumed[0]) and any(n.endswith("bias") for n in resumed[1])
    for settings in resumed:
        assert settings and all(d == (0.1 if n.endswith("weight") else 0.0) for n, (d, _) in settings.items()), settings
        assert all(lr == pytest.approx(0.01 / 5) for _, lr in settings.values()), settings  # after step 4
