"""Pipeline schedules as pure data (no torch): build, validate, time and lower them.

>>> from lightning_twobp.schedules import build_schedule, simulate
>>> schedule = build_schedule("1f1b", num_stages=4, num_microbatches=8)
>>> round(simulate(schedule).bubble_fraction, 3)
0.143

Modules: :mod:`.ir` (the data), :mod:`.spec` (the registry: one :class:`ScheduleSpec` per name;
:mod:`.catalog` registers the built-in ones), :mod:`.placement` (layouts and defaults, read from the
specs), :mod:`.builders` (one family each), :mod:`.validate`, :mod:`.simulate`, :mod:`.memory` (the
one replay of what a schedule holds), :mod:`.deferral` (the cap on W waiting after their B), :mod:`.auto`
(the search behind ``schedule="auto"``: the fastest predicted schedule within a memory limit), and the
passes :mod:`.lower` (communication) and :mod:`.grad_reduce` (the data-parallel reduce). The imports go one way: ``ir``
needs nothing.
"""

from . import catalog  # noqa: F401  (registers the built-in schedules)
from .deferral import peak_pending_w, pending_w_cap
from .grad_reduce import GradReduce, add_grad_reduce
from .ir import Action, DeadlockError, Schedule
from .lower import Comm, check_comm_deadlock, check_comm_order, lower_communication
from .memory import (
    MemoryCosts,
    MemoryPeaks,
    memory_levels,
    peak_activations,
    peak_bytes,
    peak_inflight,
    reduce_levels,
    replay_memory,
)
from .placement import (
    SCHEDULES,
    check_layout,
    check_split,
    default_num_microbatches,
    default_stages_per_rank,
    schedule_label,
    stage_to_rank,
)
from .registry import build_schedule
from .simulate import Costs, SimResult, simulate
from .spec import BuildRequest, MemoryClass, ScheduleSpec, register_schedule, schedule_spec, unregister_schedule
from .validate import validate

__all__ = [
    "Action",
    "BuildRequest",
    "Comm",
    "Costs",
    "DeadlockError",
    "GradReduce",
    "MemoryClass",
    "MemoryCosts",
    "MemoryPeaks",
    "SCHEDULES",
    "Schedule",
    "ScheduleSpec",
    "SimResult",
    "add_grad_reduce",
    "build_schedule",
    "check_comm_deadlock",
    "check_comm_order",
    "check_layout",
    "check_split",
    "default_num_microbatches",
    "default_stages_per_rank",
    "lower_communication",
    "memory_levels",
    "peak_activations",
    "peak_bytes",
    "peak_inflight",
    "peak_pending_w",
    "pending_w_cap",
    "register_schedule",
    "reduce_levels",
    "replay_memory",
    "schedule_label",
    "schedule_spec",
    "simulate",
    "stage_to_rank",
    "unregister_schedule",
    "validate",
]
