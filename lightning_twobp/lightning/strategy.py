"""``Trainer(strategy="twobp")``: an unchanged LightningModule trained through a 2BP pipeline.

This class holds Lightning's hooks only; each job lives in its own module (see docs/architecture.md):
:class:`~lightning_twobp.options.PipelineOptions` checks the options, :mod:`.pipeline` builds one
Trainer call's pipeline and runs its training and evaluation steps, :mod:`.optimizer_checks` clips and
applies the non-finite policy, :mod:`.checkpoint_hooks` saves and loads, :mod:`.layout` places ranks
and stages; the engine (:class:`~lightning_twobp.engine.PipelineExecutor`) runs the schedule.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_twobp.engine import Verdict
from lightning_twobp.engine.failure import FailureChannel, check_links_open, close_links, lost_peer
from lightning_twobp.lightning import checkpoint_hooks, first_loader, pretrained
from lightning_twobp.lightning.checkpoint import CheckpointError
from lightning_twobp.lightning.checks import (
    OutsideWrites,
    check_callbacks,
    check_nodes,
    check_parameter_hooks,
    check_sync_batchnorm,
    checked_optimizers,
    converted_in_place,
)
from lightning_twobp.lightning.collectives import StepWatch
from lightning_twobp.lightning.epoch_end import computed_at_the_bars_turn
from lightning_twobp.lightning.failures import lost_rank, naming_lost, note_epoch_end, reap, told
from lightning_twobp.lightning.grads import GradStash, Window
from lightning_twobp.lightning.layout import check_degree
from lightning_twobp.lightning.loaders import (
    check_same_batch,
    check_sharded_replicas_alike,
    eval_length,
    eval_lengths,
    seed_workers_by_replica,
)
from lightning_twobp.lightning.local_model import meta_layers_aside
from lightning_twobp.lightning.materialize import Made
from lightning_twobp.lightning.optimizer_checks import HookScaleError, NonFiniteError, buffers_kept
from lightning_twobp.lightning.pipeline import Pipeline, StepRecords, StepRun, build_pipeline
from lightning_twobp.lightning.placement import PipelinePlacement
from lightning_twobp.lightning.preemption import (
    Preempted,
    StopSignals,
    exit_after_launcher,
    mark_launcher,
    take_launcher_mark,
)
from lightning_twobp.lightning.profile import said_lost_stream_batch
from lightning_twobp.lightning.step import DP_GROUP, check_batch_size_early, check_batches, log_step_values
from lightning_twobp.options import PipelineOptions
from lightning_twobp.private import layer_sync
from lightning_twobp.schedules.auto import AutoChoice, Profile

__all__ = ["HookScaleError", "NonFiniteError", "Preempted", "StepRecords", "TwoBPStrategy"]

# Seconds a rank whose step failed waits for every rank to raise too (what all of them meet at one point
# of a step, after its last message: within milliseconds) before it closes its links for the peers that
# wait on it instead.
_TOGETHER_S = 5.0
# Seconds global rank 0, whose process serves the store, waits after a failure for the other ranks to be done
# with the store (to have read the failure told there) before its on_exception returns and its process may end.
_LEAVE_S = 10.0


class TwoBPStrategy(PipelinePlacement, DDPStrategy):
    """Pipeline parallelism with 2BP for an unchanged LightningModule.

    Args:
        schedule, split_backward, num_microbatches, pipeline_degree, stages_per_rank, max_pending_w,
        memory_limit, auto_schedules, balance, layers, gather_full_model, broadcast_buffers, post_validation,
        on_nonfinite, pipeline_timeout, data_parallel, activation_checkpointing, batch_w, pretrained,
        pretrained_prefix: the
            pipeline's options, documented and checked by :class:`~lightning_twobp.options.PipelineOptions` (before any
            process starts). ``pipeline_timeout`` is also the timeout of the process group and of every
            group the strategy makes unless ``timeout`` is given (at least 60 s), so a hung rank stops
            Lightning's collectives in minutes rather than torch's default 30; checkpoint I/O gets a
            group of its own with at least 30 minutes.
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
        max_pending_w: int | Sequence[int] | None = None,
        memory_limit: float | str | None = None,
        auto_schedules: Sequence[str] | None = None,
        balance: str | Sequence[int] = "params",
        layers: str | None = None,
        placement: Literal["call", "registration"] = "call",
        gather_full_model: bool = False,
        broadcast_buffers: bool = True,
        post_validation: bool | None = None,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        pipeline_timeout: float | None = 600.0,
        data_parallel: Literal["replicate", "shard"] = "replicate",
        activation_checkpointing: str | int | None = None,
        batch_w: bool | int = False,
        pretrained: str | os.PathLike[str] | None = None,
        pretrained_prefix: str | None = None,
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
            _refuse_unknown_options(kwargs)
        # The parameters named as PipelineOptions' fields, which lists and checks them (one list).
        self.requested = PipelineOptions.from_mapping(locals())
        # What runs: the user's options, or with schedule="auto" the choice made at the first setup.
        self.options = self.requested
        self.auto_choice: AutoChoice | None = None  # schedule="auto": what it chose, and from which costs
        self.auto_profile: Profile | None = None
        # the choice was made in a fit (one made in validate is made again); it counted post-validation's copy
        self.auto_for_training = self.auto_counted_copy = False
        self.layer_seconds: list[float] | None = None  # balance="time": each layer's, timed at the first setup
        if timeout is None and pipeline_timeout is not None:
            # Lightning's own collectives (logging, checkpoints, the non-finite check) then give up on a
            # hung rank after the same time as the pipeline's waits, not after torch's 30 minutes.
            timeout = timedelta(seconds=max(float(pipeline_timeout), 60.0))
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
            **({} if timeout is None else {"timeout": timeout}),  # type: ignore[arg-type]  # mypy checks a **dict against every parameter
        )
        self._step_checks = {"clipped": 0, "skipped": 0, "redone": 0}
        self.log_group: dist.ProcessGroup | None = None  # the loss and logs' own group (pipeline > 1)
        self.io_group: dist.ProcessGroup | None = None  # checkpoint I/O's group, with a long timeout
        self.check_group: dist.ProcessGroup | None = None  # the post-validation reduce's (pipeline > 1)
        self.shape_group: dist.ProcessGroup | None = None  # stage 0's input signature's (pipeline > 1)
        self._batches_checked = False  # the training batches split into micro-batches (checked once per fit)
        self._same_batch_checked = False  # the pipeline's ranks read the same training batch (once per call)
        self._steps_watched: set[int] = set()  # the optimizers whose first step of this call was watched
        self._outside: OutsideWrites | None = None  # the parameters outside the stages, watched during training
        self._mesh: DeviceMesh | None = None
        self._pipeline: Pipeline | None = None
        self._made: Made | None = None  # a model built on meta, made during a setup that has not ended yet
        self._pretrained_read = False  # pretrained= was read in a setup that has not ended yet
        self._calls_ended = False
        self._stash = GradStash()
        self._signals: StopSignals | None = None
        self._failures: FailureChannel | None = None  # the first failure, told to every rank (see .failures)
        self._failed = False
        self.stage_sizes: list[int] | None = None  # layers per stage, once the pipeline is built
        self._resume_rng: dict[str, torch.Tensor] | None = None  # a checkpoint's random states, not yet restored
        self._record_next = False
        self._steps_this_batch = 0  # training_step calls for the current batch (see _CLOSURE_AGAIN)
        self._closure_again_said = False  # _CLOSURE_AGAIN_NORM warned (once per strategy)
        self.last_records: StepRecords | None = None  # this rank's ops of the latest recorded step

    @property
    def step_checks(self) -> dict[str, int]:
        """Optimizer steps so far whose global check changed them: ``clipped`` (by the global norm),
        ``skipped`` (a gradient was not finite) and ``redone`` (stepped speculatively, then put back and
        redone, with ``post_validation``). Kept after the Trainer call."""
        if self._pipeline is not None and self._pipeline.checks.checks:
            self._step_checks = dict(self._pipeline.checks.counts)
        return dict(self._step_checks)

    def reset_shapes(self) -> None:
        """Agree on what the stages exchange again before the next step. Call it on every rank (in the
        callback that makes the change) after freezing or unfreezing layers between steps where that changes
        whether a stage's output requires grad: a whole stage, while the stages before it are frozen. The
        first stage's own changes, and the batch's shapes, are followed without it."""
        self._built("reset_shapes").executor.reset_shapes()

    def record_next_step(self) -> None:
        """Record the next training step's ops on this rank (every rank must ask for the same step):
        :attr:`last_records` then holds their times (:class:`~lightning_twobp.engine.ActionRecord`)
        and the bytes each micro-batch's forward saved. Costs one clock read per op on that step."""
        self._record_next = True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of one pipeline sees the same batch: the data splits by data-parallel rank.
        return {"num_replicas": self.dp_degree, "rank": self.dp_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return seed_workers_by_replica(dataloader, self.dp_rank)

    # ------------------------------------------------------------------ setup and teardown
    @override
    def set_world_ranks(self) -> None:
        # Called when the Trainer is built, before Lightning launches any process.
        check_nodes(self.num_nodes, self.num_processes, self.cluster_environment)
        super().set_world_ranks()

    @override
    def setup_environment(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            check_callbacks(trainer.callbacks)  # before their own setup: weight averaging copies the model there
            check_sync_batchnorm(layer_sync(self), self.lightning_module)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        check_links_open("a new Trainer call")
        super().setup_distributed()
        check_degree(self.world_size, self.pipeline_degree)
        self._mesh = self.layout.init_mesh(self.root_device, self._timeout)
        assert self._timeout is not None  # __init__ passes a timedelta or keeps Lightning's default one
        side = self.layout.side_groups(self._timeout)  # layout.SideGroups: why each is a group of its own
        self.io_group, self.log_group, self.check_group, self.shape_group = side.io, side.logs, side.checks, side.shapes
        pp, dp = range(self.pipeline_degree), range(self.dp_degree)
        pipelines = [[self.layout.global_rank_of(r, d) for r in pp] for d in dp]
        self._signals = StopSignals(self._timeout, pipelines)  # SIGTERM and SLURM's requeue: see .preemption

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.lightning_module is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._failed = False
        self._batches_checked = self._same_batch_checked = False
        self._steps_watched = set()
        self._outside = None
        if trainer.state.fn == TrainerFn.FITTING:  # before the layers' profile reads the first batch
            self._release_loader = first_loader.hold(trainer)
            self._bar_undo = computed_at_the_bars_turn(trainer)  # the epoch's values computed in one order
        # open before the pipeline is built: schedule="auto" and balance="time" measure the layers there,
        # in collectives over the pipeline, and a rank failing while measuring is named to the others (who
        # saw only gloo's "Connection closed by peer"); the stages this rank holds are known after
        self._failures = FailureChannel.open(f"global rank {self.global_rank} (host {socket.gethostname()})")
        with told(self._failures, "the setup of the Trainer call"):
            self._pipeline = build_pipeline(self, trainer)
        if self._failures is not None:
            self._failures.me = self.describe_rank()
        self.precision_plugin = self._pipeline.precision
        converted_in_place(self.precision_plugin, self.model)
        self.model_to_device()
        if self._pipeline.tied:
            self._pipeline.tied.sync_values()
        if trainer.state.fn == TrainerFn.FITTING:
            try:
                checked_optimizers(
                    lambda: self.setup_optimizers(trainer),
                    self.lightning_module,
                    lambda: self.optimizers,
                    self.pp_rank,
                    self.stage_ids,
                    self.pipeline_degree,
                    self._pipeline.one_process,
                )
            except Exception as e:
                if not lost_peer(e):
                    self._gather_back_refused()
                raise
        # Optimizers are created after the move to the device and hold no state yet; a checkpoint's
        # state is loaded afterwards (restore_checkpoint_after_setup), by parameter name.
        self.setup_precision_plugin()
        self._made = None  # made for good: only a refusal during setup puts a meta build back
        if self._pretrained_read:  # read for good: later calls keep the model's weights
            pretrained.mark_read(self.lightning_module, str(self.options.pretrained))
            self._pretrained_read = False

    def _gather_back_refused(self) -> None:
        """The optimizers were refused on every rank at once, before any compute (:func:`.checks.checked_optimizers`):
        data_parallel="shard" stages gathered back here, every rank still at this point, so that the model is
        as built. Not in teardown: there rank 0 under Lightning's launcher first waits for the ranks it
        started to end, then kills them (``on_exception``'s reap), while they wait on it in the gather."""
        assert self._pipeline is not None
        try:
            self._pipeline.unshard_for_good(False)
        except Exception as err:  # noqa: BLE001 - the refusal is what this call raises
            warnings.warn(f"twobp: the sharded stages were not gathered back after the refusal: {err}", stacklevel=2)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown gathers nothing then: another rank may be gone
        if self._pipeline is not None and not self._pipeline.holds_last:
            note_epoch_end(exception, self.lightning_module, f"pipeline rank {self.pp_rank}")
        if self._failures is not None and not self._failures.seen and not isinstance(exception, Preempted):
            trainer = getattr(self.lightning_module, "_trainer", None)  # not attached yet: a call failing early
            step = trainer.global_step if trainer is not None else "?"
            self._failures.report(exception, f"global step {step}, outside the training step")
        self._let_peers_go(exception)
        if isinstance(exception, Preempted):  # every rank stops at this step: none needs reaping
            exit_after_launcher()  # the launcher first: its observer would SIGKILL it for a rank's 143
        else:
            reap(self.launcher)  # rank 0 under Lightning's launcher: no rank it started outlives it
        if self._failures is not None:  # after reap: a stopped rank killed there lets the ranks waiting on it go
            self._failures.leave(wait=_LEAVE_S)
        super().on_exception(exception)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self.cluster_environment is not None
        if self._start_method == "popen" and not self.cluster_environment.creates_processes_externally:
            mark_launcher()  # this process starts the other ranks: they know it (exit_after_launcher)
        else:
            take_launcher_mark()

    def _let_peers_go(self, exception: BaseException) -> None:
        """Told; now the peers that wait on this rank must see it go, even if the user's script catches the
        error and this process lives on: close its links, at once where it lost a peer (the run is broken),
        after a few seconds where the error is its own: in a step (the later stages wait on it for data) or
        between steps (a callback of this rank's: the others wait for it in the next step or collective).
        Not for what every rank raises: at a step boundary (preemption, a non-finite or hand-clipped step, a
        full disk) or at one point (a logged value Lightning refuses, a check of the batch), seen as every rank
        on the roll within those seconds. Those leave the groups usable, for a script that catches the error and
        goes on. A setup error of this rank's own counts too: under schedule="auto" or balance="time" the others wait
        on it in the layers' measuring, and under a named schedule in the first step."""
        if self._failures is None:
            return
        if isinstance(exception, (Preempted, NonFiniteError, HookScaleError, CheckpointError)):
            return
        self._failures.mark_failed()  # on the roll (a step's error is already, through told)
        if lost_peer(exception) or not self._failures.everyone_failed(wait=_TOGETHER_S):
            close_links(self._failures.first(wait=0.0) or "")

    @override
    def on_train_end(self) -> None:
        self._validate()  # the last optimizer step's verdict: the trained weights are the checked ones
        if self._signals is not None:
            with self._naming_lost("the stop-signal agreement of the last step"):
                self._signals.close()
        if self._pipeline is not None and self._pipeline.logs is not None:
            self._pipeline.logs.flush()
        if self._outside is not None:  # a write in the last step or epoch (on_train_epoch_end) too
            with self._naming_lost("the end-of-training check of the parameters outside the pipeline"):
                self._outside.check_everywhere("at the end of training")
        super().on_train_end()

    @override
    def teardown(self) -> None:
        """Sharded stages gathered whole, Lightning's teardown (optimizers and model to the CPU), then the
        model is put back whole and the precision plugin is Lightning's own again, with the trained loss
        scale."""
        self._step_checks = self.step_checks  # kept after the pipeline goes
        self._let_loader_go()  # a call that ended before training
        pipeline, self._pipeline = self._pipeline, None
        self._calls_ended = self._calls_ended or pipeline is not None
        if self._failures is not None:  # for global rank 0's wait, where it failed alone (FailureChannel.leave)
            self._failures.done()
        self._failures = None  # this call's: the next call opens its own
        if self._signals is not None:
            self._signals.uninstall()
        vars(self).pop("_bar_undo", lambda: None)()
        lm = self.lightning_module
        if pipeline is not None:
            # data_parallel="shard": gathered on the device, before Lightning moves the model to the CPU (a
            # DTensor moved there keeps its mesh, whose NCCL groups cannot gather CPU tensors)
            pipeline.unshard_for_good(self._failed)
        # the layers a previous call left on the meta device cannot move to the CPU, and the error
        # raised trying would hide the one that ended this call
        with meta_layers_aside(lm) if lm is not None else nullcontext():
            super().teardown()
        if pipeline is not None:
            self._take_apart(pipeline)
        if self._made is not None:  # refused during setup: the model as built, so that a retry makes it again
            self._made.undo()
            self._made = None
        self._pretrained_read = False  # refused during setup: the next call reads them again

    def _take_apart(self, pipeline: Pipeline) -> None:
        # under schedule="auto" after an evaluation call made the choice, the first fit chooses again and times
        # every layer on every rank (pipeline._searches): every rank keeps the whole model for it
        whole = self.options.gather_full_model or (self.requested.schedule == "auto" and not self.auto_for_training)
        gather = whole and not self._failed and dist.is_initialized()
        pipeline.local.restore(gather, self.group("pp"), self.pp_rank, self.root_device)
        pipeline.scope.close()
        user_scaler = pipeline.user_scaler
        ours: Any = self.precision_plugin  # the pipelined copy (grads.pipelined_precision), a class made at run time
        if user_scaler is not None and ours.scaler is not user_scaler and user_scaler.is_enabled():
            user_scaler.load_state_dict(ours.scaler.state_dict())
        self.precision_plugin = pipeline.user_precision

    # ------------------------------------------------------------------ training
    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.sanity_checking and not self._batches_checked:
            check_batch_size_early(trainer, self.num_microbatches)
        self._evaluation_starts("validation")
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._evaluation_starts("test")
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._evaluation_starts("predict")
        super().on_predict_start()

    def _evaluation_starts(self, kind: str) -> None:
        """Every rank at an evaluation's start: stop signals heard from here (in an evaluation call, agreed
        per batch: every rank learns each replica's batch counts), the buffers made replica 0's."""
        self._listen_for_signals()
        trainer = self.lightning_module.trainer
        if self._signals is not None and trainer.state.fn != TrainerFn.FITTING:
            with self._naming_lost("the exchange of every replica's evaluation batch counts"):
                self._signals.plan_evaluation(eval_lengths(trainer, kind))
        if self._pipeline is not None:
            with self._naming_lost("the broadcast of replica 0's buffers"):
                self._pipeline.sync_buffers()

    def _listen_for_signals(self) -> None:
        """Our handler from the start of evaluation too (fit's sanity check, validate, test, predict):
        Lightning's own broadcasts inside the handler, which the peers, in a pipeline step, never join
        (``trainer.validate`` waited out pipeline_timeout, then named a lost peer). An evaluation call
        stops at an agreed batch (:meth:`_eval_step`); fit at its next training step."""
        if self._signals is not None:
            self._signals.install(self.lightning_module.trainer)

    @override
    def on_validation_end(self) -> None:
        self._end_agreement("validation")
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._end_agreement("test")
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._end_agreement("predict")
        super().on_predict_end()

    def _end_agreement(self, kind: str) -> None:
        """An evaluation call's end: no reduce of ours left in flight, and a stop flagged in its last batch
        raised here, on every rank. Not in fit, where training's steps go on reading the agreement (a stop
        flagged in the last evaluation batch included)."""
        trainer = self.lightning_module.trainer
        if self._signals is not None and trainer.state.fn != TrainerFn.FITTING:
            with self._naming_lost("the stop-signal agreement of the last batch"):
                self._signals.close(f"the end of the {kind} call")

    def _let_loader_go(self) -> None:
        """first_loader.hold's release, once (set in setup, for a fit)."""
        vars(self).pop("_release_loader", lambda: None)()

    @override
    def on_train_start(self) -> None:
        self._let_loader_go()  # the fit loop has its loader: a reload later runs the hook, as in one process
        scheduled_accumulation_on_restart(self.lightning_module.trainer)
        loader = self.lightning_module.trainer.train_dataloader
        if not self._batches_checked and loader is not None:
            check_batches(loader, self.num_microbatches)
            self._batches_checked = True
        if self._signals is not None:  # after Lightning registered its handlers, which this replaces
            self._signals.install(self.lightning_module.trainer)
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._resume_rng is not None:
            checkpoint_hooks.set_rng_state(self._resume_rng)
            self._resume_rng = None
        self._built("on_train_batch_start").streams.apply_pending()
        # The call's first batch only: a blocking collective here each epoch would wait on a stopped peer for
        # the process group's timeout, not pipeline_timeout (the pipeline's own first step follows at once).
        if not self._same_batch_checked:
            # hooks registered after the setup's check (in on_fit_start, on_train_start, ...): every rank refuses
            stages = self._built("on_train_batch_start").local.stages
            when = "before the first training step (registered in on_fit_start, on_train_start or on_train_batch_start)"
            with self._naming_lost("the check of the parameters' gradient hooks"):
                check_parameter_hooks(self.lightning_module, stages, when)
            step = self.lightning_module.trainer.global_step
            length = ("training loaders", float(self.lightning_module.trainer.num_training_batches))
            self._check_same_batch(batch, f"training batch {batch_idx} (global step {step})", length)
            self._same_batch_checked = True
            said_lost_stream_batch(self.lightning_module.trainer, batch)
        self._check_outside()
        self._steps_this_batch = 0  # Lightning's closure runs training_step; an optimizer may call it again (SAM)
        if self._signals is not None:  # every rank stops before the same step once one was signalled
            with self._naming_lost("the stop-signal agreement of the previous step"):
                self._signals.agree(f"training step {self.lightning_module.trainer.global_step}")
        super().on_train_batch_start(batch, batch_idx)

    def _check_outside(self) -> None:
        """The parameters outside the stages, written since the call's first batch (or a checkpoint's load)?
        (:class:`.checks.OutsideWrites`)"""
        step = self.lightning_module.trainer.global_step
        if self._outside is None:
            self._outside = OutsideWrites(self.lightning_module, self._built("on_train_batch_start").local.stages)
            return
        with told(self._failures, f"global step {step}"):
            self._outside.check(f"before global step {step}")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        with told(self._failures, f"global step {trainer.global_step}"):
            loss = self._training_step(args, kwargs)
        if self._signals is not None:  # a stop agreed now keeps the loader's position for its checkpoint
            loop = trainer.fit_loop
            ended, steps = loop.epoch_loop.batch_progress.is_last_batch, Window.of(trainer).last
            with self._naming_lost("the stop-signal agreement of this step"):
                self._signals.settle(lambda: loop.on_save_checkpoint().get("combined_loader"), ended, steps)
        return loss

    def _training_step(self, args: tuple, kwargs: dict) -> Any:
        pipeline = self._built("training_step")
        self._steps_this_batch += 1
        if self._steps_this_batch > 1 and pipeline.checks.may_redo:
            raise RuntimeError(_CLOSURE_AGAIN.format(n=self._steps_this_batch, schedule=self.options.schedule))
        if self._steps_this_batch == 2 and self.pipeline_degree > 1 and not self._closure_again_said:
            self._closure_again_said = True
            warnings.warn(_CLOSURE_AGAIN_NORM, UserWarning, stacklevel=2)
        put_back = self._redo_from(pipeline)
        loss, means = self._train_step(pipeline, args, kwargs)
        verdict = self._validate()  # the previous optimizer step's global check, long arrived
        if verdict is not None and verdict.redone:
            # That step was clipped or skipped after all: this step ran on the speculative weights.
            pipeline.metrics.undo()
            if put_back is not None:  # its buffer writes (BatchNorm's statistics) and draws happen once, in the rerun
                put_back()
            loss, means = self._train_step(pipeline, args, kwargs)
        log_step_values(self.lightning_module, means, pipeline.metrics.resolve, self.root_device, False)
        skipped = self.step_checks["skipped"]  # every rank knows the count: nothing travels
        if skipped:
            self.lightning_module.log("pipeline/skipped_steps", float(skipped), on_step=True, on_epoch=False)
        return loss.to(self.root_device)

    def _redo_from(self, pipeline: Pipeline) -> Callable[[], None] | None:
        """While an optimizer step's verdict is pending: this rank's buffers and random streams as they are
        before the step, put back by the returned function should the step run again (None: no verdict
        pending, nothing can be redone)."""
        if not pipeline.checks.pending:
            return None
        buffers, streams = buffers_kept(self.lightning_module), pipeline.streams.kept()

        def put_back() -> None:
            buffers()
            streams()

        return put_back

    def _train_step(self, pipeline: Pipeline, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
        pipeline.runner.begin("training_step", args, kwargs, self.num_microbatches, exact=True)
        run = StepRun(f"global step {self.lightning_module.trainer.global_step}", record=self._record_next)
        if pipeline.tied:  # before the trained parameters are listed: a tied weight's copies frozen alike
            with self._naming_lost("the agreement of the tied weights' requires_grad"):
                pipeline.tied.agree_requires_grad()
        params = [q for q in self.lightning_module.parameters() if q.requires_grad]
        result = pipeline.train_step(self._stash, params, run, Window.of(self.lightning_module.trainer))
        if run.records is not None:
            self._record_next, self.last_records = False, run.records
        return result

    def _check_same_batch(self, batch: Any, where: str, length: tuple[str, float] | None = None) -> None:
        """Every rank of this pipeline holds the same batch, from loaders of the same ``length`` (what, batches)
        (:func:`.loaders.check_same_batch`)."""
        ranks = [self.layout.global_rank_of(r) for r in range(self.pipeline_degree)]
        with self._naming_lost("the check that the pipeline's ranks read the same batch"):
            check_same_batch(batch, self.group("pp"), self.root_device, where, ranks, length)

    def _check_sharded_replicas(self, length: tuple[str, float] | None) -> None:
        """The sharded replicas of this rank's stages read as many batches of this evaluation loader
        (:func:`.loaders.check_sharded_replicas_alike`)."""
        ranks = [self.layout.global_rank_of(self.pp_rank, d) for d in range(self.dp_degree)]
        with self._naming_lost("the check that the sharded replicas read as many evaluation batches"):
            check_sharded_replicas_alike(length, self.group("dp"), self.root_device, ranks)

    def _pipeline_loss(self, output: Any, index: int) -> torch.Tensor:
        """The executor's loss function (bound before the pipeline exists)."""
        return self._built("training_step").loss(output, index)

    def _naming_lost(self, what: str) -> Any:
        """Around a collective over every rank: a lost rank is named (see :func:`.failures.naming_lost`), or
        the failure it told (an error of its own between steps, a callback's: :class:`PeerFailed`)."""
        replicas = self._pipeline.replicas if self._pipeline is not None else ""
        if not dist.is_initialized():
            return nullcontext()
        stack = ExitStack()
        # a rank's own error told before is named; a loss is named by this rank's own roll call, not relayed
        stack.enter_context(told(self._failures, what, relay_losses=False))
        stack.enter_context(naming_lost(what, lambda: lost_rank(self._failures, replicas)))
        return stack

    def _validate(self) -> Verdict | None:
        """The pending speculative optimizer step's verdict, if any (see ``post_validation``)."""
        if self._pipeline is None:
            return None
        with self._naming_lost("the global gradient norm and non-finite check"):
            return self._pipeline.checks.validate(self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step; an optimizer's first step of the call with its collectives watched: one over a group
        holding other pipeline stages is refused before it runs (:class:`.collectives.StepWatch`)."""
        if id(optimizer) in self._steps_watched or self.pipeline_degree == 1 or not dist.is_initialized():
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        replicas = dist.get_process_group_ranks(self.group("dp"))
        watch = StepWatch(optimizer, replicas, self.pipeline_degree, self.group("pp"))
        with watch.around():
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if watch.stepped or not isinstance(optimizer, torch.optim.Optimizer):  # else the next step is its first
            self._steps_watched.add(id(optimizer))
        return out

    def _before_step(self, optimizer: Any) -> None:
        """Right before each optimizer step (the precision plugin calls it): the global check."""
        pipeline = self._built("optimizer_step")
        scaler = getattr(self.precision_plugin, "scaler", None)
        with self._naming_lost("the global gradient norm and non-finite check"):
            pipeline.checks.before_step(self.lightning_module, optimizer, scaler, pipeline.named_losses(self.dp_rank))

    # Lightning's collectives, named when a rank is lost. In Lightning's on_exception hooks after an error
    # its peers did not all raise, they answer for this rank alone: the peers are not at that point, and a
    # collective there would meet a different one of theirs (ModelCheckpoint(save_on_exception=True) asks
    # rank 0 whether last.ckpt exists while rank 0 asks it in its own save: a deadlock until the timeout).
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(group, str) and group == DP_GROUP:  # a value the pipeline logged (step.log_step_values)
            group = self.group("dp")
        what = "Lightning's reduce of a logged value (self.log(..., sync_dist=True))"
        return self._collective(what, tensor, lambda: super(TwoBPStrategy, self).reduce(tensor, group, reduce_op))

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._collective("Lightning's barrier", None, lambda: super(TwoBPStrategy, self).barrier(*args, **kwargs))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        what = "Lightning's broadcast (a checkpoint path, a callback's state)"
        return self._collective(what, obj, lambda: super(TwoBPStrategy, self).broadcast(obj, src))

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        what = "Lightning's agreement on a decision (a checkpoint file's existence, a stop)"
        return self._collective(
            what, decision, lambda: super(TwoBPStrategy, self).reduce_boolean_decision(decision, all)
        )

    def _collective(self, what: str, alone: Any, call: Callable[[], Any]) -> Any:
        """``call()`` (one of Lightning's collectives), named when a rank is lost; ``alone`` where this rank
        answers for itself (:meth:`_alone`)."""
        if self._alone():
            return alone
        with self._naming_lost(what):
            return call()

    def _alone(self) -> bool:
        """Whether Lightning is handling an error on this rank that its peers did not all raise at one step
        boundary (see :func:`.failures.save_refused`)."""
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if checkpoint_hooks.refusal(trainer, self._failures) is None:
            return False
        if self._failures is not None:  # on the roll now: the slower on_exception hooks still to run count not
            self._failures.mark_failed()
        return True

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Add the gradients the pipeline computed in ``training_step`` (after Lightning's zero_grad)."""
        lm = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)  # on_before_backward
        self._stash.add_to_grads(1.0 / lm.trainer.accumulate_grad_batches)
        self._built("backward").checks.grads_before_hooks(optimizer)
        return self.precision_plugin.post_backward(closure_loss, lm)  # on_after_backward

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        self._validate()  # evaluate the checked weights, not a speculative step's
        pipeline = self._built(hook)
        schedule = pipeline.executor.schedule
        last_rank = self.layout.global_rank_of(schedule.stage_to_rank[pipeline.executor.last])
        kind = hook.removesuffix("_step")
        index = args[1] if len(args) > 1 and isinstance(args[1], int) else None  # None: a dataloader_iter
        loader = args[2] if len(args) > 2 else 0
        if index == 0:  # each loader's first batch
            length = eval_length(self.lightning_module.trainer, kind, loader)
            self._check_same_batch(args[0], f"the first batch of a {kind} loader", length)
            if pipeline.sharding is not None and self.dp_degree > 1:
                self._check_sharded_replicas(length)
        # An evaluation call stops before one batch on every rank once one was signalled; in fit, the next
        # training step does.
        signals = self._signals if self.lightning_module.trainer.state.fn != TrainerFn.FITTING else None
        if signals is not None:
            with self._naming_lost("the stop-signal agreement of the previous batch"):
                signals.agree_batch(kind, loader, index)
        state = pipeline.runner.begin(hook, args, kwargs, self.num_microbatches, exact=False)
        out = pipeline.eval_step(state, hook, last_rank, self.group("pp"))
        if signals is not None:  # a replica's last batch: it joins the agreements of the batches others read on
            with self._naming_lost("the stop-signal agreement of the batches other replicas read on"):
                signals.after_batch(kind, loader, index)
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context(), told(self._failures, "a validation step"):
            return self._eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context(), told(self._failures, "a test step"):
            return self._eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context(), told(self._failures, "a prediction step"):
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
        checkpoint_hooks.check_storage_options(storage_options)
        check_links_open("saving a checkpoint")
        refused = checkpoint_hooks.refusal(self.lightning_module.trainer, self._failures)
        if refused is None:
            self._validate()  # save the checked weights, not a speculative step's
            refused = self._pipeline.checks.save_refusal() if self._pipeline is not None else None
        checkpoint = checkpoint_hooks.at_stop(checkpoint, self._signals.loader_states if self._signals else None)
        checkpoint_hooks.save(self, checkpoint, filepath, self._pipeline, self._failures, refused)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Each rank reads the weights and optimizer state of its own parameters, by name, whatever the
        pipeline degree or partition the checkpoint was saved with."""
        streams = self._built("load_checkpoint").streams
        checkpoint, self._resume_rng = checkpoint_hooks.load(self, checkpoint_path, weights_only, streams)
        # its weights are the checkpoint's: pretrained= is not read in later calls
        pretrained.mark_read(self.lightning_module, f"the checkpoint {checkpoint_path}")
        self._outside = None  # the load writes every parameter (a LearningRateFinder callback's restore, mid-fit)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the weights already, by name

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="2BP pipeline parallelism (lightning_twobp)")


# The same batch's training_step again within one optimizer step: the optimizer called Lightning's closure
# twice (SAM: ascent, then descent). Post-validation keeps a copy and redoes a clipped or skipped step by
# optimizer.step() alone, which a closure-driven step cannot be (found by a trial: SAM under zb-h2 with
# clipping stopped with "SAM.step() missing 1 required positional argument: 'closure'"; an optimizer whose
# closure is optional would have been redone without its second pass, silently).
_CLOSURE_AGAIN = (
    "twobp: training_step ran {n} times for one batch: the optimizer calls Lightning's closure more than once "
    "per step (SAM-style), which post-validation (schedule='{schedule}' with gradient_clip_val or "
    "on_nonfinite='skip') cannot redo: a step it clips or skips after the fact is redone by optimizer.step() "
    "with the saved gradients, without the closure. Use TwoBPStrategy(post_validation=False), which checks "
    "before each step (exact), or a schedule that checks first (1f1b, zb-h1)"
)

# Said once, where nothing is refused: each run of the closure is exact, but what the optimizer computes over
# "all" of its parameters is over this rank's (found by a trial: SAM's ||g|| per rank, 0.0074 off one process
# after 6 steps, silently; summed over the pipeline's group it matched, 1.2e-7).
_CLOSURE_AGAIN_NORM = (
    "twobp: training_step ran 2 times for one batch: the optimizer calls Lightning's closure again within its step "
    "(SAM-style). Each call runs the pipeline and is exact, but each rank's optimizer holds only its own stages' "
    "parameters: a norm or dot product over all of them (SAM's ||g|| for its perturbation) is this rank's, not "
    "the model's, and trains differently from one process. Sum it over the pipeline: "
    "torch.distributed.all_reduce(norm_squared, group=trainer.strategy.group('pp'))"
)


def _register() -> None:
    if TwoBPStrategy.strategy_name not in StrategyRegistry:
        TwoBPStrategy.register_strategies(StrategyRegistry)


_register()


def _refuse_unknown_options(kwargs: dict[str, Any]) -> None:
    """``TwoBPStrategy(**kwargs)`` beyond its own parameters: DistributedDataParallel's options (which DDPStrategy
    passes on) do not apply; any other name is a typo, said with the nearest option."""
    import difflib
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    ddp = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
    own = [n for n in inspect.signature(TwoBPStrategy.__init__).parameters if n not in ("self", "kwargs")]
    typos = sorted(k for k in kwargs if k not in ddp)
    if typos:
        hints = []
        for k in typos:
            near = difflib.get_close_matches(k, own, n=1)
            hints.append(f"{k} (did you mean {near[0]}?)" if near else k)
        raise TypeError(f"TwoBPStrategy got unknown option(s) {', '.join(hints)}; its options are {', '.join(own)}")
    raise TypeError(
        f"TwoBPStrategy got {', '.join(sorted(kwargs))}: DistributedDataParallel's options do not apply "
        f"(the pipeline schedule computes the gradients and reduces them over data-parallel replicas "
        f"itself); remove them"
    )


def scheduled_accumulation_on_restart(trainer: Any) -> None:
    """A fit resumed mid-epoch accumulates as the epoch's ``GradientAccumulationScheduler`` says. Lightning
    (2.6) skips ``on_train_epoch_start`` for the epoch it restarts in, where that callback sets
    ``trainer.accumulate_grad_batches``: the resumed epoch stepped the optimizer after every batch (the
    Trainer's default, 1), one process alike. A checkpoint saved mid-epoch, and the stop of a preemption
    as an epoch begins (the epoch started), resume so. Set here, before the epoch's first batch, as the
    hook would have."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    if not getattr(trainer.fit_loop, "restarted_mid_epoch", False):
        return
    for callback in trainer.callbacks:
        if isinstance(callback, GradientAccumulationScheduler):
            trainer.accumulate_grad_batches = callback.get_accumulate_grad_batches(trainer.current_epoch)
