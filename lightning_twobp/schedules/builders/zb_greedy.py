"""A greedy list scheduler for the Zero Bubble families, at any costs (the paper's heuristic, §3.1).

The paper's handcrafted orders (:mod:`.zb_orders`) assume ``T_F = T_B = T_W``. For other costs this
scheduler builds a schedule by simulating it: time advances event by event, and whenever a rank is
idle it takes, among the actions whose dependencies have arrived (``comm`` included for cross-rank
edges),

1. a B (several ready: the smallest micro-batch; on the V see the tie-break below);
2. else an F, if both memory counts below stay within their limits (each stage's
   micro-batches in order; on the V the later stage first, which lets the second
   chunk drain what the first chunk started);
3. else the oldest pending W (one micro-batch each), unless the ``"fit"`` policy is on and a B whose
   gradient is already on its way would arrive before the W ends: then the rank waits for that B,
   since delaying a B delays every stage upstream of it (``"eager"`` always takes the W);

and otherwise waits for the next completion.

Memory accounting.  The paper splits a micro-batch's activation memory in two: it
holds all of M_B from its F until its B; B frees everything except M_W (the inputs
of the linear layers and the gradients of their outputs), held until W.  Each rank
counts (stage, micro-batch) pairs

* ``activations``: F done, B not done (the paper's M_B), at most ``limit_fb``;
* ``inflight``:    F done, W not done (M_B or M_W), at most ``limit_fw``.

The limits (:func:`memory_limits`, ``p`` ranks, rank ``r``) are those of the paper's own orders, so no
greedy schedule holds more than the handcrafted one of its family:

=========  ====================  ====================
schedule   F->B (M_B) limit      F->W limit
=========  ====================  ====================
ZB-H1      ``p - r``             ``p``
ZB-H2      ``2(p - r) - 1``      ``2p - 1``
ZB-V       ``2p``                ``2p``
V-Half     ``2((p + 2) // 2)``   ``2((p + 2) // 2)``
V-Min      ``2((p + 4) // 3)``   ``2((p + 4) // 3)``
=========  ====================  ====================

On the V a stage is half a 1F1B stage, so ``2p`` half-stage pairs are 1F1B's ``p``
full ones.  An F of the first chunk also keeps one slot free for the second chunk
(``count + 1 + later local stages <= limit``, for both counts): otherwise the
first chunk could fill the budget and the rank could never run the F (and so the
B, and so the W that frees memory) of its second chunk.  With that reservation the
oldest unfinished micro-batch can always make progress, and since every F->W
limit is at least the F->B one, a full F->W count always leaves a W to run: the
scheduler terminates for every micro-batch count and every cost.  Two B of one
micro-batch on its two stages can be ready together on the V; both tie-breaks
(later stage first, smallest micro-batch first) are tried by the caller.

In this project's autograd implementation what a micro-batch keeps between B and W
depends on its layers. When every weight gradient has a direct formula (Linear
weights and biases, norm scales: every LLaMa block), B frees the autograd graph and
only W's operands stay: each Linear's input and output gradient, each scale's
normalised input. That is the paper's M_W, smaller than M_B. Otherwise the whole graph
stays until W, and M_W equals M_B. ``simulate().peak_inflight`` reports the F-to-last-W
count and :func:`~..memory.peak_activations` the F-to-B one.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from ..ir import Action, Schedule
from ..memo import kept, remembering
from ..simulate import Costs
from .v_orders import V_SCHEDULES, v_memory_bound

__all__ = ["POLICIES", "greedy", "memory_limits"]

POLICIES = ("eager", "fit")


def greedy(
    name: str,
    placement: tuple[int, ...],
    num_microbatches: int,
    *,
    costs: Costs,
    policy: str = "eager",
    b_tie_break: str = "later-stage",
    max_pending_w: Sequence[int] | None = None,
) -> Schedule:
    """One greedy schedule of the Zero Bubble families (``zb-h1``, ``zb-h2``: one stage per rank;
    ``zb-v``, ``v-half``, ``v-min``: the V) over the stage-to-rank map ``placement``, within the
    family's memory limits and, with ``max_pending_w``, at most that many W waiting per stage before
    each F or B (over it, the oldest waiting W of the stage runs first).

    A cap at or above what the uncapped run ever has waiting on each stage never forces a W, so the
    run under it is the uncapped one: within a search, where the uncapped run is kept (:mod:`..memo`), that
    order is returned without running again (``schedule="auto"`` builds every cap from 0 up, most of them such)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    costs.check(len(placement))
    place = tuple(placement)
    if max_pending_w is None or remembering():
        order, most = _uncapped(name, place, num_microbatches, costs, policy, b_tie_break)
        if max_pending_w is None or all(k >= n for k, n in zip(max_pending_w, most, strict=True)):
            return order
    return _run(name, place, num_microbatches, costs, policy, b_tie_break, max_pending_w)[0]


