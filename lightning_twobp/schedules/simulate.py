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
batched over ``k`` micro-batches costs ``k * w``), ``BW = bw``, or ``b + w`` where no ``bw`` is given
(then the split costs nothing: a measured ``bw`` is what lets a fused schedule win where it does).

By default one call models ONE iteration, from a synchronised start to its last
action.  ``iterations=k`` models k back-to-back iterations that overlap as far as
the ranks' own list orders allow (no barrier between them): ZB-H2's and ZB-V's
"zero bubble" is a property of that steady state (the paper's post-validation of
the optimizer step), reported as :attr:`SimResult.period` and
:attr:`SimResult.steady_bubble`.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from operator import itemgetter

from .ir import KINDS, Action, DeadlockError, Schedule, format_grid
from .memory import MemoryCosts, peak_bytes, peak_inflight
from .per_stage import PerStage, check_stage_count, stage_value, store_per_stage

Cost = PerStage


@dataclass(frozen=True)
class Costs:
    """Per-action durations; ``f``, ``b``, ``w`` (and ``bw``, when given) are a number or one number per
    stage.

    ``bw`` is the fused backward's (BW), measured where it is; None means ``b + w``.

    ``comm`` is added to a dependency that crosses ranks.  Defaults are the unit
    costs of the Zero Bubble paper's handcrafted analysis (T_F = T_B = T_W).
    ``memory`` gives the bytes per stage (:class:`~.memory.MemoryCosts`: F to B, B to W,
    fixed); its unit default makes ``SimResult.peak_bytes`` the in-flight count.
    """

    f: Cost = 1.0
    b: Cost = 1.0
    w: Cost = 1.0
    comm: float = 0.0
    memory: MemoryCosts = MemoryCosts()
    bw: Cost | None = None

    @property
    def _durations(self) -> tuple[str, ...]:
        return ("f", "b", "w") if self.bw is None else ("f", "b", "w", "bw")

    def __post_init__(self) -> None:
        store_per_stage(self, "Costs", self._durations)
        object.__setattr__(self, "comm", float(self.comm))  # a NumPy or torch scalar too: hashable, compared by value
        if self.comm < 0:
            raise ValueError(f"Costs.comm must be >= 0, got {self.comm!r}")

    def check(self, num_stages: int) -> None:
        """Raise ValueError when a per-stage sequence does not have one value per stage."""
        check_stage_count(self, "Costs", self._durations, num_stages)
        self.memory.check(num_stages)

    @property
    def times(self) -> tuple:
        """The durations alone (what a builder's timing depends on), for comparing costs."""
        return (self.f, self.b, self.w, self.bw, self.comm)

    def of(self, kind: str, stage: int) -> float:
        """Duration of one micro-batch of ``kind`` on ``stage`` (BW: ``bw``, or B + W without it)."""
        if kind == "BW":
            if self.bw is not None:
                return stage_value(self.bw, stage)
            return self.of("B", stage) + self.of("W", stage)
        return stage_value({"F": self.f, "B": self.b, "W": self.w}[kind], stage)

    def duration(self, action: Action) -> float:
        return self.of(action.kind, action.stage) * len(action.microbatches)


