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
from lightning_twobp.schedules.deferral import peak_pending_w
from lightning_twobp.schedules.simulate import dependencies


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


def costs_of(**more):
    """Costs drawn per kind (and ``more``: a measured ``bw``)."""
    kinds = {"f": st.floats(0.25, 4), "b": st.floats(0.25, 4), "w": st.floats(0.0, 4)}
    return st.builds(Costs, **kinds, comm=st.sampled_from([0.0, 0.1, 1.0]), **more)


costs_strategy = costs_of()


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


def _reference_timeline(s, costs, iterations):
    """The simulator's model written plainly (each action's start: its rank free and every dependency
    done, plus ``comm`` across ranks), as ``simulate`` computed it before it compiled the lists to
    numbers: what its faster loop must still give, to the bit."""
    ends, pos, free, out = {}, [0] * s.num_ranks, [0.0] * s.num_ranks, []
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(s.actions):
            while row and pos[rank] < iterations * len(row):
                it, a = pos[rank] // len(row), row[pos[rank] % len(row)]
                keys = dependencies(a, s.num_stages)
                deps = [ends.get((it, *k)) for k in keys]
                if None in deps:
                    break
                hops = [costs.comm if s.stage_to_rank[stage] != rank else 0.0 for _, stage, _ in keys]
                start = max([free[rank], *(e + h for e, h in zip(deps, hops, strict=True))])
                free[rank] = start + costs.duration(a)
                for mb in a.microbatches:
                    ends[(it, "B" if a.is_backward else a.kind, a.stage, mb)] = free[rank]
                out.append((rank, a, start, free[rank], it))
                pos[rank] += 1
                progress = True
    return out


@given(
    name=st.sampled_from(SCHEDULES),
    ranks=st.integers(1, 5),
    m=st.integers(1, 12),
    split=st.booleans(),
    costs=costs_of(bw=st.one_of(st.none(), st.floats(0.25, 8))),
    iterations=st.integers(1, 4),
)
@settings(max_examples=80, deadline=None)
def test_simulate_times_as_the_model_says(name, ranks, m, split, costs, iterations):
    spr = schedule_spec(name).default_stages_per_rank
    if expected_refusal(name, ranks, m, spr, split) is not None:
        return
    s = build_schedule(name, ranks * spr, m, stages_per_rank=spr, split_backward=split, costs=costs)
    ref = _reference_timeline(s, costs, iterations)
    sim = simulate(s, costs, iterations=iterations)
    assert sim.timeline == tuple(sorted([(r, a, t0, t1) for r, a, t0, t1, _ in ref], key=lambda t: (t[2], t[0])))
    assert sim.iteration_ends == tuple(max(t1 for *_, t1, it in ref if it == i) for i in range(iterations))
    # without the timeline (what a pass comparing many orders asks for) the times are the same, and the
    # first of several iterations ends when one alone does (the builders' score reads both off one call)
    bare = simulate(s, costs, iterations=iterations, memory=False, timeline=False)
    assert (bare.timeline, bare.peak_bytes) == ((), ())
    assert (bare.iteration_ends, bare.busy, bare.makespan) == (sim.iteration_ends, sim.busy, sim.makespan)
    assert bare.iteration_ends[0] == simulate(s, costs).makespan


@given(
    name=st.sampled_from(SCHEDULES),
    ranks=st.integers(1, 6),
    m=st.integers(1, 16),
    costs=costs_of(bw=st.one_of(st.none(), st.floats(0.25, 8))),
)
@settings(max_examples=60, deadline=None)
def test_a_cap_at_the_memory_bound_changes_nothing(name, ranks, m, costs):
    """What lets schedule="auto"'s search skip those caps: a rank holds at most its family's memory bound of
    pairs from F to W, so no stage has more W waiting, and the order built under such a cap is the uncapped one."""
    spec = schedule_spec(name)
    v = spec.default_stages_per_rank
    if expected_refusal(name, ranks, m, v, True) is not None:
        return
    held = spec.memory.bound(ranks, m, v, True)
    uncapped = build_schedule(name, ranks * v, m, stages_per_rank=v, costs=costs)
    assert max(peak_pending_w(uncapped)) <= held
    assert build_schedule(name, ranks * v, m, stages_per_rank=v, costs=costs, max_pending_w=held) == uncapped
