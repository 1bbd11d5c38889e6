"""V-Half and V-Min as the controllable-memory paper builds them (Qi, Wan, Amar and Lin, "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024, arXiv 2405.15362).

The paper writes a schedule as one *building block* repeated every micro-batch (§2): on unit time
slots (F = B = W = 1 per stage, each stage half a 1F1B stage on the V), the block of micro-batch j
puts, on rank r (chunk 0 = stage r, chunk 1 = stage 2p - 1 - r), F of chunk 0 at ``a + 6j``, F of
chunk 1 at ``b + 6j``, B of chunk 1 at ``c + 6j`` and B of chunk 0 at ``d + 6j``, and the two W in
free slots. A micro-batch lives from its first F to its last W (the block's lifespan), and the peak
memory of the repeated schedule is the lifespan over the interval 6 (§2), which the V-shape blocks
(§3) shorten by giving later ranks a later F and an earlier B:

=========  ======  ===============  ====================  ==================  ======================
schedule   a       b                c                     d                   g
=========  ======  ===============  ====================  ==================  ======================
V-Min      ``r``   ``2p - 1 - r``   ``2p + g + r``        ``4p + g - 1 - r``  2 if 3 divides p, else 0
V-Half     ``2r``  ``3p - 2 - r``   ``3p + g - 1 + 2r``   ``6p + g - 2 - r``  3 if p is even, else 0
=========  ======  ===============  ====================  ==================  ======================

so each rank holds at most ``2((p + 4) // 3)`` (V-Min) or ``2((p + 2) // 2)`` (V-Half) half-stage
micro-batches from F to W: about 1/3 and 1/2 of 1F1B's p full ones. Repeating the block leaves idle
slots at the start and the end; the paper then *squeezes* (§2): every F, B and W, in time order,
moves to the earliest free slot after its dependencies where the rank's memory stays within the
block's peak. Its two passes, which :func:`v_order` follows: with the W placed, squeeze the warm-up
(until rank 0's first B of stage 0) and the cool-down (after the last micro-batch's first F); then
without the W (each free slot runs the oldest waiting W), squeeze the cool-down again; then place
the W (chunk 1's first). The order on each rank is its actions sorted by slot. These are fixed
orders for T_F = T_B = T_W; the builder (:mod:`.zero_bubble`) keeps this one or a greedy one built at
the given costs within the same memory, whichever is faster there.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

from ..ir import Action, Schedule
from ..memory import row_peak
from ..placement import place

__all__ = ["V_SCHEDULES", "v_memory_bound", "v_order"]

V_SCHEDULES = ("v-half", "v-min")
PERIOD = 6  # slots per micro-batch and rank: F, B and W of two half stages


def v_memory_bound(name: str, p: int) -> int:
    """The most half-stage (stage, micro-batch) pairs a rank holds from F to W: the paper's (p+2)//2
    (V-Half) or (p+4)//3 (V-Min) micro-batches of a full stage, twice as many half ones."""
    if name == "v-half":
        return 2 * ((p + 2) // 2)
    if name == "v-min":
        return 2 * ((p + 4) // 3)
    raise ValueError(f"no V-shape memory bound for {name!r}; choose one of {V_SCHEDULES}")


def _offsets(name: str, p: int, r: int) -> tuple[int, int, int, int]:
    """Slots of micro-batch 0's F chunk 0, F chunk 1, B chunk 1, B chunk 0 on rank r (table above)."""
    if name == "v-min":
        g = 2 if p % 3 == 0 else 0
        return r, 2 * p - 1 - r, 2 * p + g + r, 4 * p + g - 1 - r
    g = 3 if p % 2 == 0 else 0
    return 2 * r, 3 * p - 2 - r, 3 * p + g - 1 + 2 * r, 6 * p + g - 2 - r


@lru_cache(maxsize=128)  # a pure function of its arguments, returning frozen data; the squeeze takes ~1 s at p = 8
def v_order(name: str, p: int, m: int) -> Schedule:
    """The paper's V-Half or V-Min order on ``p`` ranks (``2p`` stages on the V) for ``m`` micro-batches."""
    v_memory_bound(name, p)  # checks the name
    slots = _blocks(name, p, m)
    slots = _squeeze(_with_w(slots), p, m, with_w=True)
    slots = _squeeze(_without_w(slots), p, m, with_w=False)
    rows = tuple(tuple(sorted(mine, key=mine.__getitem__)) for mine in _with_w(_without_w(slots)))
    return Schedule(
        name=name,
        num_stages=2 * p,
        num_microbatches=m,
        stage_to_rank=place("v", 2 * p, 2),
        actions=rows,
        split_backward=True,
    )


def _blocks(name: str, p: int, m: int) -> list[dict[Action, int]]:
    """Per rank, the slot of every F and B: the building block repeated every PERIOD slots."""
    out = []
    for r in range(p):
        f0, f1, b1, b0 = _offsets(name, p, r)
        down, up = r, 2 * p - 1 - r
        mine: dict[Action, int] = {}
        for j in range(m):
            base = PERIOD * j
            mine.update(
                {
                    Action("F", down, j): f0 + base,
                    Action("F", up, j): f1 + base,
                    Action("B", up, j): b1 + base,
                    Action("B", down, j): b0 + base,
                }
            )
        out.append(mine)
    return out


def _with_w(slots: list[dict[Action, int]]) -> list[dict[Action, int]]:
    return [_place_w(mine) for mine in slots]


def _without_w(slots: list[dict[Action, int]]) -> list[dict[Action, int]]:
    return [{a: t for a, t in mine.items() if a.kind != "W"} for mine in slots]


def _place_w(mine: dict[Action, int]) -> dict[Action, int]:
    """Each free slot runs the oldest waiting W, the later stage's (chunk 1's) first; the rest follow."""
    at = {t: a for a, t in mine.items()}
    waiting: dict[int, deque[Action]] = {}
    out = dict(mine)
    t, end = 0, max(at)
    while t <= end or any(waiting.values()):
        action = at.get(t)
        if action is not None:
            if action.kind == "B":
                waiting.setdefault(action.stage, deque()).append(Action("W", action.stage, action.microbatch))
        else:
            ready = [s for s in sorted(waiting, reverse=True) if waiting[s]]
            if ready:
                out[waiting[ready[0]].popleft()] = t
        t += 1
    return out


def _squeeze(slots: list[dict[Action, int]], p: int, m: int, with_w: bool) -> list[dict[Action, int]]:
    """Move actions, in time order, to the earliest free slot after their dependencies that keeps the
    rank's memory within the schedule's peak (see the module docstring for which phases move)."""
    slots = [dict(mine) for mine in slots]
    owner = place("v", 2 * p, 2)
    cap = max(_peak(mine, with_w) for mine in slots)
    where = {a: (r, t) for r, mine in enumerate(slots) for a, t in mine.items()}
    taken: list[set[int]] = [set() for _ in slots]
    phase = 0
    for a, (r, t) in sorted(where.items(), key=lambda item: (item[1][1], item[1][0])):
        if phase == 0 and a.kind == "B" and a.stage == 0:
            phase = 1
        moves = phase == 2 or (phase == 0 and with_w)
        if phase == 1 and a.kind == "F" and a.stage < p and a.microbatch == m - 1:
            phase = 2
        if moves:
            t = _earliest(slots, r, a, t, _ready_at(slots, owner, a), taken[r], cap, with_w)
        taken[r].add(t)
    return slots


def _earliest(
    slots: list[dict[Action, int]], r: int, a: Action, t: int, lo: int, taken: set[int], cap: int, with_w: bool
) -> int:
    mine = slots[r]
    for candidate in range(lo, t):
        if candidate in taken:
            continue
        mine[a] = candidate
        if _peak(mine, with_w) <= cap:
            return candidate
    mine[a] = t
    return t


def _ready_at(slots: list[dict[Action, int]], owner: tuple[int, ...], a: Action) -> int:
    """The first slot after every action ``a`` depends on (unit durations, no communication)."""
    s, j = a.stage, a.microbatch
    assert isinstance(j, int)  # this builder's W cover one micro-batch each
    deps = [Action(a.kind, s, j - 1)] if j > 0 else []
    if a.kind == "F" and s > 0:
        deps.append(Action("F", s - 1, j))
    elif a.kind == "B":
        deps.append(Action("F", s, j))
        if s < len(owner) - 1:
            deps.append(Action("B", s + 1, j))
    elif a.kind == "W":
        deps.append(Action("B", s, j))
    return max((slots[owner[d.stage]][d] + 1 for d in deps), default=0)


def _peak(mine: dict[Action, int], with_w: bool) -> int:
    """The most (stage, micro-batch) pairs the rank holds from F to W in this slot assignment."""
    if not with_w:
        mine = _place_w(mine)
    return int(row_peak(sorted(mine, key=mine.__getitem__)))  # unit costs: a whole count
