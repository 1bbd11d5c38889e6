"""The Zero Bubble paper's handcrafted orders: ZB-H1, ZB-H2 and ZB-V (Qi et al., ICLR 2024, §3 and §6).

These are fixed orders, functions of ``(p, m)`` only, built for ``T_F = T_B = T_W``. At those costs, with
consecutive iterations overlapping (each rank starts its next iteration right after its last W, as the
paper's optimizer post-validation allows), ZB-H2 and ZB-V have no bubble at all in the steady state
once ``m >= 2p - 1``; ZB-H1 keeps a bubble of ``p - 1`` per iteration (a third of 1F1B's) at 1F1B's memory.

**ZB-H1 and ZB-H2 as cycles.** Rank ``r`` runs cycles ``x = 0, 1, ...``; cycle ``x`` is

    F(x),  B(x - d_B(r)),  W(x - d_W)

leaving out the micro-batches outside ``[0, m)``. The offsets are the whole schedule:

=========  ===================  =============  =====================================
schedule   ``d_B(r)``           ``d_W``        in flight on rank r (F until W)
=========  ===================  =============  =====================================
ZB-H1      ``p - 1 - r``        ``p - 1``      ``p``  (torch's ZB1P holds the same)
ZB-H2      ``2(p - 1 - r)``     ``2(p - 1)``   ``2p - 1``
=========  ===================  =============  =====================================

The first cycles hold only F (the warm-up: ``d_B(r)`` of them), then F and B (``d_W - d_B(r)`` cycles,
their W deferred), then the steady F B W, and the last ``d_W`` cycles drain B and W. ZB-H1's offsets are
1F1B's (``d_B``) with the W of each cycle ``p - 1`` micro-batches behind, on every rank. ZB-H2 doubles
them: rank ``r`` runs ``2(p - r) - 1`` F before its first B, which fills the time until that B's
gradient arrives, and ends with ``2r + 1`` W after its last B, so rank ``r`` is busy from ``r`` to
``3m + r`` without a gap: a parallelogram, which tiles with the next iteration's.

**ZB-V.** Rank ``r`` holds chunk 0 = stage ``r`` and chunk 1 = stage ``2p - 1 - r`` (the V). With
``n = max(m, 2p - 1)``:

1. ``2(p - r) - 1`` forwards of chunk 0, then ``r`` pairs (F chunk 1, F chunk 0);
2. ``p - r`` triples (F, B, W) of chunk 1: the V's turn at the bottom;
3. the steady state, while chunk 0 has forwards left or chunk 1 lags: (F chunk 0), B W chunk 0,
   F B W chunk 1;
4. the cool-down: ``r`` pairs (B chunk 0, B chunk 1) with their W deferred, ``p - r`` pairs
   (B chunk 0, W chunk 0), then the deferred W of chunk 1 and of chunk 0.

built for ``n`` micro-batches, the actions of micro-batches ``>= m`` then dropped (for small ``m``).
Each rank holds at most ``2p`` (stage, micro-batch) pairs, each half a 1F1B stage: 1F1B's memory.
"""

from __future__ import annotations

from ..ir import Action, Schedule
from ..placement import place
from .v_orders import V_SCHEDULES, v_order

__all__ = ["paper_order"]


def paper_order(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """The paper's fixed order for ``zb-h1``, ``zb-h2`` (``num_ranks`` stages) or ``zb-v`` (``2 num_ranks``);
    ``v-half`` and ``v-min`` are the follow-up paper's (:mod:`.v_orders`)."""
    p, m = num_ranks, num_microbatches
    if name in V_SCHEDULES:
        return v_order(name, p, m)
    if name == "zb-v":
        rows = tuple(_v_row(p, m, r) for r in range(p))
        num_stages = 2 * p
    elif name in ("zb-h1", "zb-h2"):
        k = 1 if name == "zb-h1" else 2
        rows = tuple(_cycles(r, m, d_b=k * (p - 1 - r), d_w=k * (p - 1)) for r in range(p))
        num_stages = p
    else:
        raise ValueError(f"no paper order for {name!r}")
    placement = place("v", num_stages, 2) if num_stages > p else place("one", num_stages)
    return Schedule(
        name=name, num_stages=num_stages, num_microbatches=m, stage_to_rank=placement, actions=rows, split_backward=True
    )


def _cycles(stage: int, m: int, d_b: int, d_w: int) -> tuple[Action, ...]:
    row = []
    for x in range(m + d_w):
        if x < m:
            row.append(Action("F", stage, x))
        if 0 <= x - d_b < m:
            row.append(Action("B", stage, x - d_b))
        if 0 <= x - d_w < m:
            row.append(Action("W", stage, x - d_w))
    return tuple(row)


def _v_row(p: int, m: int, r: int) -> tuple[Action, ...]:
    n = max(m, 2 * p - 1)
    chunk = (r, 2 * p - 1 - r)  # this rank's stages: chunk 0 on the way down, chunk 1 on the way up
    row: list[Action] = []
    done = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}  # per kind, the next micro-batch of each chunk

    def run(times: int, ops: str) -> None:
        """``ops`` ``times`` over, in the paper's terms: ``"F1 F0"`` is an F of chunk 1, then one of chunk 0."""
        for _ in range(times):
            for op in ops.split():
                kind, c = op[0], int(op[1])
                row.append(Action(kind, chunk[c], done[kind][c]))
                done[kind][c] += 1

    f, w = done["F"], done["W"]
    run(2 * (p - r) - 1, "F0")  # the module docstring's steps: 1. down the V
    run(r, "F1 F0")
    run(p - r, "F1 B1 W1")  # 2. the V's turn at the bottom
    while f[1] < f[0] or f[0] < n:  # 3. the steady state
        if f[0] < n:
            run(1, "F0")
        run(1, "B0 W0 F1 B1 W1")
    run(r, "B0 B1")  # 4. the cool-down, chunk 1's W deferred
    run(p - r, "B0 W0")
    run(n - w[1], "W1")
    run(n - w[0], "W0")
    return tuple(a for a in row if all(mb < m for mb in a.microbatches))
