"""Where a schedule's stages live, and whether ``(name, stages, stages per rank, micro-batches)`` makes sense.

Each function reads the schedule's :class:`~.spec.ScheduleSpec`, so the builders, the strategy and
the planner apply the same rules and give the same errors: :func:`check_layout` raises a
``ValueError`` that says what would work. The schedule-specific rules are the small ``check_*``
functions below, which specs list in their ``checks``.
"""

from __future__ import annotations

from .ir import is_index
from .spec import PLACEMENTS, SCHEDULES, LayoutCheck, schedule_spec

__all__ = [
    "SCHEDULES",
    "check_layout",
    "check_split",
    "default_num_microbatches",
    "default_stages_per_rank",
    "place",
    "schedule_label",
    "stage_to_rank",
]


def default_stages_per_rank(name: str) -> int:
    """2 for the schedules built around several stages per rank (the V, interleaved 1F1B), else 1."""
    return schedule_spec(name).default_stages_per_rank


def default_num_microbatches(num_ranks: int, name: str | None = None) -> int:
    """The schedule's default ``m``; ``2p`` for every built-in one: the 2BP paper's 1F1B-2 and the smallest
    count at which ZB-H2 and ZB-V reach zero bubble."""
    return 2 * num_ranks if name is None else schedule_spec(name).default_num_microbatches(num_ranks)


def schedule_label(name: str, split_backward: bool) -> str:
    """The short name of a schedule as the docs and benchmarks write it: ``"1f1b+2BP"`` for 2BP's split
    of a schedule that also has a fused form, the bare name otherwise (``"zb-h1"`` is split by definition)."""
    split_only = name in SCHEDULES and schedule_spec(name).split_only
    return f"{name}+2BP" if split_backward and not split_only else name


def check_split(name: str, split_backward: bool) -> None:
    """Raise ``ValueError`` for a split-only schedule without the split (it has no fused form)."""
    if schedule_spec(name).split_only and not split_backward:
        raise ValueError(
            f"{name} is split by definition (its backward is separate B and W actions); got "
            f"split_backward=False: use '1f1b' or 'gpipe' for a fused backward"
        )


def check_layout(name: str, num_stages: int, stages_per_rank: int, num_microbatches: int | None = None) -> int:
    """Check a schedule name, its stage counts and (when given) its micro-batch count; return the
    number of ranks ``p = num_stages // stages_per_rank``."""
    spec = schedule_spec(name)
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
    for check in spec.checks:
        check(name, num_stages, stages_per_rank, num_microbatches)
    if spec.stages_per_rank is not None and stages_per_rank not in spec.stages_per_rank:
        raise ValueError(
            f"{name} runs {' or '.join(map(str, spec.stages_per_rank))} stages per rank; got "
            f"stages_per_rank={stages_per_rank}"
        )
    if num_microbatches is not None and (not is_index(num_microbatches) or num_microbatches < 1):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    return num_stages // stages_per_rank


def place(placement: str, num_stages: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Stage-to-rank map of a placement (:data:`~.spec.PLACEMENTS`) over ``p = num_stages // stages_per_rank``
    ranks: "one" and "loop" put stage ``s`` on rank ``s % p`` (so every rank holds stages ``r, r + p, ...``),
    "v" puts ``s`` on ``s`` for ``s < p`` and on ``2p - 1 - s`` after (Qi et al., ZB-V: the forward goes
    down the ranks and back up, rank 0 holds the first and the last stage)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    ranks = num_stages // stages_per_rank
    if placement == "v":
        if stages_per_rank != 2:
            raise ValueError(f"the V placement holds 2 stages per rank, got {stages_per_rank}")
        return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages))
    return tuple(s % ranks for s in range(num_stages))


def stage_to_rank(name: str, num_stages: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """The stage-to-rank placement schedule ``name`` uses; ``num_stages`` counts all stages."""
    check_layout(name, num_stages, stages_per_rank)
    return place(schedule_spec(name).placement, num_stages, stages_per_rank)


# ------------------------------------------------------------------ rules that specs list in `checks`
def _stages_rule(required: int, message: str) -> LayoutCheck:
    """The rule "exactly ``required`` stages per rank": else a ValueError of ``message``, which names what
    would work from the schedule's ``name``, the ``given`` stages per rank, ``stages``, ``m``, ``ranks`` and
    ``v_stages`` (the stages of a V over those ranks)."""

    def check(name: str, num_stages: int, stages_per_rank: int, m: int | None) -> None:
        if stages_per_rank != required:
            ranks = num_stages // stages_per_rank
            fields = dict(name=name, given=stages_per_rank, stages=num_stages, m=_m(m), ranks=ranks, v_stages=2 * ranks)
            raise ValueError(message.format(**fields))

    return check


# 1F1B: one stage per rank; several is Megatron's interleaved 1F1B.
check_one_stage_or_interleaved = _stages_rule(
    1,
    "{name} runs one stage per rank; got stages_per_rank={given}: use "
    "build_schedule('interleaved-1f1b', {stages}, {m}, stages_per_rank={given}) or stages_per_rank=1",
)
# ZB-H1 / ZB-H2: one stage per rank; two is the V.
check_one_stage_or_v = _stages_rule(
    1,
    "{name} runs one stage per rank; got stages_per_rank={given}: use stages_per_rank=1, or "
    "build_schedule('zb-v', {v_stages}, {m}, stages_per_rank=2) for a V over {ranks} ranks",
)
# The V schedules (ZB-V, V-Half, V-Min): exactly two stages per rank.
check_two_stages_v = _stages_rule(
    2,
    "{name} needs stages_per_rank=2 (a V of 2 stages per rank); got {given}: "
    "use build_schedule('{name}', {v_stages}, {m}, stages_per_rank=2) for {ranks} ranks",
)


def check_interleaved_microbatches(name: str, num_stages: int, stages_per_rank: int, m: int | None) -> None:
    """Interleaved 1F1B's groups of p micro-batches: with several stages per rank, m is a multiple of p."""
    ranks = num_stages // stages_per_rank
    if m is None or stages_per_rank == 1 or not is_index(m) or m < 1 or m % ranks == 0:
        return
    start = max(ranks, (m // ranks) * ranks)
    options = [start, start + ranks, start + 2 * ranks]
    raise ValueError(
        f"{name} with {stages_per_rank} stages per rank on {ranks} ranks needs "
        f"a micro-batch count that is a multiple of {ranks}: use {options[0]}, "
        f"{options[1]} or {options[2]} (got {m})"
    )


def _m(m: int | None) -> int | str:
    return "m" if m is None else m
