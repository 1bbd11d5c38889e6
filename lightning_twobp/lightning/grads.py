"""Gradients between the pipeline and Lightning's optimizer step.

* :class:`GradStash`: the pipeline computes a step's gradients inside ``training_step``; Lightning's
  automatic optimization runs ``zero_grad`` and ``backward`` after it. The stash sets them aside and
  adds them back in ``backward``, scaled by ``1 / accumulate_grad_batches`` as Lightning scales the
  loss, so ``zero_grad``, accumulation and ``optimizer.step`` see what ``loss.backward()`` gives.
* :class:`ReplicaReduce`: each stage's gradients averaged over its data-parallel replicas, started as
  soon as the stage's last W has run (the executor calls it), once per accumulation window.
* :class:`TiedParameters`: a parameter used on several pipeline ranks (tied embeddings) starts from
  one value and gets the sum of its ranks' gradients each step, as Megatron does for embeddings; so
  do the copies that sharding gives two stages of one rank.
* :func:`overflow_agreeing_scaler`: the fp16 overflow decision over every stage. Global-norm clipping
  (and skipping a step with a non-finite gradient) is the engine's
  :class:`~lightning_twobp.engine.StepValidation`, checked before the step or after it (the Zero Bubble
  paper's optimizer post-validation); the strategy calls it where Lightning clips.
* :func:`pipelined_precision`: hooks those two into Lightning where it expects them, the precision
  plugin's ``clip_grad_by_norm`` and its ``scaler``, on a copy of the plugin (the user's stays as it was).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from lightning_twobp.lightning.local_model import SharedParameter
from lightning_twobp.private import skips_backward

__all__ = [
    "GradStash",
    "ReplicaReduce",
    "TiedParameters",
    "Window",
    "dropped_after_step",
    "overflow_agreeing_scaler",
    "pipelined_precision",
]


@dataclass(frozen=True)
class Window:
    """Where a training micro-step stands in Lightning's gradient-accumulation window."""

    length: int  # accumulate_grad_batches
    first: bool  # its first micro-step (Lightning zeroes the gradients after this one's training_step)
    last: bool  # the optimizer steps after this micro-step
    # the parameters (by id) whose gradients Lightning drops right after this training_step: the pipeline step
    # may drop them first (:func:`dropped_after_step`)
    dropped: frozenset[int] = frozenset()

    @staticmethod
    def of(trainer: Any) -> Window:
        """This micro-step's window, read as Lightning's training loop decides to step
        (``_TrainingEpochLoop._should_accumulate``: every k-th batch of the epoch, and its last) and to zero
        the gradients (``_AutomaticOptimization._make_zero_grad_fn``: after the first one's training_step)."""
        progress = trainer.fit_loop.epoch_loop.batch_progress
        k, ready = trainer.accumulate_grad_batches, progress.current.ready
        last = ready % k == 0 or progress.is_last_batch or ready == trainer.num_training_batches
        first = (ready - 1) % k == 0
        return Window(k, first, last, dropped_after_step(trainer) if first else frozenset())


def dropped_after_step(trainer: Any) -> frozenset[int]:
    """The parameters (by id) whose gradients Lightning's ``zero_grad``, right after a window's first
    ``training_step``, will set to None with nothing reading them before: every optimizer's, where Lightning
    calls its default ``optimizer_zero_grad`` (``optimizer.zero_grad()``, torch's, ``set_to_none=True``) and no
    ``on_before_zero_grad`` hook of the module's or a callback's runs first. The pipeline computes the step's
    gradients inside ``training_step``, so a previous step's gradients kept through it would hold one more copy
    of every gradient for the whole step (one process frees them before its backward); dropped first, they do
    not. Empty wherever any of that does not hold, or the loop skips the backward (SWA's batch-norm epoch)."""
    lm = trainer.lightning_module
    hooked = [lm, *trainer.callbacks]
    if is_overridden("optimizer_zero_grad", lm) or skips_backward(trainer):
        return frozenset()
    if any(is_overridden("on_before_zero_grad", h, pl.Callback if h is not lm else None) for h in hooked):
        return frozenset()
    optimizers = trainer.optimizers
    if any(type(o).zero_grad is not torch.optim.Optimizer.zero_grad for o in optimizers):
        return frozenset()
    return frozenset(id(q) for o in optimizers for g in o.param_groups for q in g["params"])


