"""What one Trainer call builds in ``setup`` and ``teardown`` takes apart: :func:`build_pipeline` finds
the pipelined layers, partitions them, builds the schedule, cuts the model and assembles the
executor, the log channel, the tied parameters, the random streams, the metrics and the optimizer
checks into one :class:`Pipeline`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.engine.memory import cpu_heap
from lightning_twobp.lightning import pretrained
from lightning_twobp.lightning.autoschedule import StepHoldings, auto_schedule
from lightning_twobp.lightning.call_order import place_by_call_order
from lightning_twobp.lightning.checkpointing import AUTO_MODES, apply_activation_checkpointing, check_auto_with_switches
from lightning_twobp.lightning.checks import check_parameter_hooks
from lightning_twobp.lightning.compiled import check_not_compiled
from lightning_twobp.lightning.contract import SequentialContract, find_contract
from lightning_twobp.lightning.failures import naming_lost
from lightning_twobp.lightning.grads import (
    GradStash,
    ReplicaReduce,
    TiedParameters,
    Window,
    overflow_agreeing_scaler,
    pipelined_precision,
)
from lightning_twobp.lightning.layout import check_degree, schedule_label
from lightning_twobp.lightning.loaders import keep_users_sampler
from lightning_twobp.lightning.local_model import LocalModel, left_on_meta, split_model
from lightning_twobp.lightning.logs import LogChannel
from lightning_twobp.lightning.materialize import (
    built_on_meta,
    check_timed_layers_here,
    materialize,
    warn_made,
)
from lightning_twobp.lightning.metrics import StepMetrics
from lightning_twobp.lightning.modulelist_contract import ModuleListContract, caches_off, fastpath_off
from lightning_twobp.lightning.optimizer_checks import OptimizerChecks, hooks_may_scale_grads
from lightning_twobp.lightning.optimizer_groups import OneProcess, whole_model_places
from lightning_twobp.lightning.outside_modules import LooseParameter
from lightning_twobp.lightning.pretrained import Plan
from lightning_twobp.lightning.profile import profile_layers
from lightning_twobp.lightning.quiet import known_warnings_off
from lightning_twobp.lightning.replica_buffers import ReplicaBuffers
from lightning_twobp.lightning.rng import StageStreams, fingerprint
from lightning_twobp.lightning.sharding import (
    ShardedStages,
    check_replicas,
    check_stages,
    mixed_precision,
    replica_names,
)
from lightning_twobp.lightning.step import (
    Logs,
    StepRunner,
    batch_size,
    join_predictions,
    log_step_values,
    placeholder_holders,
    share_logs,
    step_means,
)
from lightning_twobp.partition import partition
from lightning_twobp.schedules import Schedule, build_schedule
from lightning_twobp.schedules.fusion import fused_note

if TYPE_CHECKING:
    from lightning_twobp.lightning.strategy import TwoBPStrategy
    from lightning_twobp.options import PipelineOptions

log = logging.getLogger(__name__)

__all__ = ["Pipeline", "StepRecords", "StepRun", "build_pipeline"]


@dataclass(frozen=True)
class StepRecords:
    """One recorded training step on this rank: its ops as they ran, and each (stage, micro-batch)'s
    saved bytes."""

    records: list[Any]
    held_bytes: dict[tuple[int, int], int]


@dataclass
class StepRun:
    """One training step's settings and what it leaves: whether to record its ops, its name in errors."""

    label: str
    record: bool = False
    records: StepRecords | None = None