@dataclass(frozen=True)
class SimResult:
    """Timing of ``iterations`` back-to-back iterations (one by default).

    ``bubble_fraction = sum_r (makespan - busy_r) / (num_ranks * makespan)``;
    ``peak_inflight[r]`` is the most (stage, micro-batch) pairs rank ``r`` holds at
    once, a pair being held from its F until its last B/W/BW (a proxy for activation
    memory); ``timeline`` is ``(rank, action, start, end)`` sorted by start then rank.
    ``iteration_ends[i]`` is when the last rank finished iteration ``i``; with two or
    more iterations, :attr:`period` and :attr:`steady_bubble` describe the steady state.
    ``peak_bytes[r]`` is rank ``r``'s fixed bytes plus the most its micro-batches hold at once
    at ``Costs.memory`` (:mod:`.memory`; unit costs: ``peak_inflight``).
    """

    makespan: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    timeline: tuple[tuple[int, Action, float, float], ...] = field(repr=False)
    iteration_ends: tuple[float, ...] = ()
    peak_bytes: tuple[float, ...] = ()

    @property
    def bubble_time(self) -> tuple[float, ...]:
        """Idle time per rank: ``makespan - busy``."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def iterations(self) -> int:
        return len(self.iteration_ends)

    @property
    def period(self) -> float:
        """Time per iteration in the steady state: between the ends of the last two iterations
        (needs ``iterations >= 2``; the first iteration also pays the pipeline's fill)."""
        if self.iterations < 2:
            raise ValueError("the steady-state period needs simulate(..., iterations=k) with k >= 2")
        return self.iteration_ends[-1] - self.iteration_ends[-2]

    @property
    def steady_bubble(self) -> float:
        """Idle fraction per iteration in the steady state: ``1 - mean_r busy_r / period``, where
        ``busy_r`` is one iteration's work on rank ``r`` (the paper's bubble rate, overlapped)."""
        per_iteration = sum(self.busy) / len(self.busy) / self.iterations
        return 1.0 - per_iteration / self.period if self.period > 0 else 0.0


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


def simulate(
    schedule: Schedule, costs: Costs | None = None, *, iterations: int = 1, memory: bool = True, timeline: bool = True
) -> SimResult:
    """Time ``schedule`` at ``costs`` (default unit costs); raise DeadlockError if stuck.

    ``iterations > 1`` runs the schedule that many times back to back with nothing between
    them but each rank's own list order: iteration ``i + 1`` of a rank starts right after its
    iteration ``i`` (each stage's optimizer step follows its own last W, so the next F of that
    stage sees the new weights), with no barrier between ranks. That is what the Zero Bubble
    paper's optimizer post-validation allows, and what ZB-H2's and ZB-V's zero bubble assumes.

    Every rank's start time depends only on its predecessor in the list and on its
    dependencies, so ranks are advanced round-robin until no rank can start its next
    action; the resulting times do not depend on the round-robin order. ``memory=False`` leaves
    the memory replay out (``peak_inflight`` and ``peak_bytes`` empty): a pass that compares many
    orders by their time alone (:mod:`.fusion`) spends a third of each call there; ``timeline=False``
    leaves :attr:`SimResult.timeline` empty (sorting it took a fifth of a call at p = 8).
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    costs = costs or Costs()
    costs.check(schedule.num_stages)
    rows = schedule.actions
    plan, keys = _compiled(schedule, costs)
    # ends[it * len(keys) + key]: when iteration `it` finished the F or backward that `key` names
    ends: list[float | None] = [None] * (iterations * len(keys))
    pos = [0] * len(rows)  # position in the rank's list, counted over all iterations
    free = [0.0] * len(rows)
    ran: list[tuple[int, Action, float, float]] = []
    iteration_ends = [0.0] * iterations

    progress = True
    while progress:
        progress = False
        for rank, steps in enumerate(plan):
            n, p, t = len(steps), pos[rank], free[rank]
            while p < iterations * n:
                it, at = divmod(p, n)
                needs, takes, sets = steps[at]
                base, start = it * len(keys), t
                for key, hop in needs:
                    end = ends[base + key]
                    if end is None:
                        break
                    start = max(start, end + hop)
                else:
                    t = start + takes
                    for key in sets:
                        ends[base + key] = t
                    ran.append((rank, rows[rank][at], start, t))
                    iteration_ends[it] = max(iteration_ends[it], t)
                    p += 1
                    progress = True
                    continue
                break
            pos[rank], free[rank] = p, t

    if any(p < iterations * len(row) for p, row in zip(pos, rows, strict=False)):
        # Iterations differ only in time, so a schedule that sticks sticks in its first one.
        first = [min(p, len(row)) for p, row in zip(pos, rows, strict=False)]
        done = {key for i, key in enumerate(keys) if ends[i] is not None}
        raise DeadlockError(_deadlock_report(schedule, first, done))

    makespan = max(free, default=0.0)
    busy = [0.0] * len(rows)
    for rank, _, start, end in ran:
        busy[rank] += end - start
    idle = sum(makespan - b for b in busy)
    return SimResult(
        makespan=makespan,
        bubble_fraction=idle / (len(rows) * makespan) if makespan > 0 else 0.0,
        busy=tuple(busy),
        peak_inflight=peak_inflight(schedule) if memory else (),
        peak_bytes=peak_bytes(schedule, costs.memory) if memory else (),
        timeline=tuple(sorted(ran, key=itemgetter(2, 0))) if timeline else (),  # by start, then rank
        iteration_ends=tuple(iteration_ends),
    )


def _compiled(
    schedule: Schedule, costs: Costs
) -> tuple[list[list[tuple[tuple[tuple[int, float], ...], float, tuple[int, ...]]]], list[tuple[str, int, int]]]:
    """Each rank's list as plain numbers, for :func:`simulate`'s loop (which meets every action once per
    iteration and spent most of its time hashing actions and keys): per action, its dependencies as
    ``(key, hop)`` (``hop``: ``costs.comm`` where the dependency is on another rank), its duration, and
    the keys it finishes; ``keys[key]`` is the ``(kind, stage, micro-batch)`` a key stands for (kind F, or
    B for either backward: a W finishes nothing another action waits for)."""
    index: dict[tuple[str, int, int], int] = {}
    owner, last = schedule.stage_to_rank, schedule.num_stages - 1
    took = {k: [costs.of(k, s) for s in range(schedule.num_stages)] for k in KINDS}
    plan = []
    for rank, row in enumerate(schedule.actions):
        steps = []
        for a in row:
            s, mbs = a.stage, a.microbatches
            needs: list[tuple[str, int, int]] = []  # as dependencies(a) lists them
            for mb in mbs:
                if a.kind == "F":
                    needs += [("F", s - 1, mb)] if s > 0 else []
                elif a.kind == "W":
                    needs.append(("B", s, mb))
                else:
                    needs += [("F", s, mb), ("B", s + 1, mb)] if s < last else [("F", s, mb)]
            hops = tuple((index.setdefault(k, len(index)), _hop(costs, owner, k[1], rank)) for k in needs)
            kind = "B" if a.kind == "BW" else a.kind
            sets = () if kind == "W" else tuple(index.setdefault((kind, s, mb), len(index)) for mb in mbs)
            # a stage beyond the schedule's (not validated): timed as before, left to deadlock on its dependencies
            takes = took[a.kind][s] * len(mbs) if s <= last else costs.duration(a)
            steps.append((hops, takes, sets))
        plan.append(steps)
    return plan, list(index)


def _hop(costs: Costs, owner: tuple[int, ...], stage: int, rank: int) -> float:
    """``comm`` where ``stage`` is on another rank than ``rank`` (or beyond the schedule's stages: an action
    that waits on it never runs, as before the lists were compiled)."""
    return costs.comm if stage >= len(owner) or owner[stage] != rank else 0.0


def _deadlock_report(schedule: Schedule, pos: list[int], ends: Container[tuple[str, int, int]]) -> str:
    cells = []
    waits = []
    # dependencies() says "B" for either backward; name the one this schedule writes for that micro-batch
    fused = {(a.stage, a.microbatch) for row in schedule.actions for a in row if a.kind == "BW"}
    for rank, row in enumerate(schedule.actions):
        cells.append([f">{a}<" if i == pos[rank] else str(a) for i, a in enumerate(row)])
        if pos[rank] < len(row):
            action = row[pos[rank]]
            missing = [
                f"{stage}{'BW' if kind == 'B' and (stage, mb) in fused else kind}{mb}"
                for kind, stage, mb in dependencies(action, schedule.num_stages)
                if (kind, stage, mb) not in ends
            ]
            waits.append(f"rank {rank} blocked at position {pos[rank]} on {action}, waiting for {', '.join(missing)}")
    title = f"{schedule.name}: deadlock (blocked actions marked >like this<)"
    return format_grid(title, cells) + "\n" + "\n".join(waits)
