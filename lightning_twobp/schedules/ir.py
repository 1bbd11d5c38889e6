"""The schedule IR: what each pipeline rank computes, in which order, as plain data.

An :class:`Action` is one compute step on one stage for one micro-batch (or, for a
batched weight-gradient step, several micro-batches).  A :class:`Schedule` is one
ordered action list per rank.  Nothing here imports torch: an executor walks the
lists, a simulator (:mod:`.simulate`) times them, a lowering pass (:mod:`.comm`) adds
the point-to-point communication.

Action kinds follow the split-backward literature:

* ``F``  forward.
* ``B``  backward for the inputs only: 2BP's *backward-p1* (Rae, Lee and Richings, "2BP:
  2-Stage Backpropagation", 2024), Zero Bubble's *B* (Qi et al., "Zero Bubble
  Pipeline Parallelism", ICLR 2024).  Only B is on the critical path between stages.
* ``W``  backward for the weights: 2BP's *backward-p2*, Zero Bubble's *W*.  It may
  cover several micro-batches at once (the 2BP paper batches p2 of all micro-batches;
  ``Stage.backward_weight`` accepts several ids).
* ``BW`` the usual fused backward (B and W together).

This module is data only: the passes (:mod:`.lower`, :mod:`.grad_reduce`), the checks
(:mod:`.validate`) and the timing (:mod:`.simulate`) import it, never the reverse.

String forms copy ``torch.distributed.pipelining``'s action notation: ``"2F0"`` is
stage 2 forward of micro-batch 0, a batched W is written ``"1W0+1+2"``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

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
        if not is_index(self.stage):
            raise ValueError(f"action stage must be an int >= 0, got {self.stage!r}")
        mb = self.microbatch
        if isinstance(mb, (tuple, list)):
            mbs = tuple(mb)
            if self.kind != "W":
                raise ValueError(f"only W may cover several micro-batches; {self.kind} got {mbs!r}")
            if not mbs or not all(is_index(m) for m in mbs):
                raise ValueError(f"a batched W needs one or more micro-batch ints >= 0, got {mbs!r}")
            if list(mbs) != sorted(set(mbs)):
                raise ValueError(f"a batched W lists distinct micro-batches in ascending order, got {mbs!r}")
            object.__setattr__(self, "microbatch", mbs[0] if len(mbs) == 1 else mbs)
        elif not is_index(mb):
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
            raise ValueError(f"cannot parse action {text!r}: expected STAGE KIND MB like '2F0', '0BW3' or '1W0+1+2'")
        stage, kind, mbs = match.groups()
        parts = tuple(int(m) for m in mbs.split("+"))
        return cls(kind, int(stage), parts if len(parts) > 1 else parts[0])


class DeadlockError(RuntimeError):
    """A schedule (or its lowered communication) cannot make progress."""


def is_index(value: object) -> TypeGuard[int]:
    # bool is an int subclass; True as a stage index is always a bug.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Schedule:
    """One iteration of pipeline work: an ordered action list per rank.

    ``stage_to_rank[s]`` is the rank that holds stage ``s``; ``actions[r]`` is what
    rank ``r`` runs, in order.  ``split_backward`` says whether backward is written
    as ``B`` + ``W`` (True) or as fused ``BW`` (False).  Construction checks nothing
    beyond the field types; :func:`~.validate.validate` checks the rest.
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

    @property
    def joins_w(self) -> bool:
        """Whether some action runs the W of several micro-batches of a stage at once (what batched W
        joins: GPipe's and 1F1B's W at the end of a step; never the ZB and V schedules')."""
        return any(a.kind == "W" and len(a.microbatches) > 1 for row in self.actions for a in row)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages held by ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

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
    widths = [max([len(str(i))] + [len(row[i]) for row in rows if i < len(row)]) for i in range(steps)]
    label = len(f"rank {max(len(rows) - 1, 0)}")
    header = " " * label + "  " + " ".join(f"{i:>{w}}" for i, w in enumerate(widths))
    lines = [title, header.rstrip()]
    for rank, row in enumerate(rows):
        cells = " ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=False))
        lines.append(f"{f'rank {rank}':<{label}}  {cells}".rstrip())
    return "\n".join(lines)
