"""``TwoBPStrategy(schedule="auto", memory_limit=...)``: measure, agree, search, then train with the choice.

Before the first step (as ``balance="time"`` does), every rank runs each pipelined layer on the first
micro-batch of the first training batch, at each candidate micro-batch count ``m`` (the divisors of
the batch size up to ``4p``, or the one ``num_microbatches`` the user gave): F, B and W as the real
split backward runs them (:func:`~lightning_twobp.engine.footprint.measure_layer`) and the fused
backward BW a fused schedule runs instead, their seconds (median of ``repeats`` after a warm-up), the
bytes autograd saves from F to B (on CPU: the storages its saved-tensor hooks see; the same count on
CUDA, where the allocator would add its rounding), the bytes held from B to W, and each layer's
weights and gradients. Pipeline ranks 0 and 1 time one
message of the largest layer output. One all-reduce (max) gives every rank the same table, so every
rank makes the same choice: ranks that searched on their own timings could pick different schedules
and deadlock. The search itself is :mod:`lightning_twobp.schedules.auto` (pure data); its builds and fused
variants are shared out over the ranks (:mod:`.search_builds`).

Why not time the executor's first steps (the monitor's ``measured_costs``)? Those steps would have
to run some schedule before one is known to fit the limit, and a V schedule cuts the model into
twice the stages, so the choice could not reuse them without moving weights between ranks. Timing
layers gives every layout's stage costs from one table.

Two fixed costs come from outside the layers. The optimizer's state (AdamW: two moments, each a
parameter's size) does not exist before the first step: :func:`optimizer_state_bytes` reads it off the
optimizers ``configure_optimizers`` returns (called once more here, on the whole model, and dropped),
from their type and param groups; an optimizer it does not know is counted as Adam's two copies, and
the log says so. The loss runs once per ``m`` on the last layer's output, as the executor's last stage
runs it (the user's ``training_step`` past the pipelined block, its logged Metrics put back after): what
it saves from F to B (a log-softmax as large as the logits, the targets) joins the last stage. Under the
ModuleList contract (Hugging Face models) it is part of the last layer's run, which answers the model's
call inside the step (:mod:`.layer_runs`), and the loss's own row is empty.

Under ``data_parallel="shard"`` a layer's fixed bytes are what one replica holds, counted as
``twobp-plan`` counts a sharded stage (:func:`~lightning_twobp.lightning.sharding.sharded_static_bytes`):
``1/dp`` of the weights, gradients and optimizer state, plus the weights gathered and the trained ones'
gradients unsharded from a step's first F to its last W (:func:`sharded_fixed`; a frozen weight, a LoRA's
base, has none). With fp32 AdamW that is
16 / dp + 8 bytes a parameter against replicated's 16: nothing saved at dp = 2, a quarter at dp = 4.

With ``activation_checkpointing="auto"`` the layers are profiled three times, plain and checkpointed
``"selective"`` and ``"full"`` (``checkpointing.AUTO_MODES``; wrapped as the strategy wraps them for
training, and unwrapped after), and the search weighs them together
(:func:`~lightning_twobp.schedules.auto.search_profiles`): the choice is checkpointed only where that is
the fastest within the limit, in practice where nothing plain fits, and selectively where that fits (its
recompute leaves out the matmuls). A checkpointed candidate's peak includes B's transient recompute of
one layer, from its profile's difference to the plain one
(:func:`~lightning_twobp.schedules.auto.with_recompute`). With ``activation_checkpointing=None`` a
limit nothing fits costs one checkpointed profile more, so that the refusal says whether checkpointed
blocks would fit; with ``"full"``, ``"selective"`` or ``k`` only the checkpointed profile is measured
and the recompute's transient is not counted (a warning says so).

Profiling leaves no trace: the random state is forked around it, buffers are put back and the
gradients it made are dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_twobp.engine.footprint import LayerFootprint, layer_cost, measure_layer, storage_key
from lightning_twobp.engine.post_validation import copies_frozen
from lightning_twobp.lightning.layer_runs import LayerRuns, layer_runs, trained_dtype
from lightning_twobp.lightning.optimizer_groups import optimizers_in
from lightning_twobp.lightning.profile import first_batch, keep_buffers, now
from lightning_twobp.lightning.search_builds import build_across, fuse_across
from lightning_twobp.lightning.sharding import sharded_static_bytes
from lightning_twobp.lightning.step import StepRunner, batch_size
from lightning_twobp.partition import partition
from lightning_twobp.schedules.auto import (
    AutoChoice,
    LayerCost,
    NoScheduleFits,
    Profile,
    check_families,
    choose_profiles,
    format_choice,
    fused_1f1b_peak,
    resolve_limit,
    size,
)

log = logging.getLogger(__name__)

__all__ = [
    "SavedBytes",
    "StepHoldings",
    "auto_schedule",
    "device_bytes",
    "optimizer_state_bytes",
    "reduced_bytes",
    "sharded_fixed",
    "timed_footprint",
    "trained_size",
]

_FIELDS = len(LayerCost.__dataclass_fields__)  # LayerCost's fields, in order, as one row of the agreed table
_SCALAR = 4  # bytes of a per-parameter step counter (a float32 0-d tensor in torch's optimizers)


def device_bytes(device: torch.device) -> float | None:
    """The device's memory: CUDA's total, or the machine's physical memory for the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def smallest_device(device: torch.device) -> float | None:
    """The smallest :func:`device_bytes` over the ranks (None where a rank cannot tell): a limit given as a
    fraction of the device is then one number everywhere, so every rank makes the same choice, and the same
    calls between ranks after it (the checkpointing hint profiles where nothing fits, the shared builds)."""
    mine = device_bytes(device) or 0.0
    least = -_agree(torch.tensor([-mine], dtype=torch.float64), device).item()  # the max of the negatives
    return least or None


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def _batch_statistics(m: nn.Module) -> bool:
    """Whether ``m`` normalises by its batch's statistics: a batch norm of any kind (BatchNorm1d/2d/3d,
    SyncBatchNorm, the lazy ones, a subclass) in training, or keeping no running statistics (torch then uses
    the batch's in eval too). By class name: their common base is private to torch."""
    kind = any(c.__name__ == "_BatchNorm" for c in type(m).__mro__)
    return kind and (m.training or getattr(m, "running_mean", None) is None)


