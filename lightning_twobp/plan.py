"""``twobp-plan``: the memory of every pipeline rank for a recipe, before any GPU is touched.

    twobp-plan recipe=llama7b-4gpu plan.gpu_memory_gib=80
    twobp-plan recipe=llama7b-4gpu schedule=zb-h2 trainer.devices=8 strategy.pipeline_degree=4 data.batch_size=8

The model is built on the ``meta`` device (no memory, no compute), cut into stages as the strategy
would (``balance="params"``, or the given list; ``"time"`` is measured at run time, so the plan uses
parameters), and each stage runs one micro-batch through the real split backward
(:class:`~lightning_twobp.engine.Stage`, by :mod:`~lightning_twobp.engine.footprint`) on meta tensors,
layer by layer (:mod:`~lightning_twobp.plan_layers`): a Sequential's layers, or a Hugging Face-style model's
blocks (the ModuleList contract) each run through the model's own forward, ``lm(lm.sample_input(b))``, as
``schedule="auto"`` runs them before the cut; attention as the fused kernels save it (not the math path the
meta device would take). That gives, per stage:

* **activations per micro-batch** (``M_act``): the tensors autograd saves in F, held until B;
* **held from B to W per micro-batch** (``M_W``): what 2BP keeps after B for the deferred W. When
  every weight gradient has a direct formula (Linear, RMSNorm scale) B frees the graph and only the
  weight-GEMM operands and their output gradients stay. Convolutions, BatchNorm, LayerNorm, embeddings
  and the Mamba scan's ``A_log`` have direct formulas too; a layer without one (a PReLU slope, a custom
  autograd Function) keeps its graph until W, about ``M_act``, and its stage is marked ``*``. The first
  stage, fed token ids or images, runs its whole backward in B and holds nothing.

With ``strategy.activation_checkpointing`` (``full``, ``selective`` or ``k``: every k-th layer, the
strategy's own choice of layers) each chosen layer is measured checkpointed, as the strategy wraps it: F
saves only the layer's input until B (``selective``: and its matrix products' outputs), B still leaves W
its operands (the weight GEMMs' inputs, taken from B's recompute), and B's recompute holds the layer's
full activations for a while (``recompute``). B
recomputes one layer at a time, as its engine reaches it, with or without the split; under the split it
has by then made the operands and gradients W keeps of the layers after it (their ``M_W``): the most of
the two together over the stage's layers. A fused BW (and the first stage's B, a plain backward) keeps
nothing for W: the largest layer's. The replay adds it on top of what the rank holds before that B or BW.

With ``schedule=auto`` and ``strategy.activation_checkpointing=auto`` the search weighs the layers plain
and ``full`` (a checkpointed layer's B taken as twice its F, the recompute's bytes added to its peaks)
and the plan is then that of its choice, checkpointed or not.

Where the schedule checks its optimizer steps after taking them (post-validation: zb-h2 and zb-v by default)
and may put one back (clipping by norm, ``on_nonfinite=skip``), each stage's gradients stay through the next
step, with a copy of its weights and optimizer state (``StagePlan.checked_bytes``; nothing without); with
data-parallel replicas the reduce's copy of a stage's
gradients lives from its last W to the step's end (``StagePlan.reduce_bytes``).

Replaying the schedule's action order (:func:`~lightning_twobp.schedules.replay_memory`) then gives each rank's peak: F
adds ``M_act``, B trades it for
``M_W``, W frees it (BW frees at once). This is the 2BP paper's memory cost made explicit: the same
schedule with and without the split. Weights, gradients and optimizer state complete the total; the
CUDA context, communication buffers, the allocator's fragmentation and temporary workspaces are not
modelled, hence ``plan.headroom``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from hydra.errors import (
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from lightning_twobp.config import CONF_DIR, recipes
from lightning_twobp.engine.footprint import LayerFootprint, layer_cost, measure_layer
from lightning_twobp.lightning.layout import check_degree, schedule_label
from lightning_twobp.lightning.sharding import check_replicas, sharded_static_bytes
from lightning_twobp.options import PipelineOptions
from lightning_twobp.partition import partition
from lightning_twobp.plan_layers import PlannedLayers, planned_layers
from lightning_twobp.schedules import (
    MemoryCosts,
    Schedule,
    build_schedule,
    memory_levels,
    reduce_levels,
    replay_memory,
    schedule_spec,
)
from lightning_twobp.schedules import auto as search_auto

__all__ = ["RankPlan", "StagePlan", "main", "plan", "plan_recipe"]

GiB = 2**30


@dataclass
class StagePlan:
    stage: int
    rank: int
    layers: tuple[int, int]  # first and last index in the Sequential
    params: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # M_act: saved by one micro-batch's F, held until its B
    held_bytes: int  # M_W: held by one micro-batch from its B to its W under 2BP
    graph_kept: bool  # True when W re-enters the autograd graph (then M_W ~ M_act)
    checkpointed: int = 0  # layers run under activation checkpointing
    recompute_bytes: int = 0  # held for a while by one micro-batch's B as it recomputes them, one at a time
    recompute_fused_bytes: int = 0  # the same in a fused BW (one layer at a time)
    reduce_bytes: int = 0  # data_parallel="replicate" over replicas: the reduce's copy of its gradients
    checked_bytes: int = 0  # post-validation that may put a step back: its gradients and a copy, to the next step


@dataclass
class RankPlan:
    rank: int
    stages: list[int]
    static_bytes: int  # weights + grads + optimizer state of its stages
    # {"in_flight", "activation_bytes", "recompute_bytes", "total_bytes"} with 2BP; activation_bytes holds
    # the recompute's share of the peak (recompute_bytes, 0 without activation checkpointing)
    split: dict = field(default_factory=dict)
    fused: dict = field(default_factory=dict)  # the same schedule without the split
    fits: bool | None = None


@dataclass
class Plan:
    recipe: str
    model: str
    params: int
    world: int
    pipeline_degree: int
    data_parallel: int
    schedule: str
    fused_schedule: str
    num_microbatches: int
    microbatch_size: int
    precision: str
    optimizer: str
    activation_checkpointing: str | int | None
    gpu_memory_gib: float | None
    headroom: float
    stages: list[StagePlan]
    ranks: list[RankPlan]
    notes: list[str]

    def memory_costs(self) -> MemoryCosts:
        """The plan's bytes per stage for the schedule model: ``simulate(schedule, Costs(memory=...))``
        then reports each rank's planned total (``RankPlan.split["total_bytes"]``) as ``peak_bytes``."""
        return MemoryCosts(
            activation=[sp.activation_bytes for sp in self.stages],
            held=[sp.held_bytes for sp in self.stages],
            fixed=[sp.weight_bytes + sp.grad_bytes + sp.optimizer_bytes + sp.checked_bytes for sp in self.stages],
            reduced=[sp.reduce_bytes for sp in self.stages],
        )