@kept
def _uncapped(
    name: str, placement: tuple[int, ...], m: int, costs: Costs, policy: str, b_tie_break: str
) -> tuple[Schedule, tuple[int, ...]]:
    return _run(name, placement, m, costs, policy, b_tie_break, None)


def _run(
    name: str,
    placement: tuple[int, ...],
    m: int,
    costs: Costs,
    policy: str,
    b_tie_break: str,
    max_pending_w: Sequence[int] | None,
) -> tuple[Schedule, tuple[int, ...]]:
    """The greedy's order, and per stage the most W it ever had waiting."""
    limit_fb, limit_fw = memory_limits(name, max(placement) + 1)
    scheduler = _GreedyScheduler(
        placement,
        m,
        costs,
        limit_fb,
        limit_fw,
        later_stage_first=len(placement) > max(placement) + 1,
        b_tie_break=b_tie_break,
        wait_for_b=policy == "fit",
        max_pending_w=max_pending_w,
    )
    rows = scheduler.run()
    schedule = Schedule(
        name=name,
        num_stages=len(placement),
        num_microbatches=m,
        stage_to_rank=placement,
        actions=rows,
        split_backward=True,
    )
    return schedule, tuple(scheduler.most_pending_w)


def memory_limits(name: str, num_ranks: int) -> tuple[list[int], list[int]]:
    """Per-rank ``(F->B limit, F->W limit)`` of ``zb-h1``, ``zb-h2``, ``zb-v``, ``v-half`` or ``v-min``:
    the counts the papers' orders hold (see the module docstring)."""
    p = num_ranks
    if name == "zb-h1":
        return [p - r for r in range(p)], [p] * p
    if name == "zb-h2":
        return [2 * (p - r) - 1 for r in range(p)], [2 * p - 1] * p
    if name == "zb-v":
        return [2 * p] * p, [2 * p] * p
    if name in V_SCHEDULES:  # the controllable-memory paper's V-Half and V-Min: F to W, both counts
        return [v_memory_bound(name, p)] * p, [v_memory_bound(name, p)] * p
    raise ValueError(f"no zero-bubble memory limits for {name!r}")


