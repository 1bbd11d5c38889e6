"""Lightning's own demo models and LightningCLI under strategy="twobp"."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, DemoModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy

import conftest
from conftest import launch, lightning_env, quiet_trainer

# The tests share one launch of ranks (the fixture at the end): a test's first call may wait for it.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


# The contract's one change, as docs/strategy.md shows it: the layers to pipeline are one nn.Sequential
# (with at least as many layers as stages). Everything else is the demo's own code.
def boring() -> BoringModel:
    torch.manual_seed(0)
    model = BoringModel()
    model.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    return model


def demo() -> DemoModel:
    torch.manual_seed(0)
    model = DemoModel()
    model.l1 = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
    return model


DEMOS = {
    # its own train_dataloader: batches of 1, so one micro-batch; an MSE loss (a mean): exact
    "BoringModel": (boring, None, 1, 1e-6),
    # DemoModel's loss is x.sum(), a sum over the batch. The pipeline differentiates the mean of the
    # micro-batch losses (as accumulate_grad_batches does), 1/m of the sum's gradient; its Adam is
    # invariant to that scale up to eps, so the weights agree to about 1e-5.
    "DemoModel": (demo, lambda: DataLoader(RandomDataset(32, 64), batch_size=4), 2, 1e-5),
}


def _fit(name: str, strategy, devices: int) -> dict:
    make, data, _, _ = DEMOS[name]
    model = make()
    trainer = quiet_trainer(strategy, devices, max_steps=4, limit_val_batches=2)
    torch.manual_seed(1)  # RandomDataset draws at construction
    trainer.fit(model, data() if data else None)
    return {n: q.detach().clone() for n, q in model.named_parameters()}


def _fit_pipelined(rank: int, world: int, name: str) -> dict:
    lightning_env(rank, world)
    return _fit(name, TwoBPStrategy(num_microbatches=DEMOS[name][2], gather_full_model=True), world)


@pytest.mark.parametrize("name", list(DEMOS))
def test_lightning_demo_models_train_as_in_one_process(two_ranks, request, name):
    ref = _fit(name, "auto", 1)
    atol = DEMOS[name][3]
    for params in two_ranks[request.node.name]:
        assert set(params) == set(ref)
        for n, value in params.items():
            torch.testing.assert_close(value, ref[n], rtol=1e-5, atol=atol, msg=n)


class Shards(BoringModel):
    """A hook that hands out the next shard at each call and draws it at random, as BoringModel's does:
    ``balance="time"`` and ``schedule="auto"`` read the first batch in setup, and the hook ran two or three
    times where one process runs it once (trained on another shard, silently)."""

    def __init__(self, generator: bool) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
        self.calls, self.generator = 0, generator

    def train_dataloader(self) -> DataLoader:
        self.calls += 1
        shard = RandomDataset(32, 64)
        shard.data += self.calls
        # its order drawn from the random state the hook left, or from its own generator, which the profile's
        # read of the first batch moved on (a review found that loader trained in another order)
        g = torch.Generator().manual_seed(7) if self.generator else None
        return DataLoader(shard, batch_size=4, shuffle=True, generator=g)


PROFILED = {
    "balance-time": dict(balance="time", num_microbatches=2),
    "auto": dict(schedule="auto", memory_limit="1.5x1f1b"),
    "auto-own-generator": dict(schedule="auto", memory_limit="1.5x1f1b"),
}


def _fit_shards(strategy, devices: int, generator: bool) -> tuple[dict, int]:
    torch.manual_seed(0)
    model = Shards(generator)
    quiet_trainer(strategy, devices, max_steps=4, limit_val_batches=2).fit(model)
    return {n: q.detach().clone() for n, q in model.named_parameters()}, model.calls


def _fit_shards_pipelined(rank: int, world: int, case: str) -> tuple[dict, int]:
    lightning_env(rank, world)
    return _fit_shards(TwoBPStrategy(gather_full_model=True, **PROFILED[case]), world, "generator" in case)


@pytest.mark.parametrize("case", list(PROFILED))
def test_a_hook_made_loader_is_made_once_when_the_layers_are_profiled(two_ranks, request, case):
    ref, calls = _fit_shards("auto", 1, "generator" in case)
    assert calls == 1
    for params, calls in two_ranks[request.node.name]:
        assert calls == 1, f"train_dataloader() ran {calls} times"
        for n, value in params.items():
            torch.testing.assert_close(value, ref[n], rtol=1e-5, atol=1e-6, msg=n)


class CLIModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=4)  # m = 2p = 4 by default


def _cli(rank: int, world: int, strategy_args: list[str]) -> dict:
    from lightning.pytorch.cli import LightningCLI

    lightning_env(rank, world)
    cli = LightningCLI(
        CLIModel,
        save_config_callback=None,
        args=[
            "fit",
            "--trainer.accelerator=cpu",
            f"--trainer.devices={world}",
            "--trainer.max_steps=2",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_model_summary=false",
            *strategy_args,
        ],
    )
    s = cli.trainer.strategy
    return {
        "type": type(s).__name__,
        "schedule": s.schedule_name,
        "m": s.num_microbatches,
        "steps": cli.trainer.global_step,
    }


CLI = {
    "name": (["--trainer.strategy=twobp"], "1f1b"),
    "class-path": (
        [
            "--trainer.strategy=lightning_twobp.TwoBPStrategy",
            "--trainer.strategy.schedule=zb-h1",
            "--trainer.strategy.num_microbatches=2",
        ],
        "zb-h1",
    ),
}


@pytest.mark.parametrize("case", list(CLI))
def test_lightning_cli(two_ranks, request, case):
    schedule = CLI[case][1]
    for out in two_ranks[request.node.name]:
        assert out["type"] == "TwoBPStrategy" and out["schedule"] == schedule and out["steps"] == 2


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """Every case of this module, in one launch of 2 ranks."""
    cases = {f"test_lightning_demo_models_train_as_in_one_process[{n}]": (_fit_pipelined, (n,)) for n in DEMOS}
    cases |= {
        f"test_a_hook_made_loader_is_made_once_when_the_layers_are_profiled[{k}]": (_fit_shards_pipelined, (k,))
        for k in PROFILED
    }
    # last: LightningCLI seeds at random and exports PL_GLOBAL_SEED, which Lightning's DDP setup re-seeds from
    # (as in any DDP run), so a later fit in these processes draws other data than the reference's
    cases |= {f"test_lightning_cli[{k}]": (_cli, (args,)) for k, (args, _) in CLI.items()}
    return launch(request, 2, cases, timeout=840)