def _counts(layers: list[nn.Module], batch: int, num_ranks: int) -> list[int]:
    """The micro-batch counts the search weighs: every divisor of the batch up to ``4p``, or, where a layer
    normalises by its batch's statistics (a BatchNorm in training: each micro-batch is normalised by its own,
    so the count changes what is trained), one count: the default ``2p`` (or the largest divisor below it, a
    multiple of ``p`` where there is one),
    so that the trained model does not follow the timings of the run (found by a trial: two launches of one
    configuration picked 8 and 4 micro-batches and trained two models)."""
    found = next(
        (f"pipelined layer {i} ({type(m).__name__}{' at ' + n if n else ''})"
         for i, layer in enumerate(layers) for n, m in layer.named_modules()
         if _batch_statistics(m)),
        None,
    )  # fmt: skip
    every = _divisors(batch, 4 * num_ranks)
    if found is None:
        return every
    # a multiple of the ranks where the batch has one (interleaved schedules need it), else the largest below
    below = [d for d in every if d <= 2 * num_ranks]
    kept = max([d for d in below if d % num_ranks == 0] or below)
    rank_zero_info(
        f"twobp: schedule='auto' weighs num_microbatches={kept} only: {found} normalises by each micro-batch's "
        f"statistics, so another count would train another model; pass num_microbatches= to choose it"
    )
    return [kept]