@dataclass
class Pipeline:
    """Everything one Trainer call builds in ``setup`` and ``teardown`` takes apart."""

    local: LocalModel
    executor: PipelineExecutor
    runner: StepRunner
    tied: TiedParameters
    user_precision: Any  # the precision plugin as Lightning gave it (``precision`` is ours, a copy)
    user_scaler: Any  # its GradScaler, or None; gets the trained scale back at teardown
    precision: Any  # the plugin the strategy uses during the call
    logs: LogChannel | None  # the last stage's loss and logs to the other ranks (None: one rank)
    scope: ExitStack  # what the Trainer call changed outside the model, undone at teardown
    streams: StageStreams  # this rank's stages' random streams
    metrics: StepMetrics  # the module's torchmetrics Metrics, accumulated per step over its micro-batches
    checks: OptimizerChecks  # clipping and the non-finite policy, per optimizer
    means: Logs = field(default_factory=dict)  # the training step's logged means (last stage)
    sharding: ShardedStages | None = None  # data_parallel="shard": the stages' FSDP2 shards
    replicas: str = ""  # this rank's data-parallel peers, "global rank 2 (host b)", named when lost
    buffers: ReplicaBuffers | None = None  # with several replicas: replica 0's buffers before each step
    reduce: ReplicaReduce | None = None  # replicated data parallelism: the executor's grad_reduce
    one_process: OneProcess | None = None  # the optimizers' places in one process (fit, p > 1)

    def sync_buffers(self) -> None:
        """Before a training step's first forward and at an evaluation's start (its replicas may read
        different numbers of batches), as DDP's ``broadcast_buffers``: :mod:`.replica_buffers`."""
        if self.buffers is not None:  # a lost replica is named, as the sharded stages' all-gather names it
            with naming_lost(
                "the broadcast of replica 0's buffers", lambda: f"a data-parallel replica, {self.replicas},"
            ):
                self.buffers.sync()

    def unshard_for_good(self, failed: bool) -> None:
        """data_parallel="shard", at teardown: this rank's stages hold their full weights again as plain
        parameters (one all-gather per stage), so the model is a model again."""
        if self.sharding is not None:
            self.sharding.unshard_for_good(failed)
            if not self.sharding.modules:  # the user's Parameters hold the weights again (after a failure: the shards)
                self.local.follow({})

    @property
    def holds_last(self) -> bool:
        return self.executor.last in self.executor.stages

    def named_losses(self, dp_rank: int) -> list[torch.Tensor]:
        """The micro-batch losses whose first non-finite one the optimizer check names: the last stage's,
        from one replica only (under data_parallel="shard" the check sums over every replica)."""
        one = self.sharding is None or dp_rank == 0
        return self.runner.current.losses if self.holds_last and one else []

    def capture(self) -> list[tuple] | None:
        """The first stage's inputs: its part of the step, up to the pipelined block, per micro-batch,
        drawing what the last stage's part draws there (:meth:`.rng.StageStreams.step_code`; the last
        stage's part runs inside its F)."""
        if 0 not in self.executor.stages:
            return None
        inputs = [self.runner.capture(i) for i in range(len(self.runner.current.microbatches))]
        self.metrics.clear()  # what this part updated counts where the last stage runs it again
        return inputs

    def train_step(
        self, stash: GradStash, params: list[nn.Parameter], run: StepRun, window: Window
    ) -> tuple[torch.Tensor, Logs]:
        """One pipeline step over the micro-batches ``runner.begin`` made: the gradients set aside in
        ``stash`` for ``backward``, the mean loss and the logged means on every rank of the pipeline."""
        ex = self.executor
        self.sync_buffers()
        carry = self._once_per_window(window)
        with stash.collect(params, carry is not None, window.dropped), self.precision.train_step_context():
            self.metrics.begin()  # before any part of the step runs on this rank
            inputs = self.capture()
            targets = list(range(len(self.runner.current.microbatches))) if self.holds_last else None
            # With a GradScaler (fp16), the pipeline's backward starts from the scaled loss, as
            # Lightning's backward would; the scaler unscales before clipping and stepping.
            scaler = getattr(self.precision, "scaler", None)
            ex.record = run.record
            ex.step_label = run.label  # named so in errors
            if self.sharding is not None:  # gathered once per step, held through the stage's last W
                self.sharding.gather(lambda s: ex.stages[s].refresh_parameters())
            try:
                scale = float(scaler.get_scale()) if scaler is not None else 1.0
                # a window's last micro-step carrying the earlier ones: its gradients from loss / k, as backward's
                result = ex.step(inputs, targets, loss_scale=scale / carry if carry is not None else scale)
            except BaseException:
                if self.sharding is not None:
                    self.sharding.release()
                raise
            ex.record = False
            if run.record:
                run.records = StepRecords(list(result.records), dict(result.held_bytes))
            if self.tied and (self.reduce is None or self.reduce.now):
                # without a window-wide reduce, every micro-step sums its own gradients only
                self.tied.reduce_grads({id(q) for q in params} if self.reduce is None else None)
        if self.holds_last:
            assert result.loss is not None  # the last stage's rank has the loss
            return result.loss, self.means
        assert self.logs is not None
        try:
            loss, means, states, stop = self.logs.receive()
        except RuntimeError as e:  # the last stage's rank died after this rank's last action
            last = self.executor.schedule.stage_to_rank[self.executor.last]
            raise self.executor.peer_lost(last, "the step's loss and logs", e) from e
        self.metrics.apply(states)
        _stop_too(self.runner.module, stop)
        return loss, means

    def _once_per_window(self, window: Window) -> int | None:
        """Replicated data parallelism reduces once per accumulation window, as DDP's ``no_sync`` (and the tied
        parameters' sum over their ranks with it, their window's gradients being as local): on its last
        micro-step, whose :meth:`GradStash.collect` carries the earlier ones' gradients into the reduce, its own
        backward from the loss over the returned length (k), as Lightning's. Sharded stages reduce-scatter each
        micro-step, as FSDP2 does by default, so that no unsharded gradient outlives its step."""
        if self.reduce is None:
            return None
        if window.first:
            self.reduce.begin_window()
        self.reduce.now = window.last
        return window.length if window.last and not window.first else None

    def eval_step(self, state: Any, hook: str, last_rank: int, group: Any) -> Any:
        """Validation, test and predict: a forward-only pipeline pass, then ``hook`` on the last stage per
        micro-batch with the pipelined block answered by the pipeline; the logs shared from
        ``last_rank`` (global) over ``group`` and logged on every rank (synchronised over the data-parallel
        group); the predictions, joined.
        ``state``: the step's micro-batches, from ``runner.begin`` (the batch split before any message)."""
        ex, runner = self.executor, self.runner
        self.metrics.begin()
        if self.sharding is not None:  # gathered here, not by FSDP2's hooks: a lost replica is named
            self.sharding.gather(lambda s: ex.stages[s].refresh_parameters())
        outs = ex.forward_only(self.capture(), len(state.microbatches))
        if self.sharding is not None:  # the gathered parameters are freed again once forward-only is done
            self.sharding.release()
        if outs is not None:
            with self.streams.fork(ex.last):  # the last stage's part of the step, after the block
                for i, out in enumerate(outs):
                    runner.provide(i, out)
            runner.say_dropped()
        # predictions live on the rank holding the last stage: the micro-batches' outputs, joined before the
        # logs are shared, so that a refusal there reaches the other ranks as a failed step (joined after,
        # they returned as if predict had worked and their next call waited on this rank)
        predictions = None
        if hook == "predict_step" and outs is not None:
            predictions = join_predictions(state.results, [batch_size(mb) for mb in state.microbatches])
        self._log_eval_means(last_rank, group)
        return predictions

    def _log_eval_means(self, src: int, group: Any) -> None:
        """An evaluation step's logs, from the last stage to every rank of the pipeline, logged there."""
        last = self.holds_last
        device = self.executor.device
        states = self.metrics.end() if last else None
        stop = self.runner.module.trainer.should_stop if last else None
        _, means, states, stop = share_logs(self.runner.state if last else None, None, src, group, device, states, stop)
        if not last:
            self.metrics.apply(states)
            _stop_too(self.runner.module, stop)
        # Synchronised unless the step says otherwise: the epoch value over the replicas, as one process.
        log_step_values(self.runner.module, means, self.metrics.resolve, device, sync=True)

    def loss(self, output: Any, index: int) -> torch.Tensor:
        """The executor's loss: the user's step on micro-batch ``index``; after the last one the loss and
        the logs leave for the other ranks at once (:class:`~.logs.LogChannel`), not at the step's end."""
        runner = self.runner
        loss = runner.loss(output, index)
        if index == len(runner.current.microbatches) - 1:
            states = self.metrics.end()
            self.means = step_means(runner.current)
            if self.logs is not None:
                self.logs.send(runner.mean_loss(), self.means, states, stop=runner.module.trainer.should_stop)
        return loss


