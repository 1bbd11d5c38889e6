"""1F1B (PipeDream-Flush, Narayanan et al. 2021) and Megatron's interleaved 1F1B.

Each rank runs a warm-up of forwards, a steady phase alternating one forward with
one backward, and a cool-down of the remaining backwards.

With the split backward this is the 2BP paper's 1F1B+2BP (Rae, Lee and Richings, 2024):
backward-p1 (B) takes the backward's place and backward-p2 (W) is deferred.  In
the cool-down, where 1F1B idles waiting for the gradient of the next micro-batch,
each B is followed by the W of the oldest micro-batch still without one; whatever
is left runs at the very end as one batched W per local stage.  The paper's
1F1B-1 / 1F1B-2 are ``num_microbatches = p`` and ``2p``.
"""

from __future__ import annotations

from collections import deque

from ..ir import Action, Schedule
from ..spec import BuildRequest


def one_f_one_b(req: BuildRequest) -> Schedule:
    """Plain 1F1B, one stage per rank; rank r warms up with ``min(p-1-r, m)`` forwards."""
    rows = []
    for rank in range(req.num_ranks):
        local = [s for s, r in enumerate(req.stage_to_rank) if r == rank]
        order = [(s, m) for s in local for m in range(req.num_microbatches)]
        warmup = min(req.num_ranks - 1 - rank, req.num_microbatches)
        rows.append(_row(order, order, warmup, req.split_backward))
    return _schedule(req, rows)


def interleaved_one_f_one_b(req: BuildRequest) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21 §2.2) on the loop map.

    With ``v = stages_per_rank`` chunks, rank r holds stages ``r, r+p, ...``.  Virtual
    step k runs chunk ``(k // p) % v`` (backward: ``v-1-`` that) of micro-batch
    ``(k // (p*v)) * p + k % p``: groups of p micro-batches sweep through the chunks.
    Warm-up is ``(p-r-1)*2 + (v-1)*p`` steps, capped at ``m*v``.  Needs ``m % p == 0``
    (checked by the registry).  ``v == 1`` is exactly plain 1F1B.
    """
    if req.stages_per_rank == 1:
        return one_f_one_b(req)
    v = req.stages_per_rank
    ranks = req.num_ranks
    total = req.num_microbatches * v

    def order(rank: int, backward: bool) -> list[tuple[int, int]]:
        steps = []
        for k in range(total):
            chunk = (k // ranks) % v
            if backward:
                chunk = v - 1 - chunk
            mb = (k // (ranks * v)) * ranks + k % ranks
            steps.append((chunk * ranks + rank, mb))
        return steps

    rows = []
    for rank in range(ranks):
        warmup = min((ranks - rank - 1) * 2 + (v - 1) * ranks, total)
        rows.append(_row(order(rank, False), order(rank, True), warmup, req.split_backward))
    return _schedule(req, rows)


def _schedule(req: BuildRequest, rows: list[tuple[Action, ...]]) -> Schedule:
    return Schedule(
        name=req.name,
        num_stages=req.num_stages,
        num_microbatches=req.num_microbatches,
        stage_to_rank=req.stage_to_rank,
        actions=tuple(rows),
        split_backward=req.split_backward,
    )


def _row(
    forwards: list[tuple[int, int]], backwards: list[tuple[int, int]], warmup: int, split: bool
) -> tuple[Action, ...]:
    """Warm-up, steady 1F1B pairs, cool-down; with ``split``, the 2BP W placement."""
    back = "B" if split else "BW"
    n = len(forwards)
    row = [Action("F", s, m) for s, m in forwards[:warmup]]
    for i in range(n - warmup):
        row.append(Action("F", *forwards[warmup + i]))
        row.append(Action(back, *backwards[i]))
    # (stage, mb) whose B ran but whose W has not, oldest B first.
    pending = deque(backwards[: n - warmup])
    for i in range(n - warmup, n):
        row.append(Action(back, *backwards[i]))
        if split:
            pending.append(backwards[i])
            # The cool-down B of the next micro-batch waits for the gradient from
            # downstream; one W fills that gap.
            row.append(Action("W", *pending.popleft()))
    if split and pending:
        by_stage: dict[int, list[int]] = {}
        for s, m in pending:  # dicts keep insertion order: oldest group first
            by_stage.setdefault(s, []).append(m)
        row += [Action("W", s, tuple(sorted(mbs))) for s, mbs in by_stage.items()]
    return tuple(row)
