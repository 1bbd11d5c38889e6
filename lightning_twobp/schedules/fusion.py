"""The fused backward where the split loses: BW for the micro-batches whose W fills no bubble.

2BP pays for its split twice: B and W together cost more than the fused backward they replace
(``b + w > bw``: per call, not per FLOP, on a small CPU layer; ResNet's bottlenecks at 1.42x in
docs/benchmarks.md), and each W is one action more. What it buys is a W that fills an idle slot of
its rank. Where a W fills none (ZB-V at p = 2 runs most W right after their own B), the split is pure
cost. :func:`fuse_where_split_loses` writes those micro-batches' backward as one BW at B's place,
and leaves the split where it pays, judged by the schedule model at the given costs:

* a candidate is a ``(stage, micro-batch)`` on a stage whose measured ``bw`` is below ``b + w`` (where
  a W covers several micro-batches, as 1F1B + 2BP joins them at the step's end, the others stay in it);
* in order of B's start, a candidate is fused when the simulated step is not longer for it; the next
  is judged on the schedule with every earlier fusion in (a run of candidates is tried at once first,
  and halved where it does not pass: one simulation where all of them fuse).

So the result is never slower than its source at those costs, and the cap on pending W (:mod:`.deferral`)
still holds (a BW leaves nothing pending). What it holds is replayed like any order's (:mod:`.memory`):
a BW lets go at once of what B kept for W, so a rank holds less or the same, but the communication is
lowered from the new order, and where a fusion moves when a neighbour lets a sent tensor go, that rank can
hold it longer (a V-Half case, messages counted: 15 bytes more of 525 on another rank). ``schedule="auto"``
checks each fused variant's own peak against the limit.
"""

from __future__ import annotations

from collections.abc import Callable

from .ir import Action, Schedule
from .simulate import Costs, SimResult, simulate

__all__ = ["fuse_where_split_loses", "fused_note", "num_fused"]

# A fusion is kept when the step it gives is no more than this much longer (the sum of float
# durations in a different order): equal, in the model's terms.
_SAME = 1e-9


def num_fused(schedule: Schedule) -> int:
    """How many (stage, micro-batch) backwards a split schedule runs fused (0 for one that fuses none)."""
    return sum(a.kind == "BW" for row in schedule.actions for a in row) if schedule.split_backward else 0


def fused_note(schedule: Schedule) -> str:
    """``"20 of 32 backwards fused where the split loses"`` for a split schedule fused in part, else ``""``: what
    labels and logs add to the schedule's name."""
    fused = num_fused(schedule)
    total = schedule.num_stages * schedule.num_microbatches
    return f"{fused} of {total} backwards fused where the split loses" if fused else ""


def fuse_where_split_loses(
    schedule: Schedule, costs: Costs, step: Callable[[SimResult], float] | None = None, iterations: int = 1
) -> Schedule:
    """``schedule`` with BW written for each (stage, micro-batch) whose split does not pay at ``costs``.

    ``step`` reads the step's time off a :class:`~.simulate.SimResult` of ``iterations`` back-to-back
    steps (default: the makespan of one). A fused schedule, or costs without a measured ``bw``, come
    back unchanged: there the model prices BW as ``b + w`` and fusing could not gain.
    """
    if not schedule.split_backward or costs.bw is None:
        return schedule
    read = step or (lambda sim: sim.makespan)
    sim = simulate(schedule, costs, iterations=iterations, memory=False)
    return _Greedy(costs, read, iterations).run(schedule, read(sim), _candidates(schedule, costs, sim))


class _Greedy:
    """Fuse a run of candidates at once where the step is not longer for all of them, else each half
    in turn: the one-at-a-time greedy's guarantee (each fusion kept only where the step does not grow)
    at one simulation for a run that all fuses, which ZB-V's W mostly do."""

    def __init__(self, costs: Costs, read: Callable[[SimResult], float], iterations: int) -> None:
        self.costs, self.read, self.iterations = costs, read, iterations

    def time(self, schedule: Schedule) -> float:
        return self.read(simulate(schedule, self.costs, iterations=self.iterations, memory=False, timeline=False))

    def run(self, schedule: Schedule, best: float, pairs: list[tuple[int, int]]) -> Schedule:
        if not pairs:
            return schedule
        trial = schedule
        for stage, mb in pairs:
            trial = _fuse(trial, stage, mb)
        time = self.time(trial)
        if time <= best * (1 + _SAME):
            return trial
        if len(pairs) == 1:
            return schedule
        half = len(pairs) // 2
        first = self.run(schedule, best, pairs[:half])
        now = best if first is schedule else self.time(first)
        return self.run(first, min(best, now), pairs[half:])


def _candidates(schedule: Schedule, costs: Costs, sim: SimResult) -> list[tuple[int, int]]:
    """The (stage, micro-batch) pairs worth trying, in order of their B's start in the first step."""
    cheaper = {
        s for s in range(schedule.num_stages) if costs.of("BW", s) < (costs.of("B", s) + costs.of("W", s)) * (1 - _SAME)
    }
    starts: dict[tuple[int, int], float] = {}
    for _, action, start, _ in sim.timeline:
        key = (action.stage, action.microbatches[0])
        if action.kind == "B" and action.stage in cheaper and key not in starts:  # the first step's (sorted by start)
            starts[key] = start
    return sorted(starts, key=lambda k: (starts[k], k))


def _fuse(schedule: Schedule, stage: int, mb: int) -> Schedule:
    """``schedule`` with B(stage, mb) written as BW(stage, mb), and ``mb`` gone from the W that covered it
    (a W of several micro-batches keeps the others)."""
    rank = schedule.stage_to_rank[stage]
    row: list[Action] = []
    for a in schedule.actions[rank]:
        if a.stage != stage or mb not in a.microbatches or a.kind == "F":
            row.append(a)
        elif a.kind == "B":
            row.append(Action("BW", stage, mb))
        elif len(a.microbatches) > 1:  # W: the rest of a batched one stays
            row.append(Action("W", stage, tuple(m for m in a.microbatches if m != mb)))
    rows = schedule.actions[:rank] + (tuple(row),) + schedule.actions[rank + 1 :]
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank, rows, True)