def _int_devices(cfg: DictConfig) -> int:
    devices = cfg.trainer.get("devices", 1)
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"twobp-plan needs a device count: trainer.devices is {devices!r}; set trainer.devices=N")
    return devices * int(cfg.trainer.get("num_nodes", 1) or 1)


def _bytes(precision: str) -> tuple[int, torch.dtype]:
    """Bytes per parameter, and the activations' dtype, for a Lightning precision string."""
    p = str(precision)
    if p in ("bf16-true", "16-true"):
        return 2, torch.bfloat16 if p.startswith("bf16") else torch.float16
    if p in ("bf16-mixed", "bf16"):
        return 4, torch.bfloat16  # fp32 weights, bf16 activations under autocast
    if p in ("16-mixed", "16"):
        return 4, torch.float16
    if p in ("32-true", "32"):
        return 4, torch.float32
    raise ValueError(f"twobp-plan knows precisions 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true; got {p!r}")


def _signature(layer: nn.Module, x: torch.Tensor, needs_input_grad: bool) -> tuple:
    """Layers with equal signatures save equal bytes: the paper models' identical blocks are measured once."""
    params = tuple((n, tuple(q.shape), q.dtype) for n, q in layer.named_parameters())
    return (type(layer), params, repr(layer), tuple(x.shape), x.dtype, needs_input_grad)


def _checkpointed(ac: str | int | None, index: int) -> str | None:
    """How layer ``index`` runs checkpointed (``"full"`` or ``"selective"``), or None: the rule of
    ``apply_activation_checkpointing``."""
    if ac is None or index % (ac if isinstance(ac, int) else 1) != 0:
        return None
    return "selective" if ac == "selective" else "full"


def _footprint(
    layers: PlannedLayers, i: int, x: torch.Tensor, needs: bool, cache: dict, checkpointed: str | None
) -> LayerFootprint:
    """:func:`measure_layer` of layer ``i``, once per signature; ``checkpointed``: wrapped as the strategy
    wraps it in that mode (``"full"`` or ``"selective"``), or None."""
    call = layers.calls[i]
    key = (*_signature(call, x, needs), layers.key(i), checkpointed)
    if key not in cache:
        undo = layers.checkpointed(i, checkpointed) if checkpointed else (lambda: None)
        try:
            fp = measure_layer(call, x, needs)
        except (RuntimeError, NotImplementedError) as e:  # one line naming the layer, not a traceback
            raise _MetaRunError(
                f"{layers.contract.describe(i)} does not run on the meta device ({type(e).__name__}: {e})"
            ) from e
        finally:
            undo()
        if checkpointed == "selective":  # the kept products live in torch's store, which no saved-tensor hook sees
            fp = replace(fp, activation_bytes=fp.activation_bytes + layers.kept_products(i, x))
        cache[key] = fp
    return cache[key]


class _MetaRunError(ValueError):
    """A layer's run failed on meta: a refusal of the model's (the CLI says it in one line)."""


