"""``build_schedule``: one entry point that checks arguments and dispatches by name."""

from __future__ import annotations

from .builders import gpipe, interleaved_one_f_one_b, one_f_one_b, zero_bubble
from .ir import Schedule
from .placement import check_layout, check_split
from .simulate import Costs
from .validate import validate

__all__ = ["build_schedule"]


def build_schedule(name: str, num_stages: int, num_microbatches: int, *,
                   stages_per_rank: int = 1, split_backward: bool = True,
                   costs: Costs | None = None) -> Schedule:
    """Build and validate schedule ``name`` for ``num_stages`` stages in total.

    ``stages_per_rank`` stages share a rank (``p = num_stages // stages_per_rank``
    ranks); ``split_backward`` writes backward as B + W instead of BW; ``costs``
    (a :class:`~.simulate.Costs`) steers the Zero Bubble schedules (the fastest of the
    paper's order and greedy ones at those costs) and is ignored by the fixed-order
    ones.  Raises ValueError for combinations that do not exist, saying what would work.
    """
    check_layout(name, num_stages, stages_per_rank, num_microbatches)
    check_split(name, split_backward)
    m = num_microbatches
    if name == "gpipe":
        schedule = gpipe(num_stages, m, stages_per_rank=stages_per_rank, split_backward=split_backward)
    elif name == "1f1b":
        schedule = one_f_one_b(num_stages, m, split_backward=split_backward)
    elif name == "interleaved-1f1b":
        schedule = interleaved_one_f_one_b(num_stages, m, stages_per_rank=stages_per_rank,
                                           split_backward=split_backward)
    else:
        schedule = zero_bubble(name, num_stages, m, stages_per_rank=stages_per_rank, costs=costs)
    return validate(schedule)
