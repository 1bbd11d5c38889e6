"""Resuming from a mid-epoch checkpoint reproduces the uninterrupted run bitwise: the same batches
(torchdata's StatefulDataLoader and StatefulDistributedSampler, whose position Lightning saves), each
rank's random streams (dropout on both stages) and the step counters, also where configure_optimizers
reads trainer.estimated_stepping_batches (which sets the data up before the checkpoint is loaded);
resumed under schedule="auto" (which reads a batch before the checkpoint is loaded), the same batches;
and the optimizer's whole saved state, also where its train() makes empty entries or it steps only in
train mode (schedule-free optimizers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_twobp import TwoBPStrategy
from lightning_twobp.data.modules import _DataModule
from lightning_twobp.processes import run_distributed

import conftest
from conftest import Regressor, launch, lightning_env, own_weights, quiet_trainer, regression_data

pytestmark = pytest.mark.dist


class Data(_DataModule):
    """The package's data modules' loaders (the recipes'), over 128 random samples: 16 steps an epoch."""

    def __init__(self) -> None:
        super().__init__(batch_size=8, seed=3, num_workers=0)

    def _build(self):
        return regression_data(n=128).dataset, None


def _trainer(world: int, strategy: TwoBPStrategy, max_steps: int, callbacks: list, **kw) -> pl.Trainer:
    """The data module's own samplers (StatefulDistributedSampler), saving only where a test asks."""
    return quiet_trainer(
        strategy,
        world,
        max_steps=max_steps,
        **kw,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        use_distributed_sampler=True,
        callbacks=callbacks,
    )


class Estimating(Regressor):
    """Reads trainer.estimated_stepping_batches where OneCycleLR's users do, which (given max_epochs) sets
    the fit loop's data up before the checkpoint is restored (Lightning #20550)."""

    def configure_optimizers(self):
        assert self.trainer.estimated_stepping_batches == 7
        return super().configure_optimizers()


def _fit(
    world: int,
    max_steps: int,
    folder: str | None = None,
    ckpt_path: str | None = None,
    model_class: type[Regressor] = Regressor,
    trainer_kw: dict | None = None,
    **kw,
) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    losses: dict[int, float] = {}
    batches: dict[int, torch.Tensor] = {}

    class _Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
            batches[trainer.global_step] = batch[0].clone()

    cbs: list[pl.Callback] = [_Losses()]
    if folder:
        cbs.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1))
    pl.seed_everything(7, verbose=False)
    model = model_class(widths=(6, 32, 32, 2), dropout=0.5, optimizer=torch.optim.AdamW, lr=0.01)  # both stages drop
    strategy = TwoBPStrategy(**{"schedule": "zb-h1", "num_microbatches": 4, "balance": [3, 4], **kw})
    _trainer(world, strategy, max_steps, cbs, **(trainer_kw or {})).fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    return {"losses": losses, "weights": own_weights(model), "batches": batches}


def _runs(rank: int, world: int, folder: str) -> dict:
    lightning_env(rank, world)
    straight = _fit(world, 7)
    _fit(world, 3, folder=folder)  # stops at step 3 of 16, mid-epoch, with a checkpoint there
    resumed = _fit(world, 7, ckpt_path=f"{folder}/epoch=0-step=3.ckpt")
    # schedule="auto" reads a batch to measure the layers before the checkpoint is loaded
    auto = _fit(world, 5, ckpt_path=f"{folder}/epoch=0-step=3.ckpt", schedule="auto", memory_limit="1f1b")
    estimating = _fit(
        world, 7, ckpt_path=f"{folder}/epoch=0-step=3.ckpt", model_class=Estimating, trainer_kw={"max_epochs": 1}
    )
    return {"straight": straight, "resumed": resumed, "auto": auto, "estimating": estimating}


