"""The pipeline's options, in one place: :class:`PipelineOptions` holds every option of
``TwoBPStrategy`` that is not Lightning's, checks them when it is made (before any process starts or
any compute runs) and derives the defaults. ``TwoBPStrategy``, ``twobp-plan`` and the Hydra
``strategy`` group all go through it, so each rule and each error's wording exist once.

Imports neither torch nor Lightning: ``twobp-plan`` and the config tests read it cheaply. To add an
option: a field here with its default, its check in ``__post_init__`` (an error naming the value and
the fix), its keyword on ``TwoBPStrategy.__init__`` and a line in ``conf/strategy/twobp.yaml``.
"""

from __future__ import annotations

import math
import operator
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from lightning_twobp.schedules import (
    SCHEDULES,
    build_schedule,
    check_split,
    default_num_microbatches,
    schedule_spec,
)
from lightning_twobp.schedules.auto import Candidate, check_auto_options
from lightning_twobp.schedules.deferral import check_max_pending_w
from lightning_twobp.schedules.placement import default_stages_per_rank

__all__ = ["PipelineOptions", "check_activation_checkpointing", "check_batch_w", "check_flag", "check_pretrained"]


def check_flag(name: str, value: Any, none: str | None = None) -> None:
    """``value`` is a bool (or ``None`` where ``none`` says what ``None`` means). A string is refused:
    ``"false"`` and ``"no"`` are truthy, so ``if value:`` would take them as true."""
    if isinstance(value, bool) or (value is None and none is not None):
        return
    allowed = "True or False" + (f", or None ({none})" if none is not None else "")
    raise ValueError(
        f"TwoBPStrategy({name}={value!r}): it must be {allowed}, not a {type(value).__name__}; pass a bool "
        f"(e.g. {name}=False). On the command line Hydra and LightningCLI read true/false as booleans: "
        f"strategy.{name}=false"
    )


def _is_count(value: Any) -> bool:
    """An integer >= 1 (numpy's too), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= 1
    except TypeError:
        return False


def _check_count(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"TwoBPStrategy({name}={value!r}): it must be a positive integer, or None for the default")


# what marks a directory pretrained= reads beside *.safetensors: DCP's metadata, a torch save of Hugging Face's
_PRETRAINED_MARKS = (".metadata", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _check_balance(balance: Any) -> None:
    if isinstance(balance, str):
        if balance not in ("params", "time"):
            raise ValueError(
                f"balance={balance!r}: choose 'params' (the default), 'time' or a list of layer "
                f"counts per stage, e.g. balance=[3, 5]"
            )
    elif not (isinstance(balance, Sequence) and balance and all(_is_count(b) for b in balance)):
        raise ValueError(
            f"balance={balance!r}: a list of layer counts per stage must hold integers >= 1, e.g. balance=[3, 5]"
        )


def check_pretrained(path: Any) -> None:
    """``TwoBPStrategy(pretrained=path)`` names weights lightning.pretrained reads; ValueError naming the fix."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(
            f"TwoBPStrategy(pretrained={path!r}): a path, of a directory or a file, e.g. pretrained='/models/llama'"
        )
    where = Path(path)
    if where.is_dir() and any((where / name).is_file() for name in _PRETRAINED_MARKS):
        return
    if where.is_dir() and any(where.glob("*.safetensors")):
        return
    if where.is_file() and (where.suffix == ".safetensors" or zipfile.is_zipfile(where)):
        return
    if where.is_file() and where.name.endswith(".index.json"):
        hint = f"an index is read with the files it lists: pass the directory that holds it, {str(where.parent)!r}"
    elif where.is_file():
        from lightning_twobp.lightning.pretrained_files import not_mappable

        hint = (
            f"this file is neither safetensors nor a torch.save file of torch >= 1.6 (a zip archive, which each "
            f"rank memory-maps to read only its own tensors): {not_mappable(where)}"
        )
    elif where.is_dir():
        hint = (
            "it holds no *.safetensors file, no pytorch_model.bin and no .metadata (a torch.distributed.checkpoint "
            "directory)"
        )
    else:
        hint = "it does not exist here (every rank reads it: a path on a file system all nodes share)"
    raise ValueError(
        f"TwoBPStrategy(pretrained={str(path)!r}): a directory of Hugging Face weights (what save_pretrained "
        f"writes, or a Hub snapshot), a checkpoint directory of this strategy, or a torch.save or safetensors "
        f"file is read; {hint}"
    )