@dataclass(frozen=True)
class _Measured:
    """One stage's bytes for one micro-batch (see :func:`_measure_stage`)."""

    out: torch.Tensor
    act: int  # M_act
    held: int  # M_W
    kept: bool
    recompute: int  # B's recompute of one layer, with what B made for W of the layers after it (the split)
    recompute_max: int  # the largest one layer's (a fused BW, a plain backward)
    checkpointed: int
    out_saved: bool  # the last layer saves its output (else the stage holds it from F to B on its own)


def _measure_stage(
    layers: PlannedLayers,
    start: int,
    stop: int,
    x: torch.Tensor,
    first: bool,
    cache: dict,
    chosen: Sequence[str | None] = (),
) -> _Measured:
    """The bytes of a stage of ``layers`` ``start .. stop - 1``, layer by layer. A stage's graph is kept
    from B to W as soon as one of its layers needs it (one ``retain_graph`` for the whole stage), and then
    M_W is the whole M_act plus what W reads. The first stage (no input gradient) runs all of its backward
    in B and holds nothing.
    ``chosen[i]``: layer i runs checkpointed in that mode (see :func:`_checkpointed`); its recompute
    holds what it would have saved in F, less the input it did save. Under the split B holds it on top
    of what it has made for W of the checkpointed layers after i (their operands recomputed, their
    gradients; a plain layer's gradients for W are the backward's working set, counted without
    checkpointing too)."""
    act = held = recompute = recompute_max = 0
    kept = prev_saves_output = False
    recomputed: list[tuple[int, int]] = []  # (recompute, bytes kept for W) per checkpointed layer
    for i in range(stop - start):
        needs = x.is_floating_point() and not (first and i == 0)
        ckpt = chosen[i] if i < len(chosen) else None
        m = _footprint(layers, start + i, x, needs, cache, ckpt)
        if ckpt:
            extra = _footprint(layers, start + i, x, needs, cache, None).activation_bytes - m.activation_bytes
            recompute_max = max(recompute_max, extra)
            recomputed.append((extra, m.held_bytes))
        # a tensor saved by both sides of a layer boundary (a ReLU's output, the next conv's input) is one
        shared = m.saved_input if prev_saves_output else 0
        act, held, kept = act + m.activation_bytes - shared, held + m.held_bytes, kept or m.graph_kept
        prev_saves_output = m.saves_output
        x = torch.empty(m.out_shape, dtype=m.out_dtype, device="meta")
    made = 0
    for extra, kept_for_w in reversed(recomputed):  # B's order: the last layer first
        recompute, made = max(recompute, made + extra), made + kept_for_w
    n, saved = sum(c is not None for c in chosen), prev_saves_output
    if first:  # B is a plain backward there: one layer's recompute at a time
        return _Measured(x, act, 0, False, recompute_max, recompute_max, n, saved)
    return _Measured(x, act, held + (act if kept else 0), kept, recompute, recompute_max, n, saved)


def _recompute_peak(row: Sequence[Any], levels: Sequence[float], recompute: dict[int, tuple[int, int]]) -> float:
    """The most a rank holds while a B or BW recomputes its checkpointed layers: what it held before
    that action (the micro-batch's saved inputs included) plus the recompute (``(split, fused)`` bytes
    per stage)."""
    most, before = 0.0, 0.0
    for action, after in zip(row, levels, strict=True):
        if action.kind in ("B", "BW") and action.stage in recompute:
            most = max(most, before + recompute[action.stage][action.kind == "BW"])
        before = after
    return most


def _replay(
    schedule: Schedule,
    rank: int,
    act: dict[int, int],
    held: dict[int, int],
    recompute: dict[int, tuple[int, int]] | None = None,
    reduced: dict[int, int] | None = None,
) -> dict:
    """Peak activation memory of ``rank`` over its action order (``act``, ``held``, ``recompute`` and
    ``reduced``, the data-parallel reduce's buffer from the stage's last W on, cover its stages)."""
    count = replay_memory(schedule).per_rank[rank]
    levels = memory_levels(schedule, lambda s, _: act.get(s, 0), lambda s, _: held.get(s, 0))[rank]
    if reduced:
        extra = reduce_levels(schedule.actions[rank], lambda s: reduced.get(s, 0))
        levels = tuple(level + d for level, d in zip(levels, extra, strict=True))
    peak = max(levels, default=0)
    during = _recompute_peak(schedule.actions[rank], levels, recompute or {})
    return {"in_flight": count, "activation_bytes": max(peak, during), "recompute_bytes": max(0, during - peak)}


