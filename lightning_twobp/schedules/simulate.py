"""Discrete-event timing of a :class:`~.ir.Schedule`: makespan, bubbles, in-flight peaks.

Model (the one the Zero Bubble paper, Qi et al. ICLR 2024 §2, uses for its bubble
formulas): every rank runs its action list strictly in order; an action starts at

    start = max(rank free, end(dep) + (comm if dep is on another rank else 0))

over its dependencies

* ``F(s, m)``    needs ``F(s-1, m)``;
* ``B/BW(s, m)`` needs ``B/BW(s+1, m)`` when ``s`` is not the last stage, and ``F(s, m)``;
* ``W(s, m)``    needs ``B(s, m)``.

(The last two are on the same rank and are already implied by list order in a
validated schedule.)  Durations: ``F = f``, ``B = b``, ``W = w`` per micro-batch (a W
batched over ``k`` micro-batches costs ``k * w``), ``BW = b + w``.

One call models ONE iteration, from a synchronised start to its last action;
iterations are separated by the optimizer step.  ZB-H2's and ZB-V's "zero bubble"
relies on consecutive iterations overlapping (the paper's post-validation of the
optimizer step), which this model deliberately does not capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .ir import Action, Schedule, format_grid


class DeadlockError(RuntimeError):
    """A schedule (or its lowered communication) cannot make progress."""


Cost = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Per-action durations; ``f``, ``b``, ``w`` are a number or one number per stage.

    ``comm`` is added to a dependency that crosses ranks.  Defaults are the unit
    costs of the Zero Bubble paper's handcrafted analysis (T_F = T_B = T_W).
    """

    f: Cost = 1.0
    b: Cost = 1.0
    w: Cost = 1.0
    comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w"):
            value = getattr(self, name)
            if isinstance(value, (int, float)):
                values: tuple[float, ...] = (float(value),)
            else:
                values = tuple(float(v) for v in value)
                if not values:
                    raise ValueError(f"Costs.{name} needs at least one value")
                # Stored as a tuple so that Costs stays hashable.
                object.__setattr__(self, name, values)
            if any(v < 0 for v in values):
                raise ValueError(f"Costs.{name} must be >= 0, got {value!r}")
        if self.comm < 0:
            raise ValueError(f"Costs.comm must be >= 0, got {self.comm!r}")

    def check(self, num_stages: int) -> None:
        """Raise ValueError when a per-stage sequence does not have one value per stage."""
        for name in ("f", "b", "w"):
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != num_stages:
                raise ValueError(
                    f"Costs.{name} has {len(value)} values for {num_stages} stages"
                )

    def of(self, kind: str, stage: int) -> float:
        """Duration of one micro-batch of ``kind`` on ``stage`` (BW = B + W)."""
        if kind == "BW":
            return self.of("B", stage) + self.of("W", stage)
        value = {"F": self.f, "B": self.b, "W": self.w}[kind]
        return value[stage] if isinstance(value, tuple) else value

    def duration(self, action: Action) -> float:
        return self.of(action.kind, action.stage) * len(action.microbatches)


@dataclass(frozen=True)
class SimResult:
    """Timing of one iteration.

    ``bubble_fraction = sum_r (makespan - busy_r) / (num_ranks * makespan)``;
    ``peak_inflight[r]`` is the most (stage, micro-batch) pairs rank ``r`` holds at
    once, a pair being held from its F until its last B/W/BW (a proxy for activation
    memory); ``timeline`` is ``(rank, action, start, end)`` sorted by start then rank.
    """

    makespan: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    timeline: tuple[tuple[int, Action, float, float], ...] = field(repr=False)

    @property
    def bubble_time(self) -> tuple[float, ...]:
        """Idle time per rank: ``makespan - busy``."""
        return tuple(self.makespan - b for b in self.busy)