def _check_pretrained(opts: PipelineOptions) -> None:
    """``pretrained`` names weights that can be read (checked here, before any process starts);
    ``pretrained_prefix`` goes with it. A path object is kept as a string (the options are plain data)."""
    if opts.pretrained is None:
        if opts.pretrained_prefix is not None:
            raise ValueError(
                f"TwoBPStrategy(pretrained_prefix={opts.pretrained_prefix!r}) names the module the pretrained "
                f"weights are for: give the weights too, pretrained='<directory>', or drop it"
            )
        return
    check_pretrained(opts.pretrained)
    object.__setattr__(opts, "pretrained", os.fspath(opts.pretrained))
    if opts.pretrained_prefix is not None and not isinstance(opts.pretrained_prefix, str):
        raise ValueError(
            f"TwoBPStrategy(pretrained_prefix={opts.pretrained_prefix!r}): the dotted name of a module, "
            f"e.g. pretrained_prefix='model'"
        )


def _checked_pending_w(value: Any, opts: PipelineOptions) -> int | tuple[int, ...] | None:
    """``max_pending_w`` as ``build_schedule`` takes it (a list from Hydra becomes a tuple); ValueError
    naming the value and the fix. One cap per stage is counted against the stages at setup, before any
    compute (the number of stages depends on the devices, unknown here)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        value = tuple(value)
    stages = max(len(value), 1) if isinstance(value, tuple) else 1
    check_max_pending_w(value, f"TwoBPStrategy(schedule={opts.schedule!r})", stages, opts.split_backward)
    return value


def check_activation_checkpointing(value: Any, schedule: str | None = None) -> str | int | None:
    """``value`` if it is one the option takes (``"auto"`` with ``schedule="auto"`` only); ``ValueError``
    naming them otherwise."""
    if value is None or value in ("full", "selective"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if value == "auto" and schedule == "auto":
        return value
    if value == "auto":
        named = "" if schedule is None else f"schedule={schedule!r}, "
        raise ValueError(
            f"TwoBPStrategy({named}activation_checkpointing='auto'): 'auto' lets schedule='auto' checkpoint the "
            f"blocks where only that fits its memory_limit; use schedule='auto' with a memory_limit, or name the "
            f"checkpointing: None (off), 'full', 'selective' or an int k"
        )
    raise ValueError(
        f"TwoBPStrategy(activation_checkpointing={value!r}): use None (off), 'full' (every block), an int k >= 1 "
        f"(every k-th block), 'selective' (every block, its matrix products and convolutions kept, the cheap ops "
        f"recomputed) or, "
        f"with schedule='auto', 'auto' (checkpoint every block only where nothing fits memory_limit without)"
    )


def _checked_auto_schedules(opts: PipelineOptions) -> tuple[str, ...]:
    """``auto_schedules`` as a tuple of known, distinct names that ``schedule="auto"`` can run with the
    options' ``split_backward``; ValueError naming the fix otherwise."""
    given = opts.auto_schedules
    if opts.schedule != "auto":
        raise ValueError(
            f"auto_schedules={given!r} is the list schedule='auto' chooses among; with schedule={opts.schedule!r} "
            f"drop it, or use schedule='auto'"
        )
    try:
        names = (given,) if isinstance(given, str) else tuple(given)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"auto_schedules={given!r}: give a list of schedule names, e.g. ['zb-h1', 'zb-v'] (or None: every one)"
        ) from None
    if not names:
        raise ValueError(
            f"auto_schedules={given!r} leaves schedule='auto' nothing to choose: name at least one of "
            f"{', '.join(SCHEDULES)}, or drop it (every schedule)"
        )
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"auto_schedules: unknown schedule {unknown[0]!r}; choose among {', '.join(SCHEDULES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"auto_schedules={list(names)!r} names a schedule twice: name each once")
    for name in names:
        try:
            check_split(name, opts.split_backward)
        except ValueError as e:
            raise ValueError(f"auto_schedules={list(names)!r}: {e}, or leave {name!r} out") from None
    return names


