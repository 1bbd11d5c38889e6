"""Cutting a Sequential into stages: balanced, explicit, and the errors that name the fix."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_twobp.partition import balanced_sizes, even_sizes, partition, split_sequential


def _brute(weights, k):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_balanced_sizes_is_optimal(weights, k):
    if k > len(weights):
        with pytest.raises(ValueError, match="cannot fill"):
            balanced_sizes(weights, k)
        return
    sizes = balanced_sizes(weights, k)
    assert len(sizes) == k and sum(sizes) == len(weights) and min(sizes) >= 1
    bounds = [0, *itertools.accumulate(sizes)]
    worst = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    assert worst == _brute(weights, k)


def test_equal_weights_give_even_sizes():
    assert sorted(balanced_sizes([1.0] * 10, 4)) == sorted(even_sizes(10, 4)) == [2, 2, 3, 3]
    assert balanced_sizes([1.0] * 12, 4) == [3, 3, 3, 3]


def test_params_balance_follows_parameter_counts():
    seq = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.Linear(64, 64))
    assert partition(seq, 2, "params") in ([1, 4], [2, 3], [3, 2], [4, 1])
    sizes = partition(seq, 2, "params")
    parts = split_sequential(seq, sizes)
    assert all(any(isinstance(m, nn.Linear) for m in p) for p in parts)


def test_time_and_explicit_balance():
    seq = nn.Sequential(*[nn.Identity() for _ in range(4)])
    assert partition(seq, 2, "time", costs=[3, 1, 1, 1]) == [1, 3]
    assert partition(seq, 2, [3, 1]) == [3, 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_stages=6), "4 layers cannot fill 6 stages: lower the number of stages to <= 4"),
        (dict(num_stages=2, balance=[3, 3]), r"sums to 6, but the Sequential has 4 layers"),
        (dict(num_stages=3, balance=[2, 2]), r"2 entries for 3 stages"),
        (dict(num_stages=2, balance="time"), r'balance="time" needs one measured cost per layer'),
        (dict(num_stages=2, balance="flops"), r"balance must be 'params', 'time' or a list"),
    ],
)
def test_partition_errors_name_the_fix(kwargs, match):
    seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    with pytest.raises(ValueError, match=match):
        partition(seq, **kwargs)
