"""Memory in the schedule model (bytes per stage, peak bytes per rank) and capped W deferral, as data."""

from __future__ import annotations

import pytest

from lightning_twobp.schedules import (
    Action,
    Costs,
    MemoryCosts,
    build_schedule,
    default_stages_per_rank,
    memory_levels,
    simulate,
)
from lightning_twobp.schedules.builders.zb_orders import paper_order
from lightning_twobp.schedules.builders.zero_bubble import schedule_score
from lightning_twobp.schedules.deferral import cap_pending_w, peak_pending_w, pending_w_cap

SPLIT = ("1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min")


def _build(name: str, p: int, m: int, **kw):
    spr = default_stages_per_rank(name)
    return build_schedule(name, spr * p, m, stages_per_rank=spr, **kw)


# ------------------------------------------------------------------ memory costs


def test_unit_memory_costs_give_the_in_flight_count():
    for name in SPLIT + ("gpipe", "interleaved-1f1b"):
        result = simulate(_build(name, 4, 8))
        assert result.peak_bytes == result.peak_inflight, name


def test_peak_bytes_add_fixed_bytes_and_weigh_what_b_keeps():
    p, m = 4, 8
    memory = MemoryCosts(activation=10, held=3, fixed=(100, 200, 300, 400))
    fused = simulate(build_schedule("1f1b", p, m, split_backward=False), Costs(memory=memory))
    assert fused.peak_bytes == tuple(100 * (r + 1) + 10 * (p - r) for r in range(p))  # p - r micro-batches F to BW
    # 1F1B + 2BP, rank 0: at its last F it holds 4 micro-batches past F and 4 past B (W deferred).
    split = simulate(build_schedule("1f1b", p, m), Costs(memory=memory))
    assert split.peak_bytes[0] == 100 + 10 * 4 + 3 * 4
    # The last rank runs F B F B ... and defers every W to the end: all 8 held after B.
    assert split.peak_bytes[-1] == 400 + 10 + 3 * 7


def test_the_data_parallel_reduce_buffer_counts_from_the_stages_last_backward_to_the_steps_end():
    """Replicated data parallelism copies a stage's gradients into the reduce's buffer at its last W (or BW),
    where the lowering starts the reduce, until the step's end: counted there, not as a fixed byte."""
    p, m = 2, 4
    memory = MemoryCosts(activation=10, held=0, fixed=100)
    for split in (True, False):
        schedule = build_schedule("1f1b", p, m, split_backward=split)
        plain = simulate(schedule, Costs(memory=memory)).peak_bytes
        # rank r holds p - r activations at its warm-up's end, and nothing once its last W or BW has run
        assert plain == tuple(100 + 10 * (p - r) for r in range(p))
        below = simulate(schedule, Costs(memory=MemoryCosts(activation=10, held=0, fixed=100, reduced=9))).peak_bytes
        assert below == plain, "a buffer smaller than the warm-up's peak, made after it, leaves the peak alone"
        above = simulate(schedule, Costs(memory=MemoryCosts(activation=10, held=0, fixed=100, reduced=25))).peak_bytes
        assert above == (125, 125)
    # the V: rank 0 holds stages 0 and 3, and stage 3's last W comes first, so its buffer is held under the
    # rest of stage 0's backward; only stage 3's buffer: rank 0 holds it on top of stage 0's level there
    v = build_schedule("zb-v", 2 * p, m, stages_per_rank=2)
    row = v.actions[0]
    last3 = max(i for i, a in enumerate(row) if a.stage == 3 and a.kind == "W")
    assert last3 < max(i for i, a in enumerate(row) if a.stage == 0 and a.kind == "W")
    only3 = MemoryCosts(activation=10, held=10, reduced=(0, 0, 0, 1000))
    peak = simulate(v, Costs(memory=only3)).peak_bytes[0]
    after = max(memory_levels(v, 10, 10)[0][last3:])
    assert peak == 1000 + after


def test_capped_1f1b_peak_bytes_formula():
    # Rank r at its last F: p - r micro-batches past F and not B, the other m - (p - r) past B, of which
    # at most k still wait for W (W's operands no bigger than the forward's saved tensors: held <= activation).
    memory = MemoryCosts(activation=10, held=3)
    for p in range(1, 6):
        for m in range(p, 3 * p + 1):
            for k in (*range(m + 1), None):
                result = simulate(build_schedule("1f1b", p, m, max_pending_w=k), Costs(memory=memory))
                cap = m if k is None else k
                assert result.peak_bytes == tuple(10 * (p - r) + 3 * min(cap, m - p + r) for r in range(p))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(activation=-1), "MemoryCosts.activation must be >= 0"),
        (dict(held=()), "MemoryCosts.held needs at least one value"),
    ],
)
def test_bad_memory_costs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryCosts(**kwargs)