def dependencies(action: Action, num_stages: int) -> list[tuple[str, int, int]]:
    """The (kind, stage, micro-batch) keys ``action`` waits for; B stands for B or BW."""
    deps = []
    for mb in action.microbatches:
        if action.kind == "F":
            if action.stage > 0:
                deps.append(("F", action.stage - 1, mb))
        elif action.is_backward:
            deps.append(("F", action.stage, mb))
            if action.stage < num_stages - 1:
                deps.append(("B", action.stage + 1, mb))
        else:
            deps.append(("B", action.stage, mb))
    return deps


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Time ``schedule`` at ``costs`` (default unit costs); raise DeadlockError if stuck.

    Every rank's start time depends only on its predecessor in the list and on its
    dependencies, so ranks are advanced round-robin until no rank can start its next
    action; the resulting times do not depend on the round-robin order.
    """
    costs = costs or Costs()
    costs.check(schedule.num_stages)
    owner = schedule.stage_to_rank
    rows = schedule.actions
    ends: dict[tuple[str, int, int], float] = {}
    pos = [0] * len(rows)
    free = [0.0] * len(rows)
    timeline: list[tuple[int, Action, float, float]] = []

    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(rows):
            while pos[rank] < len(row):
                action = row[pos[rank]]
                start = free[rank]
                ready = True
                for key in dependencies(action, schedule.num_stages):
                    if key not in ends:
                        ready = False
                        break
                    hop = costs.comm if owner[key[1]] != rank else 0.0
                    start = max(start, ends[key] + hop)
                if not ready:
                    break
                end = start + costs.duration(action)
                kind = "B" if action.is_backward else action.kind
                for mb in action.microbatches:
                    ends[(kind, action.stage, mb)] = end
                timeline.append((rank, action, start, end))
                free[rank] = end
                pos[rank] += 1
                progress = True

    if any(p < len(row) for p, row in zip(pos, rows)):
        raise DeadlockError(_deadlock_report(schedule, pos, ends))

    makespan = max(free, default=0.0)
    busy = [0.0] * len(rows)
    for rank, _, start, end in timeline:
        busy[rank] += end - start
    idle = sum(makespan - b for b in busy)
    return SimResult(
        makespan=makespan,
        bubble_fraction=idle / (len(rows) * makespan) if makespan > 0 else 0.0,
        busy=tuple(busy),
        peak_inflight=tuple(_peak_inflight(row) for row in rows),
        timeline=tuple(sorted(timeline, key=lambda t: (t[2], t[0]))),
    )


def _peak_inflight(row: Sequence[Action]) -> int:
    # A rank runs its actions one at a time, so walking its list in order visits
    # acquisitions (F) and releases (last B/W/BW of a pair) in time order.
    last: dict[tuple[int, int], int] = {}
    for pos, action in enumerate(row):
        if action.kind != "F":
            for mb in action.microbatches:
                last[(action.stage, mb)] = pos
    held = peak = 0
    for pos, action in enumerate(row):
        if action.kind == "F":
            held += 1
            peak = max(peak, held)
        else:
            held -= sum(1 for mb in action.microbatches if last[(action.stage, mb)] == pos)
    return peak


def _deadlock_report(schedule: Schedule, pos: list[int], ends: dict) -> str:
    cells = []
    waits = []
    for rank, row in enumerate(schedule.actions):
        cells.append(
            [f">{a}<" if i == pos[rank] else str(a) for i, a in enumerate(row)]
        )
        if pos[rank] < len(row):
            action = row[pos[rank]]
            # dependencies() says "B" for either backward; name the one this schedule uses.
            missing = [
                f"{stage}{'BW' if kind == 'B' and not schedule.split_backward else kind}{mb}"
                for kind, stage, mb in dependencies(action, schedule.num_stages)
                if (kind, stage, mb) not in ends
            ]
            waits.append(
                f"rank {rank} blocked at position {pos[rank]} on {action}, waiting for "
                f"{', '.join(missing)}"
            )
    title = f"{schedule.name}: deadlock (blocked actions marked >like this<)"
    return format_grid(title, cells) + "\n" + "\n".join(waits)