def _name_parameters(executor: PipelineExecutor, local: Any, lm: Any) -> None:
    """The stages' messages name a parameter as the model does, with the stage holding it."""
    stage_of = {id(q): s for s, m in local.stages.items() for q in m.parameters()}
    names = {}
    for n, q in lm.named_parameters():
        names[id(q)] = f"{n} (pipeline stage {stage_of[id(q)]})" if id(q) in stage_of else n
    # The set-aside layers' tensors (on the meta device here) are named too: a forward that reaches one directly,
    # not through its module (torchtune's TiedLinear keeps the embedding module outside the module tree), meets it.
    contract, bounds = local.contract, local.bounds
    for i, layer in local.removed.items():
        held_on = next(s for s in range(len(bounds) - 1) if bounds[s] <= i < bounds[s + 1])
        for n, q in layer.named_parameters():
            full = contract.parameter_name(i, n)
            full = full if contract.name in ("", "forward") else f"{contract.name}.{full}"
            names.setdefault(id(q), f"{full} (pipeline stage {held_on}, held by pipeline rank {local.owner[i]})")
    for stage in executor.stages.values():
        stage.names = names


def _stop_too(lm: Any, stop: bool) -> None:
    """A rank without the last stage stops where the last stage's step code set ``trainer.should_stop``
    (the code after the pipelined call runs there only): every rank of the pipeline leaves the loop at the
    same step, as one process does (a rank going on alone waited on its peers until the process group's
    timeout). Only ever set here, never cleared: a stop of this rank's own (a callback's) stays."""
    if stop:
        lm.trainer.should_stop = True


def _shared_seed(strategy: TwoBPStrategy) -> int | None:
    """The seed of the step code's random draws, alike on every rank of this pipeline: pipeline rank 0's
    fingerprint of its generator, broadcast (ranks seeded apart, ``seed_everything(42 + rank)``, still
    draw mixup's lambda alike). None where the pipeline is one rank."""
    group = strategy.group("pp")
    if group is None or strategy.pipeline_degree == 1:
        return None
    seed = int.from_bytes(bytes.fromhex(fingerprint())[:8], "little") >> 1
    value = torch.tensor([seed], dtype=torch.int64, device=strategy.root_device)
    dist.broadcast(value, src=strategy.layout.global_rank_of(0), group=group)
    return int(value.item())


def _schedule(strategy: TwoBPStrategy, num_stages: int) -> Schedule:
    opts = strategy.options
    return build_schedule(
        opts.schedule,
        num_stages,
        strategy.num_microbatches,
        stages_per_rank=opts.stages,
        split_backward=opts.split_backward,
        max_pending_w=opts.max_pending_w,
    )


def _announce(strategy: TwoBPStrategy, local: LocalModel, schedule: Schedule, sizes: list[int]) -> None:
    pp_rank = strategy.pp_rank
    for s, module in local.stages.items():
        first = local.bounds[s]
        n = sum(q.numel() for q in module.parameters())
        last = first + sizes[s] - 1
        log.info("stage %d: layers %d-%d (%d parameters) on pipeline rank %d", s, first, last, n, pp_rank)
    note = fused_note(schedule)  # schedule="auto" may pick a split order fused in part (schedules.fusion)
    label = schedule_label(schedule.name, strategy.options.split_backward) + (f" ({note})" if note else "")
    rank_zero_info(
        f"twobp: {label}, {schedule.num_stages} stages on "
        f"{strategy.pipeline_degree} ranks x {strategy.dp_degree} replica(s), {strategy.num_microbatches} "
        f"micro-batches; layers per stage {sizes}"
    )


