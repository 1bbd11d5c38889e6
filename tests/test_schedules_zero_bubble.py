"""The Zero Bubble families: the paper's orders, overlapped iterations, cost-aware building (no torch)."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_twobp.schedules import Costs, build_schedule, peak_activations, simulate, validate
from lightning_twobp.schedules.builders.zb_greedy import greedy, memory_limits
from lightning_twobp.schedules.builders.zb_orders import paper_order
from lightning_twobp.schedules.builders.zero_bubble import schedule_score
from lightning_twobp.schedules.memo import remembered

from conftest import cost_strategy

FAMILIES = [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]


def _build(name: str, p: int, m: int, costs: Costs | None = None):
    spr = 2 if name == "zb-v" else 1
    return build_schedule(name, spr * p, m, stages_per_rank=spr, costs=costs)


# ----------------------------------------------------------------- overlapped iterations


def test_simulate_iterations_validates_and_reports_the_steady_state():
    s = build_schedule("1f1b", 4, 8, split_backward=False)
    one = simulate(s)
    assert one.iteration_ends == (one.makespan,)
    with pytest.raises(ValueError, match="iterations=k"):
        _ = one.period
    with pytest.raises(ValueError, match="iterations must be an int >= 1"):
        simulate(s, iterations=0)
    # 1F1B cannot overlap: rank 0 ends each iteration last, and every other rank needs its next F.
    three = simulate(s, iterations=3)
    assert three.period == one.makespan
    assert three.makespan == 3 * one.makespan
    assert three.steady_bubble == pytest.approx(one.bubble_fraction)
    assert sum(three.busy) == 3 * sum(one.busy)


@pytest.mark.parametrize("name", ["zb-h2", "zb-v"])
def test_zb_h2_and_zb_v_have_no_bubble_once_iterations_overlap(name):
    # The paper's claim (T_F = T_B = T_W, m >= 2p): every rank is busy the whole period.
    busy_per_stage = 3
    spr = 2 if name == "zb-v" else 1
    for p in range(2, 9):
        for m in (2 * p - 1, 2 * p, 3 * p + 1, 4 * p):
            result = simulate(_build(name, p, m), iterations=4)
            assert result.steady_bubble == pytest.approx(0, abs=1e-12), (p, m)
            assert result.period == busy_per_stage * spr * m, (p, m)


def test_zb_h1_keeps_a_third_of_the_1f1b_bubble_even_overlapped():
    for p in range(2, 9):
        for m in range(p, 3 * p + 1):
            result = simulate(_build("zb-h1", p, m), iterations=4)
            assert result.period == 3 * m + p - 1, (p, m)  # (p - 1)(F + B - W) per rank


def test_overlap_is_what_makes_zb_h2_faster_than_zb_h1():
    for p in (2, 4, 8):
        h1, h2 = _build("zb-h1", p, 2 * p), _build("zb-h2", p, 2 * p)
        assert simulate(h1).makespan == simulate(h2).makespan  # one iteration: the same floor
        assert simulate(h2, iterations=4).period == simulate(h1, iterations=4).period - (p - 1)


# ------------------------------------------------------------------ the paper's orders


@pytest.mark.parametrize("name, spr", FAMILIES)
def test_paper_orders_are_valid_and_hold_the_papers_memory(name, spr):
    for p in range(1, 9):
        for m in range(1, 4 * p + 2):
            s = validate(paper_order(name, p, m))
            limit_fb, limit_fw = memory_limits(name, p)
            assert all(a <= lim for a, lim in zip(peak_activations(s), limit_fb, strict=False)), (p, m)
            assert all(x <= lim for x, lim in zip(simulate(s).peak_inflight, limit_fw, strict=False)), (p, m)
            if m >= 2 * p:
                # The limits are exactly the paper order's counts: the greedy gets no more memory.
                assert list(simulate(s).peak_inflight) == limit_fw, (p, m)


def test_zb_h1_holds_what_torchs_zb1p_holds():
    # torch's ScheduleInterleavedZeroBubble (ZB1P) keeps p micro-batches from F to W on every rank.
    for p in range(2, 9):
        s = _build("zb-h1", p, 2 * p)
        assert simulate(s).peak_inflight == (p,) * p
        assert simulate(s).makespan == 3 * 2 * p + p - 1


def test_zb_h2_is_the_parallelogram():
    # Rank r runs 2(p - r) - 1 forwards before its first B and 2r + 1 weight passes after its last.
    p, m = 4, 8
    s = _build("zb-h2", p, m)
    for r, row in enumerate(s.actions):
        kinds = "".join(a.kind for a in row)
        assert kinds.startswith("F" * (2 * (p - r) - 1) + "B")
        assert kinds.endswith("B" + "W" * (2 * r + 1))
    timeline = simulate(s).timeline
    for r in range(p):
        mine = [(t0, t1) for rank, _, t0, t1 in timeline if rank == r]
        assert mine[0][0] == r and mine[-1][1] == 3 * m + r  # busy from r to 3m + r without a gap
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))


# ------------------------------------------------------------------- cost-aware building

costs_strategy = cost_strategy(w_half=True)


@given(family=st.sampled_from(FAMILIES), p=st.integers(2, 8), m=st.integers(1, 32), costs=costs_strategy)
@settings(max_examples=80, deadline=None)
def test_cost_aware_build_never_loses(family, p, m, costs):
    name, _ = family
    tuned = _build(name, p, m, costs)
    score = schedule_score(tuned, costs)
    for other in (_build(name, p, m), paper_order(name, p, m)):
        assert score <= schedule_score(other, costs)
    limit_fb, limit_fw = memory_limits(name, p)
    assert all(a <= lim for a, lim in zip(peak_activations(tuned), limit_fb, strict=False))
    assert all(x <= lim for x, lim in zip(simulate(tuned).peak_inflight, limit_fw, strict=False))


def test_measured_costs_no_longer_make_zb_h1_slower():
    # Regression (the first counterexample): the greedy used to start a W in a gap that ended
    # after the next B's gradient had arrived, making 35.7 where the unit-cost order makes 32.4.
    costs = Costs(1, 1.1, 0.9)
    tuned = build_schedule("zb-h1", 8, 8, costs=costs)
    unit = build_schedule("zb-h1", 8, 8)
    assert simulate(tuned, costs).makespan <= simulate(unit, costs).makespan == pytest.approx(32.4)


def test_zb_v_at_b_twice_f_matches_the_papers_v():
    # Regression (the second counterexample): p = 8, m = 16, B = 2F used to make 167; the paper's V
    # order (torch's ScheduleZBVZeroBubble) makes 142, the floor is 135.
    costs = Costs(1, 2, 1)
    s = build_schedule("zb-v", 16, 16, stages_per_rank=2, costs=costs)
    assert simulate(s, costs).makespan <= simulate(paper_order("zb-v", 8, 16), costs).makespan == 142


def test_builds_are_reused_within_a_search_only(monkeypatch):
    """Inside ``memo.remembered`` (a search) a build made before is reused; outside it every build runs as
    written, so nothing is held after a search and a builder patched between searches is seen."""
    module = importlib.import_module("lightning_twobp.schedules.builders.zero_bubble")
    calls, real = [], module.greedy
    monkeypatch.setattr(module, "greedy", lambda *a, **k: calls.append(a) or real(*a, **k))
    with remembered():
        first = build_schedule("zb-h2", 4, 8)
        made = len(calls)
        assert made > 0 and build_schedule("zb-h2", 4, 8) == first and len(calls) == made
    assert build_schedule("zb-h2", 4, 8) == first and len(calls) == 2 * made


@given(
    name=st.sampled_from(["zb-h1", "zb-h2", "zb-v", "v-half", "v-min"]),
    ranks=st.integers(1, 5),
    m=st.integers(1, 12),
    costs=costs_strategy,
    caps=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    policy=st.sampled_from(["eager", "fit"]),
    tie_break=st.sampled_from(["later-stage", "smallest-mb"]),
)
@settings(max_examples=60, deadline=None)
def test_a_greedy_run_a_cap_cannot_change_is_reused_as_built(name, ranks, m, costs, caps, policy, tie_break):
    """Within a search the greedy returns its uncapped order for a cap at or above what that order ever had
    waiting on each stage: the order built under the cap, every time (per-stage caps, both policies)."""
    v = 2 if name in ("zb-v", "v-half", "v-min") else 1
    placement = build_schedule(name, ranks * v, m, stages_per_rank=v).stage_to_rank
    per_stage = tuple(caps[s % len(caps)] for s in range(ranks * v))
    kw = {"costs": costs, "policy": policy, "b_tie_break": tie_break}
    with remembered():
        greedy(name, placement, m, **kw)  # the uncapped run the search builds first
        reused = greedy(name, placement, m, **kw, max_pending_w=per_stage)
    assert reused == greedy(name, placement, m, **kw, max_pending_w=per_stage)