def test_memory_costs_need_one_value_per_stage():
    with pytest.raises(ValueError, match="MemoryCosts.fixed has 3 values for 4 stages"):
        simulate(build_schedule("1f1b", 4, 4), Costs(memory=MemoryCosts(fixed=(1, 2, 3))))


# ------------------------------------------------------------------ capped deferral


def _fused_as_b_then_w(name: str, p: int, m: int):
    rows = []
    for row in build_schedule(name, p, m, split_backward=False).actions:
        rows.append(
            tuple(
                x
                for a in row
                for x in (
                    (Action("B", a.stage, a.microbatch), Action("W", a.stage, a.microbatch)) if a.kind == "BW" else (a,)
                )
            )
        )
    return tuple(rows)


def test_zero_pending_w_is_fused_1f1b_with_each_backward_split_in_place():
    for p in range(1, 7):
        for m in range(1, 3 * p + 2):
            assert build_schedule("1f1b", p, m, max_pending_w=0).actions == _fused_as_b_then_w("1f1b", p, m), (p, m)


@pytest.mark.parametrize("name", SPLIT)
def test_the_cap_holds_and_a_cap_of_m_changes_nothing(name):
    for p in (2, 3, 4):
        for m in (p, 2 * p + 1):
            uncapped = _build(name, p, m)
            assert _build(name, p, m, max_pending_w=m).actions == uncapped.actions, (p, m)
            for k in range(0, 3):
                s = _build(name, p, m, max_pending_w=k)
                assert max(peak_pending_w(s)) <= k, (p, m, k)
                assert max(simulate(s).peak_inflight) <= max(simulate(uncapped).peak_inflight), (p, m, k)


def test_capped_1f1b_holds_at_most_p_plus_k():
    for p in (2, 4, 6):
        for m in (p, 2 * p, 4 * p):
            for k in range(0, m + 1):
                assert max(simulate(build_schedule("1f1b", p, m, max_pending_w=k)).peak_inflight) <= min(m, p + k)


@pytest.mark.parametrize("name", SPLIT)
def test_unit_cost_time_does_not_grow_with_the_cap(name):
    for p in (2, 3, 4):
        for m in (p, 2 * p, 2 * p + 1):
            scores = [schedule_score(_build(name, p, m, max_pending_w=k), Costs()) for k in range(m + 1)]
            assert all(b <= a for a, b in zip(scores, scores[1:], strict=False)), (p, m, scores)


def test_where_a_looser_cap_is_slower():
    # Reported, not fixed: off the grid above, the greedy V allowed to defer one more W makes a slower
    # order (steady-state period and makespan), a unit of time in ~50. Pinned so that a fix shows here.
    for p, m, k in ((5, 6, 2), (6, 7, 3)):
        tight, loose = (schedule_score(_build("zb-v", p, m, max_pending_w=j), Costs()) for j in (k, k + 1))
        assert loose == (tight[0] + 1, tight[1] + 1), (p, m, k)


def test_the_cap_on_the_zero_bubble_family_never_loses_to_the_capped_paper_order():
    costs = Costs(f=1.0, b=1.3, w=0.7, comm=0.1)
    for name in ("zb-h1", "zb-v", "v-half"):
        for k in (0, 1, 2):
            tuned = _build(name, 4, 8, costs=costs, max_pending_w=k)
            reference = cap_pending_w(paper_order(name, 4, 8), (k,) * tuned.num_stages)
            assert schedule_score(tuned, costs) <= schedule_score(reference, costs)
            assert max(peak_pending_w(tuned)) <= k


def test_a_byte_budget_becomes_a_cap_per_stage():
    memory = MemoryCosts(held=(0, 100, 300, 50))
    assert pending_w_cap(memory, 600, 4)[1:] == (6, 2, 12)
    assert pending_w_cap(memory, 600, 4)[0] >= 2**31 - 1  # holds nothing from B to W: not capped
    s = build_schedule("1f1b", 4, 8, max_pending_w=pending_w_cap(memory, 150, 4))
    assert all(a <= b for a, b in zip(peak_pending_w(s)[1:], (1, 0, 3), strict=False))


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (dict(max_pending_w=-1), "max_pending_w=-1: give the most micro-batches per stage whose W may wait"),
        (dict(max_pending_w=1.5), "an int >= 0 (0 runs each W right after its B)"),
        (dict(max_pending_w=(1, 2)), "or one per stage (4 ints >= 0)"),
        (dict(max_pending_w=True), "or None for no cap"),
        (
            dict(max_pending_w=2, split_backward=False),
            "1f1b with split_backward=False runs fused BW and has none to cap: drop max_pending_w or use "
            "split_backward=True",
        ),
    ],
)
def test_bad_caps_are_refused_before_building(kwargs, fix):
    with pytest.raises(ValueError) as info:
        build_schedule("1f1b", 4, 8, **kwargs)
    assert fix in str(info.value)