def _choose_auto(
    cfg: DictConfig, p: int, opts: PipelineOptions, shard_over: int = 1, reduce_over: int = 1
) -> search_auto.AutoChoice:
    """``schedule=auto`` on paper: each layer's bytes measured on meta at every micro-batch count that
    divides the batch (up to 4p), its time taken as parameters x samples (the GEMMs' FLOPs; meta has
    no clock; a checkpointed layer's B twice that: its recompute), the fixed bytes as the plan counts
    them (``shard_over`` > 1: one of that many ``data_parallel="shard"`` replicas' share; ``reduce_over`` > 1:
    ``data_parallel="replicate"``, whose reduce copies a stage's grads from its last W on); the device is
    ``plan.gpu_memory_gib`` x headroom. ``strategy.activation_checkpointing=auto`` weighs the layers
    plain and ``full`` (the checkpointed ones' peaks with B's recompute); a limit nothing plain fits
    says what ``full`` would hold. ``opts``: the strategy's options as checked (their ``auto_schedules``, None:
    every schedule; ``post_validation`` and ``on_nonfinite``, for what a check after the step holds)."""
    st = cfg.strategy
    batch = int(cfg.data.batch_size)
    given = st.get("num_microbatches")
    counts = [int(given)] if given else [d for d in range(1, min(batch, 4 * p) + 1) if batch % d == 0]
    ac = st.get("activation_checkpointing")
    families = opts.auto_schedules
    fp16, rollback = _scaled_fp16(cfg), _rolls_back(cfg, opts.on_nonfinite)
    after = False if fp16 else opts.post_validation
    measure = _AutoMeasure(cfg, p, shard_over, counts, families, reduce_over, after, rollback)
    gpu = cfg.plan.get("gpu_memory_gib")
    device = None if gpu is None else float(gpu) * GiB * float(cfg.plan.get("headroom", 0.9))
    limit = st.get("memory_limit") or "1f1b"
    choice, _ = search_auto.choose_profiles(
        measure.profile,
        # Not "selective": on meta a layer's time is its parameters x samples, which a recompute without
        # the matmuls cannot be told from (the strategy, with a clock, weighs it: checkpointing.AUTO_MODES).
        (None, "full") if ac == "auto" else (ac,),
        lambda first: search_auto.resolve_limit(limit, device, search_auto.fused_1f1b_peak(first)),
        lambda: measure.profile("full"),
        microbatches=counts,
        max_caps=2 * p,
        families=families,
        split_backward=None if st.get("split_backward", True) else False,  # as the strategy searches
    )
    return choice