class GradStash:
    """Gradients of the last pipeline step, held between ``training_step`` and ``backward``."""

    def __init__(self) -> None:
        self._stash: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._scaled = False  # the stash is of a window's last micro-step that carried the earlier ones

    @contextmanager
    def collect(
        self, params: Sequence[nn.Parameter], carry: bool = False, dropped: frozenset[int] = frozenset()
    ) -> Iterator[None]:
        """Inside: the step's gradients start from zero. After: they are stashed, and the gradients
        from before (an accumulation window's earlier micro-steps) are back in ``.grad``.

        ``carry``: the last micro-step of a window whose reduce over the replicas runs once
        (:class:`ReplicaReduce`). The step starts from the earlier micro-steps' gradients (which ``backward``
        scaled by 1/k) and its own backward starts from the loss over k (the pipeline's seed: what one process's
        ``loss / k`` gives), so the reduce averages the whole window's, never more than k micro-steps' mean (a sum
        of k unscaled ones overflowed "16-true" gradients where one process's did not); after it, the stash holds
        that total, added by ``backward`` as it is, and ``.grad`` is left empty for ``backward`` to fill.
        ``dropped``: parameters (by id) whose gradients from before are dropped rather than kept
        (:func:`dropped_after_step`)."""
        kept = [None if id(q) in dropped else q.grad for q in params]
        for q, g in zip(params, kept, strict=True):
            q.grad = g if carry else None
        try:
            yield
            self._stash = [(q, q.grad) for q in params if q.grad is not None]
            self._scaled = carry
        finally:
            for q, g in zip(params, kept, strict=False):
                q.grad = None if carry else g

    def add_to_grads(self, scale: float) -> None:
        """Add the stashed gradients, times ``scale``, into ``.grad`` (``None`` counts as zero); a carried
        window's total (:meth:`collect`) is scaled already."""
        scale = 1.0 if self._scaled else scale
        for q, g in self._stash:
            g = g if scale == 1.0 else g * scale
            if q.grad is None:
                q.grad = g
            else:
                q.grad.add_(g)
        self._stash, self._scaled = [], False


