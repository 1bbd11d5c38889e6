"""``Trainer(strategy="twobp")``: an unchanged LightningModule trained through a 2BP pipeline.

This class holds Lightning's hooks only; each job lives in its own module (see docs/architecture.md):
the contract finds the pipelined layers (:mod:`.contract`), :mod:`.layout` places ranks and stages,
:mod:`.model` cuts the model for one Trainer call and puts it back, :mod:`.step` runs the user's step
per micro-batch, :mod:`.grads` carries gradients to Lightning's optimizer step, :mod:`.checkpoint`
saves and loads, :mod:`.profile` measures layers for ``balance="time"``; the engine
(:class:`~lightning_twobp.engine.PipelineExecutor`) runs the schedule.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree
from typing_extensions import override

from lightning_twobp.engine import PipelineExecutor, StepValidation, Verdict
from lightning_twobp.engine.memory import keep_freed_memory
from lightning_twobp.engine.stage import deferred_fraction
from lightning_twobp.lightning import checkpoint as ckpt
from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing, check_activation_checkpointing
from lightning_twobp.lightning.checks import check_flag, check_nodes, checked_optimizers
from lightning_twobp.lightning.compiled import check_not_compiled
from lightning_twobp.lightning.contract import find_contract
from lightning_twobp.lightning.grads import (
    GradStash,
    TiedParameters,
    dp_reduce,
    overflow_agreeing_scaler,
    pipelined_precision,
)
from lightning_twobp.lightning.layout import (
    MeshLayout,
    check_degree,
    default_num_microbatches,
    default_stages_per_rank,
    schedule_label,
)
from lightning_twobp.lightning.loaders import keep_users_sampler
from lightning_twobp.lightning.logs import LogChannel
from lightning_twobp.lightning.metrics import StepMetrics
from lightning_twobp.lightning.model import LocalModel, split_model
from lightning_twobp.lightning.profile import profile_layers
from lightning_twobp.lightning.quiet import known_warnings_off
from lightning_twobp.lightning.rng import StageStreams
from lightning_twobp.lightning.step import Logs, StepRunner, check_batch_size, check_batches, share_logs, step_means
from lightning_twobp.partition import partition
from lightning_twobp.schedules import SCHEDULES, Schedule, build_schedule, check_split, schedule_spec

log = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "TwoBPStrategy"]

_NOT_YET = (
    "the pipeline is built in setup(), when a Trainer call starts: call trainer.fit (or validate, test, predict) first"
)


@dataclass(frozen=True)
class StepRecords:
    """One recorded training step on this rank: its ops as they ran, and each (stage, micro-batch)'s
    saved bytes."""

    records: list[Any]
    held_bytes: dict[tuple[int, int], int]


class NonFiniteError(RuntimeError):
    """A loss or gradient was inf or NaN under ``on_nonfinite="stop"``: raised on every rank at once."""


@dataclass
class _Pipeline:
    """Everything one Trainer call builds in ``setup`` and ``teardown`` takes apart."""

    local: LocalModel
    executor: PipelineExecutor
    runner: StepRunner
    tied: TiedParameters
    user_precision: Any  # the precision plugin as Lightning gave it (ours is a copy)
    user_scaler: Any  # its GradScaler, or None; gets the trained scale back at teardown
    logs: LogChannel | None  # the last stage's loss and logs to the other ranks (None: one rank)
    scope: ExitStack  # what the Trainer call changed outside the model, undone at teardown
    streams: StageStreams  # this rank's stages' random streams
    metrics: StepMetrics  # the module's torchmetrics Metrics, accumulated per step over its micro-batches
    checks: dict[int, StepValidation] = field(default_factory=dict)  # per optimizer: clip / non-finite
    max_norms: dict[int, float] = field(default_factory=dict)  # per optimizer: this step's clipping, if any
    means: Logs = field(default_factory=dict)  # the training step's logged means (last stage)


_IO_TIMEOUT = timedelta(minutes=30)  # at least this for checkpoint collectives


def _is_count(value: Any) -> bool:
    """An integer >= 1 (numpy's too), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= 1
    except TypeError:
        return False


class TwoBPStrategy(DDPStrategy):
    """Pipeline parallelism with 2BP for an unchanged LightningModule.

    Args:
        schedule: one of :data:`lightning_twobp.schedules.SCHEDULES`.
        split_backward: 2BP's split into B and W (``False``: the fused backward; ZB schedules are split).
        num_microbatches: micro-batches per step (default ``2 * pipeline_degree``); the batch size
            must divide by it.
        pipeline_degree: ranks per pipeline (default: every device, one pipeline); the devices
            left over form data-parallel replicas, ``devices x num_nodes = pipeline_degree x dp``.
        stages_per_rank: stages on each rank (default 2 for ``zb-v`` and ``interleaved-1f1b``, else 1).
        balance: ``"params"`` (default), ``"time"`` (forward + backward time of every layer, measured
            on the first micro-batch of the data before training), or a list of layer counts per stage.
        layers: dotted name of the Sequential to pipeline, when the module holds several.
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
            without clipping, where the error comes a step later and says so). ``"skip"``: the step is skipped on
            every rank, with a warning; ``strategy.step_checks["skipped"]`` counts them and
            ``pipeline/skipped_steps`` is logged. With fp16's GradScaler the scaler does this instead.
        activation_checkpointing: None (off), ``"full"``, ``k`` (every k-th block) or ``"selective"``:
            see :mod:`lightning_twobp.lightning.checkpointing`.
        pipeline_timeout: seconds (default 600) the pipeline's own waits on another rank may take,
            after which that rank is named as lost (its pipeline rank, stage and host). Also the
            timeout of the process group and of every group the strategy makes (the mesh's, the
            loss and logs', tied weights') unless ``timeout`` is given (at least 60 s), so a hung
            rank stops Lightning's collectives in minutes rather than torch's default 30.
            Checkpoint saves and loads use a group of their own with at least 30 minutes: writing
            and hashing a large checkpoint may take longer than a hung rank should.
        accelerator, parallel_devices, cluster_environment, precision_plugin, process_group_backend,
        timeout, start_method: as for :class:`~lightning.pytorch.strategies.DDPStrategy`. DDP's own
            options (``find_unused_parameters``, communication hooks, ...) raise ``TypeError``: there
            is no DistributedDataParallel wrapper.
    """

    strategy_name = "twobp"

    def __init__(
        self,
        schedule: str = "1f1b",
        split_backward: bool = True,
        num_microbatches: int | None = None,
        pipeline_degree: int | None = None,
        stages_per_rank: int | None = None,
        balance: str | Sequence[int] = "params",
        layers: str | None = None,
        gather_full_model: bool = False,
        post_validation: bool | None = None,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        pipeline_timeout: float | None = 600.0,
        activation_checkpointing: str | int | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(
                f"TwoBPStrategy got {', '.join(sorted(kwargs))}: DistributedDataParallel's options do not apply "
                f"(the pipeline schedule computes the gradients and reduces them over data-parallel replicas "
                f"itself); remove them"
            )
        check_flag("split_backward", split_backward)
        check_flag("gather_full_model", gather_full_model)
        check_flag("post_validation", post_validation, none="on for zb-h2 and zb-v, the default")
        if schedule not in SCHEDULES:  # checked now, not at setup: the Trainer is not built yet
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        check_split(schedule, split_backward)
        for name, value in (
            ("num_microbatches", num_microbatches),
            ("pipeline_degree", pipeline_degree),
            ("stages_per_rank", stages_per_rank),
        ):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(
                    f"TwoBPStrategy({name}={value!r}): it must be a positive integer, or None for the default"
                )
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(
                f"on_nonfinite={on_nonfinite!r}: choose 'stop' (raise on every rank, naming the "
                f"stage, micro-batch and step) or 'skip' (skip that optimizer step everywhere)"
            )
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
        if pipeline_timeout is not None and (
            isinstance(pipeline_timeout, bool)
            or not isinstance(pipeline_timeout, (int, float))
            or not math.isfinite(pipeline_timeout)
            or pipeline_timeout <= 0
        ):
            raise ValueError(
                f"pipeline_timeout={pipeline_timeout!r}: give the seconds a rank waits for another "
                f"before naming it as lost (> 0, default 600), or None for the process group's timeout"
            )
        if timeout is None and pipeline_timeout is not None:
            # Lightning's own collectives (logging, checkpoints, the non-finite check) then give up on a
            # hung rank after the same time as the pipeline's waits, not after torch's 30 minutes.
            timeout = timedelta(seconds=max(float(pipeline_timeout), 60.0))
        extra = {} if timeout is None else {"timeout": timeout}
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
            **extra,
        )
        self.schedule_name = schedule
        self.split_backward = split_backward
        self.balance = balance
        self.layers = layers
        self.activation_checkpointing = check_activation_checkpointing(activation_checkpointing)
        self.gather_full_model = gather_full_model
        self.post_validation = post_validation
        self.on_nonfinite = on_nonfinite
        self._step_checks = {"clipped": 0, "skipped": 0, "redone": 0}
        self.pipeline_timeout = pipeline_timeout
        self._log_group: dist.ProcessGroup | None = None
        self._io_group: dist.ProcessGroup | None = None
        self._batches_checked = False  # the training batches split into micro-batches (checked once per fit)
        self._num_microbatches = num_microbatches
        self._pipeline_degree = pipeline_degree
        self._stages_per_rank = stages_per_rank or default_stages_per_rank(schedule)
        self._mesh: DeviceMesh | None = None
        self._pipeline: _Pipeline | None = None
        self._stash = GradStash()
        self._failed = False
        self.stage_sizes: list[int] | None = None  # layers per stage, once the pipeline is built
        self._resume_rng: dict[str, torch.Tensor] | None = None  # a checkpoint's random states, not yet restored
        self._record_next = False
        self.last_records: StepRecords | None = None  # this rank's ops of the latest recorded step

    # ------------------------------------------------------------------ layout, for users' code
    @property
    def pipeline_degree(self) -> int:
        return self._pipeline_degree or self.world_size

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches or default_num_microbatches(self.pipeline_degree)

    @property
    def step_checks(self) -> dict[str, int]:
        """Optimizer steps so far whose global check changed them: ``clipped`` (by the global norm),
        ``skipped`` (a gradient was not finite) and ``redone`` (stepped speculatively, then put back and
        redone, with ``post_validation``). Kept after the Trainer call."""
        return dict(self._step_checks)

    def record_next_step(self) -> None:
        """Record the next training step's ops on this rank (every rank must ask for the same step):
        :attr:`last_records` then holds their times (:class:`~lightning_twobp.engine.ActionRecord`)
        and the bytes each micro-batch's forward saved. Costs one clock read per op on that step."""
        self._record_next = True

    @property
    def stages_per_rank(self) -> int:
        return self._stages_per_rank

    @property
    def _layout(self) -> MeshLayout:
        return MeshLayout(self.world_size, self.pipeline_degree, self.global_rank)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("dp", "pp")`` :class:`~torch.distributed.device_mesh.DeviceMesh` of the run."""
        if self._mesh is None:
            raise RuntimeError(f"TwoBPStrategy.device_mesh: the mesh is made when the processes start; {_NOT_YET}")
        return self._mesh

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline, ``0 .. pipeline_degree - 1``."""
        return self._layout.pp_rank

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica, ``0 .. world_size / pipeline_degree - 1``."""
        return self._layout.dp_rank

    @property
    def schedule(self) -> Schedule:
        return self._built("schedule").executor.schedule

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The pipeline stages this rank holds."""
        return tuple(self.schedule.stages_of(self.pp_rank))

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds stage 0 (the step runs up to the pipelined block here)."""
        return 0 in self.stage_ids

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (the loss and ``self.log`` happen here)."""
        return self.schedule.num_stages - 1 in self.stage_ids

    @property
    def deferred_fraction(self) -> float:
        """Share of this rank's weight-gradient work that W computed so far (see
        :func:`~lightning_twobp.engine.stage.deferred_fraction`)."""
        return deferred_fraction(self._built("deferred_fraction").executor.stages.values())

    def _built(self, what: str) -> _Pipeline:
        if self._pipeline is None:
            raise RuntimeError(f"TwoBPStrategy.{what}: {_NOT_YET}")
        return self._pipeline

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of one pipeline sees the same batch: the data splits by data-parallel rank.
        return {"num_replicas": self._layout.dp_degree, "rank": self.dp_rank}

    # ------------------------------------------------------------------ setup and teardown
    @override
    def set_world_ranks(self) -> None:
        # Called when the Trainer is built, before Lightning launches any process.
        check_nodes(self.num_nodes, self.num_processes, self.cluster_environment)
        super().set_world_ranks()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        check_degree(self.world_size, self.pipeline_degree)
        self._mesh = self._layout.init_mesh(self.root_device, self._timeout)
        # Checkpoint I/O (writing, hashing, verifying a large checkpoint) may take longer than a hung
        # rank should: its collectives get a group of their own with at least torch's 30 minutes.
        self._io_group = dist.new_group(timeout=max(self._timeout, _IO_TIMEOUT)) if dist.is_initialized() else None
        layout = self._layout
        if self.pipeline_degree > 1:
            # The loss and logs travel on a group of their own, so that their messages never mix with
            # the schedule's (NCCL matches messages between two ranks in posting order, ignoring tags).
            for d in range(layout.dp_degree):  # every rank creates every group, in one order
                group = dist.new_group(
                    [layout.global_rank_of(r, d) for r in range(self.pipeline_degree)], timeout=self._timeout
                )
                if d == layout.dp_rank:
                    self._log_group = group

    def _group(self, dim: str) -> dist.ProcessGroup | None:
        return self._mesh.get_group(dim) if self._mesh is not None else None

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._failed = False
        self._batches_checked = False
        self._pipeline = self._build(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._pipeline.tied:
            self._pipeline.tied.sync_values()
        if trainer.state.fn == TrainerFn.FITTING:
            checked_optimizers(
                lambda: self.setup_optimizers(trainer),
                self.lightning_module,
                lambda: self.optimizers,
                self.pp_rank,
                self.stage_ids,
            )
        # Optimizers are created after the move to the device and hold no state yet; a checkpoint's
        # state is loaded afterwards (restore_checkpoint_after_setup), by parameter name.
        self.setup_precision_plugin()

    def _build(self, trainer: Any) -> _Pipeline:
        lm = self.lightning_module
        if not lm.automatic_optimization:
            raise ValueError(
                "strategy='twobp' supports automatic optimization only: the pipeline schedule owns the "
                "backward, so manual_backward cannot run it; set self.automatic_optimization = True"
            )
        check_degree(self.world_size, self.pipeline_degree)
        if self.root_device.type == "cpu":
            keep_freed_memory()  # see lightning_twobp.engine.memory: measured page faults every step otherwise
        contract = find_contract(lm, self.layers)
        check_not_compiled(lm, contract)  # before the first step: compiled code cannot be split
        metrics = StepMetrics(lm)
        runner = StepRunner(lm, contract, metrics)
        num_stages = self.pipeline_degree * self._stages_per_rank
        costs = None
        if self.balance == "time":
            costs = profile_layers(
                runner, contract.layers(), trainer, self.num_microbatches, self.root_device, self.precision_plugin
            )
        sizes = partition(nn.Sequential(*contract.layers()), num_stages, self.balance, costs=costs)
        self.stage_sizes = list(sizes)
        schedule = build_schedule(
            self.schedule_name,
            num_stages,
            self.num_microbatches,
            stages_per_rank=self._stages_per_rank,
            split_backward=self.split_backward,
        )
        layout = self._layout
        streams = StageStreams(schedule.stages_of(layout.pp_rank), layout.dp_rank, self.root_device)
        local = split_model(contract, sizes, schedule, layout.pp_rank)
        for s, module in local.stages.items():
            first = local.bounds[s]
            log.info(
                "stage %d: layers %d-%d (%d parameters) on pipeline rank %d",
                s,
                first,
                first + sizes[s] - 1,
                sum(q.numel() for q in module.parameters()),
                layout.pp_rank,
            )
        rank_zero_info(
            f"twobp: {schedule_label(schedule.name, self.split_backward)}, {num_stages} stages on "
            f"{self.pipeline_degree} ranks x {layout.dp_degree} replica(s), {self.num_microbatches} micro-batches; "
            f"layers per stage {sizes}"
        )
        pp_group = self._group("pp")
        executor = PipelineExecutor(
            schedule,
            local.stages,
            loss_fn=self._loss,
            device=self.root_device,
            group=pp_group,
            grad_reduce=dp_reduce(self._group("dp"), layout.dp_degree) if layout.dp_degree > 1 else None,
            timeout=self.pipeline_timeout,
            around=streams.fork,
        )
        logs = None
        if self._log_group is not None:
            logs = LogChannel(
                self._log_group,
                layout.pp_rank,
                schedule.stage_to_rank[schedule.num_stages - 1],
                self.pipeline_degree,
                self.root_device,
            )
        tied = TiedParameters(
            local.shared,
            lambda ranks: [[layout.global_rank_of(r, d) for r in ranks] for d in range(layout.dp_degree)],
            timeout=self._timeout,
        )
        if local.shared:
            rank_zero_info(
                "twobp: parameters shared across pipeline ranks, kept in sync: "
                + "; ".join(
                    f"{contract.name}.{{{', '.join(sp.names)}}} on ranks {list(sp.ranks)}" for sp in local.shared
                )
            )
        user_precision = self.precision_plugin
        user_scaler = getattr(user_precision, "scaler", None)
        scaler = None
        if user_scaler is not None and self.world_size > 1:
            scaler = overflow_agreeing_scaler(user_scaler, self.root_device, None)
        if self.post_validation and user_scaler is not None and user_scaler.is_enabled():
            raise ValueError(
                "post_validation=True with fp16 mixed precision: the GradScaler's overflow check runs before "
                "the step, on every rank at once; use precision='bf16-mixed', or post_validation=False"
            )
        self.precision_plugin = pipelined_precision(user_precision, self._clip_by_norm, self._before_step, scaler)
        scope = ExitStack()
        scope.enter_context(known_warnings_off())  # the Trainer call's data loaders build next
        scope.callback(metrics.sync_over(self._group("dp")))
        scope.callback(apply_activation_checkpointing(local.blocks(), self.activation_checkpointing))
        if layout.dp_degree == 1:  # nothing to split: the loader's own sampler, as one process reads it
            scope.callback(keep_users_sampler(trainer))
        return _Pipeline(local, executor, runner, tied, user_precision, user_scaler, logs, scope, streams, metrics)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown gathers nothing then: another rank may be gone
        super().on_exception(exception)

    @override
    def on_train_end(self) -> None:
        self._validate()  # the last optimizer step's verdict: the trained weights are the checked ones
        if self._pipeline is not None and self._pipeline.logs is not None:
            self._pipeline.logs.flush()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        """Lightning's teardown (optimizers and model to the CPU), then the model is put back whole
        and the precision plugin is Lightning's own again, with the trained loss scale."""
        pipeline, self._pipeline = self._pipeline, None
        super().teardown()
        if pipeline is None:
            return
        gather = self.gather_full_model and not self._failed and dist.is_initialized()
        pipeline.local.restore(gather, self._group("pp"), self.pp_rank, self.root_device)
        pipeline.scope.close()
        ours = self.precision_plugin
        if (
            pipeline.user_scaler is not None
            and ours.scaler is not pipeline.user_scaler
            and pipeline.user_scaler.is_enabled()
        ):
            pipeline.user_scaler.load_state_dict(ours.scaler.state_dict())
        self.precision_plugin = pipeline.user_precision

    # ------------------------------------------------------------------ training
    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.sanity_checking and not self._batches_checked:
            self._check_batch_size_early(trainer)
        super().on_validation_start()

    def _check_batch_size_early(self, trainer: Any) -> None:
        """The sanity check runs before Lightning loads the training data. A batch size that cannot
        split into micro-batches is refused before its first validation step: the training loader is
        asked for (as Lightning will ask again later) with every random generator put back afterwards,
        so the data and the run stay what they are without this check. The last batch, which needs
        Lightning's sampler, is checked when training starts."""
        from lightning.pytorch.utilities.seed import isolate_rng

        # Lightning's private handle on the training data (2.x); read nowhere else. Should a release
        # rename it, the check falls back to on_train_start, and test_config_errors's
        # "fit-batch-before-sanity-check" case (no forward may run) fails and says so.
        source = getattr(trainer.fit_loop, "_data_source", None)
        if source is None or not source.is_defined():
            return
        with isolate_rng(include_cuda=True):
            loader = source.dataloader()
        size = getattr(loader, "batch_size", None)
        if isinstance(size, int):
            check_batch_size(size, self.num_microbatches)

    def _check_batches(self) -> None:
        loader = self.lightning_module.trainer.train_dataloader
        if loader is not None:
            check_batches(loader, self.num_microbatches)
            self._batches_checked = True

    @override
    def on_train_start(self) -> None:
        if not self._batches_checked:
            self._check_batches()
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._resume_rng is not None:
            ckpt.set_rng_state(self._resume_rng)
            self._resume_rng = None
        self._built("on_train_batch_start").streams.apply_pending()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        pipeline = self._built("training_step")
        runner = pipeline.runner
        runner.begin("training_step", args, kwargs, self.num_microbatches, exact=True)
        loss, means = self._pipeline_step(pipeline)
        verdict = self._validate()  # the previous optimizer step's global check, long arrived
        if verdict is not None and verdict.redone:
            # That step was clipped or skipped after all: this step ran on the speculative weights.
            pipeline.metrics.undo()
            runner.begin("training_step", args, kwargs, self.num_microbatches, exact=True)
            loss, means = self._pipeline_step(pipeline)
        for name, (value, kw) in means.items():
            value = pipeline.metrics.resolve(value)
            self.lightning_module.log(
                name, value.to(self.root_device) if isinstance(value, torch.Tensor) else value, **kw
            )
        if self._step_checks["skipped"]:  # every rank knows the count: nothing travels
            self.lightning_module.log(
                "pipeline/skipped_steps", float(self._step_checks["skipped"]), on_step=True, on_epoch=False
            )
        return loss.to(self.root_device)

    def _pipeline_step(self, pipeline: _Pipeline) -> tuple[torch.Tensor, Logs]:
        """One pipeline step over the micro-batches ``runner.begin`` made: the gradients set aside for
        ``backward``, the mean loss and the logged means on every rank of the pipeline."""
        ex = pipeline.executor
        params = [q for q in self.lightning_module.parameters() if q.requires_grad]
        with self._stash.collect(params), self.precision_plugin.train_step_context():
            pipeline.metrics.begin()  # before any part of the step runs on this rank
            inputs = self._capture(pipeline)
            targets = list(range(self.num_microbatches)) if ex.last in ex.stages else None
            # With a GradScaler (fp16), the pipeline's backward starts from the scaled loss, as
            # Lightning's backward would; the scaler unscales before clipping and stepping.
            scaler = getattr(self.precision_plugin, "scaler", None)
            ex.record = self._record_next
            ex.step_label = f"global step {self.lightning_module.trainer.global_step}"  # named so in errors
            result = ex.step(inputs, targets, loss_scale=float(scaler.get_scale()) if scaler is not None else 1.0)
            if self._record_next:
                ex.record = self._record_next = False
                self.last_records = StepRecords(list(result.records), dict(result.held_bytes))
            if pipeline.tied:
                pipeline.tied.reduce_grads()
        if ex.last in ex.stages:
            return result.loss, pipeline.means
        loss, means, states = pipeline.logs.receive()
        pipeline.metrics.apply(states)
        return loss, means

    @staticmethod
    def _capture(pipeline: _Pipeline) -> list[tuple] | None:
        """The first stage's inputs: its part of the step, up to the pipelined block, per micro-batch,
        drawing from stage 0's random stream (the last stage's part runs inside its F)."""
        if 0 not in pipeline.executor.stages:
            return None
        runner = pipeline.runner
        with pipeline.streams.fork(0):
            inputs = [runner.capture(mb) for mb in runner.state.microbatches]
        pipeline.metrics.clear()  # what this part updated counts where the last stage runs it again
        return inputs

    def _loss(self, output: Any, index: int) -> torch.Tensor:
        """The executor's loss: the user's step on micro-batch ``index``; after the last one the loss and
        the logs leave for the other ranks at once (:class:`~.logs.LogChannel`), not at the step's end."""
        pipeline = self._pipeline
        runner = pipeline.runner
        loss = runner.loss(output, index)
        if index == len(runner.state.microbatches) - 1:
            states = pipeline.metrics.end()
            pipeline.means = step_means(runner.state)
            if pipeline.logs is not None:
                pipeline.logs.send(runner.mean_loss(), pipeline.means, states)
        return loss

    def _validate(self) -> Verdict | None:
        """The pending speculative optimizer step's verdict, if any (see ``post_validation``)."""
        pipeline = self._pipeline
        verdict = None
        for check in pipeline.checks.values() if pipeline is not None else ():
            verdict = self._judge(check, check.validate(), done=True) or verdict
        return verdict

    def _judge(self, check: StepValidation, verdict: Verdict | None, done: bool) -> Verdict | None:
        """Count the verdict; a step skipped for a non-finite gradient stops training on every rank
        (``on_nonfinite="stop"``) or is logged (``"skip"``). Every rank sees the same verdict."""
        self._count_checks()
        if verdict is None or not verdict.nonfinite:
            return verdict
        # ``done``: the step counter has moved past the step the verdict is about (a speculative step)
        step = self.lightning_module.trainer.global_step - int(done)
        stages = sorted(s for r in verdict.nonfinite_ranks for s in self.schedule.stages_of(r))
        bad_mb = int(verdict.extra[0].item()) - 1 if verdict.extra is not None else -1
        where = (
            f"the optimizer step at global step {step}: a gradient was not finite on pipeline rank(s) "
            f"{list(verdict.nonfinite_ranks)} (stage(s) {stages})"
        )
        if bad_mb >= 0:
            where += f", and the loss of micro-batch {bad_mb} already was"
        ids = {id(q) for q in check.nonfinite_params}
        names = [n for n, q in self.lightning_module.named_parameters() if id(q) in ids]
        if self.on_nonfinite == "stop":
            mine = (
                f" On pipeline rank {self.pp_rank}: {', '.join(names[:4]) or 'none'}"
                + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                + "."
            )
            taken = (
                "the step was not taken on any rank"
                if verdict.skipped
                else "the step was taken before the check (post-validation keeps no copy to undo it when not "
                "clipping), so the weights in memory are not finite; checkpoints on disk are from before"
            )
            if dist.is_initialized() and dist.get_world_size() > 1:
                # Every rank raises here; meet first, so that no rank tears down its connections while
                # another still receives this step's last messages (it would see a lost peer instead).
                dist.all_reduce(torch.zeros(1, device=self.root_device))
            raise NonFiniteError(
                f"twobp: training stopped at {where}; {taken} (on_nonfinite='stop')."
                f"{mine} Skip such steps with TwoBPStrategy(on_nonfinite='skip'), lower the learning rate, "
                f"clip gradients (Trainer(gradient_clip_val=...)), or find the operation with "
                f"torch.autograd.detect_anomaly (docs/troubleshooting.md)"
            )
        log.warning(
            "twobp: %s; the step was skipped on every rank (%d skipped so far; on_nonfinite='skip')",
            where,
            self._step_checks["skipped"],
        )
        return verdict

    def _before_step(self, optimizer: Any) -> None:
        """Right before each optimizer step: the pipeline's global check, with this step's clipping
        threshold (if Lightning asked for clipping) and a flag of the last stage's first non-finite
        micro-batch loss riding along. Checked first, or after the step with ``post_validation``."""
        pipeline = self._built("optimizer_step")
        scaler = getattr(self.precision_plugin, "scaler", None)
        fp16 = scaler is not None and scaler.is_enabled()  # the GradScaler owns the inf/NaN check then
        max_norm = pipeline.max_norms.pop(id(optimizer), None)
        check = pipeline.checks.get(id(optimizer))
        if check is None:
            overlap = self.post_validation
            if overlap is None:
                overlap = schedule_spec(self.schedule_name).overlaps and not fp16
            # A copy to put back is needed to redo a clipped step or skip a non-finite one; stopping
            # on a non-finite step needs none (no memory, no copying every step).
            rollback = max_norm is not None or self.on_nonfinite == "skip"
            check = StepValidation(
                optimizer,
                max_norm=max_norm,
                check_finite=not fp16,
                group=self._group("pp"),
                device=self.root_device,
                overlap=overlap,
                not_counted=pipeline.tied.not_counted,
                rollback=rollback or not overlap,
            )
            pipeline.checks[id(optimizer)] = check
        check.max_norm = max_norm
        self._judge(check, check.validate(), done=True)  # nothing pending normally: training_step validated it
        extra = None
        if check.check_finite:
            extra = torch.zeros(1, device=self.root_device)
            losses = pipeline.runner.state.losses if pipeline.executor.last in pipeline.executor.stages else []
            if losses:
                finite = torch.isfinite(torch.stack(losses).float())
                # 1 + the first non-finite micro-batch, or 0: no host sync until the check's verdict
                first = torch.where(finite.all(), 0, finite.logical_not().int().argmax() + 1)
                extra = first.reshape(1).float().to(self.root_device)
        self._judge(check, check.before_step(extra=extra), done=False)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Add the gradients the pipeline computed in ``training_step`` (after Lightning's zero_grad)."""
        lm = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)  # on_before_backward
        self._stash.add_to_grads(1.0 / lm.trainer.accumulate_grad_batches)
        return self.precision_plugin.post_backward(closure_loss, lm)  # on_after_backward

    def _clip_by_norm(self, optimizer: Any, max_norm: float) -> None:
        """Lightning asks to clip by norm: by the global norm over every stage, in :meth:`_before_step`."""
        self._built("clip_gradients").max_norms[id(optimizer)] = max_norm

    def _count_checks(self) -> None:
        checks = self._pipeline.checks.values() if self._pipeline is not None else ()
        if checks:
            self._step_checks = {
                "clipped": sum(c.clipped_steps for c in checks),
                "skipped": sum(c.skipped_steps for c in checks),
                "redone": sum(c.redone_steps for c in checks),
            }

    def _share_eval_logs(self) -> None:
        """An evaluation step's logs, from the last stage to every rank of the pipeline, logged there."""
        pipeline = self._pipeline
        ex = pipeline.executor
        src = self._layout.global_rank_of(ex.schedule.stage_to_rank[ex.last])
        last = ex.last in ex.stages
        state = pipeline.runner.state if last else None
        _, means, states = share_logs(
            state, None, src, self._group("pp"), self.root_device, pipeline.metrics.end() if last else None
        )
        if not last:
            pipeline.metrics.apply(states)
        for name, (value, kw) in means.items():
            value = pipeline.metrics.resolve(value)
            # Epoch-level metrics: every rank of a pipeline holds the same value, so the mean over
            # the world is the mean over the data-parallel replicas (what one process would log).
            kw = {"sync_dist": True, **kw}
            self.lightning_module.log(
                name, value.to(self.root_device) if isinstance(value, torch.Tensor) else value, **kw
            )

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """Validation, test and predict: a forward-only pipeline pass, then ``hook`` on the last stage
        per micro-batch with the pipelined block answered by the pipeline; logs averaged and shared."""
        self._validate()  # evaluate the checked weights, not a speculative step's
        pipeline = self._built(hook)
        ex, runner = pipeline.executor, pipeline.runner
        state = runner.begin(hook, args, kwargs, self.num_microbatches, exact=False)
        pipeline.metrics.begin()
        outs = ex.forward_only(self._capture(pipeline), len(state.microbatches))
        if outs is not None:
            with pipeline.streams.fork(ex.last):  # the last stage's part of the step, after the block
                for i, out in enumerate(outs):
                    runner.provide(i, out)
        self._share_eval_logs()
        if hook != "predict_step" or outs is None:
            return None
        # predictions live on the rank holding the last stage: the micro-batches' outputs, joined
        return pytree.tree_map(
            lambda *xs: torch.cat(xs) if isinstance(xs[0], torch.Tensor) else list(xs), *state.results
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval_step("predict_step", args, kwargs)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # loading needs the partitioned model: each rank reads only its own stages

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers by parameter name

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A directory (see :mod:`lightning_twobp.lightning.checkpoint`); every rank writes its stages."""
        if storage_options is not None:
            raise TypeError(
                "TwoBPStrategy.save_checkpoint(..., storage_options=...) is not supported: the checkpoint is "
                "written with torch.distributed.checkpoint, not through a CheckpointIO plugin"
            )
        self._validate()  # save the checked weights, not a speculative step's
        path = Path(self.broadcast(str(filepath)))
        layout = {
            "pipeline_degree": self.pipeline_degree,
            "stages_per_rank": self._stages_per_rank,
            "schedule": self.schedule_name,
        }
        streams = self._pipeline.streams.state_dict() if self._pipeline is not None else None
        ckpt.save(
            checkpoint, path, self.lightning_module, self.optimizers, layout, group=self._io_group, streams=streams
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Each rank reads the weights and optimizer state of its own parameters, by name, whatever the
        pipeline degree or partition the checkpoint was saved with."""
        path = Path(self.broadcast(str(checkpoint_path)))
        lm = self.lightning_module
        streams = self._built("load_checkpoint").streams
        checkpoint = ckpt.load(
            path,
            lm,
            self.optimizers,
            weights_only,
            strict=lm.strict_loading,
            group=self._io_group,
            streams=streams.names(),
        )
        streams.resume(checkpoint.pop("twobp_streams", {}))
        # LR schedulers were saved from rank 0: a rank with other param groups keeps its own per-group
        # base learning rates (the groups' lr came back by name) and takes the shared step count.
        for config, state in zip(self.lr_scheduler_configs, checkpoint.get("lr_schedulers", []), strict=False):
            local = getattr(config.scheduler, "base_lrs", None)
            if local is not None and len(state.get("base_lrs", local)) != len(local):
                state["base_lrs"] = list(local)
                state.pop("_last_lr", None)
        # Each rank's random streams come back right before the next training step (not now: setting up
        # the loaders and the sanity check would draw from them first, which the uninterrupted run did not).
        self._resume_rng = checkpoint.pop("twobp_rng", None)
        saved = checkpoint.get("twobp", {})
        if (
            saved.get("pipeline_degree") != self.pipeline_degree
            or saved.get("stages_per_rank") != self._stages_per_rank
        ):
            rank_zero_info(
                f"twobp: resuming a checkpoint saved with pipeline_degree={saved.get('pipeline_degree')}, "
                f"stages_per_rank={saved.get('stages_per_rank')} on pipeline_degree={self.pipeline_degree}, "
                f"stages_per_rank={self._stages_per_rank}: weights and optimizer state re-partition by name"
            )
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the weights already, by name

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="2BP pipeline parallelism (lightning_twobp)")


def _register() -> None:
    if TwoBPStrategy.strategy_name not in StrategyRegistry:
        TwoBPStrategy.register_strategies(StrategyRegistry)


_register()
