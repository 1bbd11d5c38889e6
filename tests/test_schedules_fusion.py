"""The fused backward where the split loses (schedules/fusion.py), as data: never a longer step than the split
it comes from (nor a higher peak where no message is counted), the split kept where it pays, and
schedule="auto" weighing both."""

from __future__ import annotations

import pytest
from test_auto_split_price import _priced

from lightning_twobp.schedules import Action, Costs, MemoryCosts, build_schedule, schedule_spec, simulate, validate
from lightning_twobp.schedules.auto import LayerCost, Profile, choose, search
from lightning_twobp.schedules.fusion import fuse_where_split_loses, num_fused

NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min"]
# F to B, B to W and fixed bytes per stage, no messages: a fusion lets a micro-batch's B-to-W bytes go at
# once (with messages a fusion can move when another rank lets a sent tensor go: docs/schedules.md)
MEMORY = MemoryCosts(activation=100.0, held=40.0, fixed=1000.0)


def _costs(ratio: float, stages: int) -> Costs:
    """F = B = W = 1 on every stage, BW = (B + W) / ratio; the first stage's B is its whole backward (W 0),
    as schedule="auto" prices it."""
    b, w = [1.0] * stages, [1.0] * stages
    b[0], w[0] = 2.0 / ratio, 0.0
    return Costs(f=1.0, b=b, w=w, bw=2.0 / ratio, memory=MEMORY)


def _step(name: str):
    overlaps = schedule_spec(name).overlaps
    return (lambda sim: sim.period) if overlaps else (lambda sim: sim.makespan), 1 + overlaps


def _layout(name: str, p: int) -> tuple[int, int]:
    spr = 2 if name in ("zb-v", "v-half", "v-min", "interleaved-1f1b") else 1
    return p * spr, spr


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("ratio", [1.05, 1.42])
def test_a_fused_variant_is_valid_and_never_slower_than_its_split_nor_fuller_without_messages(name, p, ratio):
    stages, spr = _layout(name, p)
    costs = _costs(ratio, stages)
    read, it = _step(name)
    for m, cap in ((p, None), (2 * p, None), (2 * p, 1)):
        split = build_schedule(name, stages, m, stages_per_rank=spr, costs=costs, max_pending_w=cap)
        fused = fuse_where_split_loses(split, costs, read, it)
        assert validate(fused) is fused
        before, after = simulate(split, costs, iterations=it), simulate(fused, costs, iterations=it)
        assert read(after) <= read(before) * (1 + 1e-9), (name, m, cap)
        assert all(a <= b for a, b in zip(after.peak_bytes, before.peak_bytes, strict=True)), (name, m, cap)
        if num_fused(fused):  # each fusion takes b + w - bw off its rank's work
            assert sum(after.busy) < sum(before.busy), (name, m, cap)


def test_zb_v_at_two_ranks_fuses_the_w_that_follow_their_b_and_keeps_the_split_where_it_fills_a_bubble():
    read, it = _step("zb-v")

    def fused_at(ratio: float):
        costs = _costs(ratio, 4)
        split = build_schedule("zb-v", 4, 8, stages_per_rank=2, costs=costs)
        fused = fuse_where_split_loses(split, costs, read, it)
        return fused, read(simulate(split, costs, iterations=it)) / read(simulate(fused, costs, iterations=it))

    # ResNet's bottlenecks measured (B + W) / BW = 1.42 here: every backward that may fuse does (the first
    # stage's B is its whole backward already), 16% off the step
    fused, gain = fused_at(1.42)
    assert num_fused(fused) == 24 and gain > 1.15, (gain, str(fused))
    # at 1.1, the V's turn (3B0 3W0 back to back, nothing to fill) fuses, the cool-down's W that fill its
    # bubble stay split
    fused, gain = fused_at(1.1)
    assert gain > 1.02 and Action("BW", 3, 0) in fused.actions[0], (gain, str(fused))
    tail = fused.actions[1][-6:]
    assert {a.kind for a in tail} == {"B", "W"} and Action("W", 1, 7) in tail, str(fused)
    kinds = [a.kind for row in fused.actions for a in row]
    assert num_fused(fused) == kinds.count("BW") == 20