def check_batch_w(value: Any) -> None:
    """``value`` is one ``batch_w`` takes: False (off), True (the engine's default size) or bytes >= 0."""
    if isinstance(value, bool) or (isinstance(value, int) and value >= 0):
        return
    raise ValueError(
        f"TwoBPStrategy(batch_w={value!r}): use False (off, the default), True (join the micro-batches' W of a weight "
        f"where a micro-batch's output gradient at its op is at most 512 KiB) or an int: that limit in bytes "
        f"(e.g. batch_w=1048576; 0 is off)"
    )


def _check_batch_w(opts: PipelineOptions) -> None:
    """``batch_w`` on a schedule that has a W to join: refused by name where nothing would be joined."""
    check_batch_w(opts.batch_w)
    if opts.batch_w is False or opts.batch_w == 0 or opts.schedule == "auto":
        return  # auto: kept where its choice joins W (PipelineOptions.chosen)
    if not opts.split_backward:
        raise ValueError(
            f"TwoBPStrategy(batch_w={opts.batch_w!r}) joins the W that 2BP's split defers; schedule="
            f"{opts.schedule!r} with split_backward=False runs fused BW and has none: drop batch_w or use "
            f"split_backward=True"
        )
    m, spr = opts.num_microbatches or 4, opts.stages
    cap = opts.max_pending_w if isinstance(opts.max_pending_w, int) else None  # one per stage: counted at setup
    try:  # on 2 ranks: where W runs together does not depend on the degree
        probe = build_schedule(opts.schedule, 2 * spr, m, stages_per_rank=spr, max_pending_w=cap)
    except ValueError:
        return  # not at these counts; the executor warns at setup if the real schedule joins nothing
    if not probe.joins_w:
        capped = "" if opts.max_pending_w is None else f" with max_pending_w={opts.max_pending_w}"
        raise ValueError(
            f"TwoBPStrategy(batch_w={opts.batch_w!r}): schedule={opts.schedule!r}{capped} at num_microbatches={m} runs "
            f"each micro-batch's W on its own, so there is nothing to join; drop batch_w, or use a schedule "
            f"that runs W together: 'gpipe', '1f1b' or 'interleaved-1f1b' (split, max_pending_w not 0)"
        )


def _check_timeout(seconds: Any) -> None:
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0
    ):
        raise ValueError(
            f"pipeline_timeout={seconds!r}: give the seconds a rank waits for another "
            f"before naming it as lost (> 0, default 600), or None for the process group's timeout"
        )


def _check_data_parallel(mode: Any) -> None:
    if mode not in ("replicate", "shard"):
        raise ValueError(
            f"data_parallel={mode!r}: choose 'replicate' (every replica holds its stages' full parameters, "
            f"gradients and optimizer state; the default) or 'shard' (FSDP2: each replica holds 1/dp of them)"
        )