class ReplicaReduce:
    """The executor's ``grad_reduce`` under replicated data parallelism: average a stage's gradients over
    ``group`` (its ``dp`` replicas), as DDP would. One flat asynchronous all-reduce per dtype starts at once,
    so it runs while the rank does its remaining work; the returned function finishes it at the step's end.

    Once per accumulation window, as DDP's ``no_sync``: while ``now`` is False (a window's earlier
    micro-steps) a stage's gradients stay this replica's own, and the window's last micro-step reduces what
    the whole window accumulated (:meth:`GradStash.collect`'s ``carry``). Each gradient is divided by
    ``dp`` before the sum, as DDP divides, so fp16 gradients sum no larger than their mean.

    Every replica passes the same parameters (all that require grad). One without a gradient on this
    replica adds zeros, and a flag per parameter (1 where a gradient was there, in float32 beside the
    float32 gradients) says afterwards which had one on no replica: those keep ``.grad`` None, so the
    optimizer skips them as one process's does (a zero gradient would still decay them in AdamW).

    A parameter trained on an earlier micro-step of the window and frozen since (a callback flipping
    ``requires_grad`` between batches) still holds this replica's own gradient of those micro-steps, which the
    optimizer steps with as one process's would: the window's reduce covers it too (``_trained``, in the order
    the stage passed them, alike on every replica), else the replicas step apart."""

    def __init__(self, group: dist.ProcessGroup | None, dp: int) -> None:
        self.group, self.dp = group, dp
        self.now = True  # False inside an accumulation window: the strategy sets it each micro-step
        self.started = 0  # reduces started (one per stage and window): what the tests count
        self._trained: dict[int, dict[int, nn.Parameter]] = {}  # by stage: trained so far in this window

    def begin_window(self) -> None:
        """A window's first micro-step: nothing trained in it yet."""
        self._trained.clear()

    def __call__(self, stage: int, params: list[nn.Parameter]) -> Callable[[], None]:
        trained = self._trained.setdefault(stage, {})
        trained.update((id(q), q) for q in params)
        if not self.now:  # a window goes on
            return _nothing
        wanted = {id(q) for q in params}
        params = params + [q for key, q in trained.items() if key not in wanted]  # frozen since: their own grads
        self._trained.pop(stage)
        if not params:  # nothing to train, alike on every replica
            return _nothing
        self.started += 1
        present = torch.tensor([q.grad is not None for q in params], dtype=torch.float32, device=params[0].device)
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(k)
        by_dtype.setdefault(torch.float32, [])  # the flags travel with the float32 gradients
        started = []
        for dtype, ks in by_dtype.items():
            flat = torch.cat([grads[k].reshape(-1) for k in ks] + ([present] if dtype == torch.float32 else []))
            flat[: sum(grads[k].numel() for k in ks)].div_(self.dp)  # gloo has no AVG: divide, then SUM
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            started.append((work, flat, ks, dtype == torch.float32))

        def finish() -> None:
            flags = None
            for work, flat, ks, carries_flags in started:
                work.wait()
                if carries_flags:
                    flat, flags = flat[: flat.numel() - len(params)], flat[flat.numel() - len(params) :]
                for k, part in zip(ks, flat.split([grads[k].numel() for k in ks]), strict=True):
                    grads[k].copy_(part.view_as(grads[k]))
            assert flags is not None  # the float32 flat always goes
            for q, g, used in zip(params, grads, flags.tolist(), strict=True):
                q.grad = g if used else None

        return finish


def _nothing() -> None:
    pass


