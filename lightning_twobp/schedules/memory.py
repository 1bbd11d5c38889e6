"""What a schedule holds: one replay of each rank's action order, in micro-batch counts or in bytes.

A (stage, micro-batch) pair is allocated by its F and freed by its backward, in two steps when the
backward is split (the Zero Bubble paper's accounting, Qi et al. ICLR 2024 §3.1; the 2BP paper's
"intermediate derivatives", Rae et al. 2024 §5):

* ``F``  adds ``activation(s, m)``: what the forward saves for the backward (the paper's M_B);
* ``B``  trades it for ``held(s, m)``: what W still needs (the weight GEMMs' inputs and output
  gradients, the paper's M_W), or the whole graph where a layer has no direct weight formula;
* ``W``  frees ``held(s, m)`` (a batched W, for each of its micro-batches);
* ``BW`` frees ``activation(s, m)`` at once.

A rank runs its actions one at a time, so walking its list in order visits every allocation and
release in time order: the peak over the walk is the rank's peak, whatever the costs. With
``activation = held = 1`` the replay counts the pairs held from F to their last B/W/BW
(``SimResult.peak_inflight``); with ``held = 0``, from F to B (:func:`peak_activations`, the count the
paper states its budgets in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .ir import Schedule
from .per_stage import PerStage

__all__ = ["MemoryPeaks", "peak_activations", "peak_inflight", "replay_memory"]

# Bytes of one (stage, micro-batch): a number for all, one per stage, or one per (stage, micro-batch).
PerPair = PerStage | Mapping[tuple[int, int], float] | Callable[[int, int], float]


@dataclass(frozen=True)
class MemoryPeaks:
    """The most held at once, per rank and per stage (fixed bytes not included)."""

    per_rank: tuple[float, ...]
    per_stage: tuple[float, ...]


def _per_pair(value: PerPair) -> Callable[[int, int], float]:
    if callable(value):
        return value
    if isinstance(value, Mapping):
        return lambda s, m: value[(s, m)]
    if isinstance(value, (int, float)):
        return lambda s, m: value
    per_stage = tuple(value)
    return lambda s, m: per_stage[s]


def _change(kind: str, act: Callable[[int, int], float], keep: Callable[[int, int], float], s: int, mb: int) -> float:
    if kind == "F":
        return act(s, mb)
    if kind == "B":
        return keep(s, mb) - act(s, mb)
    return -keep(s, mb) if kind == "W" else -act(s, mb)


def replay_memory(schedule: Schedule, activation: PerPair = 1, held: PerPair = 1) -> MemoryPeaks:
    """Replay every rank's list (see the module docstring) and return the peaks.

    ``activation`` and ``held`` are a number, one number per stage, a mapping ``(stage, mb) -> bytes``
    or a function of ``(stage, mb)``.
    """
    act, keep = _per_pair(activation), _per_pair(held)
    per_stage = [0] * schedule.num_stages
    per_rank = []
    for row in schedule.actions:
        now: dict[int, float] = {}
        peak = 0
        for action in row:
            s = action.stage
            for mb in action.microbatches:
                now[s] = now.get(s, 0) + _change(action.kind, act, keep, s, mb)
            per_stage[s] = max(per_stage[s], now[s])
            peak = max(peak, sum(now.values()))
        per_rank.append(peak)
    return MemoryPeaks(per_rank=tuple(per_rank), per_stage=tuple(per_stage))


def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) pairs held from F until their last B/W/BW at once."""
    return replay_memory(schedule, 1, 1).per_rank


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) pairs held between F and B (or BW) at once.

    That is the Zero Bubble paper's M_B count, the one its memory budgets (and our greedy's F->B
    limits) bound; :func:`peak_inflight` holds a pair until its last B/W, the count that matters for
    this project's autograd split backward when a stage keeps its graph until W.
    """
    return replay_memory(schedule, 1, 0).per_rank
