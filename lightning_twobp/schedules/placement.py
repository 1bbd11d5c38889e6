"""Which schedules exist, where their stages live, and their defaults: the layout rules in one place.

Everything that decides whether ``(name, num_stages, stages_per_rank, num_microbatches)`` makes sense
is here, so that the builders, the strategy and the planner apply the same rules and give the same
errors: :func:`check_layout` raises a ``ValueError`` that says what would work.
"""

from __future__ import annotations

from .ir import is_index

__all__ = [
    "SCHEDULES",
    "check_layout",
    "check_split",
    "default_num_microbatches",
    "default_stages_per_rank",
    "schedule_label",
    "stage_to_rank",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")

# Zero Bubble schedules exist only with B and W as separate actions.
SPLIT_ONLY = ("zb-h1", "zb-h2", "zb-v")
# Schedules with exactly one stage per rank.
_ONE_STAGE = ("1f1b", "zb-h1", "zb-h2")


def default_stages_per_rank(name: str) -> int:
    """2 for the schedules built around several stages per rank (the V, interleaved 1F1B), else 1."""
    return 2 if name in ("zb-v", "interleaved-1f1b") else 1


def default_num_microbatches(num_ranks: int) -> int:
    """``2p``: the 2BP paper's 1F1B-2 and the smallest count at which ZB-H2 and ZB-V reach zero bubble."""
    return 2 * num_ranks


def schedule_label(name: str, split_backward: bool) -> str:
    """The short name of a schedule as the docs and benchmarks write it: ``"1f1b+2BP"`` for 2BP's split
    of a schedule that also has a fused form, the bare name otherwise (``"zb-h1"`` is split by definition)."""
    return f"{name}+2BP" if split_backward and name not in SPLIT_ONLY else name


def check_split(name: str, split_backward: bool) -> None:
    """Raise ``ValueError`` for a Zero Bubble schedule without the split (it has no fused form)."""
    if name in SPLIT_ONLY and not split_backward:
        raise ValueError(
            f"{name} is split by definition (its backward is separate B and W actions); got "
            f"split_backward=False: use '1f1b' or 'gpipe' for a fused backward"
        )


def check_layout(name: str, num_stages: int, stages_per_rank: int, num_microbatches: int | None = None) -> int:
    """Check a schedule name, its stage counts and (when given) its micro-batch count; return the
    number of ranks ``p = num_stages // stages_per_rank``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if not is_index(num_stages) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if not is_index(stages_per_rank) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be an int >= 1, got {stages_per_rank!r}")
    if num_stages % stages_per_rank:
        raise ValueError(
            f"num_stages={num_stages} is not a multiple of stages_per_rank={stages_per_rank}: "
            f"use {num_stages - num_stages % stages_per_rank or stages_per_rank} or "
            f"{num_stages + stages_per_rank - num_stages % stages_per_rank} stages"
        )
    ranks = num_stages // stages_per_rank
    m = "m" if num_microbatches is None else num_microbatches
    if name == "1f1b" and stages_per_rank != 1:
        raise ValueError(
            f"1f1b runs one stage per rank; got stages_per_rank={stages_per_rank}: use "
            f"build_schedule('interleaved-1f1b', {num_stages}, {m}, "
            f"stages_per_rank={stages_per_rank}) or stages_per_rank=1"
        )
    if name in ("zb-h1", "zb-h2") and stages_per_rank != 1:
        raise ValueError(
            f"{name} runs one stage per rank; got stages_per_rank={stages_per_rank}: use "
            f"stages_per_rank=1, or build_schedule('zb-v', {2 * ranks}, {m}, "
            f"stages_per_rank=2) for a V over {ranks} ranks"
        )
    if name == "zb-v" and stages_per_rank != 2:
        raise ValueError(
            f"zb-v needs stages_per_rank=2 (a V of 2 stages per rank); got {stages_per_rank}: "
            f"use build_schedule('zb-v', {2 * ranks}, {m}, stages_per_rank=2) for {ranks} ranks"
        )
    if num_microbatches is None:
        return ranks
    if not is_index(num_microbatches) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    if name == "interleaved-1f1b" and stages_per_rank > 1 and num_microbatches % ranks:
        start = max(ranks, (num_microbatches // ranks) * ranks)
        options = [start, start + ranks, start + 2 * ranks]
        raise ValueError(
            f"interleaved-1f1b with {stages_per_rank} stages per rank on {ranks} ranks needs "
            f"a micro-batch count that is a multiple of {ranks}: use {options[0]}, "
            f"{options[1]} or {options[2]} (got {num_microbatches})"
        )
    return ranks


def stage_to_rank(name: str, num_stages: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """The stage-to-rank placement a schedule uses; ``num_stages`` counts all stages.

    With ``p = num_stages // stages_per_rank`` ranks:

    * one stage per rank: stage ``s`` on rank ``s``;
    * "loop" (GPipe / Megatron interleaved, ``v = stages_per_rank`` chunks): ``s -> s % p``,
      so every rank holds stages ``r, r + p, r + 2p, ...``;
    * "V" (``zb-v``, exactly two stages per rank): ``s -> s`` for ``s < p`` and
      ``2p - 1 - s`` after, so rank 0 holds the first and the last stage and the
      forward pass goes down the ranks and back up (Qi et al., ZB-V).
    """
    ranks = check_layout(name, num_stages, stages_per_rank)
    if name == "zb-v":
        return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages))
    return tuple(s % ranks for s in range(num_stages))