class _GreedyScheduler:
    """Event-driven list scheduler; one instance builds one schedule."""

    def __init__(
        self,
        placement: tuple[int, ...],
        num_microbatches: int,
        costs: Costs,
        limit_fb: list[int],
        limit_fw: list[int],
        later_stage_first: bool,
        b_tie_break: str = "later-stage",
        wait_for_b: bool = False,
        max_pending_w: Sequence[int] | None = None,
    ) -> None:
        if any(fw < fb for fb, fw in zip(limit_fb, limit_fw, strict=False)):
            # A full F->W count must leave a W to run, or the rank could stall.
            raise ValueError(f"F->W limits {limit_fw} below F->B limits {limit_fb}")
        self.placement = placement
        self.num_stages = len(placement)
        self.num_mb = num_microbatches
        self.costs = costs
        self.limit_fb = limit_fb
        self.limit_fw = limit_fw
        self.b_tie_break = b_tie_break
        self.wait_for_b = wait_for_b
        self.max_pending_w = max_pending_w
        ranks = len(limit_fb)
        # Candidate stages in preference order.
        self.local = [
            sorted((s for s in range(self.num_stages) if placement[s] == r), reverse=later_stage_first)
            for r in range(ranks)
        ]
        self.later_local = {s: sum(1 for t in self.local[placement[s]] if t > s) for s in range(self.num_stages)}
        self.f_end: dict[tuple[int, int], float] = {}
        self.b_end: dict[tuple[int, int], float] = {}
        self.next_f = [0] * self.num_stages
        self.b_todo: list[list[int]] = [[] for _ in range(self.num_stages)]
        self.w_todo: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
        self.pending_w = [0] * self.num_stages  # per stage: B done, W not done
        self.most_pending_w = [0] * self.num_stages  # the most pending_w ever held
        self.activations = [0] * ranks  # F done, B not done
        self.inflight = [0] * ranks  # F done, W not done
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
        forced = self._over_cap(rank)
        if forced is not None:
            return forced
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
            if (
                self.activations[rank] + reserve > self.limit_fb[rank]
                or self.inflight[rank] + reserve > self.limit_fw[rank]
            ):
                continue
            if s == 0 or self._arrived(self.f_end.get((s - 1, m)), s - 1, rank, now):
                return Action("F", s, m)
        if self.w_todo[rank]:
            w = Action("W", *self.w_todo[rank][0])
            if self.wait_for_b:
                arrival = self._next_b_arrival(rank)
                if arrival is not None and arrival < now + self.costs.duration(w):
                    return None  # the B comes first; its arrival is an event, so the rank wakes then
            return w
        return None

    def _over_cap(self, rank: int) -> Action | None:
        """The oldest waiting W of a stage over its ``max_pending_w``: it runs before any F or B."""
        if self.max_pending_w is not None:
            for s, m in self.w_todo[rank]:  # oldest B first
                if self.pending_w[s] > self.max_pending_w[s]:
                    return Action("W", s, m)
        return None

    def _next_b_arrival(self, rank: int) -> float | None:
        """When the earliest B of this rank whose gradient is already computed becomes ready."""
        last = self.num_stages - 1
        best = None
        for s in self.local[rank]:
            for m in self.b_todo[s]:
                if s == last:
                    t = self.f_end[(s, m)]
                elif (s + 1, m) in self.b_end:
                    hop = self.costs.comm if self.placement[s + 1] != rank else 0.0
                    t = max(self.f_end[(s, m)], self.b_end[(s + 1, m)] + hop)
                else:
                    continue
                best = t if best is None else min(best, t)
        return best

    def _commit(self, rank: int, action: Action, end: float) -> None:
        s, m = action.stage, action.microbatch
        assert isinstance(m, int)  # the greedy places one micro-batch per action
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
            self.pending_w[s] += 1
            self.most_pending_w[s] = max(self.most_pending_w[s], self.pending_w[s])
            self.activations[rank] -= 1
        else:
            self.w_todo[rank].remove((s, m))
            self.pending_w[s] -= 1
            self.inflight[rank] -= 1
        self.free[rank] = end
        self.rows[rank].append(action)

    def _stuck_report(self, now: float) -> str:
        lines = [f"zero-bubble greedy scheduler stuck at t={now} (a scheduler bug):"]
        for rank, stages in enumerate(self.local):
            lines.append(
                f"  rank {rank}: F->B {self.activations[rank]}/{self.limit_fb[rank]}, "
                f"F->W {self.inflight[rank]}/{self.limit_fw[rank]}, "
                + ", ".join(f"stage {s} next F {self.next_f[s]} B pending {self.b_todo[s]}" for s in stages)
                + f", W pending {list(self.w_todo[rank])}"
            )
        return "\n".join(lines)
