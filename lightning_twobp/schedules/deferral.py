"""Capped W deferral: at most k micro-batches per stage wait between their B and their W.

2BP's gain is W off the critical path; its price is memory: every micro-batch whose W waits keeps
the weight GEMMs' inputs and output gradients (the Zero Bubble paper's M_W), and 1F1B + 2BP defers
most W to the end of the step, so the last stages hold all m micro-batches (the 2BP paper's §5:
peak memory rose in every run). A cap trades some of the gain back: **before every F or B of a
rank, each of its stages has at most k[s] micro-batches whose B has run and W has not**; over the
cap, the oldest waiting W runs first. The Zero Bubble authors' Megatron fork has the same knob
(``--zero-bubble-max-pending-backward``).

* k = 0: every W runs right after its own B, so 1F1B + 2BP becomes the fused 1F1B order with each
  BW written as B then W;
* k >= m: nothing changes.

:func:`cap_pending_w` applies the cap to any split schedule's order (a W has no consumer on another
rank, so running it earlier never deadlocks); the Zero Bubble builders also build under the cap
(:mod:`.builders.zb_greedy`) and keep the fastest. :func:`pending_w_cap` turns a byte budget per
stage into micro-batches through the memory costs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from .ir import Action, Schedule, is_index
from .memory import MemoryCosts

__all__ = ["cap_pending_w", "check_max_pending_w", "peak_pending_w", "pending_w_cap"]


def check_max_pending_w(
    value: int | Sequence[int] | None, name: str, num_stages: int, split_backward: bool
) -> tuple[int, ...] | None:
    """``max_pending_w`` as one cap per stage (None: no cap); ValueError saying what works otherwise."""
    if value is None:
        return None
    caps: tuple[int, ...] = (
        (value,) * num_stages if is_index(value) else tuple(value) if isinstance(value, (list, tuple)) else ()
    )
    if len(caps) != num_stages or not all(is_index(k) for k in caps):
        raise ValueError(
            f"max_pending_w={value!r}: give the most micro-batches per stage whose W may wait after their B, "
            f"an int >= 0 (0 runs each W right after its B) or one per stage ({num_stages} ints >= 0), "
            f"or None for no cap"
        )
    if not split_backward:
        raise ValueError(
            f"max_pending_w={value!r} caps the W that 2BP's split defers; {name} with split_backward=False "
            f"runs fused BW and has none to cap: drop max_pending_w or use split_backward=True"
        )
    return caps


def pending_w_cap(memory: MemoryCosts, max_bytes: float | Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose W may wait within ``max_bytes`` (a number, or one per stage)
    of what they hold from B to W (``memory.held``); a stage that holds nothing there is not capped."""
    budget = (max_bytes,) * num_stages if isinstance(max_bytes, (int, float)) else tuple(max_bytes)
    if len(budget) != num_stages or any(b < 0 for b in budget):
        raise ValueError(f"max_bytes={max_bytes!r}: give bytes >= 0, one number or one per stage ({num_stages})")
    memory.check(num_stages)
    held = [memory.of("held", s) for s in range(num_stages)]
    return tuple(math.floor(b / h) if h > 0 else 2**31 - 1 for b, h in zip(budget, held, strict=False))


def cap_pending_w(schedule: Schedule, caps: Sequence[int]) -> Schedule:
    """``schedule`` with, before each F or B, every stage of the rank at most ``caps[s]`` W behind (the
    oldest waiting W run first); the W already in the order stay where they are, less what ran earlier."""
    if not schedule.split_backward:
        raise ValueError(f"{schedule.name}: a fused schedule has no W to cap")
    rows = tuple(_capped_row(row, caps) for row in schedule.actions)
    return schedule if rows == schedule.actions else replace(schedule, actions=rows)


def _capped_row(row: Sequence[Action], caps: Sequence[int]) -> tuple[Action, ...]:
    pending: dict[int, deque[int]] = {}
    done: set[tuple[int, int]] = set()
    out: list[Action] = []
    for action in row:
        if action.kind == "W":
            left = tuple(mb for mb in action.microbatches if (action.stage, mb) not in done)
            if left:
                out.append(Action("W", action.stage, left))
                _ran(pending, done, action.stage, left)
            continue
        for s, waiting in pending.items():
            while len(waiting) > caps[s]:
                mb = waiting[0]
                out.append(Action("W", s, mb))
                _ran(pending, done, s, (mb,))
        out.append(action)
        if action.kind == "B":
            pending.setdefault(action.stage, deque()).extend(action.microbatches)  # a B covers one micro-batch
    return tuple(out)


def _ran(pending: dict[int, deque[int]], done: set[tuple[int, int]], stage: int, mbs: Sequence[int]) -> None:
    done.update((stage, mb) for mb in mbs)
    waiting = pending.get(stage, deque())
    for mb in mbs:
        if mb in waiting:
            waiting.remove(mb)


def peak_pending_w(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches waiting between their B and their W when an F or B starts."""
    peaks = [0] * schedule.num_stages
    for row in schedule.actions:
        waiting: dict[int, int] = {}
        for action in row:
            if action.kind in ("F", "B", "BW"):
                for s, n in waiting.items():
                    peaks[s] = max(peaks[s], n)
            if action.kind == "B":
                waiting[action.stage] = waiting.get(action.stage, 0) + 1
            elif action.kind == "W":
                waiting[action.stage] -= len(action.microbatches)
    return tuple(peaks)
