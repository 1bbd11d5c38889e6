"""Checking a schedule: complete, well placed, locally ordered, and deadlock-free across ranks.

:func:`validate` is the one entry point; builders end with ``return validate(schedule)`` and the
executor calls it before running anything. The cross-rank part runs the simulator (no deadlock of
the computation) and the communication pass under strict rendezvous (no deadlock of the sends and
receives, one posting order per pair of ranks).
"""

from __future__ import annotations

from .ir import Action, DeadlockError, Schedule
from .lower import check_comm_deadlock, lower_communication
from .simulate import simulate

__all__ = ["validate"]


def validate(schedule: Schedule) -> Schedule:
    """Check the schedule is complete, well placed, ordered and deadlock-free.

    Raises ``ValueError`` naming the rank, position and action at fault.
    Returns ``schedule``, so that builders can ``return validate(schedule)``.
    """
    _check_shape(schedule)
    _check_coverage(schedule)
    _check_local_order(schedule)
    # The cross-rank part: no deadlock of the computation (what the simulator computes),
    # and none of its lowered communication under blocking point-to-point semantics
    # (strict rendezvous, the NCCL worst case) with one posting order per rank pair.
    try:
        simulate(schedule, memory=False, timeline=False)
        check_comm_deadlock(lower_communication(schedule), schedule.stage_to_rank)
    except DeadlockError as err:
        raise ValueError(f"{schedule.name}: schedule deadlocks\n{err}") from err
    return schedule


def _check_shape(schedule: Schedule) -> None:
    if schedule.num_stages < 1 or schedule.num_microbatches < 1:
        raise ValueError(
            f"{schedule.name}: need num_stages >= 1 and num_microbatches >= 1, got "
            f"{schedule.num_stages} and {schedule.num_microbatches}"
        )
    if len(schedule.stage_to_rank) != schedule.num_stages:
        raise ValueError(
            f"{schedule.name}: stage_to_rank has {len(schedule.stage_to_rank)} entries for {schedule.num_stages} stages"
        )
    if sorted(set(schedule.stage_to_rank)) != list(range(schedule.num_ranks)):
        raise ValueError(f"{schedule.name}: stage_to_rank {schedule.stage_to_rank} leaves a rank without stages")
    if len(schedule.actions) != schedule.num_ranks:
        raise ValueError(f"{schedule.name}: {len(schedule.actions)} action lists for {schedule.num_ranks} ranks")
    for rank, pos, action in _walk(schedule):
        if not isinstance(action, Action):
            raise ValueError(f"{schedule.name}: rank {rank} position {pos}: {action!r} is not an Action")
        if action.stage >= schedule.num_stages:
            raise ValueError(
                f"{schedule.name}: rank {rank} position {pos}: {action} names stage "
                f"{action.stage} of {schedule.num_stages}"
            )
        if max(action.microbatches) >= schedule.num_microbatches:
            raise ValueError(
                f"{schedule.name}: rank {rank} position {pos}: {action} names a micro-batch "
                f"beyond {schedule.num_microbatches}"
            )
        if schedule.stage_to_rank[action.stage] != rank:
            raise ValueError(
                f"{schedule.name}: rank {rank} position {pos}: {action} belongs on rank "
                f"{schedule.stage_to_rank[action.stage]}, which holds stage {action.stage}"
            )
        if action.kind in ("B", "W") and not schedule.split_backward:
            raise ValueError(
                f"{schedule.name}: rank {rank} position {pos}: {action} in a schedule with "
                f"split_backward=False (expects BW)"
            )


def _check_coverage(schedule: Schedule) -> None:
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, pos, action in _walk(schedule):
        for mb in action.microbatches:
            key = (action.kind, action.stage, mb)
            if key in seen:
                r0, p0 = seen[key]
                raise ValueError(
                    f"{schedule.name}: rank {rank} position {pos}: {action} repeats "
                    f"{action.kind} of stage {action.stage} micro-batch {mb} "
                    f"(already at rank {r0} position {p0})"
                )
            seen[key] = (rank, pos)
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            # a split schedule may fuse a micro-batch's backward (.fusion): BW there, or B and W, never both
            fused = ("BW", stage, mb) in seen
            both = [k for k in ("B", "W") if fused and (k, stage, mb) in seen]
            if both:
                raise ValueError(
                    f"{schedule.name}: stage {stage} micro-batch {mb} has both BW and {both[0]}; a backward runs "
                    f"fused (BW) or split (B then W), once"
                )
            kinds = ("F", "BW") if fused or not schedule.split_backward else ("F", "B", "W")
            missing = [k for k in kinds if (k, stage, mb) not in seen]
            if missing:
                raise ValueError(
                    f"{schedule.name}: stage {stage} micro-batch {mb} has no "
                    f"{'/'.join(missing)} (rank {schedule.stage_to_rank[stage]})"
                )


def _check_local_order(schedule: Schedule) -> None:
    # F(s,m) < B/BW(s,m) < W covering (s,m), in list order on the owning rank.
    for rank, row in enumerate(schedule.actions):
        position: dict[tuple[str, int, int], int] = {}
        for pos, action in enumerate(row):
            kind = "B" if action.is_backward else action.kind
            for mb in action.microbatches:
                position[(kind, action.stage, mb)] = pos
        for pos, action in enumerate(row):
            needs = {"F": None, "B": "F", "BW": "F", "W": "B"}[action.kind]
            if needs is None:
                continue
            for mb in action.microbatches:
                before = position[(needs, action.stage, mb)]
                if before > pos:
                    raise ValueError(
                        f"{schedule.name}: rank {rank} position {pos}: {action} runs before "
                        f"{row[before]} (position {before}) which it needs"
                    )


def _walk(schedule: Schedule):
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            yield rank, pos, action
