"""V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024) as data: the
paper's order, the memory class, the cost-aware build against the paper's order, errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_twobp.schedules import (
    Action,
    Costs,
    build_schedule,
    peak_activations,
    schedule_spec,
    simulate,
    validate,
)
from lightning_twobp.schedules.builders.v_orders import v_memory_bound, v_order
from lightning_twobp.schedules.builders.zero_bubble import schedule_score

from conftest import cost_strategy

V = ("v-half", "v-min")
# Measured-like costs per stage (the tiny LLaMa's middle stage: B = 1.07 F, W = 0.84 F), with and without comm.
MEASURED = (Costs(f=1.0, b=1.07, w=0.84), Costs(f=1.0, b=1.07, w=0.84, comm=0.2))


def _build(name: str, p: int, m: int, costs: Costs | None = None):
    return build_schedule(name, 2 * p, m, stages_per_rank=2, costs=costs)


def test_the_memory_bounds_are_the_papers():
    # The paper's table, in micro-batches of a full stage: (p + 2) // 2 and (p + 4) // 3 against 1F1B's p.
    assert [v_memory_bound("v-half", p) // 2 for p in range(2, 9)] == [2, 2, 3, 3, 4, 4, 5]
    assert [v_memory_bound("v-min", p) // 2 for p in range(2, 9)] == [2, 2, 2, 3, 3, 3, 4]
    assert (
        schedule_spec("v-half").memory.bound(8, 32, 2, True) == 10
        and schedule_spec("v-min").memory.label == "(p + 4) // 3"
    )


@pytest.mark.parametrize("name", V)
def test_the_papers_order_is_valid_and_within_its_memory(name):
    for p in range(1, 7):
        for m in sorted({1, 2, p, p + 1, 2 * p - 1, 3 * p + 1, 4 * p}):
            s = validate(v_order(name, p, m))
            assert max(simulate(s).peak_inflight) <= min(v_memory_bound(name, p), 2 * m), (p, m)
            assert max(peak_activations(s)) <= v_memory_bound(name, p), (p, m)


@pytest.mark.parametrize("name", V)
@pytest.mark.parametrize("costs", [Costs(), MEASURED[1]], ids=["unit", "measured"])
def test_built_schedules_never_hold_more_than_their_memory_class(name, costs):
    bound = schedule_spec(name).memory.bound
    for p in range(2, 7):
        for m in (p, 2 * p + 1, 4 * p):
            s = _build(name, p, m, costs)
            assert max(simulate(s, costs).peak_inflight) <= bound(p, m, 2, True), (p, m)


costs_strategy = cost_strategy()


@given(name=st.sampled_from(V), p=st.integers(2, 6), m=st.integers(1, 24), costs=costs_strategy)
@settings(max_examples=25, deadline=None)
def test_cost_aware_build_is_never_slower_than_the_papers_order(name, p, m, costs):
    tuned = _build(name, p, m, costs)
    assert schedule_score(tuned, costs) <= schedule_score(v_order(name, p, m), costs)
    assert schedule_score(tuned, costs) <= schedule_score(_build(name, p, m), costs)


def test_memory_and_bubble_between_zb_v_and_1f1b():
    # p = 4, m = 8, unit costs: V-Half and V-Min hold 3/4 and 1/2 of 1F1B's p = 4 micro-batches at p = 4
    # (the bounds' rounding), and both idle less than 1F1B.
    fused = simulate(build_schedule("1f1b", 4, 8, split_backward=False))
    half, vmin = simulate(_build("v-half", 4, 8)), simulate(_build("v-min", 4, 8))
    assert max(half.peak_inflight) / 2 == 3 and max(vmin.peak_inflight) / 2 == 2 == max(fused.peak_inflight) / 2
    assert vmin.bubble_fraction < half.bubble_fraction * 2 and half.bubble_fraction < fused.bubble_fraction
    assert vmin.bubble_fraction < fused.bubble_fraction


def row(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(t) for t in text.split())


# The paper's orders at p = 2, m = 4 (stages 0, 3 on rank 0; 1, 2 on rank 1), pinned.
GOLDEN = {
    "v-half": (
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0B0 3B1 3W1 3F2 0W0 0F3 0B1 3B2 3W2 3F3 3B3 0B2 3W3 0B3 0W1 0W2 0W3",
        "1F0 2F0 1F1 2F1 2B0 2W0 1B0 1W0 1F2 2F2 2B1 1B1 2W1 1F3 1W1 2F3 2B2 1B2 2B3 1B3 2W2 2W3 1W2 1W3",
    ),
    "v-min": (
        "0F0 0F1 3F0 3B0 3W0 0B0 0W0 3F1 3B1 3W1 0F2 0B1 0W1 3F2 3B2 3W2 0F3 0B2 0W2 3F3 3B3 3W3 0B3 0W3",
        "1F0 2F0 2B0 1B0 1F1 2F1 2W0 1W0 2B1 1B1 1F2 2F2 2W1 1W1 2B2 1B2 1F3 2F3 2W2 1W2 2B3 1B3 2W3 1W3",
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_order(name):
    assert v_order(name, 2, 4).actions == tuple(row(text) for text in GOLDEN[name])


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (
            dict(stages_per_rank=1),
            "v-half needs stages_per_rank=2 (a V of 2 stages per rank); got 1: use "
            "build_schedule('v-half', 8, 8, stages_per_rank=2) for 4 ranks",
        ),
        (dict(stages_per_rank=2, split_backward=False), "v-half is split by definition"),
    ],
)
def test_errors_say_what_would_work(kwargs, fix):
    num_stages = 8 if kwargs["stages_per_rank"] == 2 else 4
    with pytest.raises(ValueError) as info:
        build_schedule("v-half", num_stages, 8, **kwargs)
    assert fix in str(info.value)
