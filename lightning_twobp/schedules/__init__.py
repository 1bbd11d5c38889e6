"""Pipeline schedules as pure data (no torch): build, validate, time and lower them.

>>> from lightning_twobp.schedules import build_schedule, simulate
>>> schedule = build_schedule("1f1b", num_stages=4, num_microbatches=8)
>>> round(simulate(schedule).bubble_fraction, 3)
0.143
"""

from .comm import Comm, check_comm_deadlock, check_comm_order, lower_communication
from .grad_reduce import GradReduce, add_grad_reduce
from .ir import Action, Schedule, stage_to_rank
from .registry import SCHEDULES, build_schedule, check_split
from .simulate import Costs, DeadlockError, SimResult, simulate
from .zero_bubble import peak_activations

__all__ = [
    "Action",
    "Comm",
    "Costs",
    "DeadlockError",
    "GradReduce",
    "SCHEDULES",
    "Schedule",
    "SimResult",
    "add_grad_reduce",
    "build_schedule",
    "check_comm_deadlock",
    "check_comm_order",
    "check_split",
    "lower_communication",
    "peak_activations",
    "simulate",
    "stage_to_rank",
]