def test_resume_mid_epoch_is_bitwise(two_ranks):
    for rank, r in enumerate(two_ranks[MID_EPOCH]):
        straight = r["straight"]
        # resumed as it was saved, and by a model whose configure_optimizers reads the estimated step count
        for run in ("resumed", "estimating"):
            resumed = r[run]
            assert sorted(resumed["losses"]) == [4, 5, 6, 7], run
            for step, loss in resumed["losses"].items():
                assert loss == straight["losses"][step], f"rank {rank}, {run}: step {step}'s loss differs"
            for name, value in straight["weights"].items():
                assert torch.equal(resumed["weights"][name], value), f"rank {rank}, {run}: {name} differs"
        # resumed under schedule="auto" (whatever it picks), the data goes on from the saved position
        assert sorted(r["auto"]["batches"]) == [4, 5]
        for step, batch in r["auto"]["batches"].items():
            assert torch.equal(batch, straight["batches"][step]), f"rank {rank}: step {step} read another batch"


# ---------------------------------------------------------------------------------------------- stage streams
class Masks(pl.LightningModule):
    """Four stages of Linear + Dropout: same-shaped dropouts, so stages drawing from equal streams would
    draw equal masks. Each dropout's masks are recorded per training step, micro-batch by micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 16), nn.Dropout(0.5), *[m for _ in range(3) for m in (nn.Linear(16, 16), nn.Dropout(0.5))]
        )
        self.masks: dict[int, dict[int, list[torch.Tensor]]] = {}  # dropout -> global step -> masks
        self.drawn: dict[int, list[float]] = {}  # global step -> the step code's draws before the pipelined call
        for k in range(4):
            self.layers[2 * k + 1].register_forward_hook(self._recorder(k))

    def _recorder(self, k: int):
        def record(module, args, out):
            self.masks.setdefault(k, {}).setdefault(self.trainer.global_step, []).append((out == 0).clone())

        return record

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.drawn.setdefault(self.trainer.global_step, []).append(float(torch.rand(())))
        return F.mse_loss(self.layers(x)[:, :2], y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


M = 4  # micro-batches of 2 samples: each mask is 2 x 16


def _masks(
    world: int, max_steps: int, folder: str | None = None, ckpt_path: str | None = None, seed: int = 7, **kw
) -> dict:
    """Each dropout's masks per step: the last M records of the step (a stage's shape probe before the
    first step of a Trainer call runs its forward once more, outside its stream); under "drawn", the
    step code's draws per step, as a set (each micro-batch's, on the first stage and the last alike)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(seed, verbose=False)
    model = Masks()
    cbs = [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)] if folder else []
    strategy = TwoBPStrategy(num_microbatches=M, **{"schedule": "zb-v", "balance": [2, 2, 2, 2], **kw})
    _trainer(world, strategy, max_steps, cbs).fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    masks: dict = {k: {step: ms[-M:] for step, ms in steps.items()} for k, steps in model.masks.items()}
    return masks | {"drawn": {step: sorted(set(d)) for step, d in model.drawn.items()}}