@dataclass
class _AutoMeasure:
    """The layers of the recipe's model on meta, measured for ``schedule=auto`` (:func:`_choose_auto`)."""

    cfg: DictConfig
    p: int
    shard_over: int
    counts: list[int]
    families: tuple[str, ...] | None = None  # strategy.auto_schedules, checked against the layers as planned
    reduce_over: int = 1  # data_parallel="replicate"'s replicas: the reduce's buffer counts where several
    checked_after: bool | None = None  # post_validation (None: each family's default; False under fp16)
    rollback: bool = False  # a checked step may be put back: clipping by norm, on_nonfinite=skip
    cache: dict[tuple, LayerFootprint] = field(default_factory=dict)

    def profile(self, ac: str | int | None) -> search_auto.Profile:
        """Every layer at each micro-batch count, run as ``activation_checkpointing=ac`` says."""
        from hydra.utils import instantiate

        cfg, st = self.cfg, self.cfg.strategy
        batch = int(cfg.data.batch_size)
        precision = str(cfg.trainer.get("precision", "32-true"))
        param_bytes, act_dtype = _bytes(precision)
        states = {"adamw": 2, "adam": 2, "sgd": 1}.get(str(cfg.plan.get("optimizer", "adamw")), 2)
        layers: dict[int, tuple] = {}
        with torch.device("meta"):
            lm = instantiate(cfg.model)
        for m in self.counts:  # planned_layers casts the model as each count's runs need it
            with planned_layers(lm, st.get("layers"), batch // m, act_dtype) as planned:
                layers[m] = self._row(planned, ac, batch // m, param_bytes, states, precision)
        balance = st.get("balance", "params")
        balance = list(balance) if OmegaConf.is_list(balance) else ("params" if balance == "time" else balance)
        split = bool(st.get("split_backward", True))
        search_auto.check_families(self.families, len(planned.units), self.p, self.counts, balance, split)
        partitions = {}
        for v in (1, 2):
            try:
                partitions[v] = tuple(partition(nn.Sequential(*planned.units), self.p * v, balance))
            except ValueError:
                continue
        return search_auto.Profile(self.p, layers, partitions, checkpointing=ac, checked_after=self.checked_after)

    def _row(
        self, planned: PlannedLayers, ac: str | int | None, samples: int, param_bytes: int, states: int, precision: str
    ) -> tuple:
        """Every layer's cost at ``samples`` per micro-batch."""
        x, row = planned.x, []
        for i, layer in enumerate(planned.units):
            needs = x.is_floating_point() and i > 0
            mode = _checkpointed(ac, i)
            fp = _footprint(planned, i, x, needs, self.cache, mode)
            n = sum(q.numel() for q in layer.parameters())
            t = float(n * samples)
            weight, state = n * param_bytes, n * states * (4 if param_bytes == 4 else 2)
            fixed = (
                sharded_static_bytes(n, weight, weight, state, self.shard_over, precision)
                if self.shard_over > 1
                else 2 * weight + state
            )
            cost = layer_cost(fp, fixed, (t, 2 * t if mode else t, t), planned.scale)
            # one replica's share under data_parallel="shard" (its grads and copy are local shards); nothing where
            # no step can be put back (StepHoldings.checked, _checked_after)
            checked = (2 * weight + state) / self.shard_over if self.rollback else 0
            cost = replace(cost, checked=float(checked))
            row.append(replace(cost, reduced=float(weight)) if self.reduce_over > 1 else cost)  # grads: as weights
            x = torch.empty(fp.out_shape, dtype=fp.out_dtype, device="meta")
        return tuple(row)


@dataclass(frozen=True)
class _Pipeline:
    """What the strategy would run: its checked options (``schedule=auto``'s choice made), the schedule,
    and the fused baseline the plan compares it with."""

    options: PipelineOptions
    degree: int  # ranks per pipeline
    num_stages: int
    num_microbatches: int
    schedule: Schedule
    fused_name: str
    fused: Schedule


def _pipeline(cfg: DictConfig, world: int, notes: list[str]) -> _Pipeline:
    """The strategy's options as it would check them, and the schedules they give."""
    # the strategy's own checks; a DictConfig converts to a dict with str keys (OmegaConf types any container)
    opts = PipelineOptions.from_mapping(
        typing.cast("dict[str, Any]", OmegaConf.to_container(cfg.strategy, resolve=True))
    )
    p = opts.degree(world)
    check_degree(world, p)
    shard_over = world // p if opts.data_parallel == "shard" else 1
    reduce_over = world // p if opts.data_parallel == "replicate" else 1
    auto = opts.schedule == "auto"
    choice = _choose_auto(cfg, p, opts, shard_over, reduce_over) if auto else None
    if choice is not None:
        searched_ac, among = opts.activation_checkpointing, opts.auto_schedules
        opts = opts.chosen(choice.best)
        notes.append(
            search_auto.format_choice(choice, unit="parameter-samples", families=among).split("\nsimulated")[0]
        )
        notes.append(
            "schedule=auto on paper: F, B and W of a layer take its parameters x samples (no clock on meta), "
            "a checkpointed layer's B twice that (its recompute)"
        )
        if searched_ac == "auto":
            notes.append(
                "activation_checkpointing=auto: schedule=auto weighed the layers plain and checkpointed ('full'), "
                "the checkpointed candidates' peaks with B's recompute on top of their highest level; training "
                "weighs 'selective' too (it needs a clock: its recompute leaves out the matmuls)"
            )
        elif opts.activation_checkpointing is not None:
            notes.append(
                "schedule=auto searched with the checkpointed layers' saved bytes, not B's recompute bytes: the "
                "per-rank figures below add them"
            )
    name, spr, m, split, cap = opts.schedule, opts.stages, opts.microbatches(p), opts.split_backward, opts.max_pending_w
    num_stages = p * spr
    schedule = (
        choice.best.schedule
        if choice is not None
        else build_schedule(name, num_stages, m, stages_per_rank=spr, split_backward=split, max_pending_w=cap)
    )
    # a split-only schedule is compared with its spec's fused baseline at the same stage count
    fused_name = schedule_spec(name).fused_baseline or name
    fused = build_schedule(fused_name, num_stages, m, stages_per_rank=spr, split_backward=False)
    return _Pipeline(opts, p, num_stages, m, schedule, fused_name, fused)


def _microbatch_size(cfg: DictConfig, m: int) -> int:
    batch = int(cfg.data.batch_size)
    if batch % m:
        raise ValueError(
            f"batch size {batch} does not split into {m} micro-batches: set data.batch_size to a multiple of {m}"
        )
    return batch // m


def _optimizer_states(optimizer: str) -> int:
    """Tensors of optimizer state per parameter."""
    states = {"adamw": 2, "adam": 2, "sgd": 1}.get(optimizer)
    if states is None:
        raise ValueError(f"plan.optimizer={optimizer!r}: choose adamw, adam or sgd")
    return states


def _planned_balance(balance: str | tuple[int, ...], notes: list[str]) -> str | list[int]:
    if balance == "time":
        notes.append('balance="time" is measured at run time; planned with balance="params"')
        return "params"
    return balance if isinstance(balance, str) else list(balance)


def _measure_scaled(
    s: int,
    layers: PlannedLayers,
    bounds: tuple[int, int],
    x: torch.Tensor,
    act_dtype: torch.dtype,
    last: bool,
    cache: dict,
    chosen: Sequence[str | None] = (),
    sends: bool = True,
) -> _Measured:
    """:func:`_measure_stage` of stage ``s`` (``layers`` ``bounds[0] .. bounds[1] - 1``), its bytes scaled by
    ``layers.scale`` (see :func:`.planned_layers`), the loss's own activations added on the last stage.
    ``sends``: the next stage is on another rank."""
    scale = layers.scale
    try:
        m = _measure_stage(layers, *bounds, x, s == 0, cache, chosen)
    except _MetaRunError as e:
        if scale != 1.0 or act_dtype == torch.float32:
            raise
        raise _MetaRunError(
            f"stage {s} does not run in {act_dtype} on meta: {e}; if it runs in fp32, plan with "
            f"trainer.precision=32-true"
        ) from e
    act, held, rec, rec_max = (int(b * scale) for b in (m.act, m.held, m.recompute, m.recompute_max))
    if last:
        act += m.out.numel() * 4  # the loss: cross-entropy saves fp32 log-probabilities of the output's size
    elif not m.out_saved and not sends:
        # The stage keeps the output it handed to the next stage on its rank until its own B runs the
        # backward from it; one sent to another rank it drops once sent (``Stage.drop_outputs``: then the
        # send holds it, a communication buffer, not modelled).
        act += int(m.out.numel() * m.out.element_size() * scale)
    return _Measured(m.out, act, held, m.kept, rec, rec_max, m.checkpointed, m.out_saved)


def _stage_plans(
    layers: PlannedLayers,
    sizes: list[int],
    act_dtype: torch.dtype,
    rank_of: Sequence[int],
    param_bytes: int,
    states: int,
    ac: str | int | None = None,
) -> list[StagePlan]:
    """Each stage's bytes: its ``sizes`` layers measured in turn from the first one's input, those ``ac``
    picks checkpointed."""
    stages, start, x = [], 0, layers.x
    cache: dict = {}
    for s, n in enumerate(sizes):
        n_params = sum(q.numel() for q in nn.ModuleList(layers.units[start : start + n]).parameters())
        chosen = [_checkpointed(ac, i) for i in range(start, start + n)]
        last = s == len(sizes) - 1
        sends = not last and rank_of[s + 1] != rank_of[s]
        m = _measure_scaled(s, layers, (start, start + n), x, act_dtype, last, cache, chosen, sends)
        x = m.out
        stages.append(
            StagePlan(
                stage=s,
                rank=rank_of[s],
                layers=(start, start + n - 1),
                params=n_params,
                weight_bytes=n_params * param_bytes,
                grad_bytes=n_params * param_bytes,
                optimizer_bytes=n_params * states * (4 if param_bytes == 4 else 2),
                activation_bytes=m.act,
                held_bytes=m.held,
                graph_kept=m.kept,
                checkpointed=m.checkpointed,
                recompute_bytes=m.recompute,
                recompute_fused_bytes=m.recompute_max,
            )
        )
        start += n
    return stages


def _rank_plans(
    pipe: _Pipeline, stages: list[StagePlan], gpu: Any, headroom: float, dp: int, precision: str
) -> list[RankPlan]:
    """Each rank's peak, with the split and with the fused baseline, from its stages' bytes."""
    act_of = {sp.stage: sp.activation_bytes for sp in stages}
    held_of = {sp.stage: sp.held_bytes for sp in stages}
    recompute = {sp.stage: (sp.recompute_bytes, sp.recompute_fused_bytes) for sp in stages if sp.checkpointed}
    ranks = []
    for r in range(pipe.degree):
        mine = list(pipe.schedule.stages_of(r))
        static = sum(_static(stages[s], pipe.options.data_parallel, dp, precision) for s in mine)
        a, reduced = {s: act_of[s] for s in mine}, {s: stages[s].reduce_bytes for s in mine}
        with_split = _replay(pipe.schedule, r, a, {s: held_of[s] for s in mine}, recompute, reduced)
        without = _replay(pipe.fused, r, a, {s: 0 for s in mine}, recompute, reduced)
        checked = sum(stages[s].checked_bytes for s in mine)  # the split schedule's check after the step
        with_split["total_bytes"] = static + checked + with_split["activation_bytes"]
        without["total_bytes"] = static + without["activation_bytes"]
        fits = None if gpu is None else with_split["total_bytes"] <= headroom * float(gpu) * GiB
        ranks.append(RankPlan(rank=r, stages=mine, static_bytes=static, split=with_split, fused=without, fits=fits))
    return ranks


def plan(cfg: DictConfig, recipe: str = "") -> Plan:
    """The memory plan of the run ``cfg`` describes (a composed twobp-train config)."""
    from hydra.utils import instantiate

    notes: list[str] = []
    world = _int_devices(cfg)
    pipe = _pipeline(cfg, world, notes)
    mbs = _microbatch_size(cfg, pipe.num_microbatches)
    precision = str(cfg.trainer.get("precision", "32-true"))
    param_bytes, act_dtype = _bytes(precision)
    optimizer = str(cfg.plan.get("optimizer", "adamw"))
    states = _optimizer_states(optimizer)

    with torch.device("meta"):
        lm = instantiate(cfg.model)
    ac = pipe.options.activation_checkpointing
    with planned_layers(lm, pipe.options.layers, mbs, act_dtype) as layers:
        sizes = partition(nn.Sequential(*layers.units), pipe.num_stages, _planned_balance(pipe.options.balance, notes))
        stages = _stage_plans(layers, sizes, act_dtype, pipe.schedule.stage_to_rank, param_bytes, states, ac)
    notes += _layer_notes(layers, precision)
    if ac is not None:
        kept = "input and its matrix products' outputs" if ac == "selective" else "input"
        notes.append(
            f"activation_checkpointing={ac!r}: F keeps each checkpointed layer's {kept} until B; B's recompute "
            f"holds one layer's activations at a time (recomp: under the split with what B has made for W of "
            f"the layers after it; the largest layer's in a fused BW), W's operands stay until W as without"
        )
    if any(sp.graph_kept for sp in stages):
        notes.append(
            "stages marked * keep their autograd graph from B to W (a layer's weight gradient has no direct "
            "formula: a PReLU slope, a custom autograd Function), so 2BP holds about M_act there"
        )
    gpu = cfg.plan.get("gpu_memory_gib")
    headroom = float(cfg.plan.get("headroom", 0.9))
    dp = world // pipe.degree
    if pipe.options.data_parallel == "shard":
        check_replicas(dp, precision)
        notes.append(
            f"data_parallel='shard': static = 1/{dp} of weights, grads and optimizer + a step's gathered "
            f"weights and grads"
        )
    elif dp > 1:
        stages = [replace(sp, reduce_bytes=sp.grad_bytes) for sp in stages]
        notes.append(
            f"data_parallel='replicate' over {dp} replicas: the reduce copies each stage's grads into its buffer "
            f"from the stage's last W to the step's end (in act/total from there)"
        )
    stages = _checked_after(cfg, pipe, stages, notes, dp if pipe.options.data_parallel == "shard" else 1)
    return Plan(
        recipe=recipe,
        model=str(cfg.model._target_).rsplit(".", 1)[-1],
        params=layers.params(),
        world=world,
        pipeline_degree=pipe.degree,
        data_parallel=world // pipe.degree,
        schedule=schedule_label(pipe.schedule.name, pipe.options.split_backward),
        fused_schedule=pipe.fused_name,
        num_microbatches=pipe.num_microbatches,
        microbatch_size=mbs,
        precision=precision,
        optimizer=optimizer,
        activation_checkpointing=ac,
        gpu_memory_gib=None if gpu is None else float(gpu),
        headroom=headroom,
        stages=stages,
        ranks=_rank_plans(pipe, stages, gpu, headroom, dp, precision),
        notes=notes,
    )


def _scaled_fp16(cfg: DictConfig) -> bool:
    """Whether the precision trains with fp16's GradScaler, which owns the non-finite check (no check after the
    step then): Lightning's "16-mixed" (16, "16"); "16-true" has no scaler, so the strategy checks after the step
    as under 32 or bf16 (``pipeline._holdings`` reads the plugin's scaler)."""
    return str(cfg.trainer.get("precision", "32-true")) in ("16", "16-mixed")


def _rolls_back(cfg: DictConfig, on_nonfinite: str) -> bool:
    """Whether a step checked after it is taken may be put back, so a copy is kept: clipping by norm (by value
    clips each rank's own gradients before the check: nothing to redo; ``optimizer_checks._new_check``), or
    ``on_nonfinite="skip"``."""
    algorithm = str(cfg.trainer.get("gradient_clip_algorithm") or "norm").lower()
    return (bool(cfg.trainer.get("gradient_clip_val")) and algorithm == "norm") or on_nonfinite == "skip"


def _checked_after(
    cfg: DictConfig, pipe: _Pipeline, stages: list[StagePlan], notes: list[str], shard_over: int = 1
) -> list[StagePlan]:
    """``stages`` with what post-validation holds through the next step where the schedule checks its
    optimizer steps after taking them (``post_validation``; zb-h2 and zb-v by default, never under fp16) and
    may put one back (clipping by norm or ``on_nonfinite=skip``): each stage's gradients and a copy of its
    weights and optimizer state (``engine.post_validation``); under ``data_parallel="shard"`` one of
    ``shard_over`` replicas' share (the gradients and the copy are its local shards). A check that cannot put
    a step back keeps nothing (a flag per parameter)."""
    if not pipe.options.overlaps(_scaled_fp16(cfg)):
        return stages
    if not _rolls_back(cfg, pipe.options.on_nonfinite):
        notes.append(
            "post-validation checks each optimizer step after it is taken; with nothing to put back (no clipping "
            "by norm, on_nonfinite=stop) it holds nothing through the next step"
        )
        return stages
    notes.append(
        "post-validation (the optimizer step checked after it is taken, and put back if clipped or skipped) holds "
        "each stage's grads through the next step, and a copy of its weights and optimizer state (in total)"
    )
    return [
        replace(sp, checked_bytes=(sp.grad_bytes + sp.weight_bytes + sp.optimizer_bytes) // shard_over) for sp in stages
    ]


def _layer_notes(layers: PlannedLayers, precision: str) -> list[str]:
    """What the plan's notes say of how the layers were measured."""
    notes = []
    if layers.scale != 1.0:
        measured = "fp32" if layers.scale < 1 else "bf16"
        notes.append(
            f"{precision}: activations measured in {measured} (the model does not run in the precision's dtype on "
            f"meta) and scaled by {layers.scale:g}"
        )
    if layers.answered:
        notes.append(
            f"the model's mask code read values on the meta device ({', '.join(sorted(layers.answered))}: a check "
            f"of all or any entries), answered as an unpadded batch answers them (one sequence per row)"
        )
    return notes


def _static(sp: StagePlan, data_parallel: str, dp: int, precision: str) -> int:
    if data_parallel == "shard":
        return sharded_static_bytes(sp.params, sp.weight_bytes, sp.grad_bytes, sp.optimizer_bytes, dp, precision)
    return sp.weight_bytes + sp.grad_bytes + sp.optimizer_bytes


def format_plan(pl: Plan) -> str:
    g = lambda b: f"{b / GiB:8.2f}"  # noqa: E731
    count = f"{pl.params / 1e9:.3f}e9" if pl.params >= 1e8 else f"{pl.params / 1e6:.3f}e6"  # a tiny recipe read 0.000e9
    lines = [
        f"twobp-plan {pl.recipe}: {pl.model}, {count} parameters; {pl.world} devices = pipeline "
        f"{pl.pipeline_degree} x data {pl.data_parallel}; {pl.schedule}, m={pl.num_microbatches}, micro-batch "
        f"{pl.microbatch_size}; {pl.precision}; {pl.optimizer}"
        + ("" if pl.activation_checkpointing is None else f"; activation_checkpointing={pl.activation_checkpointing}"),
        "",
        "per stage (GiB)    layers      params   weights    grads    optim   act/mb  B->W/mb"
        + ("   recomp" if pl.activation_checkpointing is not None else ""),
    ]
    for sp in pl.stages:
        lines.append(
            f"  stage {sp.stage:<2} rank {sp.rank:<2} {sp.layers[0]:>3}-{sp.layers[1]:<4} {sp.params / 1e6:9.1f}M"
            f"{g(sp.weight_bytes)} {g(sp.grad_bytes)} {g(sp.optimizer_bytes)} {g(sp.activation_bytes)} "
            f"{g(sp.held_bytes)}"
            + (f" {g(sp.recompute_bytes)}" if pl.activation_checkpointing is not None else "")
            + f"{' *' if sp.graph_kept else ''}"
        )
    cap = "" if pl.gpu_memory_gib is None else f"  fits {pl.gpu_memory_gib:g} GiB x {pl.headroom:g}?"
    lines += [
        "",
        f"per rank (GiB)      static | {pl.schedule}: in-flight  act    total | {pl.fused_schedule} "
        f"(no 2BP): in-flight  act    total{cap}",
    ]
    for rp in pl.ranks:
        fit = "" if rp.fits is None else ("   yes" if rp.fits else "   NO")
        lines.append(
            f"  rank {rp.rank:<2} {str(rp.stages):<8}{g(rp.static_bytes)} "
            f"|{rp.split['in_flight']:>12}{g(rp.split['activation_bytes'])}"
            f"{g(rp.split['total_bytes'])} "
            f"|{rp.fused['in_flight']:>20}{g(rp.fused['activation_bytes'])}{g(rp.fused['total_bytes'])}{fit}"
        )
    peak = max(rp.split["total_bytes"] for rp in pl.ranks)
    peak_f = max(rp.fused["total_bytes"] for rp in pl.ranks)
    lines.append(
        f"\npeak rank: {peak / GiB:.2f} GiB with 2BP, {peak_f / GiB:.2f} GiB without "
        f"({peak / peak_f - 1:+.1%}: what the split costs in memory)"
    )
    lines += [f"note: {n}" for n in pl.notes]
    return "\n".join(lines)


def plan_recipe(overrides: list[str]) -> Plan:
    """Compose the twobp-train config with ``overrides`` (e.g. ``["recipe=llama7b-4gpu"]``) and plan it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    recipe = cfg.hydra.runtime.choices.get("recipe", "")
    return plan(cfg, recipe)


# What a refusal is: our checks' ValueError (NoScheduleFits among them), an override Hydra cannot parse or
# compose, a key or value OmegaConf refuses.
_REFUSALS = (
    ValueError,
    MissingConfigException,
    OverrideParseException,
    ConfigCompositionException,
    OmegaConfBaseException,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="twobp-plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"recipes (recipe=NAME): {', '.join(recipes())}",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for twobp-train (recipe=NAME key=value ...)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = plan_recipe(args.overrides)
    except (*_REFUSALS, InstantiationException) as e:
        # A refused configuration or override (or the model's own refusal, its ValueError wrapped by Hydra):
        # its message names the numbers and the fix, and a traceback above it only buries that.
        # HYDRA_FULL_ERROR=1 shows the traceback, as for twobp-train.
        refusal = e.__cause__ if isinstance(e, InstantiationException) else e
        if not isinstance(refusal, _REFUSALS) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"twobp-plan: error: {refusal}\n(HYDRA_FULL_ERROR=1 for the traceback)", file=sys.stderr)
        return 2
    print(format_plan(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(asdict(result), fh, indent=2)
    if any(rp.fits is False for rp in result.ranks):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
