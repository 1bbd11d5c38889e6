"""Property tests: every schedule either refuses a documented impossible combination or
builds, validates, simulates and lowers to deadlock-free communication that every
pair of ranks posts in one order (NCCL matches in posting order, ignoring tags)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_twobp.schedules import (
    SCHEDULES,
    Action,
    Costs,
    build_schedule,
    check_comm_deadlock,
    check_comm_order,
    lower_communication,
    peak_activations,
    schedule_spec,
    simulate,
)
from lightning_twobp.schedules.builders.zb_greedy import memory_limits


def expected_refusal(name: str, ranks: int, m: int, spr: int, split: bool) -> str | None:
    """The message fragment build_schedule must raise with, or None if it must build."""
    if name in ("1f1b", "zb-h1", "zb-h2") and spr != 1:
        return "runs one stage per rank"
    if name in ("zb-v", "v-half", "v-min") and spr != 2:
        return f"{name} needs stages_per_rank=2"
    if schedule_spec(name).split_only and not split:
        return "split by definition"
    if name == "interleaved-1f1b" and spr > 1 and m % ranks:
        return f"multiple of {ranks}"
    return None


def _assert_memory_limits(s, result, name, ranks):
    """F->B (the paper's activation budget) and F->W (held until W) both bounded."""
    limit_fb, limit_fw = memory_limits(name, ranks)
    assert all(a <= lim for a, lim in zip(peak_activations(s), limit_fb, strict=False))
    assert all(x <= lim for x, lim in zip(result.peak_inflight, limit_fw, strict=False))


def _assert_comm_ok(s):
    lowered = lower_communication(s)
    check_comm_order(lowered)
    check_comm_deadlock(lowered, s.stage_to_rank)
    return lowered


@given(
    name=st.sampled_from(SCHEDULES),
    ranks=st.integers(1, 8),
    m=st.integers(1, 32),
    spr=st.sampled_from([1, 2]),
    split=st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_build_simulate_lower(name, ranks, m, spr, split):
    refusal = expected_refusal(name, ranks, m, spr, split)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            build_schedule(name, ranks * spr, m, stages_per_rank=spr, split_backward=split)
        return
    s = build_schedule(name, ranks * spr, m, stages_per_rank=spr, split_backward=split)
    assert (s.num_ranks, s.num_microbatches, s.split_backward) == (ranks, m, split)

    result = simulate(s)
    # Unit costs: every (stage, micro-batch) costs F + B + W = 3, however split.
    assert sum(result.busy) == 3 * ranks * spr * m
    assert result.makespan >= max(result.busy) + (ranks - 1)
    assert 0 <= result.bubble_fraction < 1
    if schedule_spec(name).split_only:
        _assert_memory_limits(s, result, name, ranks)
    lowered = _assert_comm_ok(s)
    # Lowering only adds communication; compute order is untouched.
    assert tuple(tuple(op for op in ops if isinstance(op, Action)) for ops in lowered) == s.actions


costs_strategy = st.builds(
    Costs,
    f=st.floats(0.25, 4),
    b=st.floats(0.25, 4),
    w=st.floats(0.0, 4),
    comm=st.sampled_from([0.0, 0.1, 1.0]),
)


@given(
    name=st.sampled_from(["zb-h1", "zb-h2", "zb-v", "v-half", "v-min"]),
    ranks=st.integers(1, 6),
    m=st.integers(1, 16),
    costs=costs_strategy,
)
@settings(max_examples=60, deadline=None)
def test_greedy_terminates_at_any_costs(name, ranks, m, costs):
    spr = schedule_spec(name).default_stages_per_rank
    s = build_schedule(name, ranks * spr, m, stages_per_rank=spr, costs=costs)
    result = simulate(s, costs)
    assert result.makespan >= max(result.busy) + (ranks - 1) * costs.f - 1e-9
    _assert_memory_limits(s, result, name, ranks)
    _assert_comm_ok(s)