def _stream_runs(rank: int, world: int, folder: str) -> dict:
    lightning_env(rank, world)
    return {
        "first": _masks(world, 4, folder=folder),  # zb-v: stages 0, 3 on rank 0; 1, 2 on rank 1
        "second": _masks(world, 4),
        # resumed at step 2 under interleaved 1F1B: stages 0, 2 on rank 0; 1, 3 on rank 1; the process seeded
        # otherwise (the step code's seed comes from the checkpoint)
        "resumed": _masks(world, 4, ckpt_path=f"{folder}/epoch=0-step=2.ckpt", seed=8, schedule="interleaved-1f1b"),
        # 2 data-parallel replicas of a pipeline of one rank holding both stages of the V
        "replicas": _masks(world, 2, pipeline_degree=1, balance=[4, 4]),
    }


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_each_stage_draws_from_its_own_stream_restored_by_stage(two_ranks):
    """Dropout masks: never equal between stages (each stage had its own stream) nor between data-parallel
    replicas; the same in a second run with the same seed; and after resuming under another layout, the
    same per stage as the uninterrupted run (a stage's stream is stored by stage, not by rank)."""
    ranks = two_ranks[STREAMS]
    drawn = {run: [r[run].pop("drawn") for r in ranks] for run in ("first", "second", "resumed", "replicas")}
    # the step code's draws: M per step, alike on the stages that run it (zb-v: rank 0 both), again on resume
    first_drawn = drawn["first"][0]
    assert drawn["first"][1] == {} and all(len(first_drawn[s]) == M for s in range(4)), drawn["first"]
    assert drawn["resumed"][0] == drawn["resumed"][1] == {s: first_drawn[s] for s in (2, 3)}, drawn["resumed"]
    masks = {}  # dropout -> step -> masks, from whichever rank held it
    for run in ("first", "second", "resumed"):
        masks[run] = {k: steps for r in ranks for k, steps in r[run].items()}
        assert sorted(masks[run]) == [0, 1, 2, 3]
    first = masks["first"]
    for step in range(4):
        for a in range(4):
            for b in range(a + 1, 4):
                assert _equal(first[a][step], first[b][step]) == 0, f"step {step}: dropouts {a} and {b} drew alike"
    assert all(_equal(first[k][s], masks["second"][k][s]) == M for k in range(4) for s in range(4))
    assert sorted(masks["resumed"][0]) == [2, 3]
    assert all(_equal(first[k][s], masks["resumed"][k][s]) == M for k in range(4) for s in (2, 3))
    replicas = [r["replicas"] for r in ranks]
    for k in range(4):
        for step in range(2):
            assert _equal(replicas[0][k][step], replicas[1][k][step]) == 0, f"replicas drew alike: dropout {k}"
    assert all(_equal(replicas[0][a][0], replicas[0][b][0]) == 0 for a, b in ((0, 2), (1, 3)))


