"""The schedule IR: what each pipeline rank computes, in which order, as plain data.

An :class:`Action` is one compute step on one stage for one micro-batch (or, for a
batched weight-gradient step, several micro-batches).  A :class:`Schedule` is one
ordered action list per rank.  Nothing here imports torch: an executor walks the
lists, a simulator (:mod:`.simulate`) times them, a lowering pass (:mod:`.comm`) adds
the point-to-point communication.

Action kinds follow the split-backward literature:

* ``F``  forward.
* ``B``  backward for the inputs only: 2BP's *backward-p1* (Cooper et al., "2BP:
  2-Stage Backpropagation", 2024), Zero Bubble's *B* (Qi et al., "Zero Bubble
  Pipeline Parallelism", ICLR 2024).  Only B is on the critical path between stages.
* ``W``  backward for the weights: 2BP's *backward-p2*, Zero Bubble's *W*.  It may
  cover several micro-batches at once (the 2BP paper batches p2 of all micro-batches;
  ``Stage.backward_weight`` accepts several ids).
* ``BW`` the usual fused backward (B and W together).

String forms copy ``torch.distributed.pipelining``'s action notation: ``"2F0"`` is
stage 2 forward of micro-batch 0, a batched W is written ``"1W0+1+2"``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("F", "B", "W", "BW")

# "BW" must be tried before "B", otherwise "1BW0" would parse as kind B.
_ACTION_RE = re.compile(r"^(\d+)(BW|F|B|W)(\d+(?:\+\d+)*)$")


@dataclass(frozen=True)
class Action:
    """One compute step: ``kind`` on ``stage`` for ``microbatch``.

    ``microbatch`` is an int, or for ``W`` only a sorted tuple of distinct
    micro-batches (a batched weight-gradient step); a 1-tuple is normalised to its
    int so that equal actions compare and hash equal.
    """

    kind: str
    stage: int
    microbatch: int | tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {KINDS}, got {self.kind!r}")
        if not _is_index(self.stage):
            raise ValueError(f"action stage must be an int >= 0, got {self.stage!r}")
        mb = self.microbatch
        if isinstance(mb, (tuple, list)):
            mbs = tuple(mb)
            if self.kind != "W":
                raise ValueError(
                    f"only W may cover several micro-batches; {self.kind} got {mbs!r}"
                )
            if not mbs or not all(_is_index(m) for m in mbs):
                raise ValueError(
                    f"a batched W needs one or more micro-batch ints >= 0, got {mbs!r}"
                )
            if list(mbs) != sorted(set(mbs)):
                raise ValueError(
                    f"a batched W lists distinct micro-batches in ascending order, got {mbs!r}"
                )
            object.__setattr__(self, "microbatch", mbs[0] if len(mbs) == 1 else mbs)
        elif not _is_index(mb):
            raise ValueError(f"action micro-batch must be an int >= 0, got {mb!r}")

    @property
    def microbatches(self) -> tuple[int, ...]:
        """The micro-batches this action covers, ascending."""
        mb = self.microbatch
        return mb if isinstance(mb, tuple) else (mb,)

    @property
    def is_backward(self) -> bool:
        """True for the actions that carry the gradient to the previous stage (B, BW)."""
        return self.kind in ("B", "BW")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'+'.join(str(m) for m in self.microbatches)}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("1W0+1+2") == Action("W", 1, (0, 1, 2))``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected STAGE KIND MB like '2F0', "
                "'0BW3' or '1W0+1+2'"
            )
        stage, kind, mbs = match.groups()
        parts = tuple(int(m) for m in mbs.split("+"))
        return cls(kind, int(stage), parts if len(parts) > 1 else parts[0])


def _is_index(value: object) -> bool:
    # bool is an int subclass; True as a stage index is always a bug.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Schedule:
    """One iteration of pipeline work: an ordered action list per rank.

    ``stage_to_rank[s]`` is the rank that holds stage ``s``; ``actions[r]`` is what
    rank ``r`` runs, in order.  ``split_backward`` says whether backward is written
    as ``B`` + ``W`` (True) or as fused ``BW`` (False).  Construction checks nothing
    beyond the field types; call :meth:`validate`.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    split_backward: bool

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples: the dataclass is frozen and
        # schedules are used as dict keys / compared by value.
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))

    @property
    def num_ranks(self) -> int:
        """Number of ranks, read off the stage-to-rank map."""
        return max(self.stage_to_rank) + 1 if self.stage_to_rank else 0

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks if self.num_ranks else 0

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages held by ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def validate(self) -> Schedule:
        """Check the schedule is complete, well placed, ordered and deadlock-free.

        Raises ``ValueError`` naming the rank, position and action at fault.
        Returns ``self`` so that generators can ``return schedule.validate()``.
        """
        self._validate_shape()
        self._validate_coverage()
        self._validate_local_order()
        # The cross-rank part: no deadlock of the computation (what the simulator computes),
        # and none of its lowered communication under blocking point-to-point semantics
        # (strict rendezvous, the NCCL worst case) with one posting order per rank pair.
        # Imported here because both modules import this one.
        from .comm import check_comm_deadlock, lower_communication
        from .simulate import DeadlockError, simulate

        try:
            simulate(self)
            check_comm_deadlock(lower_communication(self), self.stage_to_rank)
        except DeadlockError as err:
            raise ValueError(f"{self.name}: schedule deadlocks\n{err}") from err
        return self

    def _validate_shape(self) -> None:
        if self.num_stages < 1 or self.num_microbatches < 1:
            raise ValueError(
                f"{self.name}: need num_stages >= 1 and num_microbatches >= 1, got "
                f"{self.num_stages} and {self.num_microbatches}"
            )
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"{self.name}: stage_to_rank has {len(self.stage_to_rank)} entries for "
                f"{self.num_stages} stages"
            )
        if sorted(set(self.stage_to_rank)) != list(range(self.num_ranks)):
            raise ValueError(
                f"{self.name}: stage_to_rank {self.stage_to_rank} leaves a rank without stages"
            )
        if len(self.actions) != self.num_ranks:
            raise ValueError(
                f"{self.name}: {len(self.actions)} action lists for {self.num_ranks} ranks"
            )
        for rank, pos, action in self._walk():
            if not isinstance(action, Action):
                raise ValueError(
                    f"{self.name}: rank {rank} position {pos}: {action!r} is not an Action"
                )
            if action.stage >= self.num_stages:
                raise ValueError(
                    f"{self.name}: rank {rank} position {pos}: {action} names stage "
                    f"{action.stage} of {self.num_stages}"
                )
            if max(action.microbatches) >= self.num_microbatches:
                raise ValueError(
                    f"{self.name}: rank {rank} position {pos}: {action} names a micro-batch "
                    f"beyond {self.num_microbatches}"
                )
            if self.stage_to_rank[action.stage] != rank:
                raise ValueError(
                    f"{self.name}: rank {rank} position {pos}: {action} belongs on rank "
                    f"{self.stage_to_rank[action.stage]}, which holds stage {action.stage}"
                )
            fused = action.kind == "BW"
            if action.kind != "F" and fused == self.split_backward:
                want = "B and W" if self.split_backward else "BW"
                raise ValueError(
                    f"{self.name}: rank {rank} position {pos}: {action} in a schedule with "
                    f"split_backward={self.split_backward} (expects {want})"
                )

    def _validate_coverage(self) -> None:
        seen: dict[tuple[str, int, int], tuple[int, int]] = {}
        for rank, pos, action in self._walk():
            for mb in action.microbatches:
                key = (action.kind, action.stage, mb)
                if key in seen:
                    r0, p0 = seen[key]
                    raise ValueError(
                        f"{self.name}: rank {rank} position {pos}: {action} repeats "
                        f"{action.kind} of stage {action.stage} micro-batch {mb} "
                        f"(already at rank {r0} position {p0})"
                    )
                seen[key] = (rank, pos)
        kinds = ("F", "B", "W") if self.split_backward else ("F", "BW")
        for stage in range(self.num_stages):
            for mb in range(self.num_microbatches):
                missing = [k for k in kinds if (k, stage, mb) not in seen]
                if missing:
                    raise ValueError(
                        f"{self.name}: stage {stage} micro-batch {mb} has no "
                        f"{'/'.join(missing)} (rank {self.stage_to_rank[stage]})"
                    )

    def _validate_local_order(self) -> None:
        # F(s,m) < B/BW(s,m) < W covering (s,m), in list order on the owning rank.
        for rank, row in enumerate(self.actions):
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
                            f"{self.name}: rank {rank} position {pos}: {action} runs before "
                            f"{row[before]} (position {before}) which it needs"
                        )

    def _walk(self):
        for rank, row in enumerate(self.actions):
            for pos, action in enumerate(row):
                yield rank, pos, action

    def __str__(self) -> str:
        title = (
            f"{self.name}: {self.num_stages} stages on {self.num_ranks} ranks, "
            f"{self.num_microbatches} micro-batches, "
            f"{'split' if self.split_backward else 'fused'} backward"
        )
        return format_grid(title, [[str(a) for a in row] for row in self.actions])