@dataclass(frozen=True)
class PipelineOptions:
    """What to pipeline and how: the options of :class:`~lightning_twobp.TwoBPStrategy` (and of the Hydra
    ``strategy`` group and ``twobp-plan``), each checked when the object is made.

    Args:
        schedule: one of :data:`lightning_twobp.schedules.SCHEDULES`, or ``"auto"``: the fastest
            predicted schedule, micro-batch count and deferral cap within ``memory_limit``, chosen from
            the layers' measured costs before the first step (:mod:`lightning_twobp.lightning.autoschedule`).
        memory_limit: with ``schedule="auto"``: bytes per device (e.g. ``8e9``), a fraction of the
            device's memory (e.g. ``0.5``), ``"1f1b"`` for fused 1F1B's predicted peak, or a multiple
            of it (``"0.5x1f1b"``). A limit nothing fits is refused before training, naming the
            smallest peak that would.
        auto_schedules: with ``schedule="auto"``: the schedules it chooses among (e.g. ``("zb-h1",
            "zb-v")``; default None: every registered one). It still chooses each one's micro-batch count,
            deferral cap and split, and where the split loses, fuses it (:mod:`lightning_twobp.schedules.fusion`):
            ``("zb-v",)`` is ZB-V made the fastest it can be within ``memory_limit``. Names are checked
            when the object is made; one that cannot run on the model (too few layers for its stages, a
            ``balance`` list of another length, a layout that refuses the micro-batch counts) is said and
            left out before profiling, and a list none of which can run is refused then.
        max_pending_w: the most micro-batches per stage whose W may wait after their B (an int >= 0,
            or one per stage; None: no cap): over it the oldest W runs early, trading some of 2BP's gain
            for memory (:mod:`lightning_twobp.schedules.deferral`). Split schedules only.
        split_backward: 2BP's split into B and W (``False``: the fused backward; ZB schedules are split).
        num_microbatches: micro-batches per step (default ``2 * pipeline_degree``); the batch size
            must divide by it.
        pipeline_degree: ranks per pipeline (default: every device, one pipeline); the devices
            left over form data-parallel replicas, ``devices x num_nodes = pipeline_degree x dp``.
        stages_per_rank: stages on each rank (default 2 for ``zb-v``, ``v-half``, ``v-min`` and
            ``interleaved-1f1b``, else 1).
        balance: ``"params"`` (default), ``"time"`` (forward + backward time of every layer, measured
            on the first micro-batch of the data before training), or a list of layer counts per stage.
        layers: dotted name of the Sequential to pipeline, when the module holds several.
        placement: where the modules with parameters outside a ModuleList's blocks go (embeddings, final
            norm, head: the first stage or the last). ``"call"`` (default): on the side of the loop the
            model's forward calls them, traced before the cut on a meta copy of the model with the first
            batch's call (:mod:`lightning_twobp.lightning.call_order`; registration order where the trace
            cannot say). ``"registration"``: by registration order alone (registered before the
            ModuleList: the first stage), and the step's code does not run before the cut for the trace.
        broadcast_buffers: with data-parallel replicas, every replica takes replica 0's buffers (a batch
            norm's running statistics) before each training step and at each evaluation's start, as DDP's
            ``broadcast_buffers`` (:mod:`lightning_twobp.lightning.replica_buffers`). ``False``: each replica
            keeps its own, as before this option existed (the checkpoint holds replica 0's).
        gather_full_model: at the end of each Trainer call, every rank receives the trained weights
            of the stages it did not hold, so the model is complete on every rank. Off by default:
            then those layers stay on the ``meta`` device and calling one says how to get them.
        post_validation: clipping by the global gradient norm (``gradient_clip_val``) without stopping
            the pipeline: each rank steps at once and the global check follows, rolling the step back
            and redoing it exactly when it would have changed it (the Zero Bubble paper's optimizer
            post-validation; :class:`~lightning_twobp.engine.StepValidation`). ``None`` (default): on
            for ``zb-h2`` and ``zb-v``, whose zero bubble needs consecutive steps to overlap; off (check
            first, then step) for the others, which do not overlap anyway. With clipping or
            ``on_nonfinite="skip"`` it costs one copy of the parameters and optimizer state while a
            step is unchecked (none otherwise). Not with fp16's GradScaler.
        on_nonfinite: an inf or NaN gradient on any stage (a NaN loss makes every gradient NaN) is
            seen by every rank in the same step: one all-reduce of ``pipeline_degree + 3`` numbers
            per optimizer step, the one clipping needs anyway. ``"stop"`` (default): every rank
            raises :class:`NonFiniteError` naming the step, the stages and the first non-finite
            micro-batch loss (before the step changes any weight, except under post-validation
            without clipping, where the error comes a step later and says so). ``"skip"``: the step is
            skipped on every rank, with a warning; ``strategy.step_checks["skipped"]`` counts them and
            ``pipeline/skipped_steps`` is logged. With fp16's GradScaler the scaler does this instead.
        pipeline_timeout: seconds (default 600) the pipeline's own waits on another rank may take,
            after which that rank is named as lost (its pipeline rank, stage and host). Also the
            timeout of the process group and of every group the strategy makes (the mesh's, the
            loss and logs', tied weights') unless ``timeout`` is given (at least 60 s), so a hung
            rank stops Lightning's collectives in minutes rather than torch's default 30.
            Checkpoint saves and loads use a group of their own with at least 30 minutes: writing
            and hashing a large checkpoint may take longer than a hung rank should.
        data_parallel: what the data-parallel replicas of a stage hold. ``"replicate"`` (default):
            every replica the stage's full parameters, gradients and optimizer state, gradients
            averaged after the stage's last W. ``"shard"``: FSDP2 over the ``"dp"`` mesh dimension,
            each replica ``1/dp`` of them; the parameters are gathered once per step before the
            stage's first F and held through its last W, the gradients reduce-scattered once after
            it (:mod:`lightning_twobp.lightning.sharding`); checkpoints hold the shards. Needs at least
            2 replicas; fp32, ``"bf16-mixed"``, ``"16-mixed"`` or the ``"-true"`` half precisions (others are
            refused before any compute).
        activation_checkpointing: ``None`` (off, the default), ``"full"`` (every block recomputed in B),
            an int ``k`` (every k-th block), ``"selective"`` (every block, its matrix products and
            convolutions kept) or,
            with ``schedule="auto"``, ``"auto"``: the search weighs every schedule with plain blocks and
            with blocks checkpointed ``"selective"`` and ``"full"``, and takes the fastest within
            ``memory_limit``, checkpointed only where that is faster within it (in practice: where
            nothing plain fits)
            (:mod:`lightning_twobp.lightning.checkpointing`).
        batch_w: the 2BP paper's batched W (§4): a stage's deferred W of several micro-batches as one
            GEMM (or conv weight backward) per weight, the micro-batches' gradients and inputs
            concatenated. ``False`` (default): one call per micro-batch. ``True``: joined where a
            micro-batch's output gradient at that weight's op is at most 512 KiB
            (``lightning_twobp.engine.formulas.BATCH_BYTES``: it pays at small micro-batches, not at
            large ones; docs/benchmarks.md, "batched W"). An int: that limit in bytes (0: off). Only
            W actions over several micro-batches are joined: GPipe's and 1F1B's (interleaved too)
            W at the end of the step; the ZB and V schedules run each W alone and are refused. Not
            bit-equal to the per-micro-batch accumulation (one sum over all rows rounds differently:
            fp32, about 1e-7 of a gradient's largest value). Costs one weight's joined copy at a time.
        pretrained: weights each rank reads its own tensors from, at the first Trainer call that sets
            the model up (:mod:`lightning_twobp.lightning.pretrained`): Hugging Face's directory
            (``save_pretrained``'s or a Hub snapshot; safetensors or ``pytorch_model.bin``, sharded or
            not), a checkpoint directory of this strategy's (its weights only; ``ckpt_path`` resumes it
            whole), or one file: safetensors, or a ``torch.save`` file (a Lightning ``.ckpt``, a state
            dict), memory-mapped so that a rank reads its own tensors' bytes only.
            With a model built on the meta device no rank holds more than its stages at any time.
            Names and shapes are checked on every rank before any compute; tensors the file lacks keep
            their built values and tensors it holds beyond the model are not read (each named in a
            warning). Read once per model object: later Trainer calls keep its weights, and so do
            calls after one that loaded a checkpoint (a ``ckpt_path`` is loaded after setup, over the
            weights read there).
        pretrained_prefix: the dotted name of the module the weights are for (``"model"`` where the
            LightningModule holds ``self.model = AutoModelForCausalLM...``; ``""`` for the
            LightningModule itself). Default: the module under which the most of the file's names are
            names of the model's tensors (refused where none or two are).
    """

    schedule: str = "1f1b"
    split_backward: bool = True
    num_microbatches: int | None = None
    pipeline_degree: int | None = None
    stages_per_rank: int | None = None
    balance: str | tuple[int, ...] = "params"
    layers: str | None = None
    placement: str = "call"
    gather_full_model: bool = False
    broadcast_buffers: bool = True
    post_validation: bool | None = None
    on_nonfinite: str = "stop"
    pipeline_timeout: float | None = 600.0
    max_pending_w: int | tuple[int, ...] | None = None
    memory_limit: float | str | None = None
    auto_schedules: tuple[str, ...] | None = None
    data_parallel: str = "replicate"
    activation_checkpointing: str | int | None = None
    batch_w: bool | int = False
    pretrained: str | None = None
    pretrained_prefix: str | None = None

    def __post_init__(self) -> None:
        check_flag("split_backward", self.split_backward)
        check_flag("gather_full_model", self.gather_full_model)
        check_flag("broadcast_buffers", self.broadcast_buffers)
        check_flag("post_validation", self.post_validation, none="on for zb-h2 and zb-v, the default")
        if self.schedule not in SCHEDULES and self.schedule != "auto":  # checked now: the Trainer is not built yet
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}, or 'auto'")
        if self.auto_schedules is not None:  # a list from the user or Hydra's ListConfig: frozen
            object.__setattr__(self, "auto_schedules", _checked_auto_schedules(self))
        if self.schedule == "auto":
            check_auto_options(self.memory_limit, self.stages_per_rank, self.max_pending_w)
        else:
            check_split(self.schedule, self.split_backward)
            object.__setattr__(self, "max_pending_w", _checked_pending_w(self.max_pending_w, self))
            if self.memory_limit is not None:
                raise ValueError(
                    f"memory_limit={self.memory_limit!r} is what schedule='auto' chooses within; with "
                    f"schedule={self.schedule!r} drop it, or use schedule='auto'"
                )
        for name in ("num_microbatches", "pipeline_degree", "stages_per_rank"):
            _check_count(name, getattr(self, name))
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r}: choose 'stop' (raise on every rank, naming the "
                f"stage, micro-batch and step) or 'skip' (skip that optimizer step everywhere)"
            )
        _check_balance(self.balance)
        if self.placement not in ("call", "registration"):
            raise ValueError(
                f"placement={self.placement!r}: choose 'call' (the default: modules outside the blocks go where the "
                f"model's forward calls them) or 'registration' (by their registration order)"
            )
        if not isinstance(self.balance, str):  # a list from the user or Hydra's ListConfig: frozen
            object.__setattr__(self, "balance", tuple(operator.index(b) for b in self.balance))
        _check_timeout(self.pipeline_timeout)
        check_activation_checkpointing(self.activation_checkpointing, self.schedule)
        _check_data_parallel(self.data_parallel)
        _check_batch_w(self)
        _check_pretrained(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PipelineOptions:
        """The options among ``values`` (a Hydra ``strategy`` node, say); other keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def degree(self, world_size: int) -> int:
        """Ranks per pipeline: the option, or every rank in one pipeline."""
        return self.pipeline_degree or world_size

    @property
    def stages(self) -> int:
        """Stages on each rank: the option, or the schedule's own (2 for the V schedules; 1 until
        ``schedule="auto"`` has chosen)."""
        if self.schedule == "auto":
            return self.stages_per_rank or 1
        return self.stages_per_rank or default_stages_per_rank(self.schedule)

    def microbatches(self, degree: int) -> int:
        """Micro-batches per step: the option, or the schedule's default for ``degree`` ranks."""
        return self.num_microbatches or default_num_microbatches(
            degree, None if self.schedule == "auto" else self.schedule
        )

    def chosen(self, best: Candidate) -> PipelineOptions:
        """``schedule="auto"``'s choice as if the user had named it: the schedule, its split, m, stages per
        rank and deferral cap; with ``activation_checkpointing="auto"``, the checkpointing it chose."""
        joined = bool(self.batch_w) and best.schedule.joins_w
        ac = best.checkpointing if self.activation_checkpointing == "auto" else self.activation_checkpointing
        return replace(
            self,
            schedule=best.name,
            split_backward=best.split_backward,
            num_microbatches=best.num_microbatches,
            stages_per_rank=best.stages_per_rank,
            max_pending_w=best.max_pending_w,
            memory_limit=None,
            auto_schedules=None,
            activation_checkpointing=ac,
            batch_w=self.batch_w if joined else False,  # batch_w applies where the choice runs W together
        )

    def overlaps(self, fp16: bool) -> bool:
        """Whether an optimizer step is checked after it is taken (post-validation): the option, or the
        schedule's spec (zb-h2 and zb-v overlap steps) unless fp16's GradScaler owns the check."""
        if self.post_validation is not None:
            return self.post_validation
        return schedule_spec(self.schedule).overlaps and not fp16