def test_nothing_changes_where_bw_is_not_measured_or_not_cheaper():
    split = build_schedule("zb-h1", 2, 4)
    assert fuse_where_split_loses(split, Costs()) is split  # bw unmeasured: priced B + W, no gain to find
    assert fuse_where_split_loses(split, Costs(bw=2.0)) is split  # BW as dear as B + W
    dear = Costs(b=1.0, w=1.0, bw=[1.0, 2.5])  # stage 1's fused backward dearer than its split
    assert num_fused(fuse_where_split_loses(split, dear)) <= 4
    assert all(a.stage == 0 for row in fuse_where_split_loses(split, dear).actions for a in row if a.kind == "BW")
    fused = build_schedule("1f1b", 2, 4, split_backward=False)
    assert fuse_where_split_loses(fused, _costs(1.42, 2)) is fused


def test_a_joined_w_gives_up_the_micro_batches_fused_and_keeps_the_others():
    costs = _costs(1.05, 4)
    joined = build_schedule("gpipe", 4, 8, costs=costs)  # GPipe + 2BP: a stage's W joined at the step's end
    fused = fuse_where_split_loses(joined, costs)
    ws = {a.stage: a.microbatches for row in fused.actions for a in row if a.kind == "W"}
    fused_mbs = {s: {a.microbatch for a in fused.actions[s] if a.kind == "BW"} for s in range(4)}
    assert ws[0] == tuple(range(8)) and not fused_mbs[0]  # the first stage's W is empty: nothing to gain
    assert ws[3] == (0, 1, 2) and fused_mbs[3] == set(range(3, 8)), str(fused)
    assert all(set(ws[s]) | fused_mbs[s] == set(range(8)) for s in range(1, 4))
    assert simulate(fused, costs).makespan <= simulate(joined, costs).makespan


def test_auto_weighs_the_fused_variants_and_picks_one_where_it_is_fastest():
    candidates = search(_priced(1.1, 2, (8,)))
    choice = choose(candidates, float("inf"))
    best = choice.best
    assert best.fused > 0 and "backwards fused where the split loses" in best.label, best.label
    assert best.step_time < min(c.step_time for c in candidates)
    assert validate(best.schedule) is best.schedule and num_fused(best.schedule) == best.fused
    source = next(
        c
        for c in candidates
        if (c.name, c.split_backward, c.max_pending_w, c.checkpointing) == (best.name, True, best.max_pending_w, None)
    )
    assert best.peak <= source.peak
    # split for free (BW = B + W): no variant, the choice auto made before
    assert not any(c.fused for c in choose(search(_priced(1.0, 2, (8,))), float("inf")).considered)


def test_auto_weighs_every_split_candidates_variant():
    """A reviewer's random costs (p = 4, BW at 0.99 of B + W): the fastest that fits is interleaved 1F1B's
    variant, whose split source less a `b + w - bw` per fusion was no faster than ZB-V's: such a bound
    pruned it (a fusion can take a whole W off the critical path)."""
    fbw = [(1.942, 1.309, 2.872), (0.807, 1.911, 2.917), (1.95, 1.841, 1.546), (1.042, 0.749, 1.01)]
    fbw += [(0.598, 0.952, 2.611), (0.505, 1.517, 1.683), (0.965, 1.728, 2.183), (0.974, 1.222, 2.966)]
    held = [51.2, 187.8, 189.8, 71.5, 80.9, 109.8, 83.8, 75.3]
    layers = tuple(
        LayerCost(f=f, b=b, w=w, activation=100, held=h, fixed=1000, bw=0.99 * (b + w))
        for (f, b, w), h in zip(fbw, held, strict=True)
    )
    profile = Profile(4, {8: layers}, {1: (2,) * 4, 2: (1,) * 8})
    best = choose(search(profile, families=("zb-v", "interleaved-1f1b")), 3400).best
    assert (best.name, best.max_pending_w, best.fused) == ("interleaved-1f1b", 7, 37), best.label
    assert best.step_time == pytest.approx(89.1, abs=1e-3) and best.peak <= 3400