def _tied(strategy: TwoBPStrategy, local: LocalModel, name: str, sharding: ShardedStages | None) -> TiedParameters:
    layout = strategy.layout
    tied = TiedParameters(
        local.shared if sharding is None else sharding.resolve(local.shared),  # sharded: the DTensor shards
        lambda ranks: [[layout.global_rank_of(r, d) for r in ranks] for d in range(layout.dp_degree)],
        timeout=strategy.process_group_timeout,
        twins=sharding.twins if sharding is not None else (),
    )
    if sharding is not None and sharding.twin_names:
        twins = "; ".join(", ".join(sharding.name(s, n) for s, n in group) for group in sharding.twin_names)
        rank_zero_info(
            f"twobp: data_parallel='shard': a weight used by two stages of pipeline rank {strategy.pp_rank} is held "
            f"as one copy per stage, kept equal (their gradients summed; the optimizer holds each copy's state): "
            f"{twins}"
        )
    if local.shared:
        rank_zero_info(
            "twobp: parameters shared across pipeline ranks, kept in sync: "
            + "; ".join(f"{name}.{{{', '.join(sp.names)}}} on ranks {list(sp.ranks)}" for sp in local.shared)
        )
    return tied


def _precision(strategy: TwoBPStrategy, clip: Callable, before_step: Callable) -> tuple[Any, Any, Any]:
    """(the user's plugin, its scaler, ours): ours clips and checks through the pipeline."""
    user_precision = strategy.precision_plugin
    user_scaler = getattr(user_precision, "scaler", None)
    scaler = None
    if user_scaler is not None and strategy.world_size > 1:
        scaler = overflow_agreeing_scaler(user_scaler, strategy.root_device, None)
    if strategy.options.post_validation and user_scaler is not None and user_scaler.is_enabled():
        raise ValueError(
            "post_validation=True with fp16 mixed precision: the GradScaler's overflow check runs before "
            "the step, on every rank at once; use precision='bf16-mixed', or post_validation=False"
        )
    return user_precision, user_scaler, pipelined_precision(user_precision, clip, before_step, scaler)


def _check_blocks_fill(contract: Any, num_stages: int) -> None:
    """A ModuleList with fewer blocks than stages, named. ALBERT keeps one layer group
    (``num_hidden_groups=1``) that its loop calls ``num_hidden_layers`` times: "1 layers cannot fill 2
    stages" read as a miscount of a 4-layer model."""
    n = len(contract.layers())
    if isinstance(contract, ModuleListContract) and n < num_stages:
        raise ValueError(
            f"{contract.list_name} holds {n} block(s), fewer than the {num_stages} pipeline stages: under "
            f"strategy='twobp' the stages are cut between the blocks of that ModuleList, each block on one stage: "
            f"use at most {n} stage(s) (a V schedule has two per rank), or name a longer list of blocks with layers=. "
            f"A model that calls the same block several times in its loop (weights shared across layers, as "
            f"ALBERT's num_hidden_groups=1) cannot be cut between those calls: give it a block per layer (ALBERT: "
            f"num_hidden_groups=num_hidden_layers, which unshares the weights)"
        )


def _partition(strategy: TwoBPStrategy, runner: StepRunner, contract: Any, trainer: Any) -> list[int]:
    """Layers per stage: by parameters, a given list, or (``balance="time"``) measured times."""
    opts, layers = strategy.options, contract.layers()
    costs = None
    if opts.balance == "time" and strategy.layer_seconds is None:  # timed once, as "auto" chooses once
        m, device = strategy.num_microbatches, strategy.root_device
        with _outside_made(strategy, contract), _checkpointed(strategy, contract, opts.activation_checkpointing):
            strategy.layer_seconds = profile_layers(runner, layers, trainer, m, device, strategy.precision_plugin)
    if opts.balance == "time":
        costs = strategy.layer_seconds
    num_stages = strategy.pipeline_degree * opts.stages
    return list(partition(nn.Sequential(*layers), num_stages, opts.balance, costs=costs))


@contextmanager
def _checkpointed(strategy: TwoBPStrategy, contract: Any, mode: str | int | None) -> Iterator[None]:
    """The layers checkpointed as ``activation_checkpointing=mode`` and the model's Hugging Face switch say,
    as the Trainer call will run them (:func:`_call_scope`), while open: timed as they train."""
    undo = _checkpoint(strategy, contract, mode)
    try:
        yield
    finally:
        undo()


def _checkpoint(strategy: TwoBPStrategy, contract: Any, mode: str | int | None) -> Callable[[], None]:
    """Every layer checkpointed as ``mode`` and the model's switch say; returns the undo."""
    return apply_activation_checkpointing(list(enumerate(contract.layers())), mode, strategy.lightning_module, contract)


@contextmanager
def _outside_made(strategy: TwoBPStrategy, contract: Any) -> Iterator[None]:
    """A meta-built model's modules outside the pipelined layers made as one process makes them, for the
    profile of ``balance="time"`` or ``schedule="auto"`` to run the layers among (a rotary embedding's
    frequencies, the step's own modules), then put back as built, with the random state: the profile
    makes the layers one at a time for their runs (:func:`.layer_runs.placed`), and after the cut
    :func:`_materialize` makes this rank's share. One more pass of the model's initialization."""
    lm = strategy.lightning_module
    if not built_on_meta(lm, left_on_meta()):
        yield
        return
    _refuse_loose_on_meta(contract)
    parts = [p for layer in contract.layers() for p in contract.parts(layer)]
    made = materialize(lm, parts, strategy.root_device, left_on_meta(), parts)
    try:
        yield
    finally:
        made.undo()


