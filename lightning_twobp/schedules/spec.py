"""The schedule registry: one :class:`ScheduleSpec` per schedule name, read by every consumer.

Everything the code knows about a schedule by its name lives in its spec: the builder, where its
stages go, the stage counts and micro-batch counts it accepts, whether it exists without the split,
the fused schedule it is compared with, whether consecutive steps overlap, and how much it holds.
The layout rules (:mod:`.placement`), ``build_schedule`` (:mod:`.registry`), the strategy, the
planner and the benchmarks read it; adding a schedule is one builder and one
:func:`register_schedule` call (the built-in ones are in :mod:`.catalog`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .ir import Schedule
from .simulate import Costs

__all__ = [
    "PLACEMENTS",
    "SCHEDULES",
    "BuildRequest",
    "MemoryClass",
    "ScheduleSpec",
    "register_schedule",
    "schedule_spec",
    "unregister_schedule",
]

# "one": stage s on rank s; "loop": s on s % p (GPipe, Megatron's interleaving); "v": s on s for
# s < p and 2p - 1 - s after (the Zero Bubble paper's V, §6), so rank 0 holds the first and last stage.
PLACEMENTS = ("one", "loop", "v")


@dataclass(frozen=True)
class BuildRequest:
    """What a builder is asked for; the arguments of ``build_schedule``, already checked.

    ``stage_to_rank`` is the spec's placement at these counts; ``max_pending_w`` the most
    micro-batches per stage whose W may wait after their B (None: no cap), one per stage.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stages_per_rank: int
    split_backward: bool
    costs: Costs
    stage_to_rank: tuple[int, ...]
    max_pending_w: tuple[int, ...] | None = None

    @property
    def num_ranks(self) -> int:
        return self.num_stages // self.stages_per_rank


Builder = Callable[[BuildRequest], Schedule]
# (name, num_stages, stages_per_rank, num_microbatches or None) -> None; raises ValueError saying what works.
LayoutCheck = Callable[[str, int, int, "int | None"], None]


@dataclass(frozen=True)
class MemoryClass:
    """How much a schedule holds: ``bound(p, m, stages_per_rank, split)`` is the most (stage,
    micro-batch) pairs any rank holds from F to their last B/W/BW (``simulate().peak_inflight``), and
    ``label`` says it in units of fused 1F1B's peak (p full-stage micro-batches on rank 0)."""

    label: str
    bound: Callable[[int, int, int, bool], int]


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything that depends on a schedule's name.

    ``stages_per_rank`` lists the counts it accepts (None: any); ``checks`` are further layout rules
    (:data:`LayoutCheck`), each raising a ValueError that says what would work. ``fused_baseline`` is
    the fused schedule a split-only one is compared with at the same stage count (None: itself with
    ``split_backward=False``). ``overlaps``: consecutive steps overlap by default (optimizer
    post-validation), because the schedule's bubble is only gone then. The default micro-batch count
    is ``microbatches_per_rank * p``.
    """

    name: str
    builder: Builder
    memory: MemoryClass
    placement: str = "one"
    stages_per_rank: tuple[int, ...] | None = (1,)
    default_stages_per_rank: int = 1
    split_only: bool = False
    fused_baseline: str | None = None
    overlaps: bool = False
    microbatches_per_rank: int = 2
    checks: tuple[LayoutCheck, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name.strip() != self.name:
            raise ValueError(f"a schedule name is a non-empty string without spaces around it, got {self.name!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"schedule {self.name!r}: placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "one" and self.stages_per_rank != (1,):
            raise ValueError(
                f"schedule {self.name!r}: placement 'one' holds exactly one stage per rank; "
                f"give stages_per_rank=(1,), not {self.stages_per_rank!r}"
            )
        if self.stages_per_rank is not None and self.default_stages_per_rank not in self.stages_per_rank:
            raise ValueError(
                f"schedule {self.name!r}: default_stages_per_rank={self.default_stages_per_rank} is not "
                f"among the accepted {self.stages_per_rank}"
            )
        if self.microbatches_per_rank < 1:
            raise ValueError(f"schedule {self.name!r}: microbatches_per_rank must be >= 1")

    def default_num_microbatches(self, num_ranks: int) -> int:
        return self.microbatches_per_rank * num_ranks


_REGISTRY: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec, *, replace: bool = False) -> ScheduleSpec:
    """Add ``spec`` under its name (``replace=True`` to overwrite one); returns it."""
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"register_schedule takes a ScheduleSpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"schedule {spec.name!r} is already registered: pick another name or pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_schedule(name: str) -> None:
    """Remove a registered schedule (a test's own variant, say)."""
    schedule_spec(name)
    del _REGISTRY[name]


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec registered under ``name``; ValueError naming the choices otherwise."""
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(_REGISTRY)}")
    return spec


class _Names(Sequence[str]):
    """The registered names, in registration order: a live view, so a schedule registered later is in it."""

    def __getitem__(self, index):  # type: ignore[override]
        return tuple(_REGISTRY)[index]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_REGISTRY))

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY

    def __repr__(self) -> str:
        return repr(tuple(_REGISTRY))


SCHEDULES: Sequence[str] = _Names()