def format_grid(title: str, rows: Sequence[Sequence[str]]) -> str:
    """Render one row per rank, one column per list position (used for deadlock reports too)."""
    steps = max((len(row) for row in rows), default=0)
    widths = [
        max([len(str(i))] + [len(row[i]) for row in rows if i < len(row)]) for i in range(steps)
    ]
    label = len(f"rank {max(len(rows) - 1, 0)}")
    header = " " * label + "  " + " ".join(f"{i:>{w}}" for i, w in enumerate(widths))
    lines = [title, header.rstrip()]
    for rank, row in enumerate(rows):
        cells = " ".join(f"{c:>{w}}" for c, w in zip(row, widths))
        lines.append(f"{f'rank {rank}':<{label}}  {cells}".rstrip())
    return "\n".join(lines)


def check_layout(name: str, num_stages: int, stages_per_rank: int) -> int:
    """Check a schedule name and its stage counts; return the number of ranks."""
    from .registry import SCHEDULES  # registry imports the generators, which import us

    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if not _is_index(num_stages) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if not _is_index(stages_per_rank) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be an int >= 1, got {stages_per_rank!r}")
    if num_stages % stages_per_rank:
        raise ValueError(
            f"num_stages={num_stages} is not a multiple of stages_per_rank={stages_per_rank}: "
            f"use {num_stages - num_stages % stages_per_rank or stages_per_rank} or "
            f"{num_stages + stages_per_rank - num_stages % stages_per_rank} stages"
        )
    return num_stages // stages_per_rank


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
        if stages_per_rank != 2:
            raise ValueError(
                f"zb-v needs stages_per_rank=2 (a V of 2 stages per rank); got "
                f"{stages_per_rank}: use build_schedule('zb-v', {2 * ranks}, m, "
                f"stages_per_rank=2) for {ranks} ranks"
            )
        return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages))
    return tuple(s % ranks for s in range(num_stages))
