"""The data-parallel gradient reduce, added to a lowered schedule by a pass.

Under DP x PP each stage's gradients are averaged over the stage's replicas in the other pipelines.
They are complete once the stage's last gradient action (its last ``W``, or ``BW`` without the split)
has run, not only at the end of the step: :func:`add_grad_reduce` puts a :class:`GradReduce` right
there, after the batch of sends that follows the action (peers are unblocked first), so the executor
can start the all-reduce asynchronously and overlap it with the rank's remaining work (later W, and
other stages on the loop and V maps). The executor waits for every reduce at the end of the step.

torch.distributed.pipelining's zero-bubble schedules with DDP skip this reduce altogether (pytorch
#144530); here it is part of the lowered schedule, so it cannot be forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .ir import Action, Schedule
from .lower import Comm, Op

__all__ = ["GradReduce", "add_grad_reduce"]


@dataclass(frozen=True)
class GradReduce:
    """Average ``stage``'s gradients over its data-parallel replicas (asynchronously)."""

    stage: int

    def __str__(self) -> str:
        return f"{self.stage}REDUCE"


def add_grad_reduce(
    lowered: Sequence[Sequence[Op | GradReduce]], schedule: Schedule
) -> tuple[tuple[Op | GradReduce, ...], ...]:
    """``lowered`` (per rank, from :func:`lower_communication`) with one :class:`GradReduce` per stage,
    after the stage's last gradient action and the batch of comm ops right after it."""
    out = []
    for rank, ops in enumerate(lowered):
        last_grad: dict[int, int] = {}
        for i, op in enumerate(ops):
            if isinstance(op, Action) and op.kind in ("W", "BW"):
                last_grad[op.stage] = i
        missing = set(schedule.stages_of(rank)) - set(last_grad)
        if missing:
            raise ValueError(
                f"rank {rank}: stages {sorted(missing)} have no W or BW in schedule {schedule.name!r}, so "
                f"their gradients are never complete"
            )
        after: dict[int, list[int]] = {}
        for s, i in last_grad.items():
            j = i + 1
            while j < len(ops) and isinstance(ops[j], Comm):
                j += 1
            after.setdefault(j, []).append(s)
        row: list[Op | GradReduce] = []
        for j in range(len(ops) + 1):
            row += [GradReduce(s) for s in sorted(after.get(j, []))]
            if j < len(ops):
                row.append(ops[j])
        out.append(tuple(row))
    return tuple(out)
