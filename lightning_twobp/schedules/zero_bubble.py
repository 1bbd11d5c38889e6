"""Zero Bubble schedules ZB-H1, ZB-H2 and ZB-V (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024; ZB-V from its V-shape section) built by greedy list scheduling.

Rather than hand-writing the paper's figures, each schedule comes from the paper's
heuristic (§3.1: as many F as memory allows, B as early as possible, W to fill the
bubbles) simulated at the given :class:`~.simulate.Costs`: time advances event by
event, and whenever a rank is idle it takes, among the actions whose dependencies
have arrived (``comm`` included for cross-rank edges),

1. a B (several ready: the smallest micro-batch; on the V see the tie-break below);
2. else an F, if both memory counts below stay within their limits (each stage's
   micro-batches in order; on the V the later stage first, which lets the second
   chunk drain what the first chunk started);
3. else the oldest pending W (one micro-batch each);

and otherwise waits for the next completion.

Memory accounting.  The paper splits a micro-batch's activation memory in two: it
holds all of M_B from its F until its B; B frees everything except M_W (the inputs
of the linear layers and the gradients of their outputs), held until W.  The
budgets are therefore stated in F-to-B pairs, and W may be deferred because a
pending W only costs M_W < M_B.  Each rank counts (stage, micro-batch) pairs

* ``activations``: F done, B not done (the paper's M_B), at most ``limit_fb``;
* ``inflight``:    F done, W not done (M_B or M_W), at most ``limit_fw``, so the
  deferred W cannot pile up without bound.

=========  ==================  ===================================
schedule   F->B (M_B) limit    F->W limit
=========  ==================  ===================================
ZB-H1      ``p - r``           ``(p - r) + (p - 1)``
ZB-H2      ``2(p - r) - 1``    ``max(2(p - r) - 1, p)``
ZB-V       ``2p``              ``2p + 2``
=========  ==================  ===================================

(``p`` ranks, rank ``r``.)  The F->B limits are the paper's: ZB-H1 keeps 1F1B's
activation budget, ZB-H2 lets the first rank hold ``2p - 1``, and on the V a stage
is half a 1F1B stage, so ``2p`` half-stage pairs are 1F1B's ``p`` full ones.

The F->W limits are the smallest simple ones under which this greedy reaches the
floor ``max_r busy_r + (p - 1) F`` at unit costs (checked for p <= 8): ZB-H1 and
ZB-H2 for every ``m >= p``, at ``3m + p - 1`` (below ``p`` no schedule can: rank
0 idles until the first B returns, ending at ``2m + 2p - 1``); ZB-V for every
``m >= 2p``.  ZB-H1's bubble is then the paper's ``(p - 1)(F + B - W)`` per rank,
``p - 1`` at unit costs.  Why ``p - 1`` deferred W: at the floor the last rank,
which starts after ``p - 1`` F and is busy ``3m``, never idles, and its last B
must end ``p`` before the end (``p - 1`` B on the other ranks, then rank 0's W),
so ``p`` W follow it: the last rank holds ``p`` pairs between F and W, which is
``(p - r) + (p - 1)`` at ``r = p - 1``.  Any schedule needs that much there; this
greedy needs it on every rank (one less on any single rank and it misses the
floor for some ``m``).  ZB-H2 needs an allowance only where ``2(p - r) - 1 < p``
(the same test).  With ``2p + 1`` the V misses the floor by 1 or 2 at p = 5..8.  ZB-H2's actual
"zero bubble" comes from overlapping consecutive iterations, which the simulator
does not model; within one iteration it ends at the same floor as ZB-H1.

In this project's autograd implementation what a micro-batch keeps between B and W
depends on its layers. When every weight gradient has a direct formula (Linear
weights and biases, norm scales: every LLaMa block), B frees the autograd graph and
only W's operands stay: each Linear's input and output gradient, each scale's
normalised input. That is the paper's M_W, smaller than M_B. Otherwise the whole graph
stays until W, and M_W equals M_B. Both counts are reported:
``simulate().peak_inflight`` (F until the last B/W), bounded by the F->W limits
above, and the paper's F->B budget (:func:`peak_activations`).  At p=4, m=8
it is ``(7, 6, 5, 4)`` for ZB-H1 and ``(7, 5, 4, 4)`` for ZB-H2, against
``(4, 3, 2, 1)`` for fused 1F1B (this package's split 1F1B batches its W at the
end and holds all 8).

On the V an F of the first chunk also keeps one slot free for the second chunk
(``count + 1 + later local stages <= limit``, for both counts): otherwise the
first chunk could fill the budget and the rank could never run the F (and so the
B, and so the W that frees memory) of its second chunk.  With that reservation the
oldest unfinished micro-batch can always make progress, and since every F->W
limit is at least the F->B one, a full F->W count always leaves a W to run: the
scheduler terminates for every micro-batch count and every cost.  Two B of one
micro-batch on its two stages can be ready together on the V; like the paper's
``initial_solution``, which runs its heuristic under several switches and keeps
the best, both tie-breaks (later stage first, smallest micro-batch first) are
tried and the shorter schedule at ``costs`` is kept.
"""