# ---------------------------------------------------------------------------------------------- optimizer modes
class ModeSGD(torch.optim.SGD):
    """SGD with momentum that steps only in train mode, as schedule-free optimizers (schedulefree's
    AdamWScheduleFree) do: ``train()`` / ``eval()`` switch the mode, kept in the param groups (so saved),
    and ``train()`` reads ``self.state[p]``, which makes an empty state entry for every parameter."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr, momentum=0.9)
        for group in self.param_groups:
            group["train_mode"] = False

    def train(self) -> None:
        for group in self.param_groups:
            group["train_mode"] = True
            for q in group["params"]:
                self.state[q]  # noqa: B018 - the defaultdict's empty entry, as schedulefree's train() leaves

    def step(self, closure=None):
        if not all(group["train_mode"] for group in self.param_groups):
            raise RuntimeError("ModeSGD stepped in eval mode: call .train() first")
        return super().step(closure)


class ModeRegressor(Regressor):
    """Calls ``train()`` where schedule-free users do, at each epoch's start (after a checkpoint is loaded);
    ``early``: in configure_optimizers too."""

    def __init__(self, early: bool = False) -> None:
        super().__init__(widths=(6, 32, 32, 2), lr=0.05)
        self.early = early

    def configure_optimizers(self):
        opt = ModeSGD(self.parameters(), lr=self.lr)
        if self.early:
            opt.train()
        return opt

    def on_train_epoch_start(self) -> None:
        self.trainer.optimizers[0].train()

    def _momentum(self) -> dict[str, torch.Tensor | None]:
        opt = self.trainer.optimizers[0]
        return {n: opt.state[q].get("momentum_buffer") for n, q in self.named_parameters() if not q.is_meta}

    def on_train_start(self) -> None:  # after a checkpoint is loaded, before any step
        self.at_start = {n: None if b is None else b.clone() for n, b in self._momentum().items()}

    def on_train_end(self) -> None:
        self.at_end = {n: None if b is None else b.clone() for n, b in self._momentum().items()}


def _mode_fit(world: int, max_steps: int, folder: str | None = None, ckpt_path: str | None = None, **kw) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(7, verbose=False)
    model = ModeRegressor(**kw)
    cbs = [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)] if folder else []
    trainer = _trainer(world, TwoBPStrategy(schedule="1f1b", num_microbatches=2), max_steps, cbs)
    trainer.fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    return {"weights": own_weights(model), "at_start": model.at_start, "at_end": model.at_end}


def _mode_runs(rank: int, world: int, folder: str) -> dict:
    lightning_env(rank, world)
    out: dict = {"straight": _mode_fit(world, 5), "saved": _mode_fit(world, 2, folder=folder)}
    ckpt = f"{folder}/epoch=0-step=2.ckpt"
    for name, kw in {"late": {}, "early": {"early": True}}.items():
        try:
            out[name] = _mode_fit(world, 5, ckpt_path=ckpt, **kw)
        except Exception as err:  # noqa: BLE001 - raised on every rank alike at the load, before any step
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_resume_restores_every_saved_optimizer_state(two_ranks):
    """An optimizer that steps only in train mode, or whose train() makes empty state entries (schedule-free
    optimizers), resumes bitwise: the load reads every state entry the checkpoint holds for the rank's
    parameters (torch's template ran a step, refused in eval mode, on a fresh optimizer, and read no state
    from one with empty entries: the momentum was dropped without a word)."""
    for rank, r in enumerate(two_ranks[OPTIMIZER_MODES]):
        straight, saved = r["straight"], r["saved"]["at_end"]
        assert saved and all(b is not None for b in saved.values()), saved
        for run in ("late", "early"):
            resumed = r[run]
            assert isinstance(resumed, dict), f"rank {rank}, {run}: {resumed}"
            assert sorted(resumed["at_start"]) == sorted(saved), run
            for name, buf in saved.items():
                loaded = resumed["at_start"][name]
                assert loaded is not None and torch.equal(loaded, buf), f"rank {rank}, {run}: {name}'s momentum lost"
            for name, value in straight["weights"].items():
                assert torch.equal(resumed["weights"][name], value), f"rank {rank}, {run}: {name} differs"


# ---------------------------------------------------------------------------------------------- scheduled accumulation
def _scheduled(world: int, max_steps: int, folder: str | None = None, ckpt_path: str | None = None) -> dict:
    """2 batches a step in epoch 0 (8 steps), 3 in epoch 1; saved at step 10, mid-epoch 1, where asked."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint

    windows: dict[int, int] = {}

    class _Windows(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            windows[trainer.global_step] = trainer.accumulate_grad_batches

    cbs: list[pl.Callback] = [GradientAccumulationScheduler({0: 2, 1: 3}), _Windows()]
    if folder:
        cbs.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=10, save_top_k=-1))
    pl.seed_everything(7, verbose=False)
    model = Regressor(widths=(6, 32, 32, 2), optimizer=torch.optim.AdamW, lr=0.01)
    strategy = TwoBPStrategy(schedule="zb-h1", num_microbatches=4)
    _trainer(world, strategy, max_steps, cbs).fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    return {"weights": own_weights(model), "windows": windows}


def _straight_and_resumed(
    rank: int, world: int, folder: str, fit: Callable[..., Any], steps: int, saved_at: int, checkpoint: str
) -> dict:
    """``fit(world, max_steps, folder=..., ckpt_path=...)`` straight to ``steps``; to ``saved_at`` saving into
    ``folder``; then resumed from that save's file ``checkpoint`` to ``steps``."""
    lightning_env(rank, world)
    straight = fit(world, steps)
    fit(world, saved_at, folder=folder)
    return {"straight": straight, "resumed": fit(world, steps, ckpt_path=f"{folder}/{checkpoint}")}


def _scheduled_runs(rank: int, world: int, folder: str) -> dict:
    return _straight_and_resumed(rank, world, folder, _scheduled, 12, 10, "epoch=1-step=10.ckpt")


def test_a_mid_epoch_resume_accumulates_as_the_scheduler_says(two_ranks):
    """Lightning skips on_train_epoch_start in the epoch a fit resumes in, where GradientAccumulationScheduler
    sets the accumulation: the resumed epoch stepped after every batch (one process alike, Lightning 2.6)."""
    for rank, r in enumerate(two_ranks[SCHEDULED]):
        assert set(r["resumed"]["windows"].values()) == {3}, f"rank {rank}: {r['resumed']['windows']}"
        for name, value in r["straight"]["weights"].items():
            assert torch.equal(r["resumed"]["weights"][name], value), f"rank {rank}: {name} differs"


