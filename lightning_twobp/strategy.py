"""``Trainer(strategy="twobp")``: an unchanged LightningModule trained through a 2BP pipeline.

The model contract (see :mod:`lightning_twobp.contract`): the pipelined layers are one
``nn.Sequential``, and ``training_step`` calls it once. The strategy cuts the Sequential into stages,
keeps this rank's stages and replaces the others by empty placeholders (so ``configure_optimizers``
sees only local parameters, and parameter names stay those of the full model). Each training step is
split into micro-batches; on the first stage ``training_step`` runs up to the Sequential call (its
input is captured), on the last stage it runs with the Sequential call answered by the pipeline's
output, so the loss, metrics and ``self.log`` happen there, per micro-batch. Logged values are
averaged over the micro-batches and logged once on every rank.

Lightning's automatic optimization runs ``training_step``, then ``zero_grad``, then ``backward``.
The pipeline computes the gradients inside ``training_step``; they are set aside and added back in
``backward`` (scaled by ``1 / accumulate_grad_batches``, as Lightning scales the loss), so
``zero_grad``, gradient accumulation and ``optimizer.step`` see what ``loss.backward()`` would give.

Validation, test and predict run forward-only through the pipeline; clipping by norm uses the
global norm. ``devices = pipeline_degree x dp``: each stage's gradients are averaged over its
data-parallel group, started asynchronously as soon as the stage's last W has run. Checkpoints are directories sharded with torch.distributed.checkpoint
(see :mod:`lightning_twobp.checkpoint` to consolidate them). Under fp16 with a GradScaler the
pipeline's backward starts from the scaled loss.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils import _pytree as pytree
from typing_extensions import override

from lightning_twobp.contract import find_sequential
from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.partition import partition
from lightning_twobp.schedules import SCHEDULES, Schedule, build_schedule, check_split

log = logging.getLogger(__name__)

_GROUP = "__group__"  # key of a parameter's group hyper-parameters in a checkpoint's "optim"

__all__ = ["TwoBPStrategy"]



class _Remote(nn.Module):
    """Placeholder for a layer that lives on another pipeline rank."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(
            f"this layer lives on pipeline stage {self.stage}, on another rank; under "
            f"strategy='twobp' the Sequential runs only through the pipeline"
        )


class _Captured(Exception):
    """Raised by the Sequential on the first stage to stop ``training_step`` at its input."""

    def __init__(self, inputs: tuple) -> None:
        super().__init__("captured")
        self.inputs = inputs


def _tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _batch_size(batch: Any) -> int:
    leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return leaves[0].shape[0] if leaves else 1


class _LogRecorder:
    """Stands in for ``LightningModule.log`` during one micro-batch: records instead of logging."""

    def __init__(self, lm: Any, store: dict | None) -> None:
        self.lm, self.store = lm, store

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if self.store is None:  # first stage, before the Sequential: logged on the last stage
            return
        if args:
            raise TypeError("pass self.log options by keyword under strategy='twobp'")
        self.store[name] = (value.detach() if isinstance(value, torch.Tensor) else value, kwargs)

    def __enter__(self) -> _LogRecorder:
        self.lm.__dict__["log"] = self  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.lm.__dict__["log"]


