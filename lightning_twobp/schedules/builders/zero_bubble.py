"""Zero Bubble schedules at the costs given: the paper's order, or a greedy one where it is faster.

The families: ZB-H1, ZB-H2 and ZB-V (Qi et al., ICLR 2024) and the V-shape schedules at controlled
memory, V-Half and V-Min (Qi et al., NeurIPS 2024). :func:`zero_bubble` builds candidates and keeps
the fastest at ``costs``:

* the paper's handcrafted order (:mod:`.zb_orders`, :mod:`.v_orders`), made for ``T_F = T_B = T_W``;
* greedy schedules (:mod:`.zb_greedy`) built at ``costs`` and at unit costs, with both W policies
  (``"eager"``, ``"fit"``) and, on the V, both B tie-breaks;
* for ZB-H2, also ZB-H1's build at the same costs (it fits ZB-H2's looser memory limits), so ZB-H2
  never scores worse than ZB-H1 at those costs.

"Fastest" is the steady-state time per iteration when iterations overlap (what training runs: each
rank starts its next iteration after its own last W, see :func:`~..simulate.simulate`), then the
single iteration's makespan, then the order above (the paper's order wins ties). So building with
measured costs can never give a schedule slower, at those costs, than the paper's order or the
unit-cost build, and every candidate respects the family's memory limits (the paper order's counts).
With ``max_pending_w`` every candidate is built (greedy) or capped (:func:`~..deferral.cap_pending_w`)
under the cap, so the choice is the fastest capped schedule, never slower than the capped paper order.
"""

from __future__ import annotations

from dataclasses import replace

from ..deferral import cap_pending_w
from ..ir import Schedule
from ..memo import kept
from ..simulate import Costs, simulate
from ..spec import BuildRequest
from .zb_greedy import POLICIES, greedy
from .zb_orders import paper_order

__all__ = ["STEADY_ITERATIONS", "schedule_score", "zero_bubble"]

# Iterations simulated to measure the steady state: enough for every built-in order to settle.
STEADY_ITERATIONS = 4


@kept
def schedule_score(schedule: Schedule, costs: Costs) -> tuple[float, float]:
    """``(steady-state period, single-iteration makespan)`` at ``costs``: lower is faster. Rounded to 1e-9
    so that float noise between equally fast orders does not decide. Times only (the memory replay is
    left out). One simulation gives both: no action of a rank's first iteration waits on a later one,
    so the first iteration of several ends when a single iteration does. Reused within a search
    (:mod:`..memo`)."""
    sim = simulate(schedule, costs, iterations=STEADY_ITERATIONS, memory=False, timeline=False)
    return (round(sim.period, 9), round(sim.iteration_ends[0], 9))


@kept
def zero_bubble(req: BuildRequest) -> Schedule:
    """Build ``zb-h1``, ``zb-h2`` (one stage per rank), ``zb-v``, ``v-half`` or ``v-min`` (V, two per rank) at
    ``req.costs``, under ``req.max_pending_w`` when given. Reused within a search (:mod:`..memo`): ZB-H2
    weighs ZB-H1's build at the same request, which the search has made."""
    target = req.costs
    candidates = [paper_order(req.name, req.num_ranks, req.num_microbatches)]
    if req.max_pending_w is not None:
        candidates = [cap_pending_w(candidates[0], req.max_pending_w)]
    tie_breaks = ("later-stage", "smallest-mb") if req.stages_per_rank == 2 else ("later-stage",)
    builds = [target] if target.times == Costs().times else [target, Costs()]
    for at in builds:
        for policy in POLICIES:
            for tie_break in tie_breaks:
                candidates.append(
                    greedy(
                        req.name,
                        req.stage_to_rank,
                        req.num_microbatches,
                        costs=at,
                        policy=policy,
                        b_tie_break=tie_break,
                        max_pending_w=req.max_pending_w,
                    )
                )
    if req.name == "zb-h2":
        # ZB-H1's order holds fewer micro-batches than ZB-H2's limits allow, so it is a ZB-H2 schedule
        # too; where it is faster (W > B at m = p, iterations overlapped) ZB-H2 must not lose to it.
        h1 = zero_bubble(replace(req, name="zb-h1"))
        candidates.append(replace(h1, name=candidates[0].name))
    scores = [schedule_score(c, target) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: (scores[i], i))
    return candidates[best]