def _choose(strategy: TwoBPStrategy, runner: StepRunner, contract: Any, trainer: Any) -> list[int]:
    """``schedule="auto"``: profile and search once (the first Trainer call), then run the choice as if
    the user had named it (``strategy.options``, its ``activation_checkpointing`` applied in
    :func:`_call_scope`); returns the choice's layers per stage. The layers are profiled checkpointed as
    they will run (``activation_checkpointing``, a Hugging Face switch); with ``"auto"`` plain,
    ``"selective"`` and ``"full"`` (``AUTO_MODES``), each wrapped for its profile only."""
    req = strategy.requested
    if _searches(strategy, trainer):
        assert req.memory_limit is not None  # PipelineOptions requires it with schedule="auto"
        layers = contract.layers()

        def checkpoint(mode: str | int | None) -> Callable[[], None]:
            return _checkpoint(strategy, contract, mode)

        ac = req.activation_checkpointing
        if ac == "auto":
            check_auto_with_switches(strategy.lightning_module)
        modes = AUTO_MODES if ac == "auto" else (ac,)
        earlier, holdings = strategy.auto_choice, _holdings(strategy, trainer)
        with _outside_made(strategy, contract):
            found = _search(strategy, runner, layers, trainer, modes, checkpoint, holdings)
        strategy.auto_choice, strategy.auto_profile = found
        strategy.auto_for_training = trainer.state.fn == TrainerFn.FITTING
        strategy.auto_counted_copy = holdings.rollback
        if earlier is not None and strategy.auto_choice is not None:
            rank_zero_info(
                f"twobp: schedule='auto' chose again for training ({strategy.auto_choice.best.label}): the choice of "
                f"the strategy's earlier evaluation call ({earlier.best.label}) counted no backward, gradients or "
                f"optimizer state"
            )
    assert strategy.auto_profile is not None and strategy.auto_choice is not None
    best = strategy.auto_choice.best
    strategy.options = req.chosen(best)
    _say_dropped(req, strategy.options, best.label)
    return list(strategy.auto_profile.partitions[best.stages_per_rank])


def _searches(strategy: TwoBPStrategy, trainer: Any) -> bool:
    """Whether ``schedule="auto"`` profiles and chooses in this call: at the strategy's first, and at its first
    fit after a choice made in an evaluation call (validate, test, predict), which counted no backward,
    gradients or optimizer state (a fit keeping it could exceed memory_limit). A later call keeps the choice."""
    if strategy.auto_choice is None:
        return True
    return trainer.state.fn == TrainerFn.FITTING and not strategy.auto_for_training


def _say_dropped(req: PipelineOptions, chosen: PipelineOptions, label: str) -> None:
    """Rank zero's line when the choice drops an option the user asked for."""
    if req.batch_w and not chosen.batch_w:
        rank_zero_warn(
            f"batch_w is not applied: schedule='auto' chose {label}, which runs each W alone (batch_w joins "
            f"the W of several micro-batches only where a schedule runs them together)"
        )


def _search(
    strategy: TwoBPStrategy,
    runner: StepRunner,
    layers: list[nn.Module],
    trainer: Any,
    modes: tuple[str | int | None, ...],
    checkpoint: Callable[[Any], Callable[[], None]],
    holdings: StepHoldings,
) -> tuple:
    """:func:`auto_schedule` with the strategy's options, weighing the layers run each way of ``modes``, the
    step holding ``holdings`` beside them: (choice, the choice's profile)."""
    req = strategy.requested
    assert req.memory_limit is not None
    return auto_schedule(
        runner,
        layers,
        trainer,
        strategy.root_device,
        strategy.precision_plugin,
        strategy.group("pp"),
        strategy.pipeline_degree,
        req.balance,
        req.memory_limit,
        req.num_microbatches,
        None if req.split_backward else False,
        holdings=holdings,
        checkpointing=modes,
        checkpoint=checkpoint,
        families=req.auto_schedules,
    )


def _holdings(strategy: TwoBPStrategy, trainer: Any) -> StepHoldings:
    """What the step will hold beside the layers, as the strategy runs it (:class:`.autoschedule.StepHoldings`):
    the data-parallel layout, and the optimizer check after the step (``post_validation``; never under fp16's
    GradScaler) that may put a step back (clipping by norm, ``configure_gradient_clipping`` of the module's own,
    or ``on_nonfinite="skip"``)."""
    req, dp = strategy.requested, strategy.layout.dp_degree
    fp16 = getattr(strategy.precision_plugin, "scaler", None) is not None
    clips = bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")
    clips = clips or is_overridden("configure_gradient_clipping", strategy.lightning_module)
    return StepHoldings(
        shard_over=dp if req.data_parallel == "shard" else 1,
        reduce_over=dp if req.data_parallel == "replicate" else 1,
        checked_after=False if fp16 else req.post_validation,
        rollback=clips or req.on_nonfinite == "skip",
    )


_Reduce = Callable[[int, list[nn.Parameter]], Callable[[], None]]  # ReplicaReduce, or ShardedStages.reduce