class TiedParameters:
    """Keeps a parameter that layers on several pipeline ranks use (tied embeddings) one parameter.

    Every rank holding it gets the first holder's value at setup and, every step, the sum of the
    holders' gradients (each holder's gradient is the part of the loss's gradient that flows
    through its own uses, so the sum is what one process accumulates). Identical values, gradients
    and optimizer updates keep the copies equal. The global norm counts it once, on its first holder.
    Under ``data_parallel="shard"`` each copy is a DTensor shard, the same rows on every holder of one
    replica (dim 0 split alike over the same ``"dp"`` mesh): the same sums, on the local shards.

    ``twins``: copies of one parameter on this rank (under ``"shard"``, where two stages of one rank use
    it: :func:`~.sharding.untie_within_rank`), the first the one in ``shared`` if other ranks use it
    too. Their gradients are summed here first, then over the holders, and every copy gets the total.
    """

    def __init__(
        self,
        shared: list[SharedParameter],
        replica_groups: Callable[[Sequence[int]], list[list[int]]],
        timeout: timedelta | None = None,
        twins: Sequence[Sequence[nn.Parameter]] = (),
    ) -> None:
        """``replica_groups(pipeline_ranks)``: the global ranks of those pipeline ranks in every
        data-parallel replica, one list per replica. ``timeout``: of the holders' groups."""
        me = dist.get_rank() if shared else 0
        self._tied: list[tuple[nn.Parameter, dist.ProcessGroup, int]] = []  # (param, holders' group, first holder)
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for sp in shared:  # every rank creates every group, in one order, as torch requires
            for ranks in map(tuple, replica_groups(sp.ranks)):
                if ranks not in groups:
                    groups[ranks] = dist.new_group(list(ranks), timeout=timeout)
                if sp.param is not None and me in ranks:
                    self._tied.append((sp.param, groups[ranks], ranks[0]))
        self._twins = [list(copies) for copies in twins]
        self.not_counted = {id(q) for q, _, first in self._tied if first != me}
        self.not_counted |= {id(q) for copies in self._twins for q in copies[1:]}
        # each weight's copies on this rank, its holders' group (None: this rank's alone) and its agreed flag
        self._flags: list[tuple[list[nn.Parameter], dist.ProcessGroup | None, list[bool]]] = []
        firsts = {id(copies[0]): copies for copies in self._twins}
        for q, group, _ in self._tied:
            copies = firsts.pop(id(q), [q])
            self._flags.append((copies, group, [q.requires_grad]))
        self._flags += [(copies, None, [copies[0].requires_grad]) for copies in firsts.values()]

    def __bool__(self) -> bool:
        return bool(self._tied or self._twins)

    def agree_requires_grad(self) -> None:
        """Before each micro-step's forward: every copy of a tied weight takes the ``requires_grad`` that one of
        them was given since the last agreement, on this rank or another holder, as the one parameter of one
        process is frozen or unfrozen by any of its names. A name can reach one copy only (the backbone frozen
        as a whole, ``model.transformer.requires_grad_(False)``, reaches wte's copy and not lm_head's; under
        the V, sharded, each end holds its own copy): the others trained on, silently. It sees where each copy
        ended, not the order of the calls: set twice between two steps by different names, the change away
        from the agreed value wins (docs/strategy.md). Holders that start apart are refused, naming the fix."""
        for copies, group, agreed in self._flags:
            down = any(agreed[0] and not q.requires_grad for q in copies)
            up = any(not agreed[0] and q.requires_grad for q in copies)
            if group is not None:
                # with the holders' agreed flags too: each starts as its own copy's, which a change by one name
                # after an earlier Trainer call's last step left apart (the backbone frozen whole in on_train_end:
                # wte's copy only); no copy moves from its own start, so no vote came, and the next call trained
                # the trainable holder's copy, its sum stepping the frozen one too (0.028 off one process, the
                # holders apart)
                votes = torch.tensor([float(down), float(up), float(agreed[0]), 1.0], device=copies[0].device)
                dist.all_reduce(votes, group=group)
                if 0 < votes[2] < votes[3]:
                    raise ValueError(
                        f"twobp: a tied weight ({tuple(copies[0].shape)}) starts this Trainer call with different "
                        f"requires_grad on the ranks that use it (changed by one of its names after an earlier "
                        f"call's last step, which reached some of its copies only); in one process it is one "
                        f"parameter: freeze or unfreeze it by one name before the call (between calls the model is "
                        f"whole again on every rank: `lm_head.weight.requires_grad_(...)` reaches every copy)"
                    )
                down, up = bool(votes[0] > 0), bool(votes[1] > 0)
            # one agreed flag on every holder (checked above): a vote comes from one side of it, never both
            if down or up:
                agreed[0] = up
                for q in copies:
                    q.requires_grad_(up)

    @torch.no_grad()
    def sync_values(self) -> None:
        for q, group, src in self._tied:
            dist.broadcast(_local(q.data), src=src, group=group)
        for kept, *copies in self._twins:
            for q in copies:
                _local(q.data).copy_(_local(kept.data))

    @torch.no_grad()
    def reduce_grads(self, fresh: Collection[int] | None = None) -> None:
        """Sum each tied parameter's gradients over its holders. ``fresh``: where this runs at every micro-step
        (no replicas: no window-wide reduce), the parameters (by id) whose gradients this micro-step started
        from nothing (:meth:`GradStash.collect`'s); a tied one outside it, frozen since an earlier micro-step of
        the window, holds what an earlier call summed already: summed again, it doubled (0.012 off one process
        after a step), so it adds zeros to the sum and keeps its own."""
        twins = [copies for copies in self._twins if any(q.grad is not None for q in copies)]
        for first, *copies in twins:  # this rank's uses first: the sum lands in the first copy
            if fresh is not None and not any(id(q) in fresh for q in (first, *copies)):
                continue  # frozen since an earlier micro-step of the window: every copy holds that sum already
            if first.grad is None:
                first.grad = torch.zeros_like(first)
            for q in copies:
                if q.grad is not None:
                    _local(first.grad).add_(_local(q.grad))
        for q, group, _ in self._tied:
            # whether a holder's uses gave it a gradient in this window: one process's one parameter has a
            # .grad, and steps, where any did (frozen by the window's last micro-step after an earlier one
            # used it too); none did: no step (a zero gradient would still decay it in AdamW)
            used = torch.tensor([float(q.grad is not None)], device=q.device)
            summed = q.grad if fresh is not None and id(q) not in fresh else None  # by an earlier micro-step's call
            if q.grad is None or summed is not None:
                q.grad = torch.zeros_like(q)
            dist.all_reduce(_local(q.grad), group=group)  # every holder takes part, frozen or not
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
            if not used.item():
                q.grad = None
            elif summed is not None:
                _local(q.grad).add_(_local(summed))
        for first, *copies in twins:  # own tensors: clipping scales each gradient in place
            assert first.grad is not None  # given above
            for q in copies:
                q.grad = first.grad.detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor shard's local tensor (its storage, under no_grad), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def overflow_agreeing_scaler(
    scaler: torch.amp.GradScaler, device: torch.device, group: dist.ProcessGroup | None
) -> torch.amp.GradScaler:
    """fp16: a GradScaler skips the step and lowers its scale when *its* gradients hold inf/NaN. Each
    rank holds other stages' gradients, so one stage's overflow must skip the step on every rank, or
    the stages drift apart and their scales disagree (the pipeline's backward starts from the last
    stage's scale). torch's :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`
    ORs the inf flags over a process group in ``unscale_`` (one all-reduce); this returns one with
    ``scaler``'s settings and state, over ``group`` (the world). A fused optimizer (``AdamW(fused=True)``)
    unscales inside its own step: torch's ``step`` then reads the flags through ``_check_inf_per_device``,
    which ``ShardedGradScaler`` leaves per rank, so :class:`_AgreeingScaler` ORs them there too (a rank with
    an inf skipped its step and halved its scale while the others stepped: a cold review's reproduction)."""
    agreeing = _AgreeingScaler(
        device=device.type,
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
        process_group=group if group is not None else dist.group.WORLD,
    )
    if scaler.is_enabled():
        agreeing.load_state_dict(scaler.state_dict())
    return agreeing


