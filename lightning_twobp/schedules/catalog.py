"""The built-in schedules, registered in the order the docs present them.

Each is one :class:`~.spec.ScheduleSpec`; a new schedule is one builder (a function of a
:class:`~.spec.BuildRequest`) and one ``register_schedule`` call like these. Memory bounds count the
(stage, micro-batch) pairs a rank holds from F to their last B/W/BW; on two stages per rank each pair
is half a stage, so ``2p`` of them are fused 1F1B's ``p`` full ones.
"""

from __future__ import annotations

from .builders import gpipe, interleaved_one_f_one_b, one_f_one_b, zero_bubble
from .builders.v_orders import v_memory_bound
from .placement import (
    check_interleaved_microbatches,
    check_one_stage_or_interleaved,
    check_one_stage_or_v,
    check_two_stages_v,
)
from .spec import MemoryClass, ScheduleSpec, register_schedule

__all__: list[str] = []


def _interleaved_bound(p: int, m: int, v: int, split: bool) -> int:
    # Megatron's warm-up (p - r - 1)·2 + (v - 1)·p on rank 0, plus the one in flight in the steady state.
    if split:
        return v * m
    return min(p, m) if v == 1 else min(2 * (p - 1) + (v - 1) * p + 1, v * m)


def _v_schedule(name: str, memory: MemoryClass, overlaps: bool = False) -> ScheduleSpec:
    """A schedule of the V family: two stages per rank placed in a V, the backward split, interleaved
    1F1B as the fused baseline."""
    return ScheduleSpec(
        name,
        zero_bubble,
        memory,
        placement="v",
        stages_per_rank=(2,),
        default_stages_per_rank=2,
        split_only=True,
        fused_baseline="interleaved-1f1b",
        overlaps=overlaps,
        checks=(check_two_stages_v,),
    )


BUILT_IN = (
    ScheduleSpec(
        "gpipe", gpipe, MemoryClass("m", lambda p, m, v, split: v * m), placement="loop", stages_per_rank=None
    ),
    ScheduleSpec(
        "1f1b",
        one_f_one_b,
        MemoryClass("p (fused); m with 2BP", lambda p, m, v, split: m if split else min(p, m)),
        checks=(check_one_stage_or_interleaved,),
    ),
    ScheduleSpec(
        "interleaved-1f1b",
        interleaved_one_f_one_b,
        MemoryClass("(2(p-1) + (v-1)p + 1)/v (fused); m with 2BP", _interleaved_bound),
        placement="loop",
        stages_per_rank=None,
        default_stages_per_rank=2,
        checks=(check_interleaved_microbatches,),
    ),
    ScheduleSpec(
        "zb-h1",
        zero_bubble,
        MemoryClass("p", lambda p, m, v, split: min(p, m)),
        split_only=True,
        fused_baseline="1f1b",
        checks=(check_one_stage_or_v,),
    ),
    ScheduleSpec(
        "zb-h2",
        zero_bubble,
        MemoryClass("2p - 1", lambda p, m, v, split: min(2 * p - 1, m)),
        split_only=True,
        fused_baseline="1f1b",
        overlaps=True,
        checks=(check_one_stage_or_v,),
    ),
    _v_schedule("zb-v", MemoryClass("p", lambda p, m, v, split: min(2 * p, 2 * m)), overlaps=True),
    _v_schedule("v-half", MemoryClass("(p + 2) // 2", lambda p, m, v, split: min(v_memory_bound("v-half", p), 2 * m))),
    _v_schedule("v-min", MemoryClass("(p + 4) // 3", lambda p, m, v, split: min(v_memory_bound("v-min", p), 2 * m))),
)

for _spec in BUILT_IN:
    register_schedule(_spec)