def _data_parallel(
    strategy: TwoBPStrategy, local: LocalModel, shard: bool
) -> tuple[ShardedStages | None, _Reduce | None]:
    """The stages' data-parallel form: FSDP2 shards (``data_parallel="shard"``) and their reduce-scatter,
    the replicated all-reduce, or nothing with one replica."""
    layout = strategy.layout
    if shard:
        try:
            check_stages(local.stages, _model_names(local))
        except ValueError:
            local.restore(False, None, layout.pp_rank, strategy.root_device)  # the model as it came
            raise
        precision = str(getattr(strategy.precision_plugin, "precision", "32-true"))
        sharding = ShardedStages(
            local.stages,
            strategy.device_mesh["dp"],
            mixed_precision(precision),
            _model_names(local),
            strategy.lightning_module,
        )
        local.follow(sharding.shards())  # a tied weight read through a placeholder: the shard the stage trains
        return sharding, sharding.reduce
    if layout.dp_degree > 1:
        return None, ReplicaReduce(strategy.group("dp"), layout.dp_degree)
    return None, None


def _replica_buffers(strategy: TwoBPStrategy) -> ReplicaBuffers | None:
    """With several data-parallel replicas, the model's buffers kept to replica 0's (:mod:`.replica_buffers`)."""
    layout, group = strategy.layout, strategy.group("dp")
    if layout.dp_degree == 1 or group is None or not strategy.options.broadcast_buffers:
        return None
    src = layout.global_rank_of(layout.pp_rank, 0)
    return ReplicaBuffers(strategy.lightning_module, group, src, strategy.root_device)


def _replicas(strategy: TwoBPStrategy, sharding: ShardedStages | None) -> str:
    """This rank's data-parallel peers by global rank and host (one all-gather at setup), or ""."""
    if sharding is not None:
        return sharding.replicas
    group = strategy.group("dp")
    return replica_names(group) if group is not None and strategy.dp_degree > 1 else ""


def _model_names(local: LocalModel) -> Callable[[int, str], str]:
    """A stage's parameter by its name in the model: a stage module holds its layers as ``layers``
    (``StageModule``, ``LoopStage``), so ``layers.k.rest`` is ``rest`` of the stage's k-th layer."""
    contract = local.contract

    def name(stage: int, parameter: str) -> str:
        k, _, rest = parameter.removeprefix("layers.").partition(".")
        return f"{contract.name}.{contract.parameter_name(local.bounds[stage] + int(k), rest)}"

    return name


def _call_scope(strategy: TwoBPStrategy, trainer: Any, metrics: StepMetrics, local: LocalModel) -> ExitStack:
    """What the Trainer call changes outside the model, undone at teardown."""
    scope = ExitStack()
    scope.enter_context(known_warnings_off())  # the Trainer call's data loaders build next
    scope.callback(metrics.sync_over(strategy.group("dp")))
    ac = strategy.options.activation_checkpointing
    scope.callback(apply_activation_checkpointing(local.blocks(), ac, strategy.lightning_module, local.contract))
    if isinstance(local.contract, ModuleListContract):
        scope.callback(caches_off(strategy.lightning_module.modules(), "a cache holds every stage's blocks"))
        scope.callback(fastpath_off())
    if strategy.layout.dp_degree == 1:  # nothing to split: the loader's own sampler, as one process reads it
        scope.callback(keep_users_sampler(trainer))
    return scope


def _one_process_places(strategy: TwoBPStrategy, trainer: Any, schedule: Schedule) -> OneProcess | None:
    """Where one process's optimizers step each parameter, for :func:`.optimizer_groups.moved_from_one_process`
    after Lightning's call on this rank's stages (a fit cut into several stages only: with pipeline_degree=1 a
    V's two stages on one rank, sharded, hold a tied weight as two copies under their own names too)."""
    if trainer.state.fn != TrainerFn.FITTING or schedule.num_stages == 1:
        return None
    return whole_model_places(strategy.lightning_module)


def _split(strategy: TwoBPStrategy, contract: Any, sizes: list[int], schedule: Schedule, trainer: Any) -> LocalModel:
    """This rank's stages, their parameters' gradient hooks refused (:func:`.checks.check_parameter_hooks`)
    before any compute and before FSDP2 replaces the parameters (a hook stays on the parameter it was
    registered on, so after ``fully_shard`` it would be neither run nor seen); on a refusal the model is put
    back as it came."""
    local = split_model(contract, sizes, schedule, strategy.layout.pp_rank)
    if trainer.state.fn == TrainerFn.FITTING:
        try:
            check_parameter_hooks(strategy.lightning_module, local.stages, "at the Trainer's setup")
        except ValueError:
            local.restore(False, None, strategy.layout.pp_rank, strategy.root_device)
            raise
    return local


def _materialize(strategy: TwoBPStrategy, contract: Any, sizes: list[int], schedule: Schedule) -> None:
    """This rank's share of a model built on the meta device, with one process's values (:mod:`.materialize`),
    before the stages' random streams, whose seeds come from the random state one process's build leaves."""
    if not built_on_meta(strategy.lightning_module, left_on_meta()):
        return
    _refuse_loose_on_meta(contract)
    mine = set(schedule.stages_of(strategy.layout.pp_rank))
    stage_of = [s for s, n in enumerate(sizes) for _ in range(n)]
    parts = [contract.parts(layer) for layer in contract.layers()]
    others = [part for ps, s in zip(parts, stage_of, strict=True) if s not in mine for part in ps]
    lm = strategy.lightning_module
    made = materialize(lm, others, strategy.root_device, left_on_meta(), [p for ps in parts for p in ps])
    strategy._made = made  # put back as built by teardown should the setup be refused later
    warn_made(made, lm)
    log.info("built on the meta device: %d modules initialized, this rank's stages %s kept", made.modules, sorted(mine))