def timed_footprint(
    layer: nn.Module,
    x: Any,
    needs: bool,
    device: torch.device,
    repeats: int,
    clock: Callable[[], float] | None = None,
) -> LayerFootprint:
    """:func:`~lightning_twobp.engine.footprint.measure_layer` ``repeats`` (>= 1) times after a warm-up:
    bytes from the last run, each phase's median seconds (F, B, W and the fused BW) by ``clock``
    (default: wall time, after a device sync). Gradients accumulate: the caller clears them."""
    tick = clock or (lambda: now(device))
    runs = [measure_layer(layer, x, needs, clock=tick) for _ in range(repeats + 1)][1:]
    f, b, w, bw = (statistics.median(r.seconds[i] for r in runs) for i in range(4))
    return dataclasses.replace(runs[-1], seconds=(f, b, w, bw))


def _state_copies(opt: torch.optim.Optimizer, group: dict) -> tuple[int, int] | None:
    """Tensors of state per parameter of ``group``: (copies of the parameter, 0-d counters); None when
    ``opt`` is not one of torch's optimizers this knows (read from torch 2.x's ``step`` code)."""
    o = torch.optim
    if isinstance(opt, (o.Adam, o.AdamW)):
        return 2 + bool(group.get("amsgrad")), 1  # exp_avg, exp_avg_sq (max_exp_avg_sq); step
    if isinstance(opt, o.SGD):
        return (1 if group.get("momentum") else 0), 0  # momentum_buffer
    if isinstance(opt, (o.RAdam, o.Adamax, o.Adadelta)):
        return 2, 1
    if isinstance(opt, o.NAdam):
        return 2, 2  # exp_avg, exp_avg_sq; step, mu_product
    if isinstance(opt, o.RMSprop):
        return 1 + bool(group.get("momentum")) + bool(group.get("centered")), 1
    if isinstance(opt, o.Adagrad):
        return 1, 1
    return None


def trained_size(q: torch.Tensor, cast: torch.dtype | None) -> int:
    """Bytes per element of ``q`` once the precision has cast the model's floating tensors to ``cast``."""
    return cast.itemsize if cast is not None and q.is_floating_point() else q.element_size()


def reduced_bytes(layer: nn.Module, cast: torch.dtype | None) -> int:
    """The bytes of ``layer``'s gradients the replicated reduce copies into its flat buffer
    (:class:`~.grads.ReplicaReduce`): every trainable parameter's, in its dtype once cast."""
    return sum(q.numel() * trained_size(q, cast) for q in layer.parameters() if q.requires_grad)


def optimizer_state_bytes(
    optimizers: Sequence[torch.optim.Optimizer], cast: torch.dtype | None = None
) -> tuple[dict[int, float], list[str]]:
    """The bytes of state each parameter (by ``id``) will hold in ``optimizers`` once they have stepped,
    before they have (torch creates the state at the first step, like each parameter: in ``cast`` once the
    precision has cast them), and one line per optimizer saying how it was counted. An optimizer not known
    here is counted as Adam's two copies of each parameter, which the line says: give memory_limit that
    much less if it keeps more."""
    out: dict[int, float] = {}
    notes = []
    for opt in optimizers:
        name, total, guessed = type(opt).__name__, 0.0, False
        for group in opt.param_groups:
            copies = _state_copies(opt, group)
            guessed = guessed or copies is None
            k, scalars = copies or (2, 1)
            for q in group["params"]:
                nbytes = k * q.numel() * trained_size(q, cast) + scalars * _SCALAR
                out[id(q)] = out.get(id(q), 0.0) + nbytes
                total += nbytes
        how = (
            f"{name} is not one this counts: taken as Adam's two copies of each parameter (if it keeps more, "
            f"give memory_limit that much less)"
            if guessed
            else f"{name}"
        )
        notes.append(f"{how}: {total:.0f} bytes ({size(total)}) of optimizer state over the whole model")
    return out, notes


@dataclasses.dataclass(frozen=True)
class _OptimizerBytes:
    """Per layer: its optimizer state's bytes, and its frozen weights' that a copy to put back holds (in an
    optimizer whose step may change them: :func:`~lightning_twobp.engine.post_validation.copies_frozen`)."""

    state: list[float]
    frozen_copied: list[float]


