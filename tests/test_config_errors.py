"""Every refused configuration, as one table: each case is a bad input a user can give, the error it
must raise before any compute, and the words of the message that name the numbers and the fix.

docs/troubleshooting.md, "Every refused configuration", has one row per case id (checked below), so
the table users read and the cases CI runs cannot drift apart.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.plugins import Precision
from test_materialize import Scale
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning.checks import checked_optimizers
from lightning_twobp.lightning.optimizer_groups import whole_model_places
from lightning_twobp.processes import free_port
from lightning_twobp.train import resume_path

from conftest import Regressor, quiet_trainer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"


# Some cases run a Trainer in the test process: the process group and MASTER_PORT it leaves are undone.
pytestmark = pytest.mark.usefixtures("no_leftover_process_group")


# ---------------------------------------------------------------------------------------------- models
class Net(Regressor):
    """Three layers in one Sequential called once per step: the smallest model the strategy accepts."""

    def __init__(self) -> None:
        super().__init__((6, 8, 2), log=False)


def _metric_on_meta() -> Regressor:
    """A Regressor built on the meta device with a torchmetrics Metric among its modules."""
    from torchmetrics import MeanMetric

    with torch.device("meta"):
        model = Regressor((6, 8, 2), log=False)
        model.mean = MeanMetric()
    return model


def _legacy_file(path: Path) -> Path:
    torch.save({"w": torch.zeros(1)}, path, _use_new_zipfile_serialization=False)  # torch before 1.6
    return path


def _weights(folder: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    """A safetensors file of Net's names, those of ``shapes`` with other shapes."""
    from safetensors.torch import save_file

    own = {k: torch.zeros(shapes.get(k, tuple(v.shape))) for k, v in Net().state_dict().items()}
    save_file(own, folder / "model.safetensors")
    return folder


def _on_meta(**layers) -> Regressor:
    """A Regressor built on the meta device, with ``layers=`` its Sequential's maker if given."""
    with torch.device("meta"):
        return Regressor((6, 8, 2), log=False, **layers)


class TwoSequentials(Net):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(2, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.layers(x)), y)


class SwapsLinears(Precision):
    """What Lightning's TransformerEnginePrecision / BitsandbytesPrecision (GPU packages) do in convert_module:
    every nn.Linear replaced by another layer holding a copy of its weights."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                new = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                new.load_state_dict(child.state_dict())
                setattr(module, name, new)
            else:
                self.convert_module(child)
        return module


class SyncNormed(Net):
    """Its layers converted by hand to nn.SyncBatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.SyncBatchNorm.convert_sync_batchnorm(
            nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
        )


class NoSequential(Net):
    def __init__(self) -> None:
        super().__init__()
        del self.layers
        self.proj = nn.Linear(6, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.proj(x), y)


class SkipsLayers(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(x[:, :2] * self.layers[2].bias, y)


class TrainedInput(Net):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(self.pre(x)), y)


class AutocastAroundLayers(Net):
    """The user's own autocast around the pipelined call: the pipeline would run the layers without it."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.layers(x)
        return F.mse_loss(out.float(), y)


class Manual(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class ClampsGradients(Net):
    """Per-parameter gradient clipping by a tensor hook (RL and GAN code): the pipeline ignored it, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[2].weight.register_hook(lambda g: g.clamp(-0.02, 0.02))


class StepsInBackward(Net):
    """torch's optimizer-in-backward: each parameter's optimizer stepped in its post-accumulate-grad hook."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = {id(q): torch.optim.SGD([q], lr=0.1) for q in self.parameters()}
        for q in self.parameters():
            q.register_post_accumulate_grad_hook(self._step_one)

    def _step_one(self, q: torch.Tensor) -> None:
        self.inner[id(q)].step()
        self.inner[id(q)].zero_grad()


class ClampsFromTrainStart(Net):
    """The clamp hook registered once training starts, after the strategy's setup."""

    def on_train_start(self) -> None:
        for q in self.parameters():
            q.register_hook(lambda g: g.clamp(-0.02, 0.02))


class ReturnsString(Net):
    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.layers(x)
        return "done"


class ReturnsNone(Net):
    """Skips a batch as one process skips it: by returning None."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.layers(x)
        return None


class LogsString(Net):
    def training_step(self, batch, batch_idx):
        self.log("phase", "warmup")
        return super().training_step(batch, batch_idx)


class CatsTheLoss(Net):
    """Collects each step's loss in a CatMetric (one number per call)."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics import CatMetric

        self.losses = CatMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.update(loss.detach())
        return loss


class RunningLoss(Net):
    """A running mean of the loss over a window of 5 steps, updated in the step."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.aggregation import RunningMean

        self.running = RunningMean(window=5)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("running_loss", self.running(loss.detach()), prog_bar=True)
        return loss


class GathersInStep(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(self.all_gather(x)[0]), y)


class StepsSchedulerInStep(Net):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}}

    def training_step(self, batch, batch_idx):
        self.lr_schedulers().step()
        return super().training_step(batch, batch_idx)


class ClosureTwice(torch.optim.SGD):
    """The shape of SAM's step (ascent, then descent): Lightning's closure called twice, then the step."""

    def step(self, closure):
        closure()
        closure()
        return super().step()


class ClosureTwiceNet(Net):
    def configure_optimizers(self):
        return ClosureTwice(self.parameters(), lr=0.1)


class CallsTwice(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(x), y) + F.mse_loss(self.layers(-x), -y)


class SyncsOnStep(Net):
    def __init__(self) -> None:
        super().__init__()
        from torchmetrics import MeanMetric

        self.mean = MeanMetric(dist_sync_on_step=True)


class LogsLooseMetric(Net):
    def __init__(self) -> None:
        super().__init__()
        from torchmetrics import MeanMetric

        self.loose = {"mean": MeanMetric()}  # a plain dict: not a submodule

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.loose["mean"](loss)
        self.log("mean", self.loose["mean"])
        return loss


class StrayTensor(Net):
    def configure_optimizers(self):
        return torch.optim.SGD([*self.parameters(), torch.zeros(3, requires_grad=True)], lr=0.1)


class EmptyOptimizer(Net):
    def configure_optimizers(self):
        return torch.optim.SGD(self.layers[3:].parameters(), lr=0.1)


def _lbfgs_on_two_ranks() -> None:
    net = Net()
    optimizers = [torch.optim.LBFGS(net.parameters(), lr=0.5)]
    checked_optimizers(lambda: None, net, lambda: optimizers, pp_rank=0, stages=[0], pipeline_degree=2)


def _groups_by_position() -> None:
    """Param groups cut by position in self.parameters(), seen on pipeline rank 1 of 2, which holds the
    last Linear only: one process's first group holds the first Linear, this rank's its own first."""

    class ByPosition(Net):
        def configure_optimizers(self):
            p = list(self.parameters())
            return torch.optim.SGD([{"params": p[:2]}, {"params": p[2:], "lr": 0.01}], lr=0.1)

    net = ByPosition()
    one_process = whole_model_places(net)
    net.layers[0] = nn.Identity()  # as the pipeline sets the other rank's layers aside
    optimizers = [net.configure_optimizers()]
    checked_optimizers(lambda: None, net, lambda: optimizers, 1, [1], 2, one_process)


def _tied_in_two_groups() -> None:
    """torch's refusal of a parameter in two groups, on pipeline rank 1 of 2 (tests/test_sharded.py's tied GPT-2
    makes it end to end: its embedding's group by module, the rest by name)."""
    net = Net()
    wte = net.layers[0].weight

    def setup() -> None:
        torch.optim.SGD([{"params": [wte]}, {"params": [wte, net.layers[2].weight]}], lr=0.1)

    checked_optimizers(setup, net, lambda: [], 1, [1], 2)


