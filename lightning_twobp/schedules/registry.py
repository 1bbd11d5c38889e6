"""``build_schedule``: one entry point that checks arguments and dispatches by name."""

from __future__ import annotations

from .gpipe import gpipe
from .ir import Schedule, check_layout
from .one_f_one_b import interleaved_one_f_one_b, one_f_one_b
from .simulate import Costs
from .zero_bubble import zero_bubble

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")

# Zero Bubble schedules exist only with B and W as separate actions.
_SPLIT_ONLY = ("zb-h1", "zb-h2", "zb-v")


def check_split(name: str, split_backward: bool) -> None:
    """Raise ``ValueError`` for a Zero Bubble schedule without the split (it has no fused form)."""
    if name in _SPLIT_ONLY and not split_backward:
        raise ValueError(
            f"{name} is split by definition (its backward is separate B and W actions); got "
            f"split_backward=False: use '1f1b' or 'gpipe' for a fused backward"
        )


def build_schedule(name: str, num_stages: int, num_microbatches: int, *,
                   stages_per_rank: int = 1, split_backward: bool = True,
                   costs: Costs | None = None) -> Schedule:
    """Build and validate schedule ``name`` for ``num_stages`` stages in total.

    ``stages_per_rank`` stages share a rank (``p = num_stages // stages_per_rank``
    ranks); ``split_backward`` writes backward as B + W instead of BW; ``costs``
    (a :class:`~.simulate.Costs`) steers the greedy Zero Bubble schedules and is
    ignored by the fixed-order ones.  Raises ValueError for combinations that do
    not exist, saying what would work.
    """
    ranks = check_layout(name, num_stages, stages_per_rank)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    m = num_microbatches

    if name == "1f1b" and stages_per_rank != 1:
        raise ValueError(
            f"1f1b runs one stage per rank; got stages_per_rank={stages_per_rank}: use "
            f"build_schedule('interleaved-1f1b', {num_stages}, {m}, "
            f"stages_per_rank={stages_per_rank}) or stages_per_rank=1"
        )
    if name in ("zb-h1", "zb-h2") and stages_per_rank != 1:
        raise ValueError(
            f"{name} runs one stage per rank; got stages_per_rank={stages_per_rank}: use "
            f"stages_per_rank=1, or build_schedule('zb-v', {2 * ranks}, {m}, "
            f"stages_per_rank=2) for a V over {ranks} ranks"
        )
    if name == "zb-v" and stages_per_rank != 2:
        raise ValueError(
            f"zb-v needs stages_per_rank=2 (a V of 2 stages per rank); got {stages_per_rank}: "
            f"use build_schedule('zb-v', {2 * ranks}, {m}, stages_per_rank=2) for {ranks} ranks"
        )
    check_split(name, split_backward)
    if name == "interleaved-1f1b" and stages_per_rank > 1 and m % ranks:
        start = max(ranks, (m // ranks) * ranks)
        options = [start, start + ranks, start + 2 * ranks]
        raise ValueError(
            f"interleaved-1f1b with {stages_per_rank} stages per rank on {ranks} ranks needs "
            f"a micro-batch count that is a multiple of {ranks}: use {options[0]}, "
            f"{options[1]} or {options[2]} (got {m})"
        )

    if name == "gpipe":
        schedule = gpipe(num_stages, m, stages_per_rank=stages_per_rank,
                         split_backward=split_backward)
    elif name == "1f1b":
        schedule = one_f_one_b(num_stages, m, split_backward=split_backward)
    elif name == "interleaved-1f1b":
        schedule = interleaved_one_f_one_b(num_stages, m, stages_per_rank=stages_per_rank,
                                           split_backward=split_backward)
    else:
        schedule = zero_bubble(name, num_stages, m, stages_per_rank=stages_per_rank,
                               costs=costs)
    return schedule.validate()