# ---------------------------------------------------------------------------------------------- auto's choice
def _rechosen_runs(rank: int, world: int, folder: str) -> list[str]:
    """Saved under ZB-H1 (m=4), resumed under schedule="auto" among GPipe at m=2: the warnings' texts."""
    import warnings

    lightning_env(rank, world)
    _fit(world, 3, folder=folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(
            world,
            5,
            ckpt_path=f"{folder}/epoch=0-step=3.ckpt",
            schedule="auto",
            memory_limit="2x1f1b",
            auto_schedules=["gpipe"],
            num_microbatches=2,
        )
    return [str(w.message) for w in caught if "was trained under" in str(w.message)]


def test_a_resume_under_auto_that_chooses_otherwise_says_it_is_not_bitwise(two_ranks):
    """schedule="auto" profiles again when a run resumes, from fresh timings: it may choose another schedule
    or micro-batch count than the run that saved (seen: 1f1b+2BP (m=4) saved, 1f1b (m=4) resumed; zb-v (m=2)
    saved, gpipe (m=1) resumed), and the resumed weights are then not bitwise the uninterrupted run's."""
    said = two_ranks[RECHOSEN]
    assert len(said[0]) == 1 and said[1] == [], said  # rank zero says it, once
    assert "trained under zb-h1 (m=4)" in said[0][0] and "num_microbatches=4" in said[0][0], said[0][0]


# ---------------------------------------------------------------------------------------------- replicas' buffers
def _normed(world: int, max_steps: int, folder: str | None = None, ckpt_path: str | None = None) -> dict:
    """pp 2 x dp 2, a batch norm on each stage; saved at step 3 where asked: this rank's weights and buffers."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def layers() -> nn.Module:
        return nn.Sequential(
            nn.Linear(6, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 2)
        )

    cbs = [ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1)] if folder else []
    pl.seed_everything(7, verbose=False)
    model = Regressor(optimizer=torch.optim.AdamW, lr=0.01, layers=layers)
    strategy = TwoBPStrategy(schedule="zb-h1", num_microbatches=4, pipeline_degree=2)
    _trainer(world, strategy, max_steps, cbs).fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
    return own_weights(model) | buffers


def _normed_runs(rank: int, world: int, folder: str) -> dict:
    return _straight_and_resumed(rank, world, folder, _normed, 5, 3, "epoch=0-step=3.ckpt")


def test_a_checkpoint_holds_replica_0s_buffers_and_resumes_them_bitwise(tmp_path):
    """Each replica updates its batch norms' running statistics from its own data between the broadcasts from
    replica 0; torch.distributed.checkpoint wrote a tensor every replica holds from whichever rank had least to
    write, so stage 0's statistics came from replica 1 and the resumed run's were neither run's."""
    results = run_distributed(_normed_runs, 4, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        for name, value in r["straight"].items():
            assert torch.equal(r["resumed"][name], value), f"rank {rank}: {name} differs"


MID_EPOCH = "test_resume_mid_epoch_is_bitwise"
RECHOSEN = "test_a_resume_under_auto_that_chooses_otherwise_says_it_is_not_bitwise"
SCHEDULED = "test_a_mid_epoch_resume_accumulates_as_the_scheduler_says"
STREAMS = "test_each_stage_draws_from_its_own_stream_restored_by_stage"
OPTIMIZER_MODES = "test_resume_restores_every_saved_optimizer_state"


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory) -> conftest.Launch:
    """Both tests' runs in one launch of 2 ranks."""
    root = tmp_path_factory.mktemp("resume")
    cases = {
        MID_EPOCH: (_runs, (str(root / "mid"),)),
        STREAMS: (_stream_runs, (str(root / "streams"),)),
        OPTIMIZER_MODES: (_mode_runs, (str(root / "modes"),)),
        SCHEDULED: (_scheduled_runs, (str(root / "scheduled"),)),
        RECHOSEN: (_rechosen_runs, (str(root / "rechosen"),)),
    }
    return launch(request, 2, cases, timeout=840)
