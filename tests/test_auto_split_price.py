"""schedule="auto" sees the split's price (issue 21, RQ1): the fused backward BW is measured and priced,
so the search never picks a split schedule that loses to a fused one at the measured costs."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from lightning_twobp.engine.footprint import layer_cost, measure_layer
from lightning_twobp.lightning.autoschedule import _from_row, _to_row, timed_footprint
from lightning_twobp.schedules import Costs, build_schedule, simulate
from lightning_twobp.schedules.auto import LayerCost, Profile, choose, format_choice, search, stage_cost

# ------------------------------------------------------------------ the model of the costs, as data


def _priced(ratio: float | None, p: int = 2, counts: tuple[int, ...] = (4, 8)) -> Profile:
    """8 equal layers, F = B = W = 8 / m seconds, whose fused backward BW is (B + W) / ``ratio`` (None: not
    measured, B + W)."""

    def at(m: int) -> tuple[LayerCost, ...]:
        s = 8 / m
        bw = None if ratio is None else 2 * s / ratio
        return (LayerCost(f=s, b=s, w=s, activation=100 * s, held=40 * s, fixed=1000, bw=bw),) * 8

    return Profile(p, {m: at(m) for m in counts}, {1: (8 // p,) * p, 2: (8 // (2 * p),) * (2 * p)})


def test_costs_price_bw_as_given_and_as_b_plus_w_without():
    assert Costs(b=2.0, w=3.0).of("BW", 0) == 5.0
    costs = Costs(b=[2.0, 2.0], w=[3.0, 3.0], bw=[4.0, 3.5])
    assert (costs.of("BW", 0), costs.of("BW", 1), costs.of("B", 1)) == (4.0, 3.5, 2.0)
    fused = build_schedule("1f1b", 2, 4, split_backward=False)
    # a fused schedule runs BW at bw: as if its B were bw and W nothing
    priced = simulate(fused, Costs(f=1.0, b=2.0, w=3.0, bw=4.0)).makespan
    assert (
        priced
        == simulate(fused, Costs(f=1.0, b=4.0, w=0.0)).makespan
        < simulate(fused, Costs(f=1.0, b=2.0, w=3.0)).makespan
    )
    assert Costs(bw=1.5).times != Costs().times  # the Zero Bubble builder compares times: bw is one


def test_costs_bw_is_checked_like_f_b_and_w():
    with pytest.raises(ValueError, match=r"Costs.bw has 3 values for 4 stages"):
        Costs(bw=[1.0, 2.0, 3.0]).check(4)
    with pytest.raises(ValueError, match=r"Costs.bw has 3 values for 4 stages"):
        simulate(build_schedule("1f1b", 4, 4, split_backward=False), Costs(bw=[1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"Costs.bw must be >= 0, got -1"):
        Costs(bw=-1.0)
    with pytest.raises(ValueError, match=r"Costs.bw needs at least one value"):
        Costs(bw=[])


def test_a_stage_sums_the_fused_backward_and_the_first_stage_pays_no_split():
    a = LayerCost(f=1, b=2, w=3, bw=4)
    unmeasured = LayerCost(f=1, b=1, w=1)  # B + W stands in for its BW
    mid = stage_cost([a, unmeasured], first=False)
    assert (mid.b, mid.w, mid.bw) == (3, 4, 6)
    first = stage_cost([a, unmeasured], first=True)
    # the first stage's B is one fused backward of the whole stage (no input gradient to split off)
    assert (first.b, first.w, first.bw) == (6, 0, 6)
    old = stage_cost([unmeasured, unmeasured], first=True)
    assert (old.b, old.w, old.bw) == (4, 0, None)  # without BW: as before


def test_without_bw_the_search_predicts_as_before_and_bw_equal_to_b_plus_w_changes_nothing():
    before, equal = _priced(None), _priced(1.0)
    assert before.costs(8, 1).bw is None and equal.costs(8, 1).bw == (8.0, 8.0)
    old, new = search(before), search(equal)
    assert [(c.label, c.step_time, c.peak_bytes) for c in old] == [(c.label, c.step_time, c.peak_bytes) for c in new]
    best = choose(new, float("inf"))
    assert best.best.split_backward, best.best.label  # the split is free here: a 2BP schedule wins, as today
    assert "fused, not split" not in format_choice(best)


def test_a_split_that_costs_half_again_its_backward_loses_to_a_fused_schedule():
    candidates = search(_priced(1.5))
    choice = choose(candidates, float("inf"))
    best = choice.best
    assert not best.split_backward, best.label
    # the split candidates, and those fused where their split loses (schedules.fusion): at best as fast,
    # where every backward that may be is fused (interleaved 1F1B capped at k = 0 is then the fused order)
    splits = [c for c in choice.considered if c.split_backward]
    assert splits and best.step_time < min(c.step_time for c in splits if not c.fused)
    assert best.step_time <= min(c.step_time for c in splits)
    # the same layers with BW unmeasured (B + W): a split schedule wins, the choice auto made before
    assert choose(search(_priced(None)), float("inf")).best.split_backward
    rival = min(splits, key=lambda c: (c.step_time, c.peak))
    line = next(x for x in format_choice(choice).splitlines() if "fused, not split" in x)
    assert "the split's measured (B + W) / BW is 1.5 on stage" in line and rival.label in line, line


# ------------------------------------------------------------------ measuring BW


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _embedding() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))


CASES = {
    "block": (_block, lambda: torch.randn(5, 6, generator=torch.Generator().manual_seed(1)), True),
    "ids": (_embedding, lambda: torch.randint(0, 10, (5, 7), generator=torch.Generator().manual_seed(1)), False),
}


def _reference_grads(layer: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One plain backward of one micro-batch from a gradient of ones."""
    ref = copy.deepcopy(layer)
    out = ref(x)
    out.backward(torch.ones_like(out))
    return {n: q.grad for n, q in ref.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_measure_layer_times_a_fused_backward_with_a_clock(case):
    make, data, needs = CASES[case]
    layer, x = make(), data()
    ref = _reference_grads(layer, x)
    fp = measure_layer(layer, x, needs, clock=time.perf_counter)
    assert len(fp.seconds) == 4 and fp.seconds[3] > 0, fp.seconds
    assert layer_cost(fp, 0.0).bw == fp.seconds[3]
    # the split's gradients and BW's: two micro-batches' worth, each what a plain backward gives
    for name, q in layer.named_parameters():
        torch.testing.assert_close(q.grad, 2 * ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_without_a_clock_bw_is_not_run():
    layer, x = _block(), CASES["block"][1]()
    ref = _reference_grads(layer, x)
    fp = measure_layer(layer, x, True)
    assert fp.seconds == (0.0, 0.0, 0.0, 0.0)
    for name, q in layer.named_parameters():
        torch.testing.assert_close(q.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # the planner's estimates (given seconds) leave BW to B + W
    assert layer_cost(fp, 0.0, (1.0, 2.0, 3.0)).bw is None


def test_timed_bw_crosses_the_agreed_table():
    layer, x = _block(), CASES["block"][1]()
    fp = timed_footprint(layer, x, True, torch.device("cpu"), repeats=2)
    cost = layer_cost(fp, 64.0)
    assert cost.bw is not None and cost.bw > 0
    assert _from_row(_to_row(cost)) == cost
    # not measured: the table carries B + W, which is what None means (and output_held as output)
    unmeasured = LayerCost(f=1.0, b=2.0, w=0.5, graph_kept=True, output=8.0)
    back = _from_row(_to_row(unmeasured))
    assert back.bw == 2.5 and back.graph_kept is True
    assert back == LayerCost(f=1.0, b=2.0, w=0.5, graph_kept=True, bw=2.5, output=8.0, output_held=8.0)


def test_profiling_puts_batch_norm_statistics_back_by_name_after_a_move() -> None:
    """Profiling runs extra forwards (the fused backward's timing runs F again) and moves each layer to the
    device and back, which replaces its buffer tensors: the statistics go back by name, as they were."""
    from lightning_twobp.lightning.profile import keep_buffers

    bn = nn.BatchNorm1d(4)
    mean, var = bn.running_mean.clone(), bn.running_var.clone()
    put_back = keep_buffers([bn])
    bn.to(torch.float64)  # new buffer tensors, as a move to a GPU and back makes
    bn(torch.randn(8, 4, dtype=torch.float64) + 3)
    assert not torch.allclose(bn.running_mean, mean.double())
    put_back()
    assert torch.equal(bn.running_mean, mean.double()) and torch.equal(bn.running_var, var.double())
    assert int(bn.num_batches_tracked) == 0
