"""``schedule="auto"``: the fastest predicted schedule whose predicted peak memory fits a limit.

The search is pure data (no torch): a :class:`Profile` holds what was measured per layer at each
candidate micro-batch count (F, B and W seconds, the bytes one micro-batch holds from F to B and from
B to W, each layer's fixed bytes) and the seconds of one message between stages. For every registered
schedule family, with and without the split where both exist, every micro-batch count ``m`` and every
deferral cap ``k`` (:mod:`.deferral`), the schedule is built at those costs, timed by
:func:`~.simulate.simulate` and its per-rank peak taken from the memory replay (:mod:`.memory`). The
choice is the shortest step among those whose peak is within the limit; when none is, the refusal
names the smallest peak that would fit. This is the search the Zero Bubble authors' controllable-memory
work (Qi et al., NeurIPS 2024, §4) runs by hand over V-Min / V-Half / ZB-V and their Megatron fork's
``--zero-bubble-max-pending-backward``, made one call.

Activation checkpointing is a third knob (``activation_checkpointing="auto"``): one profile per way the
layers run (plain, checkpointed), searched together (:func:`search_profiles`). A checkpointed candidate
saves less from F to B and takes longer in B (its recompute), so the fastest within the limit is a
checkpointed one only where nothing plain fits, or fits as fast. Its peak adds B's transient recompute
of one layer (``Profile.recompute``) on top of the rank's highest level: an upper bound, as the planner
counts it (``twobp-plan``), which adds it to the level before each B.

A fused schedule's backward is timed at the fused BW measured (``LayerCost.bw``), not at B + W: where
the split costs more than the backward it splits (ResNet's blocks on CPU: 1.49x), a split schedule
whose saved bubble does not pay for that loses to a fused one, as it does in training.

A step's time is the makespan of one iteration; for the schedules whose consecutive steps overlap
(``ScheduleSpec.overlaps``: the strategy's post-validation default) it is the steady-state period
of back-to-back iterations, what such a schedule costs per step in training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .fusion import fuse_where_split_loses, fused_note, num_fused
from .ir import Schedule
from .memo import remembered
from .memory import SIGNATURE_BYTES, MemoryCosts
from .placement import check_layout, schedule_label
from .registry import build_schedule
from .simulate import Costs, SimResult, simulate
from .spec import SCHEDULES, ScheduleSpec, schedule_spec

__all__ = [
    "AutoChoice",
    "Build",
    "BuildAll",
    "Candidate",
    "FuseAll",
    "LayerCost",
    "NoScheduleFits",
    "Profile",
    "StageCost",
    "choose",
    "choose_profiles",
    "format_choice",
    "fused_order",
    "fused_1f1b_peak",
    "builds",
    "resolve_limit",
    "search",
    "search_profiles",
    "size",
    "stage_cost",
    "with_recompute",
]

MiB = 2**20


def size(nbytes: float) -> str:
    """Bytes for people: ``512 B``, ``3.2 KiB``, ``1.5 MiB``, ``7.9 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class LayerCost:
    """One micro-batch through one layer: seconds of F, B and W; bytes saved by F until B
    (``activation``), held from B to W (``held``; ``graph_kept`` when W re-enters the autograd graph,
    which then stays whole), the bytes of its input when it saves it (``saved_input``), whether it saves
    its own output, the bytes it holds whatever the schedule (``fixed``: weights, gradients, ...; under
    ``data_parallel="shard"`` one replica's, ``lightning.autoschedule.sharded_fixed``), the
    bytes of its ``output`` and, of ``held``, those of its output's gradient (``grad_output_held``: W
    reads it, as a last Linear's weight gradient does) and of its input (``input_held``: a first
    Linear's), and the bytes of optimizer state its parameters will hold (``optimizer``: AdamW's two
    moments; fixed too, kept apart so that a refusal can name them); ``bw``: seconds of the fused
    backward (BW) of the same micro-batch, where measured; None means B + W (a split that costs nothing,
    what the search assumed before it timed BW); ``reduced``: the bytes of its gradients that the
    replicated data-parallel reduce copies into its buffer (0 without replicas; :class:`~.memory.MemoryCosts`);
    ``checked``: the bytes an optimizer step checked after it is taken (post-validation) holds through the
    next step for the layer: its gradients, and a copy of its weights and optimizer state where a clipped or
    skipped step may be put back (counted only in the schedules that check so: :attr:`Profile.checked_after`).
    ``output`` is what a message of it takes (the receive buffer is made to its shape); ``output_held`` what
    keeping the output holds (its storages: a view of a larger buffer holds all of it, as CPU's ``mse_loss``
    returns its scalar in a 256-byte one), where that differs (None: ``output``)."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0
    activation: float = 0.0
    held: float = 0.0
    graph_kept: bool = False
    saved_input: float = 0.0
    saves_output: bool = False
    fixed: float = 0.0
    output: float = 0.0
    grad_output_held: float = 0.0
    input_held: float = 0.0
    optimizer: float = 0.0
    bw: float | None = None
    output_held: float | None = None
    reduced: float = 0.0
    checked: float = 0.0

    @property
    def kept(self) -> float:
        """The bytes the output holds while the stage keeps it (``output_held``, or ``output``)."""
        return self.output if self.output_held is None else self.output_held


@dataclass(frozen=True)
class StageCost:
    """A run of layers as one stage (:func:`stage_cost`); ``message``, ``input_saved``, ``grad_held``,
    ``input_held``, ``output_kept`` and ``reduced`` as in :class:`~.memory.MemoryCosts`; ``fixed`` includes
    ``optimizer``; ``bw`` the fused backward's seconds (None: B + W, no layer's was measured)."""

    f: float
    b: float
    w: float
    activation: float
    held: float
    fixed: float
    graph_kept: bool
    message: float = 0.0
    input_saved: float = 0.0
    grad_held: float = 0.0
    input_held: float = 0.0
    output_kept: float = 0.0
    optimizer: float = 0.0
    bw: float | None = None
    reduced: float = 0.0
    checked: float = 0.0


def _fused(layers: Sequence[LayerCost]) -> float | None:
    """The layers' fused backward: each one's measured BW, B + W where one has none; None when none has."""
    if all(x.bw is None for x in layers):
        return None
    return sum(x.b + x.w if x.bw is None else x.bw for x in layers)


def stage_cost(layers: Sequence[LayerCost], first: bool) -> StageCost:
    """The layers ``layers`` as one stage.

    A tensor saved on both sides of a layer boundary (a ReLU's output, the next Linear's input) counts
    once. The stage keeps its output from F until B (autograd's root), so that counts too unless the
    last layer saves it anyway (``output_kept``: where the next stage is on another rank the executor
    drops it once sent, and the memory replay holds it as a message instead). A stage's graph is kept
    from B to W as soon as one layer needs it (one ``retain_graph`` for the stage), and then it holds
    its whole activation plus what W reads. The first stage, fed ids or images (no input gradient), runs
    its whole backward in B: its W costs nothing and it holds nothing from B to W. The stage's fused
    backward is its layers' measured BWs summed (``bw``; None when no layer has one).
    """
    if not layers:
        raise ValueError("stage_cost needs one layer at least")
    act = held = 0.0
    kept = prev_saves_output = False
    for layer in layers:
        act += layer.activation - (layer.saved_input if prev_saves_output else 0.0)
        held += layer.held
        kept = kept or layer.graph_kept
        prev_saves_output = layer.saves_output
    f = sum(x.f for x in layers)
    b = sum(x.b for x in layers)
    w = sum(x.w for x in layers)
    optimizer = sum(x.optimizer for x in layers)
    fixed = sum(x.fixed for x in layers) + optimizer
    reduced = sum(x.reduced for x in layers)
    checked = sum(x.checked for x in layers)
    last = layers[-1]
    kept_out = 0.0 if last.saves_output else last.kept
    act += kept_out
    bw = _fused(layers)
    if first:
        # B runs the stage's whole backward as one fused autograd call (Stage.backward_input with no
        # input to split off), so with BW measured the split costs nothing here: B is BW, W nothing.
        # Its layers after the first were timed split (each fed a float input), and their B + W is not
        # what this B pays. Without BW: B + W, as before.
        whole = b + w if bw is None else bw
        return StageCost(
            f,
            whole,
            0.0,
            act,
            0.0,
            fixed,
            False,
            last.output,
            output_kept=kept_out,
            optimizer=optimizer,
            bw=bw,
            reduced=reduced,
            checked=checked,
        )
    held += act if kept else 0.0
    first_layer = layers[0]
    return StageCost(
        f,
        b,
        w,
        act,
        held,
        fixed,
        kept,
        last.output,
        first_layer.saved_input,
        last.grad_output_held,
        first_layer.input_held,
        kept_out,
        optimizer,
        bw,
        reduced,
        checked,
    )


@dataclass(frozen=True)
class Profile:
    """What the search reads. ``layers[m]`` is every layer's :class:`LayerCost` at the micro-batch size
    of ``m`` micro-batches per step; ``partitions[v]`` the layers per stage with ``v`` stages per rank
    (``num_ranks * v`` stages); ``comm[m]`` the seconds of one message between stages at that size;
    ``loss[m]`` the loss on the last stage's output, one layer more of the last stage (what it saves
    from F to B: the logits' log-softmax, the targets), where it was measured. ``checkpointing``: how
    the layers ran when measured (``activation_checkpointing``'s value, None: plain), which every
    candidate of this profile carries; ``recompute[m]`` each layer's bytes B's recompute holds on top of
    what F saved (0 where a layer is not checkpointed; empty: not counted, see :func:`with_recompute`)."""

    num_ranks: int
    layers: Mapping[int, Sequence[LayerCost]]
    partitions: Mapping[int, Sequence[int]]
    comm: Mapping[int, float] = field(default_factory=dict)
    loss: Mapping[int, LayerCost] = field(default_factory=dict)
    checkpointing: str | int | None = None
    recompute: Mapping[int, Sequence[float]] = field(default_factory=dict)
    # whether optimizer steps are checked after they are taken (post-validation), holding the layers'
    # ``checked`` bytes through the next step: None where each family's default says (ScheduleSpec.overlaps)
    checked_after: bool | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("Profile.layers needs the layers' costs at one micro-batch count at least")
        for v, sizes in self.partitions.items():
            n = len(next(iter(self.layers.values())))
            if len(sizes) != self.num_ranks * v or sum(sizes) != n:
                raise ValueError(
                    f"Profile.partitions[{v}] = {tuple(sizes)}: give {self.num_ranks * v} stage sizes summing to the "
                    f"{n} layers"
                )

    @property
    def microbatch_counts(self) -> tuple[int, ...]:
        return tuple(sorted(self.layers))

    def stages(self, m: int, stages_per_rank: int) -> tuple[StageCost, ...]:
        """Each stage's costs at ``m`` micro-batches, ``stages_per_rank`` stages per rank."""
        layers, out, start = self.layers[m], [], 0
        sizes = self.partitions[stages_per_rank]
        for s, n in enumerate(sizes):
            loss = [self.loss[m]] if s == len(sizes) - 1 and m in self.loss else []
            out.append(stage_cost([*layers[start : start + n], *loss], first=s == 0))
            start += n
        return tuple(out)

    def costs(self, m: int, stages_per_rank: int) -> Costs:
        """The schedule model's :class:`~.simulate.Costs` (with :class:`~.memory.MemoryCosts`)."""
        st = self.stages(m, stages_per_rank)
        fixed = [s.fixed for s in st]
        if self.num_ranks > 1:  # stage 0's rank holds the step's signature from the step's start to its end
            fixed[0] += SIGNATURE_BYTES
        memory = MemoryCosts(
            activation=[s.activation for s in st],
            held=[s.held for s in st],
            fixed=fixed,
            message=[s.message for s in st],
            input_saved=[s.input_saved for s in st],
            grad_held=[s.grad_held for s in st],
            input_held=[s.input_held for s in st],
            output_kept=[s.output_kept for s in st],
            reduced=[s.reduced for s in st],
        )
        # a stage without a measured BW (none of its layers has one) is priced as B + W, as before
        bw = None if all(s.bw is None for s in st) else [s.b + s.w if s.bw is None else s.bw for s in st]
        return Costs(
            f=[s.f for s in st],
            b=[s.b for s in st],
            w=[s.w for s in st],
            comm=self.comm.get(m, 0.0),
            memory=memory,
            bw=bw,
        )


@dataclass(frozen=True)
class Candidate:
    """One point of the search: a schedule at ``num_microbatches`` with a deferral cap (None: none),
    its predicted seconds per step and peak bytes per rank (of those, ``optimizer_bytes`` per rank are
    the optimizer's state), with the layers checkpointed as ``checkpointing`` says (None: plain)."""

    name: str
    split_backward: bool
    num_microbatches: int
    stages_per_rank: int
    max_pending_w: int | None
    step_time: float
    peak_bytes: tuple[float, ...]
    schedule: Schedule = field(repr=False, compare=False)
    sim: SimResult = field(repr=False, compare=False)
    optimizer_bytes: tuple[float, ...] = ()
    checkpointing: str | int | None = None
    costs: Costs | None = field(default=None, repr=False, compare=False)  # the durations it was built and timed at
    recompute: tuple[float, ...] = field(default=(), repr=False, compare=False)  # each stage's B recompute bytes

    @property
    def fused(self) -> int:
        """The (stage, micro-batch) backwards its split schedule runs fused (:mod:`.fusion`)."""
        return num_fused(self.schedule)

    @property
    def peak(self) -> float:
        return max(self.peak_bytes)

    @property
    def fullest(self) -> int:
        """The rank whose peak is :attr:`peak`."""
        return self.peak_bytes.index(self.peak)

    def optimizer_note(self) -> str:
        """``", of which 1.2 MiB optimizer state"`` on the fullest rank, or nothing without any."""
        if not self.optimizer_bytes or not self.optimizer_bytes[self.fullest]:
            return ""
        opt = self.optimizer_bytes[self.fullest]
        return f", of which {opt:.0f} bytes ({size(opt)}) optimizer state on rank {self.fullest}"

    @property
    def label(self) -> str:
        cap = "" if self.max_pending_w is None else f", max_pending_w={self.max_pending_w}"
        ac = "" if self.checkpointing is None else f", activation_checkpointing={self.checkpointing!r}"
        note = fused_note(self.schedule)
        fused = f", {note}" if note else ""
        return f"{schedule_label(self.name, self.split_backward)} (m={self.num_microbatches}{cap}{ac}{fused})"


@dataclass(frozen=True)
class AutoChoice:
    """The search's answer: ``best`` within ``limit`` bytes per device, and everything it weighed."""

    best: Candidate
    limit: float
    considered: tuple[Candidate, ...] = field(repr=False)

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.considered if c.peak <= self.limit)


class NoScheduleFits(ValueError):
    """No candidate's predicted peak is within the limit; ``smallest`` is the one that holds least."""

    def __init__(self, message: str, smallest: Candidate) -> None:
        super().__init__(message)
        self.smallest = smallest


def _options(name: str, split: bool | None) -> tuple[bool, ...]:
    spec = schedule_spec(name)
    both = (True,) if spec.split_only else (True, False)
    return both if split is None else tuple(s for s in both if s == split)


@dataclass(frozen=True)
class Build:
    """One schedule the search builds: :func:`build_schedule`'s arguments."""

    name: str
    num_stages: int
    num_microbatches: int
    stages_per_rank: int
    split_backward: bool
    costs: Costs
    max_pending_w: int | None

    def run(self) -> Schedule | None:
        """The schedule; None where the family refuses these counts (its layout rules)."""
        try:
            return build_schedule(
                self.name,
                self.num_stages,
                self.num_microbatches,
                stages_per_rank=self.stages_per_rank,
                split_backward=self.split_backward,
                costs=self.costs,
                max_pending_w=self.max_pending_w,
            )
        except ValueError:
            return None


# Each Build's schedule, in order (:func:`search`'s ``build_all``): one after the other by default; the
# strategy shares them out over its ranks (lightning/search_builds.py), the expensive part of a search.
BuildAll = Callable[[Sequence[Build]], Sequence[Schedule | None]]
# Each candidate's order fused where its split loses (:func:`fused_order`), in order (:func:`choose`'s
# ``fuse_all``): the same sharing as the builds'.
FuseAll = Callable[[Sequence["Candidate"]], Sequence[Schedule]]


def builds(
    profile: Profile,
    families: Iterable[str] | None = None,
    microbatches: Iterable[int] | None = None,
    split_backward: bool | None = None,
    max_caps: int | None = None,
) -> tuple[Build, ...]:
    """What :func:`search` builds (the same arguments), in its order: per family, count, split and cap. Not a cap
    at or above the family's ``MemoryClass.bound``: a rank holds no more pairs from F to W, so no stage has more
    W waiting, and the order built under such a cap is the uncapped one."""
    names = tuple(SCHEDULES) if families is None else tuple(families)
    counts = profile.microbatch_counts if microbatches is None else tuple(microbatches)
    out: list[Build] = []
    for name in names:
        spec = schedule_spec(name)
        v = spec.default_stages_per_rank
        if v not in profile.partitions:
            continue
        for m in counts:
            costs = profile.costs(m, v)
            for split in _options(name, split_backward):
                # a stage never has more W waiting than its rank holds pairs from F to W (the family's memory
                # bound), so a cap at or above it changes nothing: built, it would be the uncapped order again
                held = spec.memory.bound(profile.num_ranks, m, v, split)
                top = min(m, held) if max_caps is None else min(m, held, max_caps + 1)
                caps = (None, *range(top)) if split else (None,)
                out += [Build(name, profile.num_ranks * v, m, v, split, costs, k) for k in caps]
    return tuple(out)


def search(
    profile: Profile,
    families: Iterable[str] | None = None,
    microbatches: Iterable[int] | None = None,
    split_backward: bool | None = None,
    max_caps: int | None = None,
    build_all: BuildAll | None = None,
) -> tuple[Candidate, ...]:
    """Every (family, split, m, cap) the profile allows, built, timed and replayed.

    ``families`` (default: every registered schedule whose default stages per rank the profile has a
    partition for), ``microbatches`` (default: the profile's counts), ``split_backward`` (None: both
    where both exist). Caps run from 0 to ``m - 1`` (``m`` and above change nothing), or to ``max_caps``,
    and below the family's memory bound (:func:`builds`); a cap that leaves the order unchanged is not listed
    twice. Combinations a schedule refuses (its layout rules) are skipped. ``build_all`` makes the schedules
    of :func:`builds` (default: each in turn); the same schedules whoever builds them, so the same candidates.
    """
    requests = builds(profile, families, microbatches, split_backward, max_caps)
    with remembered():  # the builds' repeated steps reused, for this search only (.memo)
        made = build_all(requests) if build_all is not None else [b.run() for b in requests]
    out: list[Candidate] = []
    seen: set[tuple] = set()
    for b, schedule in zip(requests, made, strict=True):
        key = (b.name, b.num_microbatches, b.split_backward, schedule.actions if schedule is not None else None)
        if schedule is None or key in seen:
            continue
        seen.add(key)
        out.append(_candidate(profile, b, schedule))
    return tuple(out)


def _candidate(profile: Profile, b: Build, schedule: Schedule) -> Candidate:
    """``schedule``, built as ``b`` asked, timed and replayed at ``b``'s costs."""
    spec, m, v = schedule_spec(b.name), b.num_microbatches, b.stages_per_rank
    sim = simulate(schedule, b.costs, iterations=_iterations(spec))
    opt = _per_rank(schedule, profile.stages(m, v))
    rec = _stage_recompute(profile, m, v, b.split_backward)
    peak = _plus_recompute(sim.peak_bytes, schedule, rec)
    if spec.overlaps if profile.checked_after is None else profile.checked_after:
        stages = profile.stages(m, v)
        peak = tuple(p + sum(stages[s].checked for s in schedule.stages_of(r)) for r, p in enumerate(peak))
    step = _step(spec, sim)
    return Candidate(
        b.name,
        b.split_backward,
        m,
        v,
        b.max_pending_w,
        step,
        peak,
        schedule,
        sim,
        opt,
        profile.checkpointing,
        b.costs,
        rec,
    )


def _iterations(spec: ScheduleSpec) -> int:
    return 2 if spec.overlaps else 1


def _step(spec: ScheduleSpec, sim: SimResult) -> float:
    """A step's predicted time: the steady period where steps overlap, else one step's makespan."""
    return sim.period if spec.overlaps else sim.makespan


def search_profiles(profiles: Iterable[Profile], **options: Any) -> tuple[Candidate, ...]:
    """:func:`search` over each profile (one per way the layers run: plain, checkpointed), as one list:
    :func:`choose` then weighs them together."""
    return tuple(c for profile in profiles for c in search(profile, **options))


def choose_profiles(
    profile_of: Callable[[str | int | None], Profile | None],
    modes: Sequence[str | int | None],
    limit_of: Callable[[Profile], float],
    hint_of: Callable[[], Profile | None] | None = None,
    fuse_all: FuseAll | None = None,
    **options: Any,
) -> tuple[AutoChoice, Profile]:
    """The choice over the layers run each way of ``modes`` (``profile_of(mode)`` measures them; None: they
    cannot run that way, which is left out), and the profile it was made on. The checkpointed profiles take
    their recompute bytes from the plain one (:func:`with_recompute`); the limit is ``limit_of`` the first
    profile; ``options`` go to :func:`search`. When only plain layers were weighed and nothing fits,
    ``hint_of()`` (the layers checkpointed "full"; None: not known) lets the refusal say what checkpointing
    would hold. ``fuse_all``: as :func:`choose`'s."""
    measured = [profile_of(mode) for mode in modes]
    profiles = _recomputed([p for p in measured if p is not None])
    if not profiles:
        raise ValueError(f"none of the ways {tuple(modes)} to run the layers could be measured")
    limit = limit_of(profiles[0])
    candidates = search_profiles(profiles, **options)
    families = options.get("families")
    if not candidates and families is not None:
        raise ValueError(_none_built(families, profiles[0], options.get("microbatches")))
    unsearched: tuple[Candidate, ...] = ()
    if tuple(modes) == (None,) and hint_of is not None and all(c.peak > limit for c in candidates):
        full = hint_of()
        unsearched = () if full is None else search(with_recompute(full, profiles[0]), **options)
    try:
        choice = choose(candidates, limit, unsearched, fuse_all)
    except NoScheduleFits as e:
        if families is None:
            raise
        raise NoScheduleFits(
            f"schedule='auto' among {list(families)!r}: {e}; or add schedules to auto_schedules (or drop it: then "
            f"every schedule is weighed)",
            e.smallest,
        ) from None
    return choice, next(p for p in profiles if p.checkpointing == choice.best.checkpointing)


def _none_built(families: Sequence[str], profile: Profile, microbatches: Iterable[int] | None) -> str:
    """Why none of ``families`` gave a candidate on ``profile``: no cut of the layers into its stages, or a
    layout that refuses every micro-batch count."""
    counts = list(microbatches or profile.microbatch_counts)
    why = []
    for name in families:
        v = schedule_spec(name).default_stages_per_rank
        if v not in profile.partitions:
            why.append(
                f"{name}: its {profile.num_ranks * v} stages could not be cut from the layers (too few, or a "
                f"balance list of another length)"
            )
        else:
            why.append(f"{name}: refuses m = {', '.join(map(str, counts))} on {profile.num_ranks} ranks")
    return (
        f"schedule='auto' among {list(families)!r} has no candidate ({'; '.join(why)}; docs/schedules.md lists each "
        f"schedule's rules): add a schedule to auto_schedules, or change the pipeline"
    )


def _recomputed(profiles: list[Profile]) -> list[Profile]:
    """The checkpointed profiles with their layers' recompute bytes, where a plain profile gives them."""
    plain = next((p for p in profiles if p.checkpointing is None), None)
    if plain is None:
        return profiles
    return [p if p.checkpointing is None else with_recompute(p, plain) for p in profiles]


def with_recompute(checkpointed: Profile, plain: Profile) -> Profile:
    """``checkpointed`` with each layer's recompute bytes: what the same layer saves run plain, less what
    it saves checkpointed (its input), at each micro-batch count both profiles hold."""
    recompute = {
        m: tuple(max(0.0, p.activation - c.activation) for p, c in zip(plain.layers[m], rows, strict=True))
        for m, rows in checkpointed.layers.items()
        if m in plain.layers
    }
    return replace(checkpointed, recompute=recompute)


def _stage_recompute(profile: Profile, m: int, v: int, split: bool) -> tuple[float, ...]:
    """The most each stage's B (or fused BW) holds at once while it recomputes its layers, one at a time
    from the last: a layer's recompute plus, under the split, what B has already made for the W of the
    checkpointed layers after it (their ``held``). The first stage's B is a plain backward (no input
    gradient): one layer's recompute at a time. All zero without ``profile.recompute[m]``."""
    sizes = profile.partitions[v]
    extras = profile.recompute.get(m)
    if not extras:
        return (0.0,) * len(sizes)
    out, start = [], 0
    for s, n in enumerate(sizes):
        pairs = [
            (e, c.held) for e, c in zip(extras[start : start + n], profile.layers[m][start : start + n], strict=True)
        ]
        most = made = 0.0
        for extra, kept_for_w in reversed(pairs):
            if extra:
                most = max(most, made + extra if split and s > 0 else extra)
                made += kept_for_w
        out.append(most)
        start += n
    return tuple(out)


def _plus_recompute(peaks: tuple[float, ...], schedule: Schedule, stages: Sequence[float]) -> tuple[float, ...]:
    """Each rank's peak plus the largest recompute of its stages: on top of its highest level, an upper
    bound on what it holds while a B recomputes."""
    return tuple(p + max((stages[s] for s in schedule.stages_of(r)), default=0.0) for r, p in enumerate(peaks))


def _per_rank(schedule: Schedule, stages: Sequence[StageCost]) -> tuple[float, ...]:
    """Each rank's optimizer-state bytes: those of the stages it holds."""
    return tuple(sum(stages[s].optimizer for s in schedule.stages_of(r)) for r in range(schedule.num_ranks))


def check_families(
    families: Sequence[str] | None,
    num_layers: int,
    num_ranks: int,
    counts: Sequence[int] | None = None,
    balance: Any = None,
    split_backward: bool = True,
) -> dict[str, str]:
    """Which of ``families`` (``auto_schedules``) cannot run here, and why: more stages than ``num_layers``
    layers on ``num_ranks`` ranks (a V needs two per rank), a ``balance`` list of another length, or layout
    rules that refuse every micro-batch count of ``counts`` (interleaved 1F1B: a multiple of the ranks).
    ValueError when none can, naming each one's reason and the schedules that would run (with
    ``split_backward``); said before any layer is profiled. The search's own refusals after the profile
    remain the last word."""
    if families is None:
        return {}
    why = {name: _cannot_run(name, num_layers, num_ranks, counts, balance) for name in families}
    cannot = {k: v for k, v in why.items() if v is not None}
    if len(cannot) < len(why):
        return cannot
    would = [
        n
        for n in SCHEDULES
        if n not in why
        and (split_backward or not schedule_spec(n).split_only)
        and _cannot_run(n, num_layers, num_ranks, counts, balance) is None
    ]
    raise ValueError(
        f"auto_schedules={list(families)!r}: none can run here: "
        + "; ".join(f"{k} {v}" for k, v in cannot.items())
        + ". "
        + (f"Add one of {', '.join(would)}, " if would else "")
        + "or change the pipeline (fewer ranks, more layers, another balance or num_microbatches)"
    )


def _cannot_run(
    name: str, num_layers: int, num_ranks: int, counts: Sequence[int] | None, balance: Any = None
) -> str | None:
    """Why schedule ``name`` cannot run ``num_layers`` layers on ``num_ranks`` ranks at any of ``counts``
    (``balance``: a list of layers per stage, or a rule); None when it can."""
    stages = num_ranks * schedule_spec(name).default_stages_per_rank
    if stages > num_layers:
        return f"needs {stages} stages on {num_ranks} ranks, and the pipeline has {num_layers} layers"
    if not isinstance(balance, (str, type(None))) and len(balance) != stages:
        return f"needs {stages} stages on {num_ranks} ranks, and balance={list(balance)} cuts {len(balance)}"
    refusals = []
    for m in counts or (None,):
        try:
            check_layout(name, stages, stages // num_ranks, m)
        except ValueError as e:
            refusals.append(str(e))
            continue
        return None
    return f"refuses m = {', '.join(map(str, counts))} ({refusals[0]})" if counts else refusals[0]


def check_auto_options(memory_limit: Any, stages_per_rank: Any, max_pending_w: Any) -> None:
    """What ``schedule="auto"`` takes, checked at construction: a limit of a form
    :func:`~lightning_twobp.schedules.auto.resolve_limit` reads, and none of the options it chooses."""
    if memory_limit is None:
        raise ValueError(
            "schedule='auto' picks the fastest schedule within memory_limit: give memory_limit (bytes per device, "
            "e.g. 8e9; a fraction of the device's memory, e.g. 0.5; or '1f1b' for fused 1F1B's peak)"
        )
    resolve_limit(memory_limit, 1.0, 1.0)  # the form only; the numbers are known at setup
    for name, value in (("stages_per_rank", stages_per_rank), ("max_pending_w", max_pending_w)):
        if value is not None:
            raise ValueError(
                f"schedule='auto' chooses {name} itself; got {name}={value!r}: drop it, or name a schedule "
                f"(e.g. schedule='1f1b', {name}={value!r})"
            )


_FEWEST_BYTES = 1000  # a limit in bytes below this is refused as meant another way (memory_limit=1.5)


def resolve_limit(memory_limit: float | str, device_bytes: float | None, fused_1f1b_peak: float | None) -> float:
    """``memory_limit`` in bytes per device: a number of 1000 or more is bytes; one in (0, 1] a fraction of
    ``device_bytes``; ``"1f1b"`` fused 1F1B's predicted peak, ``"<x>x1f1b"`` (``"0.5x1f1b"``) x times it."""
    if isinstance(memory_limit, str):
        text = memory_limit.strip().lower()
        scale = 1.0
        if text.endswith("x1f1b"):
            try:
                scale = float(text[: -len("x1f1b")])
            except ValueError:
                scale = -1.0
            text = "1f1b"
        if text == "1f1b" and scale > 0 and math.isfinite(scale):
            if fused_1f1b_peak is None:
                raise ValueError(f"memory_limit={memory_limit!r} needs fused 1F1B's predicted peak, which is unknown")
            return scale * fused_1f1b_peak
    elif not isinstance(memory_limit, bool) and isinstance(memory_limit, (int, float)) and memory_limit > 0:
        if memory_limit >= _FEWEST_BYTES:
            return float(memory_limit)
        if memory_limit > 1:  # no model fits in so few bytes: a multiple of something, meant another way
            x = f"{float(memory_limit):g}"
            raise ValueError(
                f"memory_limit={x} would be {x} bytes per device (bytes are a number of {_FEWEST_BYTES} or more, "
                f"e.g. 8e9): for {x} times fused 1F1B's peak write memory_limit='{x}x1f1b'; a fraction of the "
                f"device's memory is a number in (0, 1], e.g. 0.5"
            )
        if device_bytes is None:
            raise ValueError(
                f"memory_limit={memory_limit!r} is a fraction of the device's memory, which is unknown here: "
                f"give bytes (e.g. memory_limit=8e9)"
            )
        return memory_limit * device_bytes
    raise ValueError(
        f"memory_limit={memory_limit!r}: give bytes per device (a number >= {_FEWEST_BYTES}, e.g. 8e9), a fraction of "
        f"the device's memory (0 < x <= 1, e.g. 0.5), '1f1b' for fused 1F1B's peak or e.g. '0.5x1f1b' for a multiple"
    )


def fused_1f1b_peak(profile: Profile) -> float | None:
    """Fused 1F1B's predicted peak (the most any rank holds) at its default m, or the nearest count
    profiled: what ``memory_limit="1f1b"`` means. None without a one-stage-per-rank partition."""
    if 1 not in profile.partitions:
        return None
    want = 2 * profile.num_ranks  # the 2BP paper's 1F1B-2, every schedule's default
    m = min(profile.microbatch_counts, key=lambda c: (abs(c - want), -c))
    schedule = build_schedule("1f1b", profile.num_ranks, m, split_backward=False)
    return max(simulate(schedule, profile.costs(m, 1)).peak_bytes)


def choose(
    candidates: Sequence[Candidate], limit: float, unsearched: Sequence[Candidate] = (), fuse_all: FuseAll | None = None
) -> AutoChoice:
    """The fastest candidate whose peak is within ``limit``, among ``candidates`` and each split one's variant
    fused where its split loses (:func:`_fusions`; ties: the smaller peak, then the order of ``candidates``,
    the variants after them); :class:`NoScheduleFits` naming the smallest peak when none is. ``unsearched``: the
    candidates with checkpointed layers when the user's ``activation_checkpointing`` did not allow them
    (None), never chosen: a refusal says what they would hold. ``fuse_all`` makes the variants' orders
    (:func:`fused_order` of each; default: each in turn)."""
    if not candidates:
        raise ValueError("schedule='auto' has no candidate: no schedule accepts these stage and micro-batch counts")
    candidates = (*candidates, *_fusions(candidates, fuse_all))
    fits = [c for c in candidates if c.peak <= limit]
    if not fits:
        smallest = min(candidates, key=lambda c: (c.peak, c.step_time))
        hint = _checkpointing_hint(candidates, unsearched, limit)
        raise NoScheduleFits(
            f"memory_limit={limit:.0f} bytes ({size(limit)}) per device: no schedule fits; the smallest "
            f"predicted peak is {smallest.peak:.0f} bytes ({size(smallest.peak)}){smallest.optimizer_note()}, "
            f"{smallest.label}. "
            f"Raise memory_limit to at least {math.ceil(smallest.peak)} bytes, or use more pipeline ranks or "
            f"smaller micro-batches (a larger batch divides into more){hint}",
            smallest,
        )
    best = min(fits, key=lambda c: (c.step_time, c.peak))
    return AutoChoice(best, limit, tuple(candidates))


def _fusions(candidates: Sequence[Candidate], fuse_all: FuseAll | None = None) -> list[Candidate]:
    """The split candidates with their backward fused where the split loses (:mod:`.fusion`), each a
    candidate of its own. Every one is built: no cheap bound holds (a fusion can take a whole W off the
    critical path, not only its ``b + w - bw``; a reviewer's random costs found a pruned variant 23x past
    such a bound). At p = 4 with five micro-batch counts that adds up to about the search's own time."""
    split = [c for c in candidates if c.split_backward and _priced(c)]
    orders = fuse_all(split) if fuse_all is not None else [fused_order(c) for c in split]
    variants = (_fused_variant(c, order) for c, order in zip(split, orders, strict=True))
    return [v for v in variants if v is not None]


def _priced(c: Candidate) -> bool:
    return c.costs is not None and c.costs.bw is not None


def fused_order(c: Candidate) -> Schedule:
    """``c``'s order with each backward fused where its split does not pay at ``c``'s costs (:mod:`.fusion`)."""
    assert c.costs is not None
    spec = schedule_spec(c.name)
    return fuse_where_split_loses(c.schedule, c.costs, lambda sim: _step(spec, sim), _iterations(spec))


def _fused_variant(c: Candidate, schedule: Schedule) -> Candidate | None:
    """``c`` run as ``schedule`` (its :func:`fused_order`), timed and replayed; None where nothing is fused."""
    if not num_fused(schedule):
        return None
    spec = schedule_spec(c.name)
    sim = simulate(schedule, c.costs, iterations=_iterations(spec))
    peak = _plus_recompute(sim.peak_bytes, schedule, c.recompute) if c.recompute else sim.peak_bytes
    return replace(c, step_time=_step(spec, sim), peak_bytes=peak, schedule=schedule, sim=sim)


def _checkpointing_hint(candidates: Sequence[Candidate], unsearched: Sequence[Candidate], limit: float) -> str:
    """A refusal's last words on activation checkpointing: nothing when the search weighed it already; the
    smallest peak with checkpointed layers when it is known (``unsearched``); else the option to try."""
    if any(c.checkpointing is not None for c in candidates):
        return ""
    if not unsearched:
        return (
            ", or let schedule='auto' checkpoint the blocks where nothing fits without: activation_checkpointing='auto'"
        )
    ac = min(unsearched, key=lambda c: (c.peak, c.step_time))
    known = f"{ac.peak:.0f} bytes ({size(ac.peak)}), {ac.label}"
    if ac.peak <= limit:
        return (
            f". With checkpointed blocks it would fit: the smallest predicted peak is then {known}; pass "
            f"activation_checkpointing='auto' to let schedule='auto' checkpoint them where nothing fits without"
        )
    return f". Checkpointed blocks would not fit either: the smallest predicted peak is then {known}"


def format_choice(
    choice: AutoChoice, max_actions: int = 64, unit: str = "s", families: Sequence[str] | None = None
) -> str:
    """The choice, the runners-up, and the chosen schedule's simulated timeline (rank: action@start);
    times in ``unit`` (seconds when measured); ``families``: the schedules it was made among (None: all)."""
    best = choice.best
    among = "" if families is None else f" among {', '.join(families)}"
    lines = [
        f"schedule='auto'{among}: {best.label}, predicted {best.step_time:.4g} {unit} per step, peak "
        f"{', '.join(size(b) for b in best.peak_bytes)} per rank{best.optimizer_note()} (limit {size(choice.limit)}); "
        f"{len(choice.fitting)} of {len(choice.considered)} candidates fit",
    ]
    others = sorted((c for c in choice.fitting if c is not best), key=lambda c: (c.step_time, c.peak))[:3]
    lines += [f"  next: {c.label}: {c.step_time:.4g} {unit}, peak {size(c.peak)}" for c in others]
    lines += _split_price(choice, unit)
    first = best.sim.iteration_ends[0]
    lines.append(f"simulated timeline ({unit}), {first:.4g} for the first step:")
    for rank in range(best.schedule.num_ranks):
        # the first step's actions: the timeline holds two steps for the schedules that overlap them
        n = min(max_actions, len(best.schedule.actions[rank]))
        row = [f"{a}@{start:.3g}" for r, a, start, _ in best.sim.timeline if r == rank][:n]
        lines.append(f"  rank {rank}: " + " ".join(row))
    return "\n".join(lines)


def _split_price(choice: AutoChoice, unit: str) -> list[str]:
    """One line when a fused schedule won over split ones that fit: the split's measured (B + W) / BW
    on the stages that split (the first one's B is its whole backward), and the fastest split's step."""
    best = choice.best
    splits = [c for c in choice.fitting if c.split_backward]
    costs = best.costs
    stages = range(1, best.schedule.num_stages)
    if best.split_backward or not splits or costs is None or costs.bw is None or not stages:
        return []
    fused = sum(costs.of("BW", s) for s in stages)
    if fused <= 0:
        return []
    ratio = sum(costs.of("B", s) + costs.of("W", s) for s in stages) / fused
    rival = min(splits, key=lambda c: (c.step_time, c.peak))
    where = "stage 1" if len(stages) == 1 else f"stages 1-{stages[-1]}"
    return [
        f"  fused, not split: the split's measured (B + W) / BW is {ratio:.3g} on {where}; "
        f"the fastest split, {rival.label}, {rival.step_time:.4g} {unit}"
    ]
