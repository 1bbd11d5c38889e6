"""torch.distributed.pipelining's orders as our schedule data, to compare orders apart from runtimes.

torch's runtime schedules compute each rank's action list (``pipeline_order``) from the pipeline's
sizes alone, in ``_calculate_single_rank_operations``. :func:`torch_order` calls that method on an
object carrying only those sizes (no stages, no process group) and converts its actions (F, I = input
backward, W, B = full backward) into our :class:`~lightning_twobp.schedules.Schedule`, so that
:func:`~lightning_twobp.schedules.simulate` can time torch's order and ours at the same costs. The
method is private to torch: a release that changes it makes :func:`torch_order` raise, and the test
that uses it says which.
"""

from __future__ import annotations

import types

from lightning_twobp.schedules import Action, Schedule, stage_to_rank, validate

__all__ = ["TORCH_ORDERS", "torch_order"]

# torch class name -> (our placement's schedule name, stages per rank, split backward)
TORCH_ORDERS = {
    "ScheduleZBVZeroBubble": ("zb-v", 2, True),
    "ScheduleInterleavedZeroBubble": ("interleaved-1f1b", None, True),
    "ScheduleInterleaved1F1B": ("interleaved-1f1b", None, False),
}
_KIND = {
    "F": "F",
    "I": "B",
    "W": "W",
    "B": "BW",
    "FORWARD": "F",
    "BACKWARD_INPUT": "B",
    "BACKWARD_WEIGHT": "W",
    "FULL_BACKWARD": "BW",
}


def torch_order(cls_name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """torch's order of ``cls_name`` for ``num_ranks`` ranks and ``num_microbatches``, as our data."""
    import torch.distributed.pipelining.schedules as torch_schedules

    if cls_name not in TORCH_ORDERS:
        raise ValueError(f"no conversion for {cls_name!r}; known: {', '.join(TORCH_ORDERS)}")
    placement, fixed_spr, split = TORCH_ORDERS[cls_name]
    spr = fixed_spr or stages_per_rank
    p, m = num_ranks, num_microbatches
    rounds = max(1, m // p)
    if cls_name == "ScheduleInterleavedZeroBubble" and m % rounds:
        # torch's __init__ refuses these counts; its order for them does not exist
        raise ValueError(
            f"torch refuses {cls_name} with {m} micro-batches on {p} ranks (not a multiple of its {rounds} rounds)"
        )
    sizes = types.SimpleNamespace(
        pp_group_size=p,
        n_local_stages=spr,
        _n_microbatches=m,
        num_stages=p * spr,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
        rank=0,
    )
    cls = getattr(torch_schedules, cls_name)
    rows = []
    for r in range(p):
        sizes.rank = r
        actions = []
        for a in cls._calculate_single_rank_operations(sizes, r):
            if a is None:  # an idle slot in torch's list; the order is what counts
                continue
            kind = str(a.computation_type).rsplit(".", 1)[-1]
            actions.append(Action(_KIND[kind], a.stage_index, a.microbatch_index))
        rows.append(tuple(actions))
    s2r = stage_to_rank(placement, p * spr, spr) if spr > 1 else tuple(range(p))
    return validate(Schedule(f"torch-{cls_name}", p * spr, m, s2r, tuple(rows), split))
