"""An optimizer whose step communicates (muon-optimizer's ``MuonWithAuxAdam`` all-gathers its weights over the
world) is refused where its group holds other pipeline stages: at its first step, before the collective runs."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
import torch.distributed as dist

from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning.checks import checked_optimizers
from lightning_twobp.processes import run_distributed

from conftest import Regressor, lightning_env, quiet_trainer, regression_data


class GathersOverTheWorld(torch.optim.SGD):
    """SGD, then an all_gather of its first parameter over the default group, the world (as muon's
    ``MuonWithAuxAdam`` gathers its updated weights); ``only_rank``: on that global rank only."""

    def __init__(self, params, only_rank: int | None = None, group=None) -> None:
        super().__init__(params, lr=0.1)
        self.only_rank, self.group, self.steps = only_rank, group, 0

    def step(self, closure=None):
        loss = super().step(closure)  # SGD's step is hooked too: its post-hook runs before the gather
        if self.only_rank is None or dist.get_rank() == self.only_rank:
            p = self.param_groups[0]["params"][0].detach()
            size = dist.get_world_size(self.group)
            dist.all_gather([torch.empty_like(p) for _ in range(size)], p, group=self.group)
        self.steps += 1
        return loss


class SumsOverTheWorld(torch.optim.SGD):
    """SGD after summing its squared gradient norm over the default group: with one replica the world is the
    pipeline, and a sum over its stages is what a global norm (SAM's) needs: allowed."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1)
        self.steps = 0

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        norm = sum(q.grad.square().sum() for g in self.param_groups for q in g["params"] if q.grad is not None)
        dist.all_reduce(torch.as_tensor(norm))
        super().step()
        self.steps += 1
        return loss


class ReducesOverReplicas(torch.optim.SGD):
    """SGD after an all_reduce of its gradients over this stage's data-parallel replicas: allowed."""

    def __init__(self, params, group) -> None:
        super().__init__(params, lr=0.1)
        self.group, self.steps = group, 0

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for q in (q for g in self.param_groups for q in g["params"] if q.grad is not None):
            dist.all_reduce(q.grad, group=self.group)
            q.grad /= dist.get_world_size(self.group)
        super().step()
        self.steps += 1
        return loss


class Stepping(Regressor):
    def __init__(self, make) -> None:
        super().__init__()
        self.make, self.forwards, self.opt = make, 0, None

    def training_step(self, batch, batch_idx):
        self.forwards += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        self.opt = self.make(self)
        return self.opt


def _fit(rank: int, world: int, how: str) -> tuple[str, int, int]:
    lightning_env(rank, world)
    makes = {
        "world": lambda m: GathersOverTheWorld(m.parameters()),
        "one-rank": lambda m: GathersOverTheWorld(m.parameters(), only_rank=1),
        "replicas": lambda m: ReducesOverReplicas(m.parameters(), m.trainer.strategy.group("dp")),
        "world-dp": lambda m: GathersOverTheWorld(m.parameters()),
        "world-sum": lambda m: SumsOverTheWorld(m.parameters()),
    }
    model = Stepping(makes[how])
    strategy = TwoBPStrategy(pipeline_degree=2, num_microbatches=2, pipeline_timeout=120)
    try:
        quiet_trainer(strategy, world, max_steps=3).fit(model, regression_data(32, batch_size=8, seed=1))
        said = "trained"
    except Exception as e:  # noqa: BLE001 - returned for the test to read
        said = f"{type(e).__name__}: {e}"
    return said, model.opt.steps if model.opt is not None else -1, model.forwards


_REFUSAL = (
    r"RuntimeError: GathersOverTheWorld.step called torch.distributed.all_gather over global ranks \[0, 1\] under "
    r"strategy='twobp' with pipeline_degree=2: global rank\(s\) \[{other}\] hold other pipeline stages .* within "
    r"this stage's data-parallel replicas only \(global ranks \[{me}\], self.trainer.strategy.group\('dp'\)\), or "
    r"all_reduce a norm or dot product over the pipeline's group \(self.trainer.strategy.group\('pp'\)\)\. "
    r"Use an optimizer .*SingleDeviceMuon or SingleDeviceMuonWithAuxAdam, or torch.optim.Muon.* Refused at the "
    r"first optimizer step, before the collective ran"
)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_an_optimizer_gathering_over_the_world_is_refused_at_its_first_step():
    """Before this check the gather wrote the other stage's weights into this one's (muon's MuonWithAuxAdam:
    1.84 off one process after 3 steps, silently), or gloo aborted on the sizes after the step's compute."""
    for rank, (said, steps, _) in enumerate(run_distributed(_fit, 2, "world", timeout=240)):
        assert re.search(_REFUSAL.format(me=rank, other=1 - rank), said, re.S), said
        assert steps == 0, "refused at the first step, before its gather and before any second step"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_sum_over_the_world_that_is_the_pipeline_trains():
    """pp 2, one replica: an all_reduce over the default group sums over the pipeline's stages (a review found it
    refused, as only the "pp" group object itself was allowed)."""
    for said, steps, _ in run_distributed(_fit, 2, "world-sum", timeout=240):
        assert (said, steps) == ("trained", 3), said


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_one_ranks_refusal_reaches_the_other_as_peer_failed():
    results = run_distributed(_fit, 2, "one-rank", timeout=240)
    (said0, steps0, _), (said1, steps1, _) = results
    assert re.search(_REFUSAL.format(me=1, other=0), said1, re.S), said1
    assert steps1 == 0
    assert said0.startswith("PeerFailed: ") and "GathersOverTheWorld.step called torch.distributed.all_gather" in said0
    assert steps0 == 1, "rank 0 stepped once (its step communicates with no one), then heard of rank 1's refusal"


def _fit_dp(rank: int, world: int) -> list[tuple[str, int, int]]:
    return [_fit(rank, world, "replicas"), _fit(rank, world, "world-dp")]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_under_pp_x_dp_a_collective_over_the_replicas_trains_and_one_over_the_world_is_refused():
    """4 ranks, 2 pipelines of 2: the step may all-reduce over its stage's replicas (global ranks g and g + 2)."""
    for rank, (replicas, world) in enumerate(run_distributed(_fit_dp, 4, timeout=540)):
        assert replicas[:2] == ("trained", 3), replicas
        ranks = ", ".join(map(str, sorted({rank % 2, rank % 2 + 2})))
        assert f"data-parallel replicas only (global ranks [{ranks}]" in world[0], world[0]
        assert "GathersOverTheWorld.step called torch.distributed.all_gather over global ranks [0, 1, 2, 3]" in world[0]
        assert world[1] == 0


def test_muon_over_the_world_is_refused_at_setup_and_its_single_device_variants_are_not(monkeypatch):
    """muon-optimizer (not a dependency): a module of that name with its classes, as the user imported it."""
    muon = types.ModuleType("muon")
    for name in ("Muon", "MuonWithAuxAdam", "SingleDeviceMuon", "SingleDeviceMuonWithAuxAdam"):
        setattr(muon, name, type(name, (torch.optim.SGD,), {"__module__": "muon"}))
    monkeypatch.setitem(sys.modules, "muon", muon)
    model = Regressor()

    def check(cls, degree: int = 2) -> None:
        optimizers = [cls(model.parameters(), lr=0.1)]
        checked_optimizers(lambda: None, model, lambda: optimizers, pp_rank=0, stages=[0], pipeline_degree=degree)

    for name in ("Muon", "MuonWithAuxAdam"):
        closure_wrapper = type("WithClosure", (getattr(muon, name),), {})  # the user's subclass adding a closure
        with pytest.raises(ValueError, match=rf"muon.{name} is not supported under strategy='twobp' with "):
            check(closure_wrapper)
        check(getattr(muon, name), degree=1)  # data parallel only: the world is this stage's replicas
    check(muon.SingleDeviceMuon)
    check(muon.SingleDeviceMuonWithAuxAdam)