class _AgreeingScaler(ShardedGradScaler):
    """``ShardedGradScaler`` whose per-device inf flags are ORed over its group where a fused optimizer reads them
    (see :func:`overflow_agreeing_scaler`); ``unscale_`` ORs them already, and ``step`` calls this only for an
    optimizer that unscales itself and was not unscaled before."""

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        found = super()._check_inf_per_device(optimizer)
        for flag in found.values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return found


class _GlobalNormClipping:
    """Mixed into a copy of the precision plugin: clipping by norm uses the pipeline's global norm, and
    every optimizer step passes the pipeline's global check (clipping and non-finite gradients) last,
    after the user's ``on_before_optimizer_step`` hooks and Lightning's clipping call."""

    _twobp_clip_by_norm: Callable[[Any, float], None]
    _twobp_before_step: Callable[[Any], None]

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._twobp_clip_by_norm(optimizer, clip_val)

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        super()._after_closure(model, optimizer)  # type: ignore[misc]
        self._twobp_before_step(optimizer)


_CLASSES: dict[type, type] = {}


def pipelined_precision(
    plugin: Any, clip_by_norm: Callable[[Any, float], None], before_step: Callable[[Any], None], scaler: Any = None
) -> Any:
    """A copy of Lightning's precision ``plugin`` (same class, plus :class:`_GlobalNormClipping`)
    whose ``clip_grad_by_norm`` calls ``clip_by_norm(optimizer, max_norm)``, which calls
    ``before_step(optimizer)`` right before each optimizer step, and whose ``scaler`` is ``scaler``
    when given. The original plugin and its scaler are not touched."""
    cls = type(plugin)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Pipelined{cls.__name__}", (_GlobalNormClipping, cls), {"__module__": __name__})
    new = copy.copy(plugin)
    new.__class__ = _CLASSES[cls]
    new._twobp_clip_by_norm = clip_by_norm
    new._twobp_before_step = before_step
    if scaler is not None:
        new.scaler = scaler
    return new
