"""The schedule registry: every registered schedule walked through build, validate, simulate, lowering and
the executor; a schedule registered in a test runs through Trainer with no other edit; one memory replay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.schedules import (
    SCHEDULES,
    Action,
    MemoryClass,
    Schedule,
    ScheduleSpec,
    build_schedule,
    check_comm_deadlock,
    lower_communication,
    peak_activations,
    register_schedule,
    replay_memory,
    schedule_label,
    schedule_spec,
    simulate,
    unregister_schedule,
)
from lightning_twobp.schedules.builders import gpipe

import conftest
from conftest import Regressor, launch, lightning_env, quiet_trainer, regression_data

ROOT = Path(__file__).resolve().parent.parent


def _layouts(spec: ScheduleSpec) -> list[tuple[int, bool]]:
    """(stages per rank, split) pairs a spec accepts, at its default stages per rank and one more."""
    sprs = {spec.default_stages_per_rank} | ({1, 2} if spec.stages_per_rank is None else set(spec.stages_per_rank))
    splits = (True,) if spec.split_only else (True, False)
    return [(spr, split) for spr in sorted(sprs) for split in splits]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_registered_schedule_builds_validates_simulates_and_lowers(name):
    spec = schedule_spec(name)
    for spr, split in _layouts(spec):
        for p in (1, 2, 3):
            for m in (p, spec.default_num_microbatches(p)):
                s = build_schedule(name, p * spr, m, stages_per_rank=spr, split_backward=split)
                assert (s.name, s.num_ranks, s.split_backward) == (name, p, split)
                result = simulate(s)
                assert sum(result.busy) == 3 * p * spr * m
                assert max(result.peak_inflight) <= spec.memory.bound(p, m, spr, split), (p, m, spr, split)
                check_comm_deadlock(lower_communication(s), s.stage_to_rank)


def test_placement_and_defaults_come_from_the_spec():
    assert [schedule_spec(n).placement for n in ("gpipe", "1f1b", "zb-h1", "zb-v")] == ["loop", "one", "one", "v"]
    assert {n for n in SCHEDULES if schedule_spec(n).overlaps} >= {"zb-h2", "zb-v"}
    assert schedule_spec("zb-h1").fused_baseline == "1f1b" and schedule_spec("1f1b").fused_baseline is None
    assert schedule_label("zb-h1", True) == "zb-h1" and schedule_label("1f1b", True) == "1f1b+2BP"


def test_schedules_is_a_live_view_of_the_registry():
    spec = ScheduleSpec(
        "loop-copy", gpipe, MemoryClass("m", lambda p, m, v, split: v * m), placement="loop", stages_per_rank=None
    )
    register_schedule(spec)
    try:
        assert "loop-copy" in SCHEDULES and list(SCHEDULES)[-1] == "loop-copy"
        s = build_schedule("loop-copy", 4, 3, stages_per_rank=2)
        assert s.name == "loop-copy" and s.actions == build_schedule("gpipe", 4, 3, stages_per_rank=2).actions
        with pytest.raises(ValueError, match="already registered"):
            register_schedule(spec)
    finally:
        unregister_schedule("loop-copy")
    assert "loop-copy" not in SCHEDULES


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(placement="ring"), "placement must be one of"),
        (dict(placement="one", stages_per_rank=(1, 2)), "placement 'one' holds exactly one stage per rank"),
        (dict(placement="loop", stages_per_rank=(2,)), "default_stages_per_rank=1 is not among the accepted"),
        (dict(name=" x"), "non-empty string"),
    ],
)
def test_a_bad_spec_is_refused(kwargs, match):
    args = dict(name="x", builder=gpipe, memory=MemoryClass("m", lambda p, m, v, split: m)) | kwargs
    with pytest.raises(ValueError, match=match):
        ScheduleSpec(**args)


def test_a_builder_that_ignores_the_spec_placement_is_named():
    spec = ScheduleSpec(
        "v-gpipe",
        gpipe,
        MemoryClass("m", lambda p, m, v, split: v * m),
        placement="v",
        stages_per_rank=(2,),
        default_stages_per_rank=2,
    )
    register_schedule(spec)
    try:
        s = build_schedule("v-gpipe", 4, 2, stages_per_rank=2)  # gpipe reads the request's placement
        assert s.stage_to_rank == (0, 1, 1, 0)
    finally:
        unregister_schedule("v-gpipe")


def test_every_built_in_schedule_has_a_hydra_option():
    for name in SCHEDULES:
        assert (ROOT / "conf" / "schedule" / f"{name}.yaml").read_text().count(f"schedule: {name}") == 1, name


# --------------------------------------------------------------------------- one memory replay


def test_one_replay_gives_counts_and_bytes():
    a = Action.parse
    s = Schedule(
        "hand",
        2,
        2,
        (0, 1),
        [
            [a("0F0"), a("0F1"), a("0B0"), a("0B1"), a("0W0+1")],
            [a("1F0"), a("1B0"), a("1F1"), a("1BW1"), a("1W0")],
        ],
        split_backward=True,
    )
    assert replay_memory(s).per_rank == simulate(s).peak_inflight == (2, 2)
    assert peak_activations(s) == (2, 1)
    # F adds the activation, B trades it for what W needs, W frees that; BW frees at once.
    peaks = replay_memory(s, activation=(10, 100), held=(1, 5))
    assert peaks.per_rank == (20, 105) and peaks.per_stage == (20, 105)
    per_mb = replay_memory(s, activation={(0, 0): 1, (0, 1): 2, (1, 0): 3, (1, 1): 4}, held=0)
    assert per_mb.per_rank == (3, 4)


# --------------------------------------------------------------------------- torch-free import


def test_importing_the_schedules_loads_no_torch_and_lightning_still_finds_twobp():
    code = (
        "import sys, lightning_twobp.schedules, lightning_twobp.options\n"
        "assert not {'torch', 'lightning'} & set(sys.modules), 'schedules or options imported torch or lightning'\n"
        "import lightning.pytorch\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'twobp' in StrategyRegistry, 'import lightning_twobp no longer registers twobp'\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- the executor and Trainer


EVERY = "test_every_registered_schedule_runs_on_two_ranks_like_one_process"
REGISTERED = "test_a_schedule_registered_in_a_test_trains_through_trainer"


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """Every registered schedule on the executor, then the one a test registers under a Trainer (it stays
    registered in those processes), in one launch of 2 ranks."""
    cases = {EVERY: (_walk_executor, (list(SCHEDULES),)), REGISTERED: (_fit, ("gpipe-copy",))}
    return launch(request, 2, cases, timeout=600)


def _walk_executor(rank: int, world: int, names: list[str]) -> list[str]:
    failures = []
    for name in names:
        spec = schedule_spec(name)
        spr = spec.default_stages_per_rank
        for split in (True,) if spec.split_only else (True, False):
            sched = build_schedule(name, world * spr, 2 * world, stages_per_rank=spr, split_backward=split)
            torch.manual_seed(0)
            parts = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(sched.num_stages)]
            x, y = torch.randn(sched.num_microbatches, 3, 4), torch.randn(sched.num_microbatches, 3, 4)
            ref = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in parts])
            ref.load_state_dict(nn.Sequential(*parts).state_dict())
            for i in range(len(x)):
                (nn.functional.mse_loss(ref(x[i]), y[i]) / len(x)).backward()
            mine = {s: parts[s] for s in sched.stages_of(rank)}
            ex = PipelineExecutor(sched, mine, loss_fn=nn.functional.mse_loss)
            ex.step(list(x) if 0 in mine else None, list(y) if sched.num_stages - 1 in mine else None)
            for s, mod in mine.items():
                for q, r in zip(mod.parameters(), ref[s].parameters(), strict=False):
                    if q.grad is None or not torch.allclose(q.grad, r.grad, rtol=1e-5, atol=1e-7):
                        failures.append(f"{name} split={split}: stage {s} gradient differs from one process")
    return failures


@pytest.mark.dist
def test_every_registered_schedule_runs_on_two_ranks_like_one_process(two_ranks):
    results = two_ranks[EVERY]
    assert results == [[], []], "\n".join(f for r in results for f in r)


def _copy_spec() -> ScheduleSpec:
    return ScheduleSpec(
        "gpipe-copy", gpipe, MemoryClass("m", lambda p, m, v, split: v * m), placement="loop", stages_per_rank=None
    )


def _fit(rank: int, world: int, schedule: str | None) -> dict:
    from lightning_twobp import TwoBPStrategy

    if schedule is not None:
        register_schedule(_copy_spec())  # the only edit a new schedule needs, in this process
        lightning_env(rank, world)
    model = Regressor((4, 8, 8, 2), log=False)
    strategy = "auto" if schedule is None else TwoBPStrategy(schedule=schedule, num_microbatches=4)
    trainer = quiet_trainer(strategy, world, max_steps=3)
    trainer.fit(model, regression_data(32, 4, 2))
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


@pytest.mark.dist
def test_a_schedule_registered_in_a_test_trains_through_trainer(two_ranks):
    ref = _fit(0, 1, None)
    results = two_ranks[REGISTERED]
    got = {n: v for r in results for n, v in r.items()}
    assert set(got) == set(ref)
    for n, v in got.items():
        torch.testing.assert_close(v, ref[n], rtol=1e-5, atol=1e-6, msg=n)