def _refuse_loose_on_meta(contract: Any) -> None:
    """A model built on the meta device is made layer by layer, each module by its own initialization; a parameter
    the model holds directly beside its blocks (:class:`.outside_modules.LooseParameter`) has none of its own (the
    model's would make the blocks too, on every rank): refused, naming it, before any weight is made."""
    if not isinstance(contract, ModuleListContract):
        return
    ours = left_on_meta()
    for path, part in contract.outside():
        if isinstance(part, LooseParameter) and part.tensor().is_meta and id(part.tensor()) not in ours:
            holder = path.rpartition(".")[0] or "the LightningModule"
            raise ValueError(
                f"{path}, a parameter held directly by {holder} beside the blocks in {contract.list_name}, is on the "
                f"meta device: a model built there is made layer by layer, each module by its own reset_parameters() "
                f"(or Hugging Face's _init_weights), and a parameter the model holds directly has none of its own (the "
                f"model's would make its blocks too, on every rank). Build the model on a real device (each rank "
                f"sets aside what it does not hold), or put the parameter in a module of its own with a "
                f"reset_parameters() that sets it"
            )


def _checked_contract(strategy: TwoBPStrategy, trainer: Any) -> SequentialContract | ModuleListContract:
    """The model's contract, with what the pipeline cannot run refused on every rank before any compute."""
    lm, opts = strategy.lightning_module, strategy.options
    if not lm.automatic_optimization:
        raise ValueError(
            "strategy='twobp' supports automatic optimization only: the pipeline schedule owns the "
            "backward, so manual_backward cannot run it; set self.automatic_optimization = True. For two "
            "optimizers (configure_optimizers returning [Muon(...), AdamW(...)], for which Lightning asks for manual "
            "optimization), return one torch.optim.Optimizer subclass that holds both: its __init__ builds them "
            "(torch.optim.Muon over the 2-D weights, AdamW over the rest, both from self.parameters()) and calls "
            "super().__init__(muon.param_groups + adamw.param_groups, {}), then points their param_groups at its own "
            "(sliced) and their state at self.state (again after load_state_dict); its step(closure) runs the "
            "closure under torch.enable_grad(), then muon.step() and adamw.step() (docs/troubleshooting.md)"
        )
    contract = find_contract(lm, opts.layers)
    if strategy.requested.schedule == "auto":  # it chooses once: its balance="time" reads its own profile
        if _searches(strategy, trainer):  # a choice made already: by an evaluation call, which left the layers
            again = strategy.auto_choice is not None
            check_timed_layers_here(contract.layers(), left_on_meta(), "schedule='auto'", after_failed_evaluation=again)
    elif opts.balance == "time" and strategy.layer_seconds is None:
        check_timed_layers_here(contract.layers(), left_on_meta(), "balance='time'")
    check_not_compiled(lm, contract)  # before the first step: compiled code cannot be split
    # under "auto" the stages per rank are yet to be chosen: at least one per rank
    per_rank = opts.stages if strategy.requested.schedule != "auto" else 1
    _check_blocks_fill(contract, strategy.pipeline_degree * per_rank)
    if isinstance(contract, ModuleListContract) and trainer.state.fn == TrainerFn.FITTING:
        contract.check_every_block_runs()  # LayerDrop: every rank, before any compute
    return contract


def _cut(strategy: TwoBPStrategy, runner: StepRunner, contract: Any, trainer: Any) -> tuple[list[int], Schedule]:
    """The layers per stage and the schedule: the modules outside a ModuleList's blocks placed where the model
    calls them first (the partition's units), then ``schedule="auto"``'s choice or the named schedule's cut."""
    if isinstance(contract, ModuleListContract) and _several_stages(strategy):
        if strategy.options.placement == "call":
            place_by_call_order(runner, contract, trainer, strategy.precision_plugin)
        else:
            contract.place_by_calls({}, "TwoBPStrategy(placement='registration') was given")
    if strategy.requested.schedule == "auto":
        sizes = _choose(strategy, runner, contract, trainer)
        assert strategy.auto_choice is not None
        schedule = strategy.auto_choice.best.schedule  # the order the search built and timed at the measured costs
    else:
        sizes = _partition(strategy, runner, contract, trainer)
        schedule = _schedule(strategy, strategy.pipeline_degree * strategy.options.stages)
    strategy.stage_sizes = list(sizes)
    return sizes, schedule


def _several_stages(strategy: TwoBPStrategy) -> bool:
    """Whether the model may be cut into several stages (under "auto", two on one rank: a V schedule)."""
    return strategy.pipeline_degree > 1 or strategy.options.stages > 1 or strategy.requested.schedule == "auto"


def _pretrained_plan(strategy: TwoBPStrategy) -> Plan | None:
    """What ``pretrained=`` reads into this model (:mod:`.pretrained`): nothing where an earlier call read
    it or loaded a checkpoint into it. (A ``ckpt_path`` of this call is loaded after setup, over what is
    read here: Lightning names it to the strategy only then.)"""
    path, lm = strategy.options.pretrained, strategy.lightning_module
    if path is None:
        return None
    before = pretrained.read_before(lm)
    if before is not None:
        say = log.info if before == path else rank_zero_warn  # another directory named: the user expects it read
        say(f"twobp: pretrained weights {path} not read: this model holds {before}'s, read in an earlier Trainer call")
        return None
    found = pretrained.plan(path, lm, strategy.options.pretrained_prefix)
    pretrained.warn_unmatched(found)
    return found