def _zero_over_two_stages() -> None:
    """ZeroRedundancyOptimizer over the world, seen from pipeline rank 1 of 2: global rank 0 holds stage 0."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    _one_rank_group()
    net = Net()
    optimizers = [ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)]
    checked_optimizers(lambda: None, net, lambda: optimizers, pp_rank=1, stages=[1], pipeline_degree=2)


def _muon_over_the_world() -> None:
    """muon-optimizer's MuonWithAuxAdam (not a dependency: a module of that name with its class, as the user
    imported it) seen on pipeline rank 0 of 2, subclassed to take Lightning's closure as users do."""
    import sys
    import types

    muon = types.ModuleType("muon")
    muon.MuonWithAuxAdam = type("MuonWithAuxAdam", (torch.optim.SGD,), {"__module__": "muon"})  # type: ignore[attr-defined]
    sys.modules["muon"] = muon
    try:
        net = Net()
        optimizers = [type("WithClosure", (muon.MuonWithAuxAdam,), {})(net.parameters(), lr=0.02)]
        checked_optimizers(lambda: None, net, lambda: optimizers, pp_rank=0, stages=[0], pipeline_degree=2)
    finally:
        del sys.modules["muon"]


class SharedBlocks(pl.LightningModule):
    """A ModuleList holding one block twice (weights shared between positions of the loop)."""

    def __init__(self) -> None:
        super().__init__()
        block = nn.Linear(6, 6)
        self.blocks = nn.ModuleList([block, block, nn.Linear(6, 6)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x)[:, :2], y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _LoopNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class LooseParameter(SharedBlocks):
    """A parameter the LightningModule holds directly beside the model its step calls (a learned temperature): the
    step's code around the call runs on every stage or on the last, so no one stage can hold it."""

    def __init__(self) -> None:
        super().__init__()
        del self.blocks
        self.net = _LoopNet()
        self.scale = nn.Parameter(torch.ones(6))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss((self.net(x) * self.scale)[:, :2], y)


class _LooseLoopNet(_LoopNet):
    """A parameter held directly beside the blocks, used before them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x):
        return super().forward(x * self.scale)


class LooseOnMeta(LooseParameter):
    """A model built on the meta device that holds a parameter directly beside its blocks: no module of its own
    initializes it."""

    def __init__(self) -> None:
        super().__init__()
        del self.scale
        with torch.device("meta"):
            self.net = _LooseLoopNet()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x)[:, :2], y)


class _KeepsAux(nn.Tanh):
    """A Tanh that keeps an auxiliary loss on itself in its forward, as a Switch MoE or a VQ-VAE layer does."""

    def forward(self, x):
        self.aux = x.pow(2).mean()
        return super().forward(x)


class AuxLossOnModule(Net):
    """The auxiliary loss of a layer on the first stage read back from the layer in training_step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(6, 8), _KeepsAux(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        return loss + 0.01 * sum(m.aux for m in self.layers if hasattr(m, "aux"))


class _AuxLinear(nn.Linear):
    def forward(self, x):
        out = super().forward(x)
        self.aux = out.pow(2).mean()  # a block's auxiliary loss kept on it
        return out


class AuxLossOnBlock(SharedBlocks):
    """The ModuleList contract's form: blocks that keep their auxiliary loss, summed in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_AuxLinear(6, 6) for _ in range(3)])

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 0.01 * sum(b.aux for b in self.blocks if hasattr(b, "aux"))


def _data(samples: int = 16, batch: int = 8, drop_last: bool = True, second_dim: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(samples, 6, generator=g), torch.randn(samples, second_dim, generator=g)),
        batch_size=batch,
        drop_last=drop_last,
    )


def _trainer(strategy: TwoBPStrategy, **kw) -> pl.Trainer:
    return quiet_trainer(strategy, **(dict(max_steps=2, use_distributed_sampler=True) | kw))


# What the latest _fit did: its model, the weights before, the module forwards it ran.
_SEEN: dict = {}


def _count_forward(module, args, output) -> None:
    _SEEN["forwards"] = _SEEN.get("forwards", 0) + 1


def _fit(
    model: pl.LightningModule | None = None,
    data: DataLoader | None = None,
    ckpt_path: str | None = None,
    trainer: dict | None = None,
    val: DataLoader | None = None,
    **strategy,
) -> pl.Trainer:
    t = _trainer(TwoBPStrategy(**strategy), **(trainer or {}))
    model = model or Net()
    _SEEN.update(model=model, before={k: v.detach().clone() for k, v in model.state_dict().items()}, forwards=0)
    handle = torch.nn.modules.module.register_module_forward_hook(_count_forward)
    try:
        t.fit(model, data if data is not None else _data(), val, ckpt_path=ckpt_path)
    finally:
        handle.remove()
    return t


def _one_rank_group() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _executor(schedule: tuple, modules: dict, step: tuple | None = None) -> None:
    from lightning_twobp.engine import PipelineExecutor
    from lightning_twobp.schedules import build_schedule

    _one_rank_group()
    ex = PipelineExecutor(
        build_schedule(*schedule[:3], **schedule[3] if len(schedule) > 3 else {}), modules, loss_fn=F.mse_loss
    )
    if step is not None:
        ex.step(*step)


def _saved_checkpoint(tmp: Path) -> Path:
    """A real strategy='twobp' checkpoint of two steps of Net."""
    t = _fit()
    path = tmp / "c.ckpt"
    t.save_checkpoint(path)
    if dist.is_initialized():
        dist.destroy_process_group()
    return path


def _damage(tmp: Path) -> str:
    path = _saved_checkpoint(tmp)
    shard = sorted(path.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, the size unchanged
    shard.write_bytes(bytes(data))
    _fit(ckpt_path=str(path), trainer=dict(max_steps=3))
    return ""


def _without_manifest(tmp: Path) -> None:
    path = _saved_checkpoint(tmp)
    (path / "twobp-manifest.json").unlink()
    _fit(ckpt_path=str(path), trainer=dict(max_steps=3))


def _not_twobp(tmp: Path) -> None:
    folder = tmp / "other.ckpt"
    folder.mkdir()
    _fit(ckpt_path=str(folder), trainer=dict(max_steps=3))


def _storage_options(tmp: Path) -> None:
    t = _fit()
    _SEEN.clear()  # the fit trained; the refusal is the save's
    t.strategy.save_checkpoint(t._checkpoint_connector.dump_checkpoint(), tmp / "c.ckpt", storage_options={"a": 1})


def _stale_optimizer(tmp: Path) -> None:
    t = _fit()
    _SEEN.clear()  # the fit trained; the refusal is the save's
    # what a later Trainer call with another layout does to a layer this rank did not train in it
    layer = next(m for m in t.lightning_module.modules() if isinstance(m, nn.Linear))
    layer.weight = nn.Parameter(layer.weight.detach().clone())
    t.save_checkpoint(tmp / "c.ckpt")


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from lightning_twobp.config import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # for ${hydra:...} in the run directory's paths
    return cfg


def _instantiate(*overrides: str):
    from lightning_twobp.train import instantiate_data

    return instantiate_data(_compose(*overrides))


def _plan(*overrides: str):
    from lightning_twobp.plan import plan_recipe

    return plan_recipe(list(overrides))


def _token_file(
    tmp: Path, n: int, dtype: str = "uint16", sidecar: dict | None = None, extra_byte: bool = False
) -> Path:
    import numpy as np

    path = tmp / "train.bin"
    data = (np.arange(n) % 250).astype(dtype).tobytes() + (b"\0" if extra_byte else b"")
    path.write_bytes(data)
    if sidecar is not None:
        (tmp / "train.bin.json").write_text(json.dumps(sidecar))
    return path


def _tokens(tmp: Path, n: int = 1000, seq_len: int = 8, vocab_size: int | None = None, **kw) -> None:
    from lightning_twobp.data.tokens import TokenFile

    TokenFile(_token_file(tmp, n, **kw), seq_len, vocab_size=vocab_size)


def _last(tmp: Path) -> None:
    run = tmp / "outputs" / "cpu-tiny-llama" / "2026-12-01_10-00-00"
    run.mkdir(parents=True)
    resume_path("last", str(run))


def _build(name: str, *args, **kw):
    import importlib

    module, cls = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)(*args, **kw)


# ---------------------------------------------------------------------------------------------- the table
# id -> (what is run, given a tmp_path; the exception; a regex the message must match)
Case = tuple[Callable[[Path], object], type[BaseException], str]
S, X, D = "lightning_twobp.schedules.build_schedule", "lightning_twobp.models", "lightning_twobp.data"
CASES: dict[str, Case] = {
    # schedules: pure data, refused when built
    "schedule-unknown": (
        lambda t: _build(S, "zb-x", 2, 4),
        ValueError,
        r"unknown schedule 'zb-x'; choose one of gpipe, 1f1b, .*zb-v",
    ),
    "schedule-zero-stages": (lambda t: _build(S, "1f1b", 0, 4), ValueError, r"num_stages must be an int >= 1, got 0"),
    "schedule-zero-microbatches": (
        lambda t: _build(S, "1f1b", 2, 0),
        ValueError,
        r"num_microbatches must be an int >= 1, got 0",
    ),
    "schedule-stages-not-multiple": (
        lambda t: _build(S, "interleaved-1f1b", 6, 4, stages_per_rank=4),
        ValueError,
        r"num_stages=6 is not a multiple of stages_per_rank=4: use 4 or 8",
    ),
    "schedule-1f1b-two-stages-per-rank": (
        lambda t: _build(S, "1f1b", 4, 4, stages_per_rank=2),
        ValueError,
        r"1f1b runs one stage per rank.*build_schedule\('interleaved-1f1b', 4, 4",
    ),
    "schedule-zb-h1-two-stages-per-rank": (
        lambda t: _build(S, "zb-h1", 4, 4, stages_per_rank=2),
        ValueError,
        r"zb-h1 runs one stage per rank.*build_schedule\('zb-v', 4, 4",
    ),
    "schedule-zb-v-one-stage-per-rank": (
        lambda t: _build(S, "zb-v", 2, 4),
        ValueError,
        r"zb-v needs stages_per_rank=2 .*build_schedule\('zb-v', 4, 4, stages_per_rank=2\)",
    ),
    "schedule-zb-fused": (
        lambda t: _build(S, "zb-h2", 2, 4, split_backward=False),
        ValueError,
        r"zb-h2 is split by definition .* use '1f1b' or 'gpipe'",
    ),
    "schedule-interleaved-microbatches": (
        lambda t: _build(S, "interleaved-1f1b", 8, 6, stages_per_rank=2),
        ValueError,
        r"on 4 ranks needs a micro-batch count that is a multiple of 4: use 4",
    ),
    # the executor: refused when it is made, or before the first action
    "executor-ranks": (
        lambda t: _executor(("1f1b", 2, 2), {0: nn.Linear(2, 2)}),
        ValueError,
        r"schedule '1f1b' has 2 ranks but the process group has 1: build the schedule with "
        r"num_stages = 1 x stages_per_rank",
    ),
    "executor-modules": (
        lambda t: _executor(("1f1b", 1, 2), {1: nn.Linear(2, 2)}),
        ValueError,
        r"rank 0 holds stages \[0\] in schedule '1f1b', but modules were given for stages \[1\]",
    ),
    "executor-microbatches": (
        lambda t: _executor(("1f1b", 1, 4), {0: nn.Linear(2, 2)}, ([torch.ones(1, 2)] * 3, [torch.ones(1, 2)] * 3)),
        ValueError,
        r"rank 0 holds stage 0: pass inputs as a sequence of 4 micro-batches \(got 3 items\)",
    ),
    "executor-non-tensor-between-stages": (
        lambda t: _executor(
            ("interleaved-1f1b", 2, 2, {"stages_per_rank": 2}),
            {0: _DictOut(), 1: nn.Identity()},
            ([torch.ones(1, 2)] * 2, [torch.ones(1, 2)] * 2),
        ),
        RuntimeError,
        r"shape exchange before the first action, stage 0 .* values passed between pipeline stages "
        r"must be tensors",
    ),
    "executor-packed-sequence-between-stages": (
        lambda t: _executor(
            ("interleaved-1f1b", 2, 2, {"stages_per_rank": 2}),
            {0: _PackedOut(), 1: nn.Identity()},
            ([torch.ones(1, 2)] * 2, [torch.ones(1, 2)] * 2),
        ),
        RuntimeError,
        r"shape exchange before the first action, stage 0 .* stage 0 returns a PackedSequence: .* Unpack it "
        r"\(torch.nn.utils.rnn.pad_packed_sequence\)",
    ),
    # TwoBPStrategy(...): refused when it is constructed
    "strategy-num-microbatches": (
        lambda t: TwoBPStrategy(num_microbatches=0),
        ValueError,
        r"TwoBPStrategy\(num_microbatches=0\): it must be a positive integer",
    ),
    "strategy-pipeline-degree": (
        lambda t: TwoBPStrategy(pipeline_degree=-2),
        ValueError,
        r"TwoBPStrategy\(pipeline_degree=-2\): it must be a positive integer",
    ),
    "strategy-stages-per-rank": (
        lambda t: TwoBPStrategy(stages_per_rank=1.5),
        ValueError,
        r"TwoBPStrategy\(stages_per_rank=1.5\): it must be a positive integer",
    ),
    "strategy-schedule": (
        lambda t: TwoBPStrategy(schedule="zero-bubble"),
        ValueError,
        r"unknown schedule 'zero-bubble'; choose one of",
    ),
    "strategy-zb-fused": (
        lambda t: TwoBPStrategy(schedule="zb-v", split_backward=False),
        ValueError,
        r"zb-v is split by definition",
    ),
    "strategy-max-pending-w": (
        lambda t: TwoBPStrategy(max_pending_w=-1),
        ValueError,
        r"max_pending_w=-1: give the most micro-batches per stage whose W may wait after their B",
    ),
    "strategy-max-pending-w-fused": (
        lambda t: TwoBPStrategy(max_pending_w=1, split_backward=False),
        ValueError,
        r"max_pending_w=1 caps the W that 2BP's split defers; .* drop max_pending_w or use split_backward=True",
    ),
    "strategy-batch-w": (
        lambda t: TwoBPStrategy(batch_w="yes"),
        ValueError,
        r"TwoBPStrategy\(batch_w='yes'\): use False \(off, the default\), True",
    ),
    "strategy-pretrained-legacy-file": (
        lambda t: TwoBPStrategy(pretrained=_legacy_file(t / "pytorch_model.bin")),
        ValueError,
        r"TwoBPStrategy\(pretrained='.*pytorch_model.bin'\): .* this file is neither safetensors nor a torch.save file "
        r"of torch >= 1.6 \(a zip archive, which each rank memory-maps .*\): it is in torch's legacy format .* load "
        r"it once and torch.save it again",
    ),
    "strategy-batch-w-fused": (
        lambda t: TwoBPStrategy(batch_w=True, split_backward=False),
        ValueError,
        r"batch_w=True\) joins the W that 2BP's split defers; .* drop batch_w or use split_backward=True",
    ),
    "strategy-batch-w-alone": (
        lambda t: TwoBPStrategy(schedule="zb-h1", batch_w=True),
        ValueError,
        r"schedule='zb-h1' at num_microbatches=4 runs each micro-batch's W on its own, so there is nothing to join",
    ),
    "strategy-auto-without-limit": (
        lambda t: TwoBPStrategy(schedule="auto"),
        ValueError,
        r"schedule='auto' picks the fastest schedule within memory_limit: give memory_limit",
    ),
    "strategy-auto-limit-form": (
        lambda t: TwoBPStrategy(schedule="auto", memory_limit="lots"),
        ValueError,
        r"memory_limit='lots': give bytes per device",
    ),
    "strategy-auto-limit-few-bytes": (
        lambda t: TwoBPStrategy(schedule="auto", memory_limit=1.5),
        ValueError,
        r"memory_limit=1.5 would be 1.5 bytes per device",
    ),
    "strategy-auto-chosen-option": (
        lambda t: TwoBPStrategy(schedule="auto", memory_limit="1f1b", max_pending_w=1),
        ValueError,
        r"schedule='auto' chooses max_pending_w itself; got max_pending_w=1",
    ),
    "strategy-limit-without-auto": (
        lambda t: TwoBPStrategy(schedule="1f1b", memory_limit=0.5),
        ValueError,
        r"memory_limit=0.5 is what schedule='auto' chooses within; with schedule='1f1b' drop it",
    ),
    "strategy-auto-checkpointing-without-auto": (
        lambda t: TwoBPStrategy(schedule="1f1b", activation_checkpointing="auto"),
        ValueError,
        r"TwoBPStrategy\(schedule='1f1b', activation_checkpointing='auto'\): 'auto' lets schedule='auto' checkpoint",
    ),
    "strategy-on-nonfinite": (
        lambda t: TwoBPStrategy(on_nonfinite="ignore"),
        ValueError,
        r"on_nonfinite='ignore': choose 'stop' .* or 'skip'",
    ),
    "strategy-balance-name": (
        lambda t: TwoBPStrategy(balance="flops"),
        ValueError,
        r"balance='flops': choose 'params' \(the default\), 'time' or a list of layer counts",
    ),
    "strategy-placement-name": (
        lambda t: TwoBPStrategy(placement="order"),
        ValueError,
        r"placement='order': choose 'call' \(the default: modules outside the blocks go where the model's forward "
        r"calls them\) or 'registration'",
    ),
    "strategy-balance-list": (
        lambda t: TwoBPStrategy(balance=[3, 0]),
        ValueError,
        r"balance=\[3, 0\]: a list of layer counts per stage must hold integers >= 1",
    ),
    "strategy-pipeline-timeout": (
        lambda t: TwoBPStrategy(pipeline_timeout=0),
        ValueError,
        r"pipeline_timeout=0: give the seconds .* \(> 0, default 600\)",
    ),
    "strategy-split-backward-not-bool": (
        lambda t: TwoBPStrategy(split_backward="false"),
        ValueError,
        r"TwoBPStrategy\(split_backward='false'\): it must be True or False, not a "
        r"str; pass a bool",
    ),
    "strategy-gather-not-bool": (
        lambda t: TwoBPStrategy(gather_full_model="no"),
        ValueError,
        r"TwoBPStrategy\(gather_full_model='no'\): it must be True or False, not a str",
    ),
    "strategy-post-validation-not-bool": (
        lambda t: TwoBPStrategy(post_validation="maybe"),
        ValueError,
        r"TwoBPStrategy\(post_validation='maybe'\): it must be True or False, or "
        r"None \(on for zb-h2 and zb-v, the default\)",
    ),
    "strategy-data-parallel": (
        lambda t: TwoBPStrategy(data_parallel="fsdp"),
        ValueError,
        r"data_parallel='fsdp': choose 'replicate' .* or 'shard'",
    ),
    "strategy-ddp-options": (
        lambda t: TwoBPStrategy(find_unused_parameters=True),
        TypeError,
        r"TwoBPStrategy got find_unused_parameters: DistributedDataParallel's options do not "
        r"apply .* remove them",
    ),
    "strategy-unknown-option": (
        lambda t: TwoBPStrategy(num_microbatch=4),
        TypeError,
        r"TwoBPStrategy got unknown option\(s\) num_microbatch \(did you mean num_microbatches\?\); its options are",
    ),
    # a Trainer call: refused at setup or when training starts, before the first step
    "fit-devices-not-multiple": (
        lambda t: _fit(pipeline_degree=2),
        ValueError,
        r"1 devices cannot be split into pipelines of 2: .*\(use one of \[1\]\)",
    ),
    "fit-shard-one-replica": (
        lambda t: _fit(data_parallel="shard"),
        ValueError,
        r"data_parallel='shard' with 1 data-parallel replica: there is nothing to shard the stages over",
    ),
    "fit-shard-precision": (
        lambda t: _fit(data_parallel="shard", trainer=dict(precision="64-true")),
        ValueError,
        r"data_parallel='shard' with precision='64-true': fp32 \('32-true'\), 'bf16-mixed', 'bf16-true', '16-true' "
        r"and '16-mixed' are supported; use one of those or data_parallel='replicate'",
    ),
    "fit-more-stages-than-layers": (
        lambda t: _fit(schedule="interleaved-1f1b", stages_per_rank=4),
        ValueError,
        r"3 layers cannot fill 4 stages: lower the number of stages to <= 3",
    ),
    "fit-balance-sum": (
        lambda t: _fit(schedule="interleaved-1f1b", stages_per_rank=2, balance=[1, 1]),
        ValueError,
        r"balance=\[1, 1\] sums to 2, but the Sequential has 3 layers",
    ),
    "fit-balance-entries": (
        lambda t: _fit(schedule="interleaved-1f1b", stages_per_rank=2, balance=[1, 1, 1]),
        ValueError,
        r"balance=\[1, 1, 1\] has 3 entries for 2 stages",
    ),
    "fit-batch-smaller-than-m": (
        lambda t: _fit(data=_data(16, 2), num_microbatches=4),
        ValueError,
        r"the training batch size 2 is smaller than num_microbatches=4",
    ),
    "fit-batch-before-sanity-check": (
        lambda t: _fit(data=_data(16, 2), val=_data(16, 8), num_microbatches=4, trainer=dict(num_sanity_val_steps=2)),
        ValueError,
        r"the training batch size 2 is smaller than num_microbatches=4",
    ),
    "fit-batch-not-divisible": (
        lambda t: _fit(data=_data(18, 6), num_microbatches=4),
        ValueError,
        r"training batch size 6 does not split into 4 micro-batches: use a batch size that "
        r"is a multiple of 4, or set num_microbatches to a divisor of 6",
    ),
    "fit-last-batch": (
        lambda t: _fit(data=_data(22, 8, drop_last=False), num_microbatches=4),
        ValueError,
        r"last batch holds 6 samples \(22 samples in batches of 8\), which do not split into 4 "
        r"micro-batches: pass drop_last=True",
    ),
    "fit-batch-tensors-differ": (
        lambda t: _fit(data=_batch_of_two_sizes(), num_microbatches=2),
        ValueError,
        r"cannot split the batch into micro-batches: its tensors have first dimensions "
        r"\[4, 8\]",
    ),
    "fit-two-sequentials": (
        lambda t: _fit(TwoSequentials()),
        ValueError,
        r"TwoSequentials holds 2 nn.Sequential modules \(head, layers\): name the one to pipeline with "
        r"layers=\.\.\.",
    ),
    "fit-layers-unknown": (
        lambda t: _fit(layers="blocks"),
        ValueError,
        r"layers='blocks' names no submodule of Net; candidates found: layers",
    ),
    "fit-layers-not-a-sequence": (
        lambda t: _fit(layers="layers.0"),
        ValueError,
        r"layers='layers.0' points to Linear, not to an nn.Sequential or an nn.ModuleList",
    ),
    "fit-no-sequential": (
        lambda t: _fit(NoSequential()),
        ValueError,
        r"NoSequential holds no nn.Sequential and no nn.ModuleList of blocks with parameters",
    ),
    # Lightning's weight averaging copies the whole model before the split: a shape error on one rank later
    "fit-weight-averaging": (
        lambda t: _fit(trainer=dict(callbacks=[StochasticWeightAveraging(swa_lrs=0.01)])),
        ValueError,
        r"callbacks=\[StochasticWeightAveraging\(...\)\] is not supported under strategy='twobp': it averages a copy "
        r"of the whole model.*twobp-consolidate",
    ),
    "fit-weight-averaging-ema": (
        lambda t: _fit(trainer=dict(callbacks=[EMAWeightAveraging()])),
        ValueError,
        r"callbacks=\[EMAWeightAveraging\(...\)\] is not supported under strategy='twobp'",
    ),
    # Lightning's DDP converts the model in its own setup, which the strategy replaces: ignored, silently
    "fit-sync-batchnorm": (
        lambda t: _fit(trainer=dict(sync_batchnorm=True)),
        ValueError,
        r"Trainer\(sync_batchnorm=True\) is not supported under strategy='twobp': SyncBatchNorm gathers.*GroupNorm",
    ),
    # gathers over the whole world, whose ranks hold other stages: a hang or a mismatch on GPU
    "fit-sync-batchnorm-module": (
        lambda t: _fit(SyncNormed()),
        ValueError,
        r"nn.SyncBatchNorm \(layers.1\) is not supported under strategy='twobp'",
    ),
    # the pipeline is built before the conversion: it trained the old layers, the optimizer held the new ones
    "fit-precision-replaces-layers": (
        lambda t: _fit(trainer=dict(plugins=[SwapsLinears()])),
        ValueError,
        r"SwapsLinears replaced layers of the model as it converted it, which strategy='twobp' does not support.*"
        r"precision='bf16-true'",
    ),
    "fit-model-pruning": (
        lambda t: _fit(trainer=dict(callbacks=[ModelPruning("l1_unstructured", amount=0.3)])),
        ValueError,
        r"callbacks=\[ModelPruning\(...\)\] is not supported under strategy='twobp': it collects the modules to "
        r"prune before the pipeline splits the model.*Prune before fit",
    ),
    "fit-backbone-finetuning": (
        lambda t: _fit(trainer=dict(callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])),
        ValueError,
        r"callbacks=\[BackboneFinetuning\(...\)\] is not supported under strategy='twobp': after unfreezing it "
        r"sets the learning rate of optimizer.param_groups\[-1\].*Subclass it",
    ),
    "fit-manual-optimization": (
        lambda t: _fit(Manual()),
        ValueError,
        r"strategy='twobp' supports automatic optimization only.*"
        r"self.automatic_optimization = True",
    ),
    # the split adds weight gradients into .grad itself, per micro-batch: the hooks ran on parts, or not at all
    "fit-parameter-grad-hook": (
        lambda t: _fit(ClampsGradients()),
        ValueError,
        r"layers.2.weight \(pipeline stage 0\) has a gradient hook \(Tensor.register_hook\), found at the Trainer's "
        r"setup, .*the hook would see parts of the gradient.*gradient_clip_algorithm='value'.*on_before_optimizer_step",
    ),
    "fit-parameter-post-accumulate-hook": (
        lambda t: _fit(StepsInBackward()),
        ValueError,
        r"layers.0.weight \(pipeline stage 0\) has a post-accumulate-grad hook "
        r"\(Tensor.register_post_accumulate_grad_hook\), found at the Trainer's setup.*"
        r"let Lightning step the optimizer",
    ),
    "fit-parameter-hook-at-train-start": (
        lambda t: _fit(ClampsFromTrainStart()),
        ValueError,
        r"layers.0.weight \(pipeline stage 0\) has a gradient hook \(Tensor.register_hook\), found before the first "
        r"training step \(registered in on_fit_start, on_train_start or on_train_batch_start\)",
    ),
    "fit-step-skips-layers": (
        lambda t: _fit(SkipsLayers()),
        RuntimeError,
        r"training_step did not call layers: under strategy='twobp' it must call the "
        r"pipelined block exactly once",
    ),
    "fit-scheduler-step-in-step": (
        lambda t: _fit(StepsSchedulerInStep()),
        RuntimeError,
        r"self.lr_schedulers\(\).step\(\) in training_step under strategy='twobp': the step's code runs once per "
        r"micro-batch \(2 per batch\).* step it where every rank runs once per batch \(on_train_batch_end\)",
    ),
    "fit-closure-twice-post-validation": (
        # a pipeline of one stage checks too: post_validation=True with clipping keeps a step to redo
        lambda t: _fit(ClosureTwiceNet(), trainer=dict(gradient_clip_val=0.05), post_validation=True),
        RuntimeError,
        r"training_step ran 2 times for one batch: the optimizer calls Lightning's closure more than once per "
        r"step \(SAM-style\), which post-validation .* cannot redo.* Use TwoBPStrategy\(post_validation=False\)",
    ),
    "fit-step-calls-twice": (
        lambda t: _fit(CallsTwice()),
        RuntimeError,
        r"the step called layers a second time: under strategy='twobp' it must call the "
        r"pipelined Sequential once per step .* layers\(torch.cat\(\[x, -x\]\)\)",
    ),
    "fit-autocast-around-layers": (
        lambda t: _fit(AutocastAroundLayers()),
        ValueError,
        r"training_step changes torch.autocast around its call of layers \(autocast there: cpu bfloat16; in the "
        r"Trainer's precision context: cpu off\).*use Trainer\(precision='bf16-mixed'\)",
    ),
    # the step reads it on the last stage, where the layer is a placeholder: hasattr was False, the term dropped
    "fit-aux-loss-on-module": (
        lambda t: _fit(AuxLossOnModule(), schedule="zb-v", balance=[2, 1]),
        RuntimeError,
        r"layers\[1\] stored a scalar that requires grad on itself in its training forward \(layers\[1\].aux; an "
        r"auxiliary loss kept on the module\?\), on a pipeline stage other than the last.*"
        r"`out, aux = self.layers\(x\)` in training_step",
    ),
    "fit-aux-loss-on-block": (
        lambda t: _fit(AuxLossOnBlock(), schedule="zb-v", balance=[1, 2]),
        RuntimeError,
        r"blocks.0 stored a scalar that requires grad on itself in its training forward \(blocks.0.aux; .*"
        r"A block passes one hidden state on under the ModuleList contract, so such a loss cannot travel with it",
    ),
    "fit-input-requires-grad": (
        lambda t: _fit(TrainedInput()),
        ValueError,
        r"the input of layers requires grad: a module with parameters runs before it in "
        r"training_step.*move it into the Sequential",
    ),
    "fit-step-returns-no-loss": (
        lambda t: _fit(ReturnsString()),
        RuntimeError,
        r"training_step returned str on micro-batch 0: .* must return the loss tensor",
    ),
    "fit-step-returns-none": (
        lambda t: _fit(ReturnsNone()),
        RuntimeError,
        r"training_step returned None on micro-batch 0, which skips the batch in one process: .* a step cannot "
        r"skip its batch",
    ),
    "fit-log-a-string": (
        lambda t: _fit(LogsString()),
        RuntimeError,
        r"self.log\('phase', str\) from a step under strategy='twobp': log a tensor, a number or a "
        r"torchmetrics Metric",
    ),
    "fit-metric-cat-one-number": (
        lambda t: _fit(CatsTheLoss()),
        RuntimeError,
        r"self.losses \(CatMetric\) was given one number in training_step under strategy='twobp': .* \(2 per "
        r"batch\), so it would hold 2 numbers per batch where one process holds one.*outputs\['loss'\]",
    ),
    "fit-metric-running-in-step": (
        lambda t: _fit(RunningLoss()),
        RuntimeError,
        r"self.running \(RunningMean, window=5\) was updated in training_step under strategy='twobp': its window "
        r"counts updates.* would hold 5 micro-batches, not 5 batches",
    ),
    "fit-num-nodes-one-machine": (
        lambda t: _fit(trainer=dict(num_nodes=2)),
        ValueError,
        r"Trainer\(num_nodes=2, devices=1\) on one machine: Lightning starts 1 process\(es\) "
        r"here and they would wait for 1 more from 1 other node\(s\) .* use num_nodes=1 with "
        r"devices=2",
    ),
    "fit-all-gather-in-step": (
        lambda t: _fit(GathersInStep()),
        RuntimeError,
        r"self.all_gather in training_step under strategy='twobp': .* would wait forever; "
        r"gather where every rank runs at once",
    ),
    "fit-optimizer-outside-model": (
        lambda t: _fit(StrayTensor()),
        ValueError,
        r"an optimizer of configure_optimizers on pipeline rank 0 holds 1 tensor\(s\) that "
        r"are not parameters of the LightningModule \(shapes \(3,\)\).*register it in the "
        r"module",
    ),
    "fit-optimizer-empty": (
        lambda t: _fit(EmptyOptimizer()),
        ValueError,
        r"configure_optimizers on pipeline rank 0 \(stages \[0\]\) gave an optimizer an empty "
        r"parameter list .* build every optimizer from self.parameters\(\)",
    ),
    "fit-optimizer-lbfgs": (
        # one process holds every stage, where LBFGS is exact: the check as setup runs it on 2 pipeline ranks
        # (tests/test_strategy.py's errors before compute refuse it end to end on 2 ranks)
        lambda t: _lbfgs_on_two_ranks(),
        ValueError,
        r"LBFGS is not supported under strategy='twobp' with pipeline_degree=2: its step takes dot products "
        r"and norms over all of its parameters .* Use an optimizer whose update is per parameter",
    ),
    "fit-optimizer-groups-by-position": (
        # the check as setup runs it on pipeline rank 1 of 2 (tests/test_strategy.py refuses it end to end)
        lambda t: _groups_by_position(),
        ValueError,
        r"configure_optimizers on pipeline rank 1 steps 2 of its parameters otherwise than one process does: "
        r"layers.2.weight is in optimizer 0 \(SGD, lr=0.1, .*\) here and in optimizer 0 \(SGD, lr=0.01, .*\) in one "
        r"process .* choose each group's parameters by name or module",
    ),
    "fit-optimizer-tied-in-two-groups": (
        lambda t: _tied_in_two_groups(),
        ValueError,
        r"configure_optimizers on pipeline rank 1 \(stages \[1\]\) put a parameter in two param groups \(some "
        r"parameters appear in more than one parameter group\)\. .* a tied weight .* Choose its group by one name",
    ),
    "fit-optimizer-zero-over-stages": (
        # the check as setup runs it on pipeline rank 1 of 2 (tests/test_strategy.py refuses it end to end)
        lambda t: _zero_over_two_stages(),
        ValueError,
        r"ZeroRedundancyOptimizer over global ranks \[0\] under strategy='twobp': global rank\(s\) \[0\] hold other "
        r"pipeline stages .* Shard over the data-parallel replicas of this stage: ZeroRedundancyOptimizer\(\.\.\., "
        r"process_group=self.trainer.strategy.group\('dp'\)\)",
    ),
    "fit-optimizer-muon-over-the-world": (
        # the check as setup runs it on pipeline rank 0 of 2 (tests/test_optimizer_collectives.py: any optimizer
        # whose step communicates over other stages' ranks, refused end to end at its first step)
        lambda t: _muon_over_the_world(),
        ValueError,
        r"muon.MuonWithAuxAdam is not supported under strategy='twobp' with pipeline_degree=2: its step splits the "
        r"parameters by dist.get_rank\(\) and dist.get_world_size\(\) of the world group .*muon's SingleDeviceMuon "
        r"or SingleDeviceMuonWithAuxAdam, or torch.optim.Muon",
    ),
    "fit-metric-dist-sync-on-step": (
        lambda t: _fit(SyncsOnStep()),
        ValueError,
        r"mean \(MeanMetric\) has dist_sync_on_step=True: under strategy='twobp' only the "
        r"last stage's rank runs the step past the pipelined block.*drop "
        r"dist_sync_on_step",
    ),
    "fit-log-loose-metric": (
        lambda t: _fit(LogsLooseMetric()),
        RuntimeError,
        r"self.log\('mean', MeanMetric\) under strategy='twobp': log a Metric that is an "
        r"attribute of the LightningModule",
    ),
    "fit-shared-blocks": (
        lambda t: _fit(SharedBlocks()),
        ValueError,
        r"blocks holds the same module more than once .* give every entry its own module",
    ),
    "fit-loose-parameter": (
        lambda t: _fit(LooseParameter()),
        ValueError,
        r"the LooseParameter itself holds parameters directly \(scale\) beside the model that holds the blocks in "
        r"net.blocks: .* put them in a module of their own registered after the model",
    ),
    "fit-loose-parameter-on-meta": (
        lambda t: _fit(LooseOnMeta()),
        ValueError,
        r"net.scale, a parameter held directly by net beside the blocks in net.blocks, is on the meta device: .*"
        r"Build the model on a real device",
    ),
    "fit-meta-no-reset-parameters": (
        lambda t: _fit(_on_meta(layers=lambda: nn.Sequential(nn.Linear(6, 4), Scale(), nn.Linear(4, 2)))),
        ValueError,
        r"layers.1 \(Scale\) holds scale on the meta device and has no reset_parameters\(\): .* give Scale a "
        r"reset_parameters\(\) that sets them, or build the model on a real device",
    ),
    "fit-meta-metric": (
        lambda t: _fit(_metric_on_meta()),
        ValueError,
        r"mean \(MeanMetric\) is a torchmetrics Metric built on the meta device: its states' defaults have no "
        r"values to start from; build the Metric outside",
    ),
    "fit-pretrained-shape": (
        lambda t: _fit(pretrained=_weights(t, {"layers.0.weight": (9, 6)})),
        ValueError,
        r"the pretrained weights in .* do not fit the model: 1 tensor\(s\) differ in shape: layers.0.weight: \(8, 6\) "
        r"in the model, \(9, 6\) in the file. Build the model with the config the weights were saved with",
    ),
    # checkpoints: refused before anything is loaded
    "checkpoint-not-twobp": (
        _not_twobp,
        RuntimeError,
        r"other.ckpt is not a strategy='twobp' checkpoint \(no meta.pt, no twobp-manifest.json\)",
    ),
    "checkpoint-damaged": (
        _damage,
        RuntimeError,
        r"checkpoint .*c.ckpt is damaged, not loaded: .*\.distcp: its SHA-256 differs",
    ),
    "checkpoint-no-manifest": (
        _without_manifest,
        RuntimeError,
        r"c.ckpt has no twobp-manifest.json: it was not written completely",
    ),
    "checkpoint-optimizer-stale": (
        _stale_optimizer,
        RuntimeError,
        r"was not saved: the optimizer steps 1 parameter\(s\) that are no longer the model's .*weights_only=True",
    ),
    "checkpoint-storage-options": (
        _storage_options,
        TypeError,
        r"save_checkpoint\(\.\.\., storage_options=\.\.\.\) is not supported",
    ),
    "checkpoint-last-none": (
        _last,
        FileNotFoundError,
        r"ckpt_path=last: no complete checkpoint under .*cpu-tiny-llama/\*/checkpoints/ .* "
        r"quoted for Hydra",
    ),
    # twobp-train and twobp-plan: the Hydra config
    "train-unknown-recipe": (lambda t: _compose("recipe=llama-7b"), Exception, r"Could not find 'recipe/llama-7b'"),
    "train-model-data-mismatch": (
        lambda t: _instantiate("model=tiny-resnet", "data=counting"),
        ValueError,
        r"data=counting does not fit model=tiny-resnet \(Interpolation key 'model.vocab_size' "
        r"not found\): use data=images for ResNet",
    ),
    "train-tokens-without-path": (
        lambda t: _instantiate("data=tokens"),
        ValueError,
        r"data.train_path has no value: give it on the command line, e.g. "
        r"data.train_path=data/my-corpus/train.bin",
    ),
    "plan-devices-not-multiple": (
        lambda t: _plan("trainer.devices=3", "strategy.pipeline_degree=2"),
        ValueError,
        r"3 devices cannot be split into pipelines of 2: devices x num_nodes must be a multiple of pipeline_degree "
        r"\(use one of \[1, 3\]\)",
    ),
    "plan-batch-not-divisible": (
        lambda t: _plan("data.batch_size=6", "strategy.num_microbatches=4"),
        ValueError,
        r"batch size 6 does not split into 4 micro-batches: set data.batch_size to a "
        r"multiple of 4",
    ),
    "plan-precision": (
        lambda t: _plan("trainer.precision=8-true"),
        ValueError,
        r"twobp-plan knows precisions .*; got '8-true'",
    ),
    "plan-optimizer": (
        lambda t: _plan("plan.optimizer=lion"),
        ValueError,
        r"plan.optimizer='lion': choose adamw, adam or sgd",
    ),
    "plan-auto-nothing-fits": (
        lambda t: _plan("trainer.devices=2", "schedule=auto", "strategy.memory_limit=1000"),
        ValueError,
        r"memory_limit=1000 bytes \(1000 B\) per device: no schedule fits; the smallest predicted peak is \d+ bytes",
    ),
    # data
    "data-batch-size": (
        lambda t: _build(f"{D}.TokenDataModule", vocab_size=16, seq_len=8, batch_size=0),
        ValueError,
        r"batch_size is 0: it must be at least 1",
    ),
    "data-val-without-train": (
        lambda t: _build(f"{D}.TokenDataModule", vocab_size=16, seq_len=8, batch_size=2, val_path="v.bin"),
        ValueError,
        r"val_path v.bin was given without a train path",
    ),
    "data-mask-token": (
        lambda t: _build(f"{D}.synthetic.MaskedCountingTokens", 16, 8, 10, mask_token_id=16),
        ValueError,
        r"mask_token_id 16 is outside the vocabulary of 16 ids: use an id in \[0, 16\)",
    ),
    "data-image-path": (
        lambda t: _build(
            f"{D}.ImageDataModule", num_classes=2, image_size=8, batch_size=2, path=str(t / "nope")
        ).setup(),
        FileNotFoundError,
        r"image path .*nope does not exist",
    ),
    "tokens-missing": (
        lambda t: _build(f"{D}.tokens.TokenFile", t / "train.bin", 8),
        FileNotFoundError,
        r"token file .*train.bin does not exist: write one with `twobp-tokenize",
    ),
    "tokens-no-sidecar": (
        lambda t: _tokens(t),
        ValueError,
        r"train.bin has no sidecar train.bin.json saying its dtype: pass dtype='uint16' or "
        r"dtype='uint32'",
    ),
    "tokens-truncated": (
        lambda t: _tokens(t, sidecar={"dtype": "uint16"}, extra_byte=True),
        ValueError,
        r"train.bin is 2,001 bytes, not a multiple of 2 \(uint16's item size\)",
    ),
    "tokens-too-short": (
        lambda t: _tokens(t, n=8, sidecar={"dtype": "uint16"}),
        ValueError,
        r"train.bin holds 8 tokens, too short for seq_len 8 \+ 1",
    ),
    "tokens-outside-vocab": (
        lambda t: _tokens(t, vocab_size=128, sidecar={"dtype": "uint16"}),
        ValueError,
        r"train.bin holds token id 249, outside the model's vocab_size 128: set vocab_size >= 250",
    ),
    # models
    "model-heads": (
        lambda t: _build(f"{X}.LlamaLM", dim=30, n_heads=4),
        ValueError,
        r"dim 30 must divide by n_heads 4",
    ),
    "model-lr-decay": (
        lambda t: _build(f"{X}.LlamaLM", lr_decay="linear-ish"),
        ValueError,
        r"lr_decay='linear-ish': choose one of",
    ),
    "model-hf-arch": (
        lambda t: _build(f"{X}.HFCausalLM", arch="t5"),
        ValueError,
        r"arch='t5': not a model type transformers has a causal LM for",
    ),
    "model-hf-config": (
        lambda t: _build(f"{X}.HFCausalLM", config=str(t / "nowhere")),
        ValueError,
        r"config='.*nowhere' does not exist: give a folder holding a Hugging Face config.json",
    ),
}


class _DictOut(nn.Module):
    def forward(self, x):
        return {"hidden": x}


class _PackedOut(nn.Module):
    def forward(self, x):
        return nn.utils.rnn.pack_padded_sequence(x.unsqueeze(-1), torch.tensor([x.shape[1]]), batch_first=True)


def _collate_gone_wrong(samples):
    return torch.stack([s[0] for s in samples]), torch.zeros(4, 2)


def _batch_of_two_sizes() -> DataLoader:
    """Batches of an 8-row input and a 4-row target."""
    return DataLoader(TensorDataset(torch.randn(16, 6)), batch_size=8, drop_last=True, collate_fn=_collate_gone_wrong)


# Refused at the first forward of step 0 (what only the user's own step can show); every other case
# is refused before any module runs.
AT_FIRST_FORWARD = {
    "fit-closure-twice-post-validation",  # the second call of the closure: the first step ran its pipeline
    "fit-log-loose-metric",
    "fit-step-calls-twice",
    "fit-step-skips-layers",
    "fit-input-requires-grad",
    "fit-step-returns-no-loss",
    "fit-step-returns-none",
    "fit-log-a-string",
    "fit-batch-tensors-differ",
    "fit-metric-cat-one-number",
    "fit-metric-running-in-step",
    "fit-aux-loss-on-module",
    "fit-aux-loss-on-block",
}


def _docs_rows() -> dict[str, list[str]]:
    section = DOCS.read_text().split("## Every refused configuration", 1)[1].split("\n## ", 1)[0]
    return {
        m[0]: [c.strip() for c in m[1].split(" | ")]
        for m in re.findall(r"^\| `([a-z0-9-]+)` \| (.*) \|$", section, re.M)
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_any_compute_with_the_numbers_and_the_fix(case, tmp_path):
    call, exc, match = CASES[case]
    _SEEN.clear()
    with pytest.raises(exc) as info:
        call(tmp_path)
    # Hydra and Lightning wrap some errors: the message may sit in the raised error's cause
    err = info.value
    msgs = [f"{type(e).__name__}: {e}" for e in (err, err.__cause__) if e is not None]
    message = next((m for m in msgs if re.search(match, m, re.S)), None)
    assert message is not None, f"{case}: {msgs}"
    # the docs row quotes the message: every fragment between its "..." is in it
    quoted = _docs_rows()[case][1].replace("`", "").split(" then ")
    for part in (p.strip() for q in quoted for p in q.split("...")):
        assert len(part) < 12 or part.rstrip(", ") in message.replace("`", ""), (
            f"{case}: the docs quote {part!r}, not in {message!r}"
        )
    if "model" in _SEEN:  # a Trainer call: no weight changed, no module ran unless the step had to
        if case not in AT_FIRST_FORWARD:
            assert _SEEN["forwards"] == 0, f"{case}: {_SEEN['forwards']} module forwards ran before the refusal"
        after = _SEEN["model"].state_dict()
        assert all(torch.equal(v, after[k]) for k, v in _SEEN["before"].items() if not after[k].is_meta), case


def test_every_case_has_a_row_in_the_docs_table():
    rows = re.findall(
        r"^\| `([a-z0-9-]+)` \|",
        DOCS.read_text().split("## Every refused configuration", 1)[1].split("\n## ", 1)[0],
        re.M,
    )
    assert len(rows) == len(set(rows)), "a case id appears twice in the docs table"
    assert set(rows) == set(CASES), (
        f"docs only: {sorted(set(rows) - set(CASES))}; tests only: {sorted(set(CASES) - set(rows))}"
    )
    assert len(CASES) >= 40


class AutocastOffAroundLayers(Net):
    """Autocast entered off around the call, naming another dtype: nothing changes for the layers."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.autocast("cpu", dtype=torch.float16, enabled=False):
            out = self.layers(x)
        return F.mse_loss(out, y)


def test_autocast_that_changes_nothing_around_the_call_trains():
    """The control for fit-autocast-around-layers: the dtype of an autocast that is off is not compared."""
    assert _fit(AutocastOffAroundLayers()).global_step == 2


class _KeepsDetached(nn.Tanh):
    def forward(self, x):
        self.aux, self.seen = x.pow(2).mean().detach(), x  # a detached scalar, an activation kept for a look
        return super().forward(x)


class ReparametrizedFirstStage(AuxLossOnModule):
    """The controls for fit-aux-loss-on-module: torch's hook-based weight_norm sets a computed weight as an
    attribute before each forward, and values kept detached or not scalar reach no loss term."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        weight_norm = torch.nn.utils.weight_norm  # the hook-based form (deprecated), still common
        self.layers = nn.Sequential(weight_norm(nn.Linear(6, 8)), _KeepsDetached(), _Gated(), nn.Linear(8, 2))


class _Gated(nn.Module):
    """Keeps the gate its forward uses on itself: a scalar with grad that the stage's output depends on."""

    def __init__(self) -> None:
        super().__init__()
        self.logit = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        self.alpha = torch.sigmoid(self.logit)
        return x * self.alpha


def test_reparametrized_weights_and_detached_values_on_a_first_stage_train():
    with pytest.warns(FutureWarning, match="weight_norm"):
        model = ReparametrizedFirstStage()
    assert _fit(model, schedule="zb-v", balance=[3, 1]).global_step == 2


def test_a_batch_that_splits_trains():
    """The control for the batch cases: 20 samples in batches of 8 leave a last batch of 4, which splits
    into 4 micro-batches, so nothing is refused and every batch trains."""
    t = _fit(data=_data(20, 8, drop_last=False), num_microbatches=4, trainer=dict(max_steps=-1, max_epochs=1))
    assert t.global_step == 3


class NextShard(Net):
    """Its ``train_dataloader()`` hands out the next shard at each call, as a user's streaming data may:
    the strategy's own check before the sanity check called it once more than one process does, and the run
    trained on the second shard (found by a trial)."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.calls = batch, 0

    def train_dataloader(self):
        self.calls += 1
        return _data(16, self.batch)

    def val_dataloader(self):
        return _data(16, 8)


@pytest.mark.parametrize("batch", [8, 2])
def test_a_training_loader_from_a_hook_is_asked_for_once_as_in_one_process(batch):
    model = NextShard(batch)
    t = _trainer(TwoBPStrategy(num_microbatches=4), num_sanity_val_steps=2)
    if batch == 8:
        t.fit(model)
        assert t.global_step == 2
    else:  # refused when Lightning asks for it, before the first training step
        with pytest.raises(ValueError, match=r"the training batch size 2 is smaller than num_microbatches=4"):
            t.fit(model)
        assert t.global_step == 0
    assert model.calls == 1


class Teacher(Net):
    """A copy of the pipelined layers outside the pipeline: ``how`` says what happens to it in training."""

    def __init__(self, how: str) -> None:
        super().__init__()
        import copy

        self.teacher = copy.deepcopy(self.layers).requires_grad_(False)
        self.register_buffer("temperature", torch.ones(()))
        self.how = how

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            if self.how == "averaged":
                self.averaged.update_parameters(self.layers)
            elif self.how != "epoch-end":
                self._ema()
            self.temperature.mul_(0.5)  # a buffer written on a schedule: left alone

    def on_train_epoch_end(self):
        if self.how == "epoch-end":  # the last epoch's write: seen at the end of training
            self._ema()

    @torch.no_grad()
    def _ema(self) -> None:
        pairs = zip(self.teacher.parameters(), self.layers.parameters(), strict=False)
        for t, q in pairs:  # the mean-teacher / BYOL update, as written for one process
            if self.how == "data":  # Lightning Bolts' BYOLMAWeightUpdate: no version counter moves
                t.data = 0.9 * t.data + 0.1 * q.data
            elif self.how == "data-in-place":  # MoCo's momentum update: neither version nor storage moves
                t.data.mul_(0.9).add_(q.data, alpha=0.1)
            elif self.how != "frozen":
                t.mul_(0.9).add_(q, alpha=0.1)

    def on_train_start(self):
        if self.how == "averaged":
            self.averaged = torch.optim.swa_utils.AveragedModel(self.teacher)


@pytest.mark.parametrize("how", ["ema", "data", "data-in-place", "epoch-end", "averaged", "frozen"])
def test_a_copy_outside_the_pipeline_written_in_training_is_refused(how):
    """An EMA teacher (or AveragedModel) outside the pipeline, updated from the pipelined layers, holds another
    value on every rank (each holds only its own stages' weights; a trial's teacher was 0.23 off one process
    after an epoch, silently): refused before the next step, naming it. A frozen reference model and a
    buffer written on a schedule train on."""
    if how == "frozen":
        assert _fit(Teacher(how), layers="layers").global_step == 2
        return
    with pytest.raises(
        ValueError,
        match=r"(teacher|averaged.module).0.weight.* changed during training \(seen "
        + ("at the end of training" if how == "epoch-end" else r"before global step 1")
        + r"\).* not supported yet: keep it frozen",
    ):
        _fit(Teacher(how), layers="layers")


def test_ckpt_path_last_finds_the_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "outputs" / "cpu-tiny-llama" / "2026-12-01_10-00-00"
    run.mkdir(parents=True)
    older = tmp_path / "outputs" / "cpu-tiny-llama" / "2026-11-30_10-00-00" / "checkpoints" / "epoch=0-step=5.ckpt"
    older.mkdir(parents=True)
    (older / "twobp-manifest.json").write_text("{}")
    assert resume_path("last", str(run)) == str(older)
    assert resume_path("some/path", str(run)) == "some/path" and resume_path(None, str(run)) is None


def test_ckpt_path_last_resumes_the_newest_checkpoint_of_this_model(tmp_path, capsys):
    """A newer run with other overrides (``model.vocab_size``) holds other shapes: ``last`` took it, and torch's
    loader failed on a size mismatch naming neither checkpoint (found by the docs trial)."""
    from omegaconf import OmegaConf

    runs = tmp_path / "outputs" / "cpu-tiny-llama"
    ckpts = {}
    for when, vocab in [("2026-11-29_10-00-00", 256), ("2026-11-30_10-00-00", 384)]:
        (runs / when / ".hydra").mkdir(parents=True)
        OmegaConf.save(
            OmegaConf.create({"model": {"dim": 64, "vocab_size": vocab}}), runs / when / ".hydra/config.yaml"
        )
        ckpts[vocab] = runs / when / "checkpoints" / "epoch=0-step=5.ckpt"
        ckpts[vocab].mkdir(parents=True)
        (ckpts[vocab] / "twobp-manifest.json").write_text("{}")
    os.utime(ckpts[256] / "twobp-manifest.json", (1, 1))  # the older
    run = str(runs / "2026-12-01_10-00-00")
    assert resume_path("last", run, OmegaConf.create({"dim": 64, "vocab_size": 384})) == str(ckpts[384])
    assert resume_path("last", run, OmegaConf.create({"dim": 64, "vocab_size": 256})) == str(ckpts[256])
    assert "model.vocab_size 384 there, 256 here; resuming" in capsys.readouterr().out
    # none alike (a changed learning rate, found by a review: refused, where the shapes were the same): the newest
    assert resume_path("last", run, OmegaConf.create({"dim": 64, "vocab_size": 512})) == str(ckpts[384])
    assert "model.vocab_size 384 there, 512 here; resuming it all the same" in capsys.readouterr().out


def test_pipeline_timeout_bounds_lightnings_collectives_too():
    """The process group's timeout follows pipeline_timeout, and so do the groups the strategy makes
    (torch's new_group would give them its own 30-minute default); checkpoint I/O keeps 30 minutes."""
    from datetime import timedelta

    assert TwoBPStrategy()._timeout == timedelta(seconds=600)
    assert TwoBPStrategy(pipeline_timeout=5)._timeout == timedelta(seconds=60)  # not below a minute
    assert TwoBPStrategy(pipeline_timeout=5, timeout=timedelta(seconds=90))._timeout == timedelta(seconds=90)
    strategy = _fit(pipeline_timeout=5).strategy

    def timeout(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    assert timeout(dist.group.WORLD) == timedelta(seconds=60)
    assert (
        timeout(strategy.device_mesh.get_group("pp"))
        == timeout(strategy.device_mesh.get_group("dp"))
        == timedelta(seconds=60)
    )
    assert timeout(strategy.io_group) == timedelta(minutes=30)


def test_a_wandb_gradient_hook_is_refused_with_its_own_fix():
    """WandbLogger.watch(log='gradients') registers a read-only hook on every parameter: the refusal names
    wandb's own option, not the clamp fixes of a hook that changes gradients."""
    from lightning_twobp.lightning.checks import _hook_refusal

    def hook(grad):
        return None

    hook.__module__ = "wandb.integration.torch.wandb_torch"  # where wandb's watch defines its hooks
    message = _hook_refusal("layers.0.weight (pipeline stage 0)", [hook], "at the Trainer's setup")
    assert "wandb" in message and "log='parameters'" in message and "gradient_clip_algorithm" not in message
    assert "gradient_clip_algorithm" in _hook_refusal("layers.0.weight (pipeline stage 0)", [print], "at setup")