def _optimizer_bytes(lm: Any, trainer: Any, layers: list[nn.Module], cast: torch.dtype | None) -> _OptimizerBytes:
    """Each layer's optimizer bytes (training only), from a throw-away ``configure_optimizers``."""
    if trainer.state.fn != TrainerFn.FITTING:  # nothing steps: no state (a later fit chooses again)
        return _OptimizerBytes([0.0] * len(layers), [0.0] * len(layers))
    optimizers = optimizers_in(lm.configure_optimizers())
    per_param, notes = optimizer_state_bytes(optimizers, cast)
    for line in notes:
        rank_zero_info("twobp: schedule='auto' counts " + line)
        if "not one this counts" in line:
            log.warning("twobp: schedule='auto': %s", line)
    copied = {id(q) for o in optimizers if copies_frozen(o) for g in o.param_groups for q in g["params"]}
    state = [sum(per_param.get(id(q), 0.0) for q in layer.parameters() if q.requires_grad) for layer in layers]
    held = [[q for q in layer.parameters() if not q.requires_grad and id(q) in copied] for layer in layers]
    frozen = [float(sum(q.numel() * trained_size(q, cast) for q in qs)) for qs in held]
    return _OptimizerBytes(state, frozen)


def sharded_fixed(
    cost: LayerCost, layer: nn.Module, dp: int, precision: str, cast: torch.dtype | None = None
) -> LayerCost:
    """``cost`` with its fixed bytes as one of ``dp`` replicas holds them under ``data_parallel="shard"``
    (``precision``: the Trainer's, e.g. ``"32-true"``, which casts the weights to ``cast``): the planner's
    count of a sharded stage (:func:`~lightning_twobp.lightning.sharding.sharded_static_bytes`), its
    optimizer share kept apart."""
    every = list(layer.parameters())  # frozen ones too (a LoRA's base weights): sharded and gathered alike
    params = sum(q.numel() for q in every)
    weight = sum(q.numel() * trained_size(q, cast) for q in every)
    grad = sum(q.numel() * trained_size(q, cast) for q in every if q.requires_grad)
    state = math.ceil(cost.optimizer)
    trained = sum(q.numel() for q in every if q.requires_grad)
    total = sharded_static_bytes(params, weight, grad, state, dp, precision, trained)
    share = -(-state // dp)
    return dataclasses.replace(cost, fixed=float(total - share), optimizer=float(share))


class _Loss(nn.Module):
    """The last stage's loss on micro-batch 0 as a layer of its own: the step past the block."""

    def __init__(self, runner: StepRunner) -> None:
        super().__init__()
        self.runner = runner

    def forward(self, *output: torch.Tensor) -> torch.Tensor:
        # a Sequential whose last layer returns a tuple: the step is given the tuple, as the executor gives it
        return self.runner.loss(output[0] if len(output) == 1 else output, 0)


def _profile_loss(runner: StepRunner, runs: LayerRuns, output: Any, repeats: int) -> LayerCost:
    """The loss as the last stage runs it, on the last layer's ``output`` (a tensor, or a tuple of them; inside
    :func:`.layer_runs`: the micro-batch on the device, the Metrics it updates put back after)."""
    loss = runs.in_forward_context(_Loss(runner))
    return layer_cost(timed_footprint(loss, output, True, runs.device, repeats), 0.0)


def _profile_layers(runs: LayerRuns, device: torch.device, repeats: int) -> tuple[list, float, torch.Tensor]:
    """Each layer's footprint on one micro-batch (:mod:`.layer_runs`), the largest output sent on (one
    message: the last layer's goes nowhere; a layer's values sent beside the hidden state count in it, and
    so does the ModuleList contract's micro-batch index, ``LayerRuns.sent_beside``) and the last layer's
    output."""
    x = runs.inputs
    if len(x) != 1 or not (
        isinstance(x[0], torch.Tensor)
        or (isinstance(x[0], (tuple, list)) and all(isinstance(v, torch.Tensor) for v in x[0]))
    ):
        kind = type(x[0]).__name__ if x else ""
        got = f"{len(x)} inputs" if len(x) != 1 else f"one {kind} that is not a tensor nor a tuple of tensors"
        raise ValueError(
            "schedule='auto' times the layers one by one from one tensor (or one tuple of tensors) into the first; "
            f"this model's pipelined block is given {got}: name a schedule instead"
        )
    t: Any = x[0]
    rows, largest = [], 0
    for i, run in enumerate(runs.runs):
        with runs.placed(run.layer):  # as it will train: weights and gradients in the precision's dtype
            fp = timed_footprint(run.call, t, i > 0, device, repeats)
            run.layer.zero_grad(set_to_none=True)
            fixed = float(sum(q.numel() * q.element_size() * (1 + q.requires_grad) for q in run.layer.parameters()))
        cost, beside = layer_cost(fp, fixed), runs.sent_beside
        t = fp.output
        if i == 0:  # the first stage is given the index with its captured inputs, kept until its B
            cost = dataclasses.replace(cost, activation=cost.activation + beside)
        if i < len(runs.runs) - 1:  # a layer whose output may go to another stage (counted into the last one too)
            cost = dataclasses.replace(cost, output=cost.output + beside, output_held=cost.kept + beside)
            largest = max(largest, fp.out_bytes + beside)
        rows.append(cost)
    return rows, float(largest), t


def _message_seconds(nbytes: float, group: Any, device: torch.device, repeats: int) -> float:
    """Half a round trip of ``nbytes`` between pipeline ranks 0 and 1 (0 elsewhere: the max agrees)."""
    if group is None or dist.get_world_size(group) < 2:
        return 0.0
    me = dist.get_rank(group)
    if me > 1:
        return 0.0
    peer = dist.get_global_rank(group, 1 - me)
    buf = torch.zeros(max(1, int(nbytes) // 4), device=device)
    times = []
    for _ in range(repeats + 1):
        start = now(device)
        if me == 0:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
        times.append((now(device) - start) / 2)
    return statistics.median(times[1:])


def _to_row(cost: LayerCost) -> list[float]:
    """A layer's row of the agreed table: its fields in order, a bool as 0 or 1, and a ``bw`` not measured
    as ``b + w``, which is what None means (a number for the all-reduce, and the max of the ranks' BWs
    either way: no NaN to propagate or sentinel to outrank); an ``output_held`` of None as ``output``."""
    fields = {f: getattr(cost, f) for f in LayerCost.__dataclass_fields__}
    if cost.bw is None:
        fields["bw"] = cost.b + cost.w
    fields["output_held"] = cost.kept
    return [float(v) for v in fields.values()]


def _from_row(row: Sequence[float]) -> LayerCost:
    """A layer's row of the agreed table (its bools went through it as 0 and 1; ``bw`` always a number:
    :func:`_to_row`)."""
    fields = LayerCost.__dataclass_fields__.values()
    pairs = zip(fields, row[:_FIELDS], strict=True)
    kw: dict[str, Any] = {f.name: bool(v) if f.type == "bool" else v for f, v in pairs}
    return LayerCost(**kw)


def _agree(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The element-wise max over every rank: one table, one choice everywhere."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        table = table.to(device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return table.cpu()


def _partitions(layers: list[nn.Module], p: int, balance: Any, weights: list[float]) -> dict[int, tuple[int, ...]]:
    """Layers per stage for one and two stages per rank (where the model has enough layers)."""
    out = {}
    for v in (1, 2):
        try:
            costs = weights if balance == "time" else None
            out[v] = tuple(partition(nn.Sequential(*layers), p * v, balance, costs=costs))
        except ValueError:
            continue
    return out


@dataclasses.dataclass(frozen=True)
class StepHoldings:
    """How the strategy will run the step, for what it holds beside the layers' own bytes: the data-parallel
    replicas a stage is sharded over (``data_parallel="shard"``: its fixed bytes are one replica's share), or
    those of ``data_parallel="replicate"`` (the reduce's buffer, a copy of a stage's gradients from its last W
    to the step's end); whether optimizer steps are checked after they are taken (``post_validation``: None,
    each schedule family's default; False under fp16's GradScaler) and may then be put back (``rollback``:
    clipping by norm, ``on_nonfinite="skip"``), which holds the step's gradients through the next step and a
    copy of the weights and optimizer state (``engine.post_validation``; without ``rollback`` nothing)."""

    shard_over: int = 1
    reduce_over: int = 1
    checked_after: bool | None = None
    rollback: bool = False

    def checked(self, layer: nn.Module, cast: torch.dtype | None, optimizer: float, frozen: float = 0.0) -> float:
        """What a check after the step holds of ``layer`` (its ``optimizer`` bytes of state, and ``frozen``
        bytes of weights without gradients that the copy holds too) through the next step, as one replica of
        ``shard_over`` holds its share."""
        if not self.rollback:  # nothing to put back: neither the gradients nor a copy are kept (stop 58)
            return 0.0
        trained = [q for q in layer.parameters() if q.requires_grad]
        grads = sum(q.numel() * trained_size(q, cast) for q in trained)
        copy = grads + frozen + optimizer  # the weights' copy, in their dtype
        return (grads + copy) / self.shard_over


@dataclasses.dataclass(frozen=True)
class _Profiler:
    """What profiling the layers needs, for each way of running them (:meth:`profile`)."""

    runner: StepRunner
    layers: list[nn.Module]
    trainer: Any
    batch: Any
    counts: list[int]
    device: torch.device
    precision: Any
    pp_group: Any
    num_ranks: int
    balance: Any
    repeats: int
    holdings: StepHoldings
    optimizer: _OptimizerBytes  # each layer's optimizer-state bytes, and the frozen ones a copy holds
    checkpoint: Callable[[Any], Callable[[], None]] | None  # wraps the layers in a mode; returns the undo

    @property
    def fitting(self) -> bool:
        return bool(self.trainer.state.fn == TrainerFn.FITTING)

    def profile(self, mode: str | int | None) -> Profile | None:
        """The layers run as ``activation_checkpointing=mode`` says (wrapped for the profile only):
        measured, agreed by every rank, one :class:`Profile`. None when they cannot run checkpointed
        that way (selective checkpointing refuses a block that writes a kept matrix product in place:
        Hugging Face ConvBERT, Longformer): said, and that way left out of the search. Plain, they must
        run: an error there is the model's. (Every rank profiles the same layers: a failure is every
        rank's, before the profile's one message between ranks.)"""
        undo: Callable[[], None] = _nothing
        failed: Exception | None = None
        rows: list[list[list[float]]] = []
        largest: list[float] = []
        try:
            if self.checkpoint is not None:  # inside: a wrapping that fails on one rank is agreed below, not a hang
                undo = self.checkpoint(mode)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                rows, largest = self._rows()
        except Exception as e:  # noqa: BLE001 - any way the layers cannot run checkpointed: left out, said below
            if mode is None:
                raise
            failed = e
        finally:
            undo()
        if _agree(torch.tensor([float(failed is not None)], dtype=torch.float64), self.device).item():
            why = f"{type(failed).__name__}: {failed}" if failed is not None else "it failed on another rank"
            rank_zero_warn(
                f"schedule='auto' leaves activation_checkpointing={mode!r} out of its search: the layers cannot run "
                f"that way ({why}). The other ways are weighed as usual (docs/troubleshooting.md)."
            )
            return None
        # one message between ranks 0 and 1 per count, once every rank has profiled (a rank whose profile
        # failed is in the agreement above, not waiting for a message its peer would send)
        seconds = [_message_seconds(b, self.pp_group, self.device, self.repeats) for b in largest]
        rows = [[r + [t] for r in per_m] for per_m, t in zip(rows, seconds, strict=True)]
        table = _agree(torch.tensor(rows, dtype=torch.float64), self.device).tolist()
        counts = self.counts
        by_m = {m: tuple(_from_row(r) for r in layer_rows[:-1]) for m, layer_rows in zip(counts, table, strict=True)}
        loss = (
            {m: _from_row(layer_rows[-1]) for m, layer_rows in zip(counts, table, strict=True)} if self.fitting else {}
        )
        comm = {m: table[i][0][_FIELDS] for i, m in enumerate(counts)}
        weights = [c.f + c.b + c.w for c in by_m[counts[-1]]]
        partitions = _partitions(self.layers, self.num_ranks, self.balance, weights)
        checked_after = self.holdings.checked_after
        return Profile(self.num_ranks, by_m, partitions, comm, loss, checkpointing=mode, checked_after=checked_after)

    def _rows(self) -> tuple[list[list[list[float]]], list[float]]:
        """This rank's table: per micro-batch count, a row per layer and one for the loss; and per count,
        the largest output a stage sends. Buffers are put back after."""
        device, repeats = self.device, self.repeats
        put_back = keep_buffers(self.layers)
        try:
            return self._each_count(device, repeats)
        finally:
            put_back()

    def _each_count(self, device: torch.device, repeats: int) -> tuple[list[list[list[float]]], list[float]]:
        rows, sent = [], []
        for m in self.counts:
            # several=True: values a ModuleList model passes beside the hidden state go from layer to layer too
            opened = layer_runs(self.runner, self.layers, self.trainer, self.batch, m, device, self.precision, True)
            with opened as runs:
                costs, largest, out = _profile_layers(runs, device, repeats)
                # the loss: in the last layer's run already, or measured on its output (training only:
                # validation and prediction steps return no loss)
                fitting = self.fitting and not runs.with_loss
                loss = _profile_loss(self.runner, runs, out, repeats) if fitting else LayerCost()
            held = zip(costs, self.layers, self.optimizer.state, self.optimizer.frozen_copied, strict=True)
            costs = [self._held(c, q, o, f, runs.cast) for c, q, o, f in held]
            costs.append(loss)  # the last row
            rows.append([_to_row(c) for c in costs])
            sent.append(largest)
        return rows, sent

    def _held(
        self, cost: LayerCost, layer: nn.Module, optimizer: float, frozen: float, cast: torch.dtype | None
    ) -> LayerCost:
        """``cost`` with what the step holds for ``layer`` beside its runs' bytes (:class:`StepHoldings`)."""
        h = self.holdings
        cost = dataclasses.replace(cost, optimizer=optimizer, checked=h.checked(layer, cast, optimizer, frozen))
        if h.shard_over > 1:
            cost = sharded_fixed(cost, layer, h.shard_over, str(getattr(self.precision, "precision", "32-true")), cast)
        if h.reduce_over > 1:
            cost = dataclasses.replace(cost, reduced=float(reduced_bytes(layer, cast)))
        return cost


def _nothing() -> None:
    """Nothing to undo: the layers were not wrapped."""


def _checkpointed_too(profiler: _Profiler) -> Profile | None:
    """For a refusal's hint only: the layers profiled with every block checkpointed "full". A block that
    cannot run checkpointed must not turn the refusal (which names the memory_limit fix) into its own
    error: the hint is then left out (None), with a warning that says why."""
    try:
        return profiler.profile("full")
    except Exception as e:  # noqa: BLE001 - any failure of the hint's extra profile; the refusal stands
        rank_zero_warn(f"schedule='auto' could not measure the blocks checkpointed for its refusal's hint: {e}")
        return None


def auto_schedule(
    runner: StepRunner,
    layers: list[nn.Module],
    trainer: Any,
    device: torch.device,
    precision: Any,
    pp_group: Any,
    num_ranks: int,
    balance: Any,
    memory_limit: float | str,
    num_microbatches: int | None = None,
    split_backward: bool | None = None,
    repeats: int = 2,
    holdings: StepHoldings = StepHoldings(),
    checkpointing: Sequence[str | int | None] = (None,),
    checkpoint: Callable[[Any], Callable[[], None]] | None = None,
    families: Sequence[str] | None = None,
) -> tuple[AutoChoice, Profile]:
    """Profile, agree, search and log (see the module docstring); the same answer on every rank, and the
    profile of the choice. ``holdings``: what the step holds beside the layers, by how it runs
    (:class:`StepHoldings`).
    ``checkpointing``: the ways of running the layers to weigh, one profile each
    (``activation_checkpointing="auto"``: ``AUTO_MODES``); ``checkpoint(mode)`` wraps the layers so
    and returns the undo (None: they are profiled as they are). ``memory_limit="1f1b"`` is fused 1F1B's
    peak in the first way. ``families``: the schedules to choose among (None: every one)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        batch = first_batch(trainer)
        optimizer = _optimizer_bytes(runner.module, trainer, layers, trained_dtype(precision))
    counts = [num_microbatches] if num_microbatches else _counts(layers, batch_size(batch), num_ranks)
    # before profiling: a list none of which can run here is refused; one that cannot is said and left out
    skipped = check_families(families, len(layers), num_ranks, counts, balance, split_backward is not False)
    for name, why in skipped.items():
        rank_zero_warn(f"schedule='auto' leaves {name} out of auto_schedules' search: it {why}")
    profiler = _Profiler(
        runner,
        layers,
        trainer,
        batch,
        counts,
        device,
        precision,
        pp_group,
        num_ranks,
        balance,
        repeats,
        holdings,
        optimizer,
        checkpoint,
    )
    # every rank makes the same calls, from the one agreed table: the hint's profile all-reduce is met
    try:
        choice, profile = choose_profiles(
            profiler.profile,
            checkpointing,
            lambda first: resolve_limit(memory_limit, smallest_device(device), fused_1f1b_peak(first)),
            None if checkpoint is None else (lambda: _checkpointed_too(profiler)),
            split_backward=split_backward,
            max_caps=2 * num_ranks,
            build_all=build_across(),  # each rank builds a share; every rank gets them all
            fuse_all=fuse_across(),  # and the fused variants alike
            families=families,
        )
    except NoScheduleFits as e:
        if not num_microbatches:
            raise
        raise _only_count_tried(e, num_microbatches, num_ranks) from None
    rank_zero_info("twobp: " + format_choice(choice, families=families))
    if choice.best.checkpointing is not None and not profile.recompute:
        rank_zero_warn(
            f"schedule='auto' chose {choice.best.label} from the checkpointed layers' saved bytes, without the "
            f"transient of B's recompute (one layer's activations at a time, with what B has made for W): leave "
            f"that much headroom in memory_limit, or pass activation_checkpointing='auto', whose search counts it"
        )
    return choice, profile


def _only_count_tried(e: NoScheduleFits, num_microbatches: int, num_ranks: int) -> NoScheduleFits:
    """The refusal ``e`` where the user gave ``num_microbatches``: its "a larger batch divides into more" holds
    for the counts auto picks, not a given one."""
    return NoScheduleFits(
        f"{e}. num_microbatches={num_microbatches} was given, so it is the only count tried, and a larger "
        f"batch makes each of its micro-batches larger: give a larger num_microbatches, or leave it out to "
        f"let schedule='auto' try the divisors of the batch size up to {4 * num_ranks}",
        e.smallest,
    )


class SavedBytes:
    """The bytes autograd holds for the backward, live, while inside (a context manager): every tensor
    saved by a forward counts from its save until autograd lets go of it (views of one storage once,
    parameters never: they live anyway). ``peak`` is the most held at once. On CPU, where no
    allocator keeps statistics, this is the measured side of ``schedule="auto"``'s predicted peak."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._exclude = {storage_key(t) for t in exclude}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.now = 0
        self.peak = 0
        self._hooks: Any = None

    @property
    def live(self) -> dict[int, int]:
        """The storages held now: one key per storage (:func:`storage_key`), its bytes."""
        return dict(self._bytes)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        k = storage_key(t)
        alias = t.detach()  # a saved output itself would make a cycle through its grad_fn
        if k in self._exclude:
            return alias
        if k not in self._refs:
            self._refs[k] = 0
            self._bytes[k] = t.untyped_storage().nbytes()
            self.now += self._bytes[k]
            self.peak = max(self.peak, self.now)
        self._refs[k] += 1
        weakref.finalize(alias, self._release, k)
        return alias

    def _release(self, k: int) -> None:
        self._refs[k] -= 1
        if not self._refs[k]:
            del self._refs[k]
            self.now -= self._bytes.pop(k)

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
