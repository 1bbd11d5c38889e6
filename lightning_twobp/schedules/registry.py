"""``build_schedule``: one entry point that checks arguments and dispatches through the schedule's spec."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .deferral import cap_pending_w, check_max_pending_w
from .ir import Schedule
from .placement import check_layout, check_split, place
from .simulate import Costs
from .spec import BuildRequest, schedule_spec
from .validate import validate

__all__ = ["build_schedule"]


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    stages_per_rank: int = 1,
    split_backward: bool = True,
    costs: Costs | None = None,
    max_pending_w: int | Sequence[int] | None = None,
) -> Schedule:
    """Build and validate schedule ``name`` for ``num_stages`` stages in total.

    ``stages_per_rank`` stages share a rank (``p = num_stages // stages_per_rank``
    ranks); ``split_backward`` writes backward as B + W instead of BW; ``costs``
    (a :class:`~.simulate.Costs`) steers the Zero Bubble schedules (the fastest of the
    paper's order and greedy ones at those costs) and is ignored by the fixed-order
    ones.  ``max_pending_w`` (an int, or one per stage) caps the micro-batches whose W waits
    after their B (:mod:`.deferral`; the Zero Bubble builders build under the cap at ``costs``).
    Raises ValueError for combinations that do not exist, saying what would work.
    """
    spec = schedule_spec(name)
    check_layout(name, num_stages, stages_per_rank, num_microbatches)
    check_split(name, split_backward)
    caps = check_max_pending_w(max_pending_w, name, num_stages, split_backward)
    costs = costs or Costs()
    costs.check(num_stages)
    req = BuildRequest(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stages_per_rank=stages_per_rank,
        split_backward=split_backward,
        costs=costs,
        stage_to_rank=place(spec.placement, num_stages, stages_per_rank),
        max_pending_w=caps,
    )
    schedule = spec.builder(req)
    if caps is not None:  # a builder that does not build under the cap gets it applied to its order
        schedule = cap_pending_w(schedule, caps)
    if schedule.stage_to_rank != req.stage_to_rank:
        raise ValueError(
            f"schedule {name!r}: its builder placed the stages as {schedule.stage_to_rank}, its spec's "
            f"{spec.placement!r} placement as {req.stage_to_rank}: make the builder use "
            f"BuildRequest.stage_to_rank"
        )
    if schedule.name != name:  # a builder shared by several specs (a registered variant) names its own family
        schedule = replace(schedule, name=name)
    return validate(schedule)