class TwoBPStrategy(DDPStrategy):
    """Pipeline parallelism with 2BP for an unchanged LightningModule.

    Args:
        schedule: one of :data:`lightning_twobp.schedules.SCHEDULES`.
        split_backward: 2BP's split into B and W (``False``: the fused backward; ZB schedules are split).
        num_microbatches: micro-batches per step (default ``2 * pipeline_degree``); the batch size
            must divide by it.
        pipeline_degree: ranks per pipeline (default: every device, one pipeline).
        stages_per_rank: stages on each rank (default 2 for ``zb-v``, else 1).
        balance: ``"params"`` (default), ``"time"`` (forward + backward time of every layer, measured
            on the first micro-batch of the data before training), or a list of layer counts per stage.
        layers: dotted name of the Sequential to pipeline, when the module holds several.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (process group
            backend, timeout, cluster environment, start method).
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
        **kwargs: Any,
    ) -> None:
        if schedule not in SCHEDULES:  # checked now, not at setup: the Trainer is not built yet
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        check_split(schedule, split_backward)
        super().__init__(**kwargs)
        self.schedule_name = schedule
        self.split_backward = split_backward
        self._num_microbatches = num_microbatches
        self._pipeline_degree = pipeline_degree
        self._stages_per_rank = stages_per_rank or (2 if schedule in ("zb-v", "interleaved-1f1b") else 1)
        self._balance = balance
        self._layers = layers
        self._executor: PipelineExecutor | None = None
        self.stage_sizes: list[int] | None = None  # layers per stage, once the pipeline is built
        self._stash: list[tuple[nn.Parameter, torch.Tensor]] = []

    # ------------------------------------------------------------------ layout
    @property
    def pipeline_degree(self) -> int:
        return self._pipeline_degree or self.world_size

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches or 2 * self.pipeline_degree

    @property
    def schedule(self) -> Schedule:
        if self._executor is None:
            raise RuntimeError("the pipeline is built in setup(); call trainer.fit first")
        return self._executor.schedule

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of one pipeline sees the same batch: the data splits by data-parallel rank.
        dp = self.world_size // self.pipeline_degree
        return {"num_replicas": dp, "rank": self.global_rank // self.pipeline_degree}

    def _check_layout(self) -> None:
        p, world = self.pipeline_degree, self.world_size
        if world % p:
            raise ValueError(
                f"{world} devices cannot be split into pipelines of {p}: devices x num_nodes must be "
                f"a multiple of pipeline_degree (use pipeline_degree={world} or a divisor of it)"
            )

    @override
    def setup_distributed(self) -> None:
        """The world, then its pipelines (consecutive ranks) and data-parallel groups (the same
        stage in every pipeline). Every rank creates every group, in one order, as torch requires."""
        super().setup_distributed()
        self._check_layout()
        p = self.pipeline_degree
        dp = self.world_size // p
        self._pp_group = self._dp_group = None  # None: the world (one pipeline), or no DP group
        if dp > 1:
            for d in range(dp):
                group = dist.new_group([d * p + r for r in range(p)])
                if self.global_rank // p == d:
                    self._pp_group = group
            for r in range(p):
                group = dist.new_group([d * p + r for d in range(dp)])
                if self.global_rank % p == r:
                    self._dp_group = group

    def _global_rank_of(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's pipeline."""
        return (self.global_rank // self.pipeline_degree) * self.pipeline_degree + pp_rank

    def _build_pipeline(self) -> None:
        if self._executor is not None:
            return
        self._check_layout()
        lm = self.lightning_module
        assert lm is not None
        if not lm.automatic_optimization:
            raise ValueError(
                "strategy='twobp' supports automatic optimization only: the pipeline schedule owns the "
                "backward, so manual_backward cannot run it; set self.automatic_optimization = True"
            )
        self._seq_name, seq = find_sequential(lm, self._layers)
        self._seq = seq
        self._mode: tuple[str, Any] = ("idle", None)
        seq.forward = self._sequential_call  # the Sequential answers only through the pipeline
        num_stages = self.pipeline_degree * self._stages_per_rank
        costs = self._profile_layers(seq) if self._balance == "time" else None
        sizes = partition(seq, num_stages, self._balance, costs=costs)
        self.stage_sizes = list(sizes)
        schedule = build_schedule(
            self.schedule_name, num_stages, self.num_microbatches,
            stages_per_rank=self._stages_per_rank, split_backward=self.split_backward,
        )
        rank = self.global_rank % self.pipeline_degree
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        # Checked on every rank (each knows the whole cut), so every rank stops, not only the empty one.
        for r in range(self.pipeline_degree):
            stages = schedule.stages_of(r)
            if not any(q.requires_grad for s in stages for i in range(bounds[s], bounds[s + 1]) for q in seq[i].parameters()):
                here = ", ".join(f"stage {s}: layers {bounds[s]}-{bounds[s + 1] - 1}" for s in stages)
                raise ValueError(
                    f"pipeline rank {r} would hold no trainable parameters ({here}), so configure_optimizers "
                    f"would get an empty parameter list: give it a layer with parameters with balance=[...] "
                    f"(layers per stage now {list(sizes)}), or use fewer pipeline ranks"
                )
        mine = set(schedule.stages_of(rank))
        modules: dict[int, nn.Module] = {}
        for s in range(num_stages):
            layer_ids = range(bounds[s], bounds[s + 1])
            if s in mine:
                modules[s] = nn.Sequential(*[seq[i] for i in layer_ids])
            else:  # drop remote layers: no memory, no parameters for configure_optimizers
                for i in layer_ids:
                    seq._modules[str(i)] = _Remote(s)
            if s in mine:
                params = sum(q.numel() for i in layer_ids for q in seq[i].parameters())
                log.info("stage %d: layers %d-%d (%d parameters) on rank %d", s, bounds[s], bounds[s + 1] - 1, params, rank)
        rank_zero_info(
            f"twobp: {schedule.name}{' + 2BP' if self.split_backward else ''}, {num_stages} stages on "
            f"{self.pipeline_degree} ranks, {self.num_microbatches} micro-batches; layers per stage {sizes}"
        )
        self._modules = modules
        self._schedule_obj = schedule

    def _sample_batch(self) -> Any:
        """The first batch of the data the running loop will read (setup hooks have run)."""
        trainer = self.lightning_module.trainer
        fn = trainer.state.fn
        loop = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
                TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}[fn]
        # Lightning keeps the loop's data source privately; this is the hook it would call itself.
        source = loop._data_source
        loaders = source.dataloader() if source.is_defined() else None
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        if isinstance(loaders, dict):
            loaders = next(iter(loaders.values()), None)
        if loaders is None:
            raise ValueError(
                'balance="time" profiles the layers on the first batch of the data, and none was found: pass '
                "the dataloader to the Trainer call, or use balance='params' or a list of layer counts"
            )
        return next(iter(loaders))

    def _profile_layers(self, seq: nn.Sequential, repeats: int = 3) -> list[float]:
        """Forward + backward seconds of every layer of ``seq`` on one micro-batch of real data, for
        ``balance="time"``. Rank 0 measures (each layer on this rank's device, one at a time, so a model
        that fits only across the pipeline can still be profiled), every rank gets its numbers: ranks
        that timed on their own could disagree on the cut and deadlock."""
        costs: list[float] | None = None
        if self.global_rank == 0:
            # Profiling must leave no trace: the RNG is forked around all of it (reading a batch draws
            # a loader seed and a shuffle; dropout draws too), BatchNorm statistics are put back, so
            # training afterwards is what it would have been, and rank 0 stays in step with the rest.
            devices = [self.root_device] if self.root_device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                costs = self._time_layers(seq, repeats)
        box = [costs]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(box, src=0, device=self.root_device if self.root_device.type == "cuda" else None)
        return box[0]

    def _time_layers(self, seq: nn.Sequential, repeats: int) -> list[float]:
        lm = self.lightning_module
        trainer = lm.trainer
        step = {TrainerFn.FITTING: "training_step", TrainerFn.VALIDATING: "validation_step",
                TrainerFn.TESTING: "test_step", TrainerFn.PREDICTING: "predict_step"}[trainer.state.fn]
        self._step_name, self._args, self._kwargs = step, (0,), {}
        mb = self._split(self._sample_batch(), exact=False)[0]
        mb = pytree.tree_map(lambda t: t.to(self.root_device) if isinstance(t, torch.Tensor) else t, mb)
        # The step runs up to the Sequential on this device; whatever it uses besides the Sequential
        # (small: the Sequential holds the layers) goes there now, as model_to_device will anyway.
        inside = {id(m) for m in seq.modules()}
        with torch.no_grad():
            for m in lm.modules():
                if id(m) in inside:
                    continue
                for k, q in m._parameters.items():  # this module's own, not its children's
                    if q is not None:
                        q.data = q.data.to(self.root_device)
                for k, b in m._buffers.items():
                    if b is not None:
                        m._buffers[k] = b.to(self.root_device)
        x = self._capture(mb)
        costs = []
        buffers = {n: b.clone() for n, b in seq.named_buffers()}
        with self.precision_plugin.forward_context():
            for i, layer in enumerate(seq):
                layer.to(self.root_device)
                x = tuple(t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                          for t in x)
                times = []
                for _ in range(repeats + 1):  # the first run warms caches and allocators up
                    start = self._now()
                    out = layer(*x)
                    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                    if outs:
                        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                    times.append(self._now() - start)
                costs.append(sorted(times[1:])[len(times[1:]) // 2])
                layer.zero_grad(set_to_none=True)
                for t in x:
                    if isinstance(t, torch.Tensor):
                        t.grad = None
                if self.root_device.type != "cpu":
                    layer.to("cpu")
                x = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in _tuple(out))
        with torch.no_grad():
            for n, b in seq.named_buffers():
                b.copy_(buffers[n])
        log.info("twobp: forward+backward seconds per layer: %s", ", ".join(f"{c:.2e}" for c in costs))
        return costs

    def _now(self) -> float:
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)
        return time.perf_counter()

    def _sequential_call(self, *inputs: Any) -> Any:
        mode, value = self._mode
        if mode == "capture":
            raise _Captured(inputs)
        if mode == "provide":
            return value
        raise RuntimeError(
            f"{self._seq_name or 'the Sequential'} was called outside a pipeline step; under strategy='twobp' "
            f"call it only from training_step"
        )

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._build_pipeline()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._executor = PipelineExecutor(
            self._schedule_obj, self._modules, loss_fn=self._last_stage_loss, device=self.root_device,
            group=getattr(self, "_pp_group", None),
            grad_reduce=self._start_reduce if self.world_size > self.pipeline_degree else None,
        )
        # Clipping by norm must see the norm of the whole model, not of this rank's stages.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and self.world_size > 1:
            self._agree_on_overflow(scaler)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        # Optimizers are created after the move to the device and hold no state yet; a checkpoint's
        # state is loaded afterwards (restore_checkpoint_after_setup), by parameter name.
        self.setup_precision_plugin()

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: gradients come from the pipeline schedule."""

    # ------------------------------------------------------------------ training
    def _split(self, batch: Any, exact: bool = True) -> list[Any]:
        """Micro-batches along the first dimension; training needs equal ones (``exact``),
        evaluation takes a smaller last batch as up to m nearly equal pieces."""
        m = self.num_microbatches
        leaves, spec = pytree.tree_flatten(batch)
        sizes = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
        if len(sizes) != 1:
            raise ValueError(
                f"cannot split the batch into micro-batches: its tensors have first dimensions {sorted(sizes)}; "
                f"every tensor in the batch needs the same batch dimension first"
            )
        (n,) = sizes
        if exact and n % m:
            raise ValueError(
                f"batch size {n} does not split into {m} micro-batches: use a batch size that is a multiple "
                f"of {m}, or set num_microbatches to a divisor of {n}"
            )
        m = min(m, n)
        chunks = [x.tensor_split(m) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * m for x in leaves]
        return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(m)]

    def _run_step(self, mb: Any, args: tuple, kwargs: dict) -> Any:
        return getattr(self.lightning_module, self._step_name)(mb, *args, **kwargs)

    def _last_stage_loss(self, output: Any, index: int) -> torch.Tensor:
        self._mode = ("provide", output)
        logs: dict[str, tuple[Any, dict]] = {}
        try:
            with _LogRecorder(self.lightning_module, logs):
                out = self._run_step(self._mbs[index], self._args, self._kwargs)
        finally:
            self._mode = ("idle", None)
        self._logs.append(logs)
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"training_step returned {type(out).__name__} on micro-batch {index}: under strategy='twobp' "
                f"it must return the loss tensor (or a dict with 'loss')"
            )
        return loss

    def _capture(self, mb: Any) -> tuple:
        self._mode = ("capture", None)
        try:
            with _LogRecorder(self.lightning_module, None):
                self._run_step(mb, self._args, self._kwargs)
        except _Captured as c:
            inputs = c.inputs
        else:
            raise RuntimeError(
                f"training_step did not call {self._seq_name or 'the Sequential'}: under strategy='twobp' it must "
                f"call the pipelined Sequential exactly once"
            )
        finally:
            self._mode = ("idle", None)
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise ValueError(
                    "the Sequential's input requires grad: a module with parameters runs before it in "
                    "training_step, which the pipeline cannot train; move it into the Sequential"
                )
        return inputs

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._executor is not None and self.lightning_module is not None
        ex = self._executor
        batch, self._args, self._kwargs = args[0], args[1:], kwargs
        self._step_name = "training_step"
        self._mbs = self._split(batch)
        self._logs = []
        params = [q for q in self.lightning_module.parameters() if q.requires_grad]
        kept = [q.grad for q in params]
        for q in params:  # the step's gradients start from zero; earlier ones are put back below
            q.grad = None
        with self.precision_plugin.train_step_context():
            inputs = [self._capture(mb) for mb in self._mbs] if 0 in ex.stages else None
            targets = list(range(len(self._mbs))) if ex.last in ex.stages else None
            # With a GradScaler (fp16), the pipeline's backward starts from the scaled loss, as
            # Lightning's backward would; the scaler unscales before clipping and stepping.
            scaler = getattr(self.precision_plugin, "scaler", None)
            result = ex.step(inputs, targets, loss_scale=float(scaler.get_scale()) if scaler is not None else 1.0)
        self._stash = [(q, q.grad) for q in params if q.grad is not None]
        for q, g in zip(params, kept):
            q.grad = g
        return self._share_loss_and_logs(result.loss).to(self.root_device)

    def _start_reduce(self, stage: int, params: list[nn.Parameter]) -> Any:
        """Average ``stage``'s gradients over its data-parallel replicas, as DDP would: called by the
        executor right after the stage's last W, one flat asynchronous all-reduce per dtype, so it runs
        while the rank does its remaining work; the returned function finishes it at the step's end."""
        dp = self.world_size // self.pipeline_degree
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for q in params:
            by_dtype.setdefault(q.grad.dtype, []).append(q.grad)
        started = []
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            work = dist.all_reduce(flat, group=self._dp_group, async_op=True)  # SUM: gloo has no AVG
            started.append((work, flat, grads))

        def finish() -> None:
            for work, flat, grads in started:
                work.wait()
                flat.div_(dp)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))

        return finish

    def _share_loss_and_logs(self, loss: torch.Tensor | None, evaluating: bool = False) -> torch.Tensor | None:
        """The loss and logged values live on the last stage: average the logs over micro-batches
        (weighted by their sizes), send both to every rank, log once everywhere (the logger writes
        from global rank 0)."""
        lm = self.lightning_module
        ex = self._executor
        last_rank = self._global_rank_of(self.schedule.stage_to_rank[self.schedule.num_stages - 1])
        payload = None
        if ex.last in ex.stages:
            sizes = [_batch_size(mb) for mb in self._mbs]
            weights = [n / sum(sizes) for n in sizes]
            means: dict[str, tuple[Any, dict]] = {}
            for name in self._logs[0] if self._logs else {}:
                values = [logs[name][0] for logs in self._logs]
                kw = self._logs[0][name][1]
                if isinstance(values[0], torch.Tensor):
                    means[name] = (sum(v.float().cpu() * w for v, w in zip(values, weights)), kw)
                else:
                    means[name] = (sum(v * w for v, w in zip(values, weights)), kw)
            payload = (None if loss is None else loss.detach().cpu(), means)
        box = [payload]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(
                box, src=last_rank, group=getattr(self, "_pp_group", None),
                device=self.root_device if self.root_device.type == "cuda" else None,
            )
        shared_loss, means = box[0]
        for name, (value, kw) in means.items():
            if evaluating:
                # Epoch-level metrics: every rank of a pipeline holds the same value, so the mean over
                # the world is the mean over the data-parallel replicas (what one process would log).
                kw = {"sync_dist": True, **kw}
            lm.log(name, value.to(self.root_device) if isinstance(value, torch.Tensor) else value, **kw)
        return shared_loss

    def _eval_step(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Validation, test and predict: a forward-only pipeline pass, then ``name`` on the last stage
        per micro-batch with the Sequential answered by the pipeline; logs averaged and shared."""
        assert self._executor is not None
        ex = self._executor
        batch, self._args, self._kwargs = args[0], args[1:], kwargs
        self._step_name = name
        self._mbs = self._split(batch, exact=False)
        self._logs = []
        inputs = [self._capture(mb) for mb in self._mbs] if 0 in ex.stages else None
        outs = ex.forward_only(inputs, len(self._mbs))
        results = []
        if outs is not None:
            for mb, out in zip(self._mbs, outs):
                logs: dict[str, tuple[Any, dict]] = {}
                self._mode = ("provide", out)
                try:
                    with _LogRecorder(self.lightning_module, logs):
                        results.append(self._run_step(mb, self._args, self._kwargs))
                finally:
                    self._mode = ("idle", None)
                self._logs.append(logs)
        self._share_loss_and_logs(None, evaluating=True)
        if name != "predict_step" or outs is None:
            return None
        # predictions live on the rank holding the last stage: the micro-batches' outputs, joined
        return pytree.tree_map(lambda *xs: torch.cat(xs) if isinstance(xs[0], torch.Tensor) else list(xs), *results)

    def _agree_on_overflow(self, scaler: Any) -> None:
        """fp16: a GradScaler skips the step and halves its scale when *its* gradients overflow. Each
        rank holds other stages' gradients, so an overflow on one stage must skip the step on every
        rank, or the stages drift apart and their scales disagree (the pipeline's backward starts from
        the last stage's scale). After ``unscale_`` the ranks OR their inf/NaN flags (one all-reduce),
        as DDP gets for free from gradients that are already identical."""
        unscale = scaler.unscale_

        def unscale_everywhere(optimizer: Any) -> None:
            unscale(optimizer)
            flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            total = torch.zeros((), device=self.root_device)
            for f in flags.values():
                total += f.to(self.root_device, torch.float32)
            dist.all_reduce(total)  # the world: every stage of every replica steps or skips together
            for f in flags.values():
                f.copy_((total > 0).to(f.dtype))

        scaler.unscale_ = unscale_everywhere

    def _clip_grad_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` with the norm over every stage of the pipeline."""
        grads = [q.grad for q in self.precision_plugin.main_params(optimizer) if q.grad is not None]
        local = torch.zeros((), device=self.root_device, dtype=torch.float32)
        if grads:
            local = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads]).pow(2).sum()
        if dist.is_initialized() and self.world_size > 1:
            # Every stage once: the pipeline's ranks (replicas hold the same, already averaged grads).
            dist.all_reduce(local, group=getattr(self, "_pp_group", None))
        total = local.sqrt()
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)  # the formula clip_grad_norm_ uses
        for g in grads:
            g.mul_(coef.to(g.dtype))

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Add the gradients the pipeline computed in ``training_step`` (after Lightning's zero_grad)."""
        lm = self.lightning_module
        assert lm is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)  # on_before_backward
        scale = 1.0 / lm.trainer.accumulate_grad_batches
        for q, g in self._stash:
            g = g if scale == 1.0 else g * scale
            if q.grad is None:
                q.grad = g
            else:
                q.grad.add_(g)
        self._stash = []
        return self.precision_plugin.post_backward(closure_loss, lm)  # on_after_backward

    # ------------------------------------------------------------------ evaluation
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # loading needs the partitioned model: each rank reads only its own stages

    def _optimizer_names(self) -> list[list[str]]:
        """Per optimizer, the parameter names in ``optimizer.state_dict()``'s index order."""
        names = {id(q): n for n, q in self.lightning_module.named_parameters()}
        return [[names[id(q)] for g in opt.param_groups for q in g["params"]] for opt in self.optimizers]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A directory: weights and optimizer state by parameter name with torch.distributed.checkpoint
        (each rank writes its own stages, replicas are deduplicated), the rest in ``meta.pt``. State kept
        by name, not by a stage's parameter index, is what lets a run resume under another partition."""
        import torch.distributed.checkpoint as dcp
        from pathlib import Path

        path = Path(self.broadcast(str(filepath)))
        if self.global_rank == 0:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        optimizer_states = checkpoint.pop("optimizer_states", [])
        optim: dict[str, Any] = {}  # "optimizer/parameter name/state key" -> value
        for i, (state, names) in enumerate(zip(optimizer_states, self._optimizer_names())):
            for index, values in state["state"].items():
                for key, value in values.items():
                    optim[f"{i}/{names[index]}/{key}"] = value
            # Each parameter's group hyper-parameters (lr, weight decay, ...), so that a rank whose
            # groups differ from rank 0's (another cut) rebuilds its own groups right.
            for g in state["param_groups"]:
                # pickled: checkpoint would flatten a dict (and its tuples) into separate entries
                hyper = pickle.dumps({k: v for k, v in g.items() if k != "params"})
                for index in g["params"]:
                    optim[f"{i}/{names[index]}/{_GROUP}"] = hyper
        dcp.save({"model": checkpoint.pop("state_dict"), "optim": optim}, checkpoint_id=path)
        if self.global_rank == 0:
            # Hyper-parameters of each param group (lr, betas, ...): the same on every stage.
            checkpoint["optimizer_groups"] = [
                [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
                for state in optimizer_states
            ]
            checkpoint["twobp"] = {"pipeline_degree": self.pipeline_degree,
                                   "stages_per_rank": self._stages_per_rank, "schedule": self.schedule_name}
            torch.save(checkpoint, path / "meta.pt")
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Each rank reads the weights and optimizer state of its own parameters, by name, whatever the
        pipeline degree or partition the checkpoint was saved with."""
        import torch.distributed.checkpoint as dcp
        from pathlib import Path
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / "meta.pt").is_file():
            raise FileNotFoundError(
                f"{path} is not a strategy='twobp' checkpoint (no meta.pt): pass the checkpoint directory "
                f"ModelCheckpoint wrote, or load a consolidated file with strategy='auto'"
            )
        checkpoint = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
        # Which optimizer states exist, and their shapes, from the checkpoint's own metadata.
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        all_names = self._optimizer_names()
        local = {f"{i}/{n}" for i, names in enumerate(all_names) for n in names}
        optim: dict[str, Any] = {}
        for key, meta in stored.items():
            if not key.startswith("optim."):
                continue
            name = key[len("optim."):]
            if name.rsplit("/", 1)[0] in local:
                optim[name] = (torch.empty(meta.size, dtype=meta.properties.dtype)
                               if isinstance(meta, TensorStorageMetadata) else None)
        state = {"model": self.lightning_module.state_dict(), "optim": optim}  # loaded in place
        dcp.load(state, checkpoint_id=path)
        checkpoint["state_dict"] = state["model"]
        groups = checkpoint.pop("optimizer_groups", None)
        if groups is not None:
            checkpoint["optimizer_states"] = []
            for i, (opt, names) in enumerate(zip(self.optimizers, all_names)):
                per_param: dict[int, dict[str, Any]] = {}
                for index, n in enumerate(names):
                    prefix = f"{i}/{n}/"
                    values = {k[len(prefix):]: v for k, v in state["optim"].items() if k.startswith(prefix)}
                    values.pop(_GROUP, None)
                    if values:
                        per_param[index] = values
                current = opt.state_dict()["param_groups"]
                saved = groups[i] if i < len(groups) else []
                param_groups = []
                for j, g in enumerate(current):
                    # the group's settings as saved with its first parameter; older checkpoints: by position
                    first = f"{i}/{names[g['params'][0]]}/{_GROUP}" if g["params"] else None
                    stored = state["optim"].get(first)
                    hyper = pickle.loads(stored) if stored is not None else (saved[j] if j < len(saved) else {})
                    param_groups.append({**g, **hyper, "params": g["params"]})
                checkpoint["optimizer_states"].append({"state": per_param, "param_groups": param_groups})
        # LR schedulers were saved from rank 0: a rank with other param groups keeps its own per-group
        # base learning rates (the groups' lr came back by name above) and takes the shared step count.
        for config, state in zip(self.lr_scheduler_configs, checkpoint.get("lr_schedulers", [])):
            local = getattr(config.scheduler, "base_lrs", None)
            if local is not None and len(state.get("base_lrs", local)) != len(local):
                state["base_lrs"] = list(local)
                state.pop("_last_lr", None)
        saved = checkpoint.get("twobp", {})
        if saved.get("pipeline_degree") != self.pipeline_degree or saved.get("stages_per_rank") != self._stages_per_rank:
            rank_zero_info(
                f"twobp: resuming a checkpoint saved with pipeline_degree={saved.get('pipeline_degree')}, "
                f"stages_per_rank={saved.get('stages_per_rank')} on pipeline_degree={self.pipeline_degree}, "
                f"stages_per_rank={self._stages_per_rank}: weights and optimizer state re-partition by name"
            )
        return checkpoint

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

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="2BP pipeline parallelism (lightning_twobp)"
        )


def _register() -> None:
    if TwoBPStrategy.strategy_name not in StrategyRegistry:
        TwoBPStrategy.register_strategies(StrategyRegistry)


_register()