def _read_pretrained(strategy: TwoBPStrategy, found: Plan | None) -> None:
    if found is None:
        return
    count = pretrained.load(found, strategy.lightning_module)
    strategy._pretrained_read = True  # the model keeps these weights in later calls once this setup ends
    under, total = found.prefix.rstrip(".") or "the model", len(set(found.keys.values()))
    log.info("pretrained: %d of %d tensors read from %s into %s", count, total, found.path, under)


def _cpu_heap(strategy: TwoBPStrategy) -> None:
    """See lightning_twobp.engine.memory: page faults every step unless the heap is kept; under a
    memory_limit it is not, so the resident set follows the tensors schedule="auto" counted."""
    heap = cpu_heap(strategy.requested.memory_limit)
    way = {"default": "left to the C library"}.get(heap, heap)
    log.info("CPU heap: freed memory %s (engine.memory.cpu_heap; TWOBP_KEEP_FREED_MEMORY=0/1 overrides)", way)


@contextmanager
def _closed_on_failure(sharding: ShardedStages | None) -> Iterator[None]:
    """A refusal after the stages are sharded (post_validation=True with fp16's GradScaler) makes no Pipeline,
    whose teardown closes what the sharding opened: DTensor's handlers of equal and .item() and the module's
    ``log`` shadow (:mod:`.shard_reads`), left in the process after the failed call. Closed here then."""
    try:
        yield
    except BaseException:
        if sharding is not None:
            sharding.within_meshes.close()
        raise


def build_pipeline(strategy: TwoBPStrategy, trainer: Any) -> Pipeline:
    """The pipeline of one Trainer call on this rank, from the strategy's options and layout."""
    lm = strategy.lightning_module
    opts, layout, device = strategy.options, strategy.layout, strategy.root_device
    check_degree(strategy.world_size, strategy.pipeline_degree)
    shard = opts.data_parallel == "shard"
    if shard:
        check_replicas(layout.dp_degree, str(getattr(strategy.precision_plugin, "precision", "32-true")))
    if device.type == "cpu":
        _cpu_heap(strategy)
    contract = _checked_contract(strategy, trainer)
    weights = _pretrained_plan(strategy)  # before any compute: names and shapes, alike on every rank
    metrics = StepMetrics(lm)
    runner = StepRunner(lm, contract, metrics)
    sizes, schedule = _cut(strategy, runner, contract, trainer)
    opts = strategy.options  # under "auto", the choice, as if the user had named it
    _materialize(strategy, contract, sizes, schedule)  # before the streams, seeded from the random state
    streams = StageStreams(schedule.stages_of(layout.pp_rank), layout.dp_rank, device, _shared_seed(strategy))
    runner.streams = streams
    one_process = _one_process_places(strategy, trainer, schedule)  # the model still whole
    local = _split(strategy, contract, sizes, schedule, trainer)
    _read_pretrained(strategy, weights)  # this rank's tensors only, before FSDP2 shards them
    runner.holders = placeholder_holders(lm)
    _announce(strategy, local, schedule, list(sizes))
    sharding, grad_reduce = _data_parallel(strategy, local, shard)
    with _closed_on_failure(sharding):
        executor = PipelineExecutor(
            schedule,
            local.stages,
            loss_fn=strategy._pipeline_loss,
            device=device,
            group=strategy.group("pp"),
            grad_reduce=grad_reduce,
            timeout=opts.pipeline_timeout,
            around=streams.fork,
            batch_w=opts.batch_w,
            shape_group=strategy.shape_group,
        )
        _name_parameters(executor, local, strategy.lightning_module)
        logs = None
        if strategy.log_group is not None:
            last_rank = schedule.stage_to_rank[schedule.num_stages - 1]
            logs = LogChannel(strategy.log_group, layout.pp_rank, last_rank, strategy.pipeline_degree, device)
        tied = _tied(strategy, local, contract.name, sharding)
        # Sharded gradients: each rank holds 1/dp of its stages' gradients, so the global norm and the
        # non-finite check sum over every rank (each shard counted once), not over one pipeline.
        # Otherwise a group of their own (layout.SideGroups: on NCCL, on "pp" they held the next step's sends back).
        check_group = dist.group.WORLD if shard else (strategy.check_group or strategy.group("pp"))
        checks = OptimizerChecks(
            opts,
            check_group,
            device,
            schedule.stages_of,
            layout.pp_rank,
            tied.not_counted,
            strategy.pipeline_degree,
            watch_hooks=hooks_may_scale_grads(trainer.lightning_module, trainer.callbacks),
            copy_counted=strategy.requested.schedule != "auto" or strategy.auto_counted_copy,
        )
        user_precision, user_scaler, precision = _precision(strategy, checks.clip_by_norm, strategy._before_step)
        scope = _call_scope(strategy, trainer, metrics, local)
        return Pipeline(
            local,
            executor,
            runner,
            tied,
            user_precision,
            user_scaler,
            precision,
            logs,
            scope,
            streams,
            metrics,
            checks,
            sharding=sharding,
            replicas=_replicas(strategy, sharding),
            buffers=_replica_buffers(strategy),
            reduce=grad_reduce if isinstance(grad_reduce, ReplicaReduce) else None,
            one_process=one_process,
        )