from __future__ import annotations

import heapq
from collections import deque

from .ir import Action, Schedule, stage_to_rank
from .simulate import Costs, simulate


def zero_bubble(name: str, num_stages: int, num_microbatches: int, *,
                stages_per_rank: int, costs: Costs | None = None) -> Schedule:
    """Build ``zb-h1``, ``zb-h2`` (one stage per rank) or ``zb-v`` (V, two per rank)."""
    costs = costs or Costs()
    costs.check(num_stages)
    placement = stage_to_rank(name, num_stages, stages_per_rank)
    limit_fb, limit_fw = memory_limits(name, num_stages // stages_per_rank)
    # One stage per rank never has two B ready on different stages: one pass.
    tie_breaks = ("later-stage", "smallest-mb") if name == "zb-v" else ("later-stage",)
    best: tuple[float, Schedule] | None = None
    for tie_break in tie_breaks:
        rows = _GreedyScheduler(placement, num_microbatches, costs, limit_fb, limit_fw,
                                later_stage_first=name == "zb-v", b_tie_break=tie_break).run()
        schedule = Schedule(
            name=name,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            stage_to_rank=placement,
            actions=rows,
            split_backward=True,
        )
        makespan = simulate(schedule, costs).makespan
        if best is None or makespan < best[0]:
            best = (makespan, schedule)
    return best[1]


def memory_limits(name: str, num_ranks: int) -> tuple[list[int], list[int]]:
    """Per-rank ``(F->B limit, F->W limit)`` of ``zb-h1``, ``zb-h2`` or ``zb-v``.

    The first bounds the pairs holding full activations (the paper's M_B), the
    second also those waiting for their W; see the module docstring.
    """
    p = num_ranks
    if name == "zb-h1":
        fb = [p - r for r in range(p)]
        return fb, [x + p - 1 for x in fb]
    if name == "zb-h2":
        fb = [2 * (p - r) - 1 for r in range(p)]
        return fb, [max(x, p) for x in fb]
    if name == "zb-v":
        return [2 * p] * p, [2 * p + 2] * p
    raise ValueError(f"no zero-bubble memory limits for {name!r}")


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) pairs held between F and B (or BW) at once.

    That is the paper's M_B count, the one the F->B limits bound; compare
    ``simulate(schedule).peak_inflight``, which holds a pair until its last B/W,
    the count that matters for this project's autograd split backward.
    """
    peaks = []
    for row in schedule.actions:
        held = peak = 0
        for action in row:
            if action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif action.is_backward:
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


class _GreedyScheduler:
    """Event-driven list scheduler; one instance builds one schedule."""

    def __init__(self, placement: tuple[int, ...], num_microbatches: int, costs: Costs,
                 limit_fb: list[int], limit_fw: list[int], later_stage_first: bool,
                 b_tie_break: str = "later-stage") -> None:
        if any(fw < fb for fb, fw in zip(limit_fb, limit_fw)):
            # A full F->W count must leave a W to run, or the rank could stall.
            raise ValueError(f"F->W limits {limit_fw} below F->B limits {limit_fb}")
        self.placement = placement
        self.num_stages = len(placement)
        self.num_mb = num_microbatches
        self.costs = costs
        self.limit_fb = limit_fb
        self.limit_fw = limit_fw
        self.b_tie_break = b_tie_break
        ranks = len(limit_fb)
        # Candidate stages in preference order.
        self.local = [
            sorted((s for s in range(self.num_stages) if placement[s] == r),
                   reverse=later_stage_first)
            for r in range(ranks)
        ]
        self.later_local = {
            s: sum(1 for t in self.local[placement[s]] if t > s) for s in range(self.num_stages)
        }
        self.f_end: dict[tuple[int, int], float] = {}
        self.b_end: dict[tuple[int, int], float] = {}
        self.next_f = [0] * self.num_stages
        self.b_todo: list[list[int]] = [[] for _ in range(self.num_stages)]
        self.w_todo: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
        self.activations = [0] * ranks  # F done, B not done
        self.inflight = [0] * ranks     # F done, W not done
        self.free = [0.0] * ranks
        self.rows: list[list[Action]] = [[] for _ in range(ranks)]

    def run(self) -> tuple[tuple[Action, ...], ...]:
        remaining = 3 * self.num_stages * self.num_mb
        now = 0.0
        events: list[float] = []
        while remaining:
            # Zero-cost actions finish at `now` and may unblock others at `now`,
            # so sweep the ranks until nothing more starts at this instant.
            started = True
            while started:
                started = False
                for rank in range(len(self.limit_fb)):
                    if self.free[rank] > now:
                        continue
                    action = self._pick(rank, now)
                    if action is None:
                        continue
                    end = now + self.costs.duration(action)
                    self._commit(rank, action, end)
                    heapq.heappush(events, end)
                    heapq.heappush(events, end + self.costs.comm)
                    remaining -= 1
                    started = True
            while events and events[0] <= now:
                heapq.heappop(events)
            if remaining and not events:
                raise RuntimeError(self._stuck_report(now))
            if events:
                now = heapq.heappop(events)
        return tuple(tuple(row) for row in self.rows)

    def _arrived(self, end: float | None, src_stage: int, rank: int, now: float) -> bool:
        if end is None:
            return False
        hop = self.costs.comm if self.placement[src_stage] != rank else 0.0
        return end + hop <= now

    def _pick(self, rank: int, now: float) -> Action | None:
        last = self.num_stages - 1
        ready_b = []
        for s in self.local[rank]:
            for m in self.b_todo[s]:
                if self.f_end[(s, m)] <= now and (
                    s == last or self._arrived(self.b_end.get((s + 1, m)), s + 1, rank, now)
                ):
                    ready_b.append((m, s))
                    break
        if ready_b:
            # ready_b holds each local stage's smallest ready micro-batch, later
            # stages first; min() keeps the first of equal keys.
            if self.b_tie_break == "smallest-mb":
                m, s = min(ready_b, key=lambda ms: ms[0])
            else:
                m, s = ready_b[0]
            return Action("B", s, m)
        for s in self.local[rank]:
            m = self.next_f[s]
            if m >= self.num_mb:
                continue
            reserve = 1 + self.later_local[s]
            if (self.activations[rank] + reserve > self.limit_fb[rank]
                    or self.inflight[rank] + reserve > self.limit_fw[rank]):
                continue
            if s == 0 or self._arrived(self.f_end.get((s - 1, m)), s - 1, rank, now):
                return Action("F", s, m)
        if self.w_todo[rank]:
            return Action("W", *self.w_todo[rank][0])
        return None

    def _commit(self, rank: int, action: Action, end: float) -> None:
        s, m = action.stage, action.microbatch
        if action.kind == "F":
            self.next_f[s] += 1
            self.f_end[(s, m)] = end
            self.b_todo[s].append(m)
            self.activations[rank] += 1
            self.inflight[rank] += 1
        elif action.kind == "B":
            self.b_todo[s].remove(m)
            self.b_end[(s, m)] = end
            self.w_todo[rank].append((s, m))
            self.activations[rank] -= 1
        else:
            self.w_todo[rank].popleft()
            self.inflight[rank] -= 1
        self.free[rank] = end
        self.rows[rank].append(action)

    def _stuck_report(self, now: float) -> str:
        lines = [f"zero-bubble greedy scheduler stuck at t={now} (a scheduler bug):"]
        for rank, stages in enumerate(self.local):
            lines.append(
                f"  rank {rank}: F->B {self.activations[rank]}/{self.limit_fb[rank]}, "
                f"F->W {self.inflight[rank]}/{self.limit_fw[rank]}, "
                + ", ".join(
                    f"stage {s} next F {self.next_f[s]} B pending {self.b_todo[s]}"
                    for s in stages
                )
                + f", W pending {list(self.w_todo[rank])}"
            )
        return "\n".join(lines)
