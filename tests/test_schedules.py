"""Schedules as data: IR, generators, simulator and communication lowering (no torch)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_twobp.schedules
from lightning_twobp.schedules import (
    SCHEDULES,
    Action,
    Comm,
    Costs,
    DeadlockError,
    Schedule,
    build_schedule,
    check_comm_deadlock,
    check_comm_order,
    default_stages_per_rank,
    lower_communication,
    peak_activations,
    simulate,
    stage_to_rank,
    validate,
)
from lightning_twobp.schedules.builders.zb_greedy import memory_limits


def row(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(t) for t in text.split())


def floor(result, num_ranks: int, f: float = 1.0) -> float:
    """No schedule beats this: the last rank cannot start before (p-1) forwards."""
    return max(result.busy) + (num_ranks - 1) * f


# --------------------------------------------------------------------------- IR


@pytest.mark.parametrize(
    "text, action",
    [
        ("2F0", Action("F", 2, 0)),
        ("0B13", Action("B", 0, 13)),
        ("11BW3", Action("BW", 11, 3)),
        ("1W7", Action("W", 1, 7)),
        ("1W0+1+2", Action("W", 1, (0, 1, 2))),
    ],
)
def test_action_string_form(text, action):
    assert str(action) == text
    assert Action.parse(text) == action


@given(
    kind=st.sampled_from(["F", "B", "W", "BW"]),
    stage=st.integers(0, 40),
    mbs=st.sets(st.integers(0, 99), min_size=1, max_size=5),
)
@settings(max_examples=100, deadline=None)
def test_action_parse_round_trips(kind, stage, mbs):
    mb = tuple(sorted(mbs)) if kind == "W" else min(mbs)
    action = Action(kind, stage, mb)
    assert Action.parse(str(action)) == action
    assert action.microbatches == (tuple(sorted(mbs)) if kind == "W" else (min(mbs),))


def test_batched_w_of_one_micro_batch_is_an_int():
    assert Action("W", 0, (3,)) == Action("W", 0, 3)
    assert Action("W", 0, (3,)).microbatch == 3


@pytest.mark.parametrize(
    "args",
    [
        ("X", 0, 0),
        ("f", 0, 0),
        ("F", -1, 0),
        ("F", 0, -2),
        ("F", 0, (0, 1)),
        ("B", 0, (0, 1)),
        ("W", 0, ()),
        ("W", 0, (2, 1)),
        ("W", 0, (1, 1)),
        ("F", True, 0),
    ],
)
def test_action_rejects_bad_fields(args):
    with pytest.raises(ValueError):
        Action(*args)


def test_action_parse_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F0")


def test_schedule_properties_and_grid():
    s = build_schedule("gpipe", 4, 2, stages_per_rank=2)
    assert (s.num_ranks, s.stages_per_rank) == (2, 2)
    assert s.stages_of(0) == (0, 2) and s.stages_of(1) == (1, 3)
    lines = str(s).splitlines()
    assert lines[0].startswith("gpipe: 4 stages on 2 ranks, 2 micro-batches, split")
    assert lines[2].split()[:4] == ["rank", "0", "0F0", "0F1"]
    assert lines[3].split()[-1] == "1W0+1"


def _two_stage(rank0: str, rank1: str, split: bool = True, m: int = 2) -> Schedule:
    return Schedule("hand", 2, m, (0, 1), (row(rank0), row(rank1)), split)


def test_validate_accepts_a_hand_written_schedule():
    s = _two_stage("0F0 0F1 0B0 0B1 0W0+1", "1F0 1B0 1F1 1B1 1W1 1W0")
    assert validate(s) is s
    # a split schedule may run some micro-batches' backward fused (schedules.fusion): BW there
    mixed = _two_stage("0F0 0F1 0B0 0BW1 0W0", "1F0 1BW0 1F1 1B1 1W1")
    assert validate(mixed) is mixed


@pytest.mark.parametrize(
    "rank0, rank1, split, message",
    [
        ("0F0 0F1 0B0 0B1 0W0", "1F0 1B0 1F1 1B1 1W0+1", True, "stage 0 micro-batch 1 has no W"),
        ("0F0 0F1 0B0 0B1 0W0+1 0W1", "1F0 1B0 1F1 1B1 1W0+1", True, "repeats W"),
        ("0F0 0F1 0B0 0B1 0W0+1 1F0", "1B0 1F1 1B1 1W0+1", True, "belongs on rank 1"),
        ("0F0 0F1 0B0 0W0+1 0B1", "1F0 1B0 1F1 1B1 1W0+1", True, "rank 0 position 3: 0W0+1 runs before 0B1"),
        ("0F0 0F1 0BW0 0B1 0W1", "1F0 1BW0 1F1 1B1 1BW1 1W1", True, "stage 1 micro-batch 1 has both BW and B"),
        ("0F0 0F1 0BW0 0BW1 0W1", "1F0 1BW0 1F1 1BW1", True, "stage 0 micro-batch 1 has both BW and W"),
        ("0F0 0F1 0B0 0B1 0W0+1", "1F0 1B0 1F1 1B1 1W0+1", False, "split_backward=False"),
        # Rank 1 wants 1F1 first, which needs 0F1, queued behind 0BW0, which needs 1BW0.
        ("0F0 0BW0 0F1 0BW1", "1F1 1BW1 1F0 1BW0", False, "deadlock"),
        # the same in a split schedule fused in part: the wait names the fused backward it waits for
        ("0F0 0BW0 0F1 0B1 0W1", "1F1 1B1 1W1 1F0 1BW0", True, "on 0BW0, waiting for 1BW0"),
    ],
)
def test_validate_names_the_fault(rank0, rank1, split, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(_two_stage(rank0, rank1, split))


# ------------------------------------------------------------- stage-to-rank


def test_stage_to_rank_maps():
    assert stage_to_rank("1f1b", 4) == (0, 1, 2, 3)
    assert stage_to_rank("interleaved-1f1b", 8, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_to_rank("gpipe", 6, 3) == (0, 1, 0, 1, 0, 1)
    assert stage_to_rank("zb-v", 8, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        stage_to_rank("gpipe", 5, 2)
    with pytest.raises(ValueError, match="stages_per_rank=2"):
        stage_to_rank("zb-v", 4, 1)


# ---------------------------------------------------------------- golden orders

ONE_F_ONE_B_FUSED = {
    0: "0F0 0F1 0F2 0F3 0BW0 0F4 0BW1 0F5 0BW2 0F6 0BW3 0F7 0BW4 0BW5 0BW6 0BW7",
    3: "3F0 3BW0 3F1 3BW1 3F2 3BW2 3F3 3BW3 3F4 3BW4 3F5 3BW5 3F6 3BW6 3F7 3BW7",
}
# Warm-up 3 on rank 0; cool-down B5 B6 B7 each followed by the oldest W (0, 1, 2);
# the rest batched.  Rank 3 has no cool-down, so one W covers everything.
ONE_F_ONE_B_SPLIT = {
    0: "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0W0 0B6 0W1 0B7 0W2 0W3+4+5+6+7",
    3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 3W0+1+2+3+4+5+6+7",
}


@pytest.mark.parametrize("split, golden", [(False, ONE_F_ONE_B_FUSED), (True, ONE_F_ONE_B_SPLIT)])
def test_1f1b_golden(split, golden):
    s = build_schedule("1f1b", 4, 8, split_backward=split)
    for rank, text in golden.items():
        assert s.actions[rank] == row(text)


def test_gpipe_golden():
    s = build_schedule("gpipe", 2, 3)
    assert s.actions == (row("0F0 0F1 0F2 0B0 0B1 0B2 0W0+1+2"), row("1F0 1F1 1F2 1B0 1B1 1B2 1W0+1+2"))


def test_gpipe_loop_runs_local_stages_forward_then_backward():
    s = build_schedule("gpipe", 4, 2, stages_per_rank=2, split_backward=False)
    assert s.actions[0] == row("0F0 0F1 2F0 2F1 2BW0 2BW1 0BW0 0BW1")


def test_interleaved_with_one_stage_per_rank_is_1f1b():
    for split in (True, False):
        a = build_schedule("interleaved-1f1b", 4, 6, split_backward=split)
        b = build_schedule("1f1b", 4, 6, split_backward=split)
        assert a.name == "interleaved-1f1b" and a.actions == b.actions


def test_interleaved_megatron_order():
    # p=2, v=2, m=4: forward sweeps (chunk 0: mb 0,1)(chunk 1: mb 0,1)(chunk 0: 2,3)...;
    # rank 1 warms up with (2-1-1)*2 + (2-1)*2 = 2 forwards.
    s = build_schedule("interleaved-1f1b", 4, 4, stages_per_rank=2, split_backward=False)
    assert s.actions[1] == row("1F0 1F1 3F0 3BW0 3F1 3BW1 1F2 1BW0 1F3 1BW1 3F2 3BW2 3F3 3BW3 1BW2 1BW3")


# ------------------------------------------------------------ bubbles, analytic


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_fused_bubble_matches_gpipe_formula(name):
    # BW costs b + w = 2, F = 1: bubble (p-1)/(m+p-1) (Huang et al.; Narayanan et al.).
    for p in range(1, 7):
        for m in range(1, 13):
            result = simulate(build_schedule(name, p, m, split_backward=False))
            assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert result.makespan == 3 * (m + p - 1)


def test_interleaved_bubble_is_divided_by_v():
    # Megatron's interleaved bubble (p-1)/(v*m + p-1) with per-chunk unit costs.
    v = 2
    for p in range(1, 7):
        for m in range(p, 4 * p + 1, p):
            s = build_schedule("interleaved-1f1b", v * p, m, stages_per_rank=v, split_backward=False)
            result = simulate(s)
            assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


def test_split_backward_shortens_gpipe_and_1f1b():
    # 2BP: W leaves the B chain.  GPipe saves exactly (p-1)*w (the drain carries only
    # B); 1F1B saves at least that, since its cool-down W also fill the bubble.
    for p, m in ((2, 4), (4, 8), (5, 3), (3, 1)):
        fused = simulate(build_schedule("gpipe", p, m, split_backward=False)).makespan
        assert simulate(build_schedule("gpipe", p, m)).makespan == fused - (p - 1)
        fused = simulate(build_schedule("1f1b", p, m, split_backward=False)).makespan
        assert simulate(build_schedule("1f1b", p, m)).makespan <= fused - (p - 1)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_zb_h_reaches_the_floor_from_m_equals_p(name):
    # The paper's accounting (budget on F->B, W deferred by up to p-1): at unit
    # costs the makespan is the floor 3m + p - 1 for every m >= p, i.e. ZB-H1's
    # bubble of (p-1)(F+B-W) = p-1 on every rank.  Below p, rank 0 idles from its
    # last F until the first B returns at 2p-1, so nothing beats 2m + 2p - 1.
    for p in range(1, 9):
        for m in range(1, 3 * p + 1):
            result = simulate(build_schedule(name, p, m))
            if m >= p:
                assert result.makespan == 3 * m + p - 1 == floor(result, p), (p, m)
                assert result.bubble_time == pytest.approx((p - 1,) * p), (p, m)
            else:
                assert result.makespan == 2 * m + 2 * p - 1, (p, m)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v"])
def test_zb_reaches_the_floor_from_m_equals_2p(name):
    spr = 2 if name == "zb-v" else 1
    cases = [(p, m) for p in range(2, 7) for m in range(2 * p, 4 * p + 1)]
    # The V used to miss by 1 (p=5, 7) and 2 (p=8) under an F->W budget of 2p.
    cases += [(7, 14), (7, 21), (8, 16), (8, 24)]
    for p, m in cases:
        result = simulate(build_schedule(name, spr * p, m, stages_per_rank=spr))
        assert result.makespan == floor(result, p), (p, m)


@pytest.mark.parametrize("costs", [Costs(), Costs(f=1, b=2, w=1), Costs(f=2, b=1, w=0.5)])
def test_no_schedule_beats_the_floor(costs):
    for name in SCHEDULES:
        spr = default_stages_per_rank(name) if name != "interleaved-1f1b" else 1  # m = 1, 3 below
        for split in (True, False) if name in ("gpipe", "1f1b") else (True,):
            for p in (1, 2, 4):
                for m in (1, 3, 8):
                    s = build_schedule(name, spr * p, m, stages_per_rank=spr, split_backward=split, costs=costs)
                    result = simulate(s, costs)
                    assert result.makespan >= floor(result, p, costs.f) - 1e-9


# --------------------------------------------------------------- peak in-flight


def test_peak_inflight():
    for p in range(1, 7):
        for m in range(1, 13):
            fused = simulate(build_schedule("1f1b", p, m, split_backward=False)).peak_inflight
            assert fused == tuple(min(p - r, m) for r in range(p))
            for split in (True, False):
                gp = simulate(build_schedule("gpipe", p, m, split_backward=split)).peak_inflight
                assert gp == (m,) * p
            for name, spr in (("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)):
                s = build_schedule(name, spr * p, m, stages_per_rank=spr)
                limit_fb, limit_fw = memory_limits(name, p)
                # F->B (the paper's M_B) within budget, F->W within its bound.
                assert all(a <= lim for a, lim in zip(peak_activations(s), limit_fb, strict=False))
                assert all(x <= lim for x, lim in zip(simulate(s).peak_inflight, limit_fw, strict=False))
            if m >= p:
                # ZB-H1 holds what torch's ZB1P holds: p pairs from F to W on every rank.
                assert simulate(build_schedule("zb-h1", p, m)).peak_inflight == (p,) * p
    # ZB-H1 keeps 1F1B's F->B budget, and F->W (what this project's autograd holds) is p;
    # ZB-H2 holds 2p - 1 on every rank, the paper's 2x.
    h1 = build_schedule("zb-h1", 4, 8)
    assert peak_activations(h1) == (4, 3, 2, 1)
    assert simulate(h1).peak_inflight == (4, 4, 4, 4)
    h2 = build_schedule("zb-h2", 4, 8)
    assert peak_activations(h2) == (7, 5, 3, 1)
    assert simulate(h2).peak_inflight == (7, 7, 7, 7)
    fused = build_schedule("1f1b", 4, 8, split_backward=False)
    assert peak_activations(fused) == simulate(fused).peak_inflight == (4, 3, 2, 1)


# ------------------------------------------------------------------- simulator


def test_costs_per_stage_comm_and_batched_w():
    s = build_schedule("1f1b", 2, 1, split_backward=False)
    result = simulate(s, Costs(comm=0.5))
    # F0 [0,1] -> +0.5 -> F1 [1.5,2.5], BW1 [2.5,4.5] -> +0.5 -> BW0 [5,7]
    assert result.makespan == 7.0
    assert [(r, str(a), t0, t1) for r, a, t0, t1 in result.timeline] == [
        (0, "0F0", 0.0, 1.0),
        (1, "1F0", 1.5, 2.5),
        (1, "1BW0", 2.5, 4.5),
        (0, "0BW0", 5.0, 7.0),
    ]
    g = build_schedule("gpipe", 2, 3)
    per_stage = simulate(g, Costs(f=(1, 2), b=(1, 1), w=(3, 1)))
    # rank 0's batched W covers 3 micro-batches at w=3 each.
    assert per_stage.timeline[-1][1] == Action("W", 0, (0, 1, 2))
    assert per_stage.timeline[-1][3] - per_stage.timeline[-1][2] == 9
    assert per_stage.busy == (3 + 3 + 9, 6 + 3 + 3)
    assert per_stage.bubble_time == tuple(per_stage.makespan - b for b in per_stage.busy)
    with pytest.raises(ValueError, match="3 values for 2 stages"):
        simulate(g, Costs(f=(1, 2, 3)))
    with pytest.raises(ValueError):
        Costs(w=-1)


def test_deadlock_error_shows_the_blocked_grid():
    s = _two_stage("0F0 0BW0 0F1 0BW1", "1F1 1BW1 1F0 1BW0", split=False)
    with pytest.raises(DeadlockError) as info:
        simulate(s)
    text = str(info.value)
    assert ">0BW0<" in text and ">1F1<" in text
    assert "rank 1 blocked at position 0 on 1F1, waiting for 0F1" in text
    assert isinstance(info.value, RuntimeError)


def test_zero_costs_do_not_divide_by_zero():
    result = simulate(build_schedule("1f1b", 3, 2), Costs(f=0, b=0, w=0))
    assert result.makespan == 0 and result.bubble_fraction == 0


def test_greedy_schedules_follow_costs():
    # Slow links and few micro-batches: the V built for them beats the V built for unit costs.
    slow_links = Costs(f=1, b=1, w=0.5, comm=1)
    tuned = build_schedule("zb-v", 8, 5, stages_per_rank=2, costs=slow_links)
    unit = build_schedule("zb-v", 8, 5, stages_per_rank=2)
    assert tuned.actions != unit.actions
    assert simulate(tuned, slow_links).makespan == 45.5
    assert simulate(unit, slow_links).makespan == 54.5
    with pytest.raises(ValueError, match="4 values for 8 stages"):
        build_schedule("zb-v", 8, 8, stages_per_rank=2, costs=Costs(f=(1, 1, 1, 3)))


# ---------------------------------------------------------------- communication


def test_comm_string_and_partner():
    assert str(Comm("SEND_F", 2, 0, 3)) == "2SEND_F0"
    assert Comm("SEND_F", 2, 0, 3).partner == ("RECV_F", 3, 0)
    assert Comm("RECV_B", 2, 5, 3).partner == ("SEND_B", 3, 5)
    with pytest.raises(ValueError):
        Comm("SEND", 0, 0, 1)


def test_lowered_1f1b_groups_forward_send_with_backward_recv():
    lowered = lower_communication(build_schedule("1f1b", 2, 2, split_backward=False))
    assert [str(op) for op in lowered[0]] == [
        "0F0",
        "0SEND_F0",
        "0F1",
        "0SEND_F1",
        "0RECV_B0",
        "0BW0",
        "0RECV_B1",
        "0BW1",
    ]
    assert [str(op) for op in lowered[1]] == [
        "1RECV_F0",
        "1F0",
        "1BW0",
        "1SEND_B0",
        "1RECV_F1",
        "1F1",
        "1BW1",
        "1SEND_B1",
    ]
    check_comm_deadlock(lowered, (0, 1))


def test_adjacent_stages_on_one_rank_exchange_nothing():
    lowered = lower_communication(build_schedule("zb-v", 2, 3, stages_per_rank=2))
    assert all(isinstance(op, Action) for op in lowered[0])


def _naive_lowering(schedule):
    # The placement rule without the rendezvous repair: each receive right before
    # its consumer, each send right after its producer.
    placement, last = schedule.stage_to_rank, schedule.num_stages - 1
    out = []
    for rank, actions in enumerate(schedule.actions):
        ops = []
        for a in actions:
            s, m = a.stage, a.microbatch
            remote_prev = s > 0 and placement[s - 1] != rank
            remote_next = s < last and placement[s + 1] != rank
            if a.kind == "F":
                ops += [Comm("RECV_F", s, m, placement[s - 1])] if remote_prev else []
                ops.append(a)
                ops += [Comm("SEND_F", s, m, placement[s + 1])] if remote_next else []
            elif a.kind == "B":
                ops += [Comm("RECV_B", s, m, placement[s + 1])] if remote_next else []
                ops.append(a)
                ops += [Comm("SEND_B", s, m, placement[s - 1])] if remote_prev else []
            else:
                ops.append(a)
        out.append(tuple(ops))
    return tuple(out)


def test_lowering_hoists_receives_where_rendezvous_would_stick():
    # GPipe on the loop map (stages 0, 2 on rank 0; 1, 3 on rank 1): rank 1 sends
    # 1F0 on to stage 2, which rank 0 receives only before 2F0, after all its
    # stage-0 forwards; rank 0 meanwhile sends 0F2, which rank 1 receives only
    # before 1F2.  Each waits for the other.  The lowering moves the receive of 0F2
    # into the batch where rank 1 waits.
    s = build_schedule("gpipe", 4, 4, stages_per_rank=2)
    with pytest.raises(DeadlockError, match="rank 1 stuck at item 2 waiting on 1SEND_F0"):
        check_comm_deadlock(_naive_lowering(s), s.stage_to_rank)
    lowered = lower_communication(s)
    check_comm_deadlock(lowered, s.stage_to_rank)
    ops = [str(op) for op in lowered[1]]
    assert ops.index("1RECV_F2") < ops.index("1F1")


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_one_stage_per_rank_receives_stay_just_before_their_consumer(name):
    for split in (True, False):
        lowered = lower_communication(build_schedule(name, 4, 6, split_backward=split))
        for ops in lowered:
            for i, op in enumerate(ops):
                if isinstance(op, Comm) and not op.is_send:
                    consumer = next(o for o in ops[i + 1 :] if isinstance(o, Action))
                    assert (consumer.stage, consumer.microbatch) == (op.stage, op.microbatch)


def test_check_comm_order_rejects_posting_order_nccl_would_mismatch():
    # Deadlock-free under rendezvous (both receives sit in one batch), but NCCL
    # ignores tags: 0SEND_F0 would land in the buffer posted for micro-batch 1.
    placement = (0, 1)
    swapped = (
        (Action("F", 0, 0), Comm("SEND_F", 0, 0, 1), Action("F", 0, 1), Comm("SEND_F", 0, 1, 1)),
        (Comm("RECV_F", 1, 1, 0), Comm("RECV_F", 1, 0, 0), Action("F", 1, 0), Action("F", 1, 1)),
    )
    message = "rank 0 -> rank 1: message 0 is posted out of order"
    with pytest.raises(ValueError, match=message):
        check_comm_order(swapped)
    with pytest.raises(ValueError, match=message):
        check_comm_deadlock(swapped, placement)
    in_order = (swapped[0], (swapped[1][1], swapped[1][0]) + swapped[1][2:])
    check_comm_deadlock(in_order, placement)
    # Streams in the other direction are a separate sequence: a gradient sent back
    # does not shift the forward messages.
    check_comm_order(
        (
            (Comm("SEND_F", 0, 0, 1), Comm("RECV_B", 0, 0, 1)),
            (Comm("SEND_B", 1, 0, 0), Comm("RECV_F", 1, 0, 0)),
        )
    )


def test_lowering_posts_receives_in_the_senders_order_on_the_v():
    # ZB-V on 2 ranks: rank 0 sends 0F0 0F1 0F2 (chunk 0 activations) and then
    # 3B0 (chunk 1 gradient) to rank 1, which needs 3B0 (for 2B0) before 0F2 (for
    # 1F2).  Receiving each just before its consumer posts 2RECV_B0 before
    # 1RECV_F2: on NCCL the activation of 0F2 would land in the gradient buffer.
    s = build_schedule("zb-v", 4, 4, stages_per_rank=2)
    naive = _naive_lowering(s)
    with pytest.raises(
        ValueError, match="rank 0 -> rank 1: message 2 .* rank 0 sends 0SEND_F2 but rank 1 receives 2RECV_B0"
    ):
        check_comm_order(naive)
    lowered = lower_communication(s)
    check_comm_order(lowered)
    check_comm_deadlock(lowered, s.stage_to_rank)
    ops = [str(op) for op in lowered[1]]
    assert ops.index("1RECV_F2") < ops.index("2RECV_B0") < ops.index("2B0")


@pytest.mark.parametrize("name", ["gpipe", "interleaved-1f1b", "zb-v"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_two_streams_per_pair_are_posted_in_one_order(name, ranks):
    # The loop and V maps run two streams each way between a pair of ranks.
    for m in (ranks, 2 * ranks, 3 * ranks):
        for split in (True, False) if name != "zb-v" else (True,):
            s = build_schedule(name, 2 * ranks, m, stages_per_rank=2, split_backward=split)
            check_comm_order(lower_communication(s))


def test_check_comm_deadlock_rejects_malformed_lowerings():
    placement = (0, 1)
    a = Action("F", 0, 0)
    with pytest.raises(ValueError, match="no matching"):
        check_comm_deadlock(((a, Comm("SEND_F", 0, 0, 1)), ()), placement)
    with pytest.raises(ValueError, match="names peer"):
        check_comm_deadlock(((a, Comm("SEND_F", 0, 0, 0)),), (0, 1))
    with pytest.raises(ValueError, match="belongs on rank 1"):
        check_comm_deadlock(((Comm("RECV_F", 1, 0, 0),), ()), placement)
    # Each rank sends first and receives later: stuck under strict rendezvous.
    crossed = (
        (Comm("SEND_F", 0, 0, 1), Action("F", 0, 1), Comm("RECV_B", 0, 0, 1)),
        (Comm("SEND_B", 1, 0, 0), Action("F", 1, 1), Comm("RECV_F", 1, 0, 0)),
    )
    with pytest.raises(DeadlockError, match="rank 0 stuck at item 0 waiting on 0SEND_F0"):
        check_comm_deadlock(crossed, placement)


# ----------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "args, kwargs, fix",
    [
        (("pipedream", 4, 8), {}, "choose one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zb-v"),
        (("zb-v", 4, 8), {}, "use build_schedule('zb-v', 8, 8, stages_per_rank=2)"),
        (("zb-v", 6, 8), {"stages_per_rank": 3}, "use build_schedule('zb-v', 4, 8, stages_per_rank=2)"),
        (
            ("interleaved-1f1b", 8, 6),
            {"stages_per_rank": 2},
            "interleaved-1f1b with 2 stages per rank on 4 ranks needs a micro-batch count that "
            "is a multiple of 4: use 4, 8 or 12 (got 6)",
        ),
        (("zb-h1", 4, 8), {"split_backward": False}, "use '1f1b' or 'gpipe' for a fused backward"),
        (("zb-h2", 4, 8), {"stages_per_rank": 2}, "use stages_per_rank=1, or build_schedule('zb-v'"),
        (("1f1b", 8, 8), {"stages_per_rank": 2}, "use build_schedule('interleaved-1f1b', 8, 8, stages_per_rank=2)"),
        (("gpipe", 5, 8), {"stages_per_rank": 2}, "use 4 or 6 stages"),
        (("gpipe", 0, 8), {}, "num_stages must be an int >= 1"),
        (("gpipe", 4, 0), {}, "num_microbatches must be an int >= 1"),
    ],
)
def test_errors_say_what_would_work(args, kwargs, fix):
    with pytest.raises(ValueError) as info:
        build_schedule(*args, **kwargs)
    assert fix in str(info.value)


def test_package_imports_no_torch():
    # Schedules are pure data: an executor may import torch, this package may not.
    package = Path(lightning_twobp.schedules.__file__).parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "torch" for n in names), path.name


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_grad_reduce_follows_each_stages_last_weight_gradient(name, p):
    from lightning_twobp.schedules import GradReduce, add_grad_reduce, lower_communication

    spr = default_stages_per_rank(name)
    sched = build_schedule(name, p * spr, 2 * p, stages_per_rank=spr)
    lowered = lower_communication(sched)
    for rank, row in enumerate(add_grad_reduce(lowered, sched)):
        assert [op for op in row if not isinstance(op, GradReduce)] == list(lowered[rank]), "nothing else moves"
        reduces = [i for i, op in enumerate(row) if isinstance(op, GradReduce)]
        assert sorted(row[i].stage for i in reduces) == sorted(sched.stages_of(rank)), "one reduce per local stage"
        for i in reduces:
            s = row[i].stage
            later = [
                op for op in row[i + 1 :] if isinstance(op, Action) and op.stage == s and op.kind in ("W", "BW", "B")
            ]
            assert not later, f"rank {rank}: {s}REDUCE before {later[0]}"
            last = max(
                j for j, op in enumerate(row[:i]) if isinstance(op, Action) and op.stage == s and op.kind in ("W", "BW")
            )
            between = row[last + 1 : i]
            assert all(not isinstance(op, Action) for op in between), f"rank {rank}: {s}REDUCE waits for {between}"
