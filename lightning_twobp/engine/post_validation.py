"""The optimizer step's global checks without stopping the pipeline: the Zero Bubble paper's
optimizer post-validation (Qi et al., ICLR 2024, §4).

Two checks need every stage's gradients: clipping by the global gradient norm, and the non-finite
check (an inf or NaN gradient on any stage skips the step everywhere, or the stages drift apart).
Done before the step, each is an all-reduce that waits for the slowest rank to finish its last W, so
the first stage cannot start the next iteration early and ZB-H2's and ZB-V's parallelograms cannot
tile. Both rarely change anything in stable training, so :class:`StepValidation` with
``overlap=True``

1. starts the all-reduce of each rank's ``(norm^p, non-finite)`` asynchronously (:meth:`before_step`),
   keeps a copy of the parameters, the optimizer state and the param-group settings, and lets the
   optimizer step with the gradients as they are;
2. later, once the next pipeline step has run (the reduction arrived long before),
   :meth:`validate` looks at the global result. Only if it would have changed the step (the norm is
   above ``max_norm``, or a gradient is not finite) it puts the copy back and redoes the step
   exactly as the synchronous check would have (clipped gradients, or no step), and says so: the
   pipeline step that ran on the speculative weights must then run again.

The parameters after every step are bitwise those of ``overlap=False``, which checks before stepping
(the reference; tests compare the two). The price is memory: one copy of the parameters and of the
optimizer state (2 more for Adam), and the step's gradients are kept until :meth:`validate`, so the
caller must drop them with ``zero_grad(set_to_none=True)`` (the default), never zero them in place.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from lightning_twobp.private import tensor_version

__all__ = ["StepValidation", "Verdict", "copies_frozen"]

# torch's optimizers whose step leaves a parameter without a gradient as it is (each one's ``_init_group``
# skips ``p.grad is None``), weight decay and state included: a copy to put back needs none of those (a
# LoRA's frozen base in the optimizer was copied every step). By exact type: a subclass may step otherwise.
_STEPS_GRADED_ONLY = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
        torch.optim.Adafactor,
    }
)


def copies_frozen(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a copy to put back holds ``optimizer``'s parameters without a gradient too (frozen ones, a
    LoRA's base): where its step may change them (any optimizer but torch's own)."""
    return type(optimizer) not in _STEPS_GRADED_ONLY


def _local(t: torch.Tensor) -> torch.Tensor:
    """What the check reads of a gradient: a DTensor's local shard; a sparse gradient's coalesced values
    (``nn.Embedding(sparse=True)``), which have its norm and finiteness (norms of sparse tensors raise)."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t.coalesce().values() if t.is_sparse else t


def _nonfinite_flags(params: Sequence[nn.Parameter], device: torch.device) -> torch.Tensor | None:
    """1 for each of ``params`` whose gradient is not finite, else 0, on ``device``, without a host sync."""
    if not params:
        return None
    finite = [_finite(_local(_grad(q))).to(device) for q in params]
    return torch.stack(finite).logical_not()


def _finite(g: torch.Tensor) -> torch.Tensor:
    """Whether ``g``'s norm is finite (a 0-d bool), taken in its own dtype: float32 only for 16-bit gradients
    (a float32 norm of a float64 or complex gradient raises; a float64 norm above float32's range is finite)."""
    low = g.dtype in (torch.float16, torch.bfloat16)
    return torch.linalg.vector_norm(g, dtype=torch.float32 if low else None).isfinite()


def _grad(q: nn.Parameter) -> torch.Tensor:
    """A checked parameter's gradient (a DTensor one under data_parallel="shard")."""
    assert q.grad is not None  # the parameters checked are those with a gradient (_params_with_grads)
    return q.grad


@dataclass(frozen=True)
class Verdict:
    """What the global check said about one optimizer step.

    ``total_norm`` is the global gradient norm (``None`` without clipping); ``clipped``: it was above
    ``max_norm`` and the gradients were scaled down; ``skipped``: a gradient somewhere was not finite
    and the step did not happen; ``redone``: the weights differ from the speculative step's, so work
    done with those must be redone (overlap mode only).
    """

    total_norm: torch.Tensor | None
    clipped: bool
    skipped: bool
    redone: bool = False
    nonfinite_ranks: tuple[int, ...] = ()  # ranks of ``group`` that held a non-finite gradient
    extra: torch.Tensor | None = None  # the caller's ``extra`` statistics, summed over ``group``
    nonfinite: bool = False  # a gradient was not finite (skipped, or taken with ``rollback=False``)


class StepValidation:
    """Global-norm clipping and the non-finite check for one rank's optimizer over a pipeline.

    Args:
        optimizer: this rank's optimizer (its parameters are this rank's stages').
        max_norm: clip the gradients to this global norm (``None``: no clipping).
        norm_type: the norm's order (2 by default; ``inf`` for the largest absolute value).
        check_finite: skip the step on every rank when any gradient is inf or NaN.
        group: the ranks whose gradients make up the model (the pipeline); ``None`` for one process.
        device: where the small reduction tensor lives (the gradients' device).
        overlap: step speculatively and check later (:meth:`validate`), or check before stepping.
        not_counted: ids of parameters that are clipped but not counted in the norm (a tied copy
            whose first holder counts it).
        rollback: overlap mode keeps a copy to put back (default). ``False`` without clipping: no copy
            (no memory), and a non-finite step stands; :meth:`validate` only reports it
            (``Verdict.nonfinite``), for a caller that stops training then.

    Call :meth:`before_step` after the step's gradients are complete and right before
    ``optimizer.step()``; with ``overlap=True`` call :meth:`validate` before the next
    ``before_step`` (best: after the next pipeline step, when the reduction has long arrived).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        check_finite: bool = True,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        overlap: bool = True,
        not_counted: frozenset[int] | set[int] = frozenset(),
        rollback: bool = True,
    ) -> None:
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (or None for no clipping), got {max_norm!r}")
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.norm_type = float(norm_type)
        self.check_finite = check_finite
        self.group = group
        self.device = torch.device(device)
        self.overlap = overlap
        self.rollback = rollback
        if overlap and not rollback and max_norm is not None:
            raise ValueError("clipping after the step needs rollback=True: a clipped step is put back and redone")
        self.not_counted = frozenset(not_counted)
        self.last: Verdict | None = None  # the latest verdict
        self.skipped_steps = 0  # steps not taken: a gradient was not finite
        self.clipped_steps = 0  # steps whose gradients were scaled down to max_norm
        self.redone_steps = 0  # speculative steps put back and redone (overlap mode)
        self.nonfinite_params: list[nn.Parameter] = []  # this rank's, at the latest skipped step
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._grads: list[tuple[nn.Parameter, torch.Tensor]] = []  # the speculative step's, to redo it
        # without rollback: the speculative step's parameters, and which had a non-finite gradient
        self._suspects: tuple[list[nn.Parameter], torch.Tensor | None] = ([], None)
        self._params: dict[int, torch.Tensor] = {}
        self._state: dict[int, dict[str, Any] | None] = {}
        self._copied: list[nn.Parameter] = []  # the parameters the latest copy holds
        self._groups: list[dict[str, Any]] = []

    @property
    def active(self) -> bool:
        """Whether anything needs checking (no clipping and no finite check: the step is left alone)."""
        return self.max_norm is not None or self.check_finite

    @property
    def pending(self) -> bool:
        """A speculative step waits for :meth:`validate`."""
        return self._pending is not None

    # ------------------------------------------------------------------ the check
    def _params_with_grads(self) -> list[nn.Parameter]:
        return [q for g in self.optimizer.param_groups for q in g["params"] if q.grad is not None]

    def _slots(self) -> tuple[int, int]:
        """(this rank's place in ``group``, the group's size): which rank was not finite travels too."""
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _local_stats(self, params: Sequence[nn.Parameter], extra: torch.Tensor | None) -> torch.Tensor:
        """``[norm^p over counted gradients, 1 if non-finite else 0, that flag in this rank's slot of
        the group, *extra]`` for this rank (max instead of sum for the inf-norm, reduced the same way).
        A non-finite tied copy counts even where its norm does not."""
        # A DTensor gradient (data_parallel="shard") counts by its local shard: ``group`` then spans
        # every rank, so each shard is summed once (a DTensor norm would reduce over its mesh again).
        counted = [_local(_grad(q)) for q in params if id(q) not in self.not_counted]
        others = [_local(_grad(q)) for q in params if id(q) in self.not_counted]
        if counted:
            local = get_total_norm(counted, self.norm_type).to(self.device, torch.float32)
        else:
            local = torch.zeros((), device=self.device)
        power = local if self.norm_type == float("inf") else local.pow(self.norm_type)
        bad = torch.isfinite(local).logical_not().float()
        if others:
            bad = torch.maximum(bad, torch.isfinite(get_total_norm(others, 2.0)).logical_not().float().to(bad.device))
        me, size = self._slots()
        flags = torch.zeros(size, device=self.device)
        flags[me] = bad
        parts = [power.reshape(1), bad.reshape(1), flags]
        if extra is not None:
            parts.append(extra.to(self.device, torch.float32).reshape(-1))
        return torch.cat(parts)

    def _reduce(self, stats: torch.Tensor, async_op: bool) -> Any:
        if self.group is None and not dist.is_initialized():
            return None
        if dist.get_world_size(self.group) == 1:
            return None
        if self.norm_type == float("inf"):
            return dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.group, async_op=async_op)
        return dist.all_reduce(stats, group=self.group, async_op=async_op)  # SUM of both entries

    def _details(self, stats: torch.Tensor) -> dict[str, Any]:
        """Which ranks of the group were not finite, and the summed ``extra``."""
        size = self._slots()[1]
        flags = stats[2 : 2 + size].tolist()
        extra = stats[2 + size :]
        return {
            "nonfinite_ranks": tuple(r for r, f in enumerate(flags) if f > 0),
            "extra": extra if extra.numel() else None,
        }

    def _decide(self, stats: torch.Tensor) -> tuple[torch.Tensor | None, bool, bool]:
        """``(total norm, clip?, skip?)`` from the reduced statistics, as one process would decide."""
        skip = self.check_finite and bool(stats[1] > 0)
        total = None
        clip = False
        if self.max_norm is not None:
            total = stats[0] if self.norm_type == float("inf") else stats[0].pow(1.0 / self.norm_type)
            # clip_grads_with_norm_ scales by min(1, max_norm / (total + 1e-6)): anything below 1 changes the step
            clip = bool(self.max_norm / (total + 1e-6) < 1.0)
        return total, clip, skip

    def _apply(self, params: Sequence[nn.Parameter], total: torch.Tensor | None, clip: bool, skip: bool) -> None:
        """What the synchronous check does to the gradients before ``optimizer.step()``: drop them all
        (the optimizer then skips every parameter) or clip them in place."""
        if skip:
            self._note_nonfinite([(q, q.grad) for q in params])
            for q in params:
                q.grad = None
        elif total is not None:
            assert self.max_norm is not None  # _decide() gives a total only to clip to max_norm
            # Always applied in the synchronous check, as clip_grad_norm_ does: a factor of exactly 1.0
            # when below max_norm, so the speculative step (which never multiplies) is bitwise the same.
            clip_grads_with_norm_(params, self.max_norm, total, foreach=None)

    # ------------------------------------------------------------------ the step
    def before_step(self, extra: torch.Tensor | None = None) -> Verdict | None:
        """The step's gradients are complete and ``optimizer.step()`` comes next. ``extra``: a few
        numbers of the caller's that ride along the reduction (summed), returned in the verdict.
        Returns the verdict when checking first (``overlap=False``)."""
        if not self.active:
            return None
        if self._pending is not None:
            raise RuntimeError("the previous speculative step was never validated: call validate() first")
        params = self._params_with_grads()
        stats = self._local_stats(params, extra)
        if not self.overlap:
            self._reduce(stats, async_op=False)
            total, clip, skip = self._decide(stats)
            self._apply(params, total, clip, skip)
            return self._record(total, clip, skip, redone=False, **self._details(stats))
        work = self._reduce(stats, async_op=True)
        if self.rollback:
            self._snapshot()
            self._grads = [(q, _grad(q)) for q in params]
            # Tensor._version counts in-place writes: a redo must see the gradients the step saw.
            self._versions = [tensor_version(g) for _, g in self._grads]
        else:
            # Nothing to redo: the gradients go with the caller's zero_grad, not kept through the next
            # pipeline step (a copy of every gradient, before stop 58); which were not finite is kept for
            # the message (a flag per parameter, no host sync).
            self._suspects = (params, _nonfinite_flags(params, self.device))
        self._pending = (work, stats)
        return None

    def validate(self) -> Verdict | None:
        """Overlap mode: the verdict on the last speculative step (``None`` if there was none). When it
        would have changed the step, the copy is put back and the step redone as the synchronous check
        would have (``redone=True``): anything computed since with the speculative weights is stale."""
        if self._pending is None:
            return None
        work, stats = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        total, clip, skip = self._decide(stats)
        details = self._details(stats)
        grads, self._grads = self._grads, []
        if not clip and not skip:
            return self._record(total, False, False, redone=False, **details)
        if not self.rollback:  # nothing to put back: the step stands, the verdict says what it was
            params, flags = self._suspects
            self._suspects = ([], None)
            if skip and flags is not None:
                self.nonfinite_params = [q for q, bad in zip(params, flags.tolist(), strict=True) if bad]
            return self._record(total, False, False, redone=False, nonfinite=skip, **details)
        changed = [i for i, (_, g) in enumerate(grads) if tensor_version(g) != self._versions[i]]
        if changed and not skip:
            raise RuntimeError(
                f"{len(changed)} gradients were changed in place after the speculative optimizer step "
                f"(zero_grad(set_to_none=False)?), so the step cannot be redone with clipping: zero "
                f"gradients with zero_grad(set_to_none=True), or validate with overlap=False"
            )
        self._restore()
        if skip:
            self._note_nonfinite(grads)
        else:
            self._redo(grads, total)
        return self._record(total, clip, skip, redone=True, **details)

    def _note_nonfinite(self, grads: Sequence[tuple[nn.Parameter, torch.Tensor | None]]) -> None:
        """This rank's parameters with a non-finite gradient, for the caller's message (failure path only:
        one host sync per parameter)."""
        self.nonfinite_params = [q for q, g in grads if g is not None and not bool(torch.isfinite(_local(g)).all())]

    def _record(
        self,
        total: torch.Tensor | None,
        clip: bool,
        skip: bool,
        redone: bool,
        nonfinite_ranks: tuple[int, ...] = (),
        extra: torch.Tensor | None = None,
        nonfinite: bool | None = None,
    ) -> Verdict:
        self.skipped_steps += skip
        self.clipped_steps += clip and not skip
        self.redone_steps += redone
        self.last = Verdict(total, clip, skip, redone, nonfinite_ranks, extra, skip if nonfinite is None else nonfinite)
        return self.last

    def _redo(self, grads: list[tuple[nn.Parameter, torch.Tensor]], total: torch.Tensor | None) -> None:
        """The step again, with the clipped gradients and the settings it first ran with (an LR
        scheduler may have moved the learning rate since)."""
        params = [q for q, _ in grads]
        current = [q.grad for q in params]
        now = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        try:
            for q, g in grads:
                q.grad = g
            for group, saved in zip(self.optimizer.param_groups, self._groups, strict=False):
                group.update(saved)
            self._apply(params, total, clip=True, skip=False)
            self.optimizer.step()
        finally:
            for q, before in zip(params, current, strict=False):
                q.grad = before
            for group, saved in zip(self.optimizer.param_groups, now, strict=False):
                group.update(saved)

    # ------------------------------------------------------------------ the copy
    @torch.no_grad()
    def _snapshot(self) -> None:
        """Copy the parameters the step may change, their optimizer state and the group settings (buffers
        kept across steps while their parameter is copied; a parameter left out, frozen since, frees its)."""
        every = [q for g in self.optimizer.param_groups for q in g["params"]]
        self._copied = every if copies_frozen(self.optimizer) else [q for q in every if q.grad is not None]
        before, self._params = self._params, {}
        kept_state, self._state = self._state, {}
        for q in self._copied:
            buf = before.get(id(q))
            if buf is None or buf.shape != q.shape or buf.dtype != q.dtype:
                self._params[id(q)] = q.detach().clone()
            else:
                self._params[id(q)] = buf.copy_(q)
            st = self.optimizer.state.get(q)
            self._state[id(q)] = _copy_state(st, kept_state.get(id(q)) or {}) if st else None
        self._groups = [
            copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in self.optimizer.param_groups
        ]

    @torch.no_grad()
    def _restore(self) -> None:
        state = self.optimizer.state
        for q in self._copied:
            q.copy_(self._params[id(q)])
            saved = self._state.get(id(q))
            if saved is None:
                state.pop(q, None)
                continue
            st = state.setdefault(q, {})
            for k in list(st):
                if k not in saved:
                    del st[k]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor):
                    if isinstance(st.get(k), torch.Tensor) and st[k].shape == v.shape and st[k].dtype == v.dtype:
                        st[k].copy_(v)
                    else:
                        st[k] = v.clone()
                else:
                    st[k] = copy.deepcopy(v)


def _copy_state(state: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """A copy of one parameter's optimizer state, into ``kept``'s tensors where they still fit."""
    copied: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            old = kept.get(k)
            if isinstance(old, torch.Tensor) and old.shape == v.shape and old.dtype == v.dtype:
                copied[k] = old.copy_(v)
            else:
                copied[k] = v.detach().clone()
        else:
            copied[k] = copy.deepcopy(v)
    return copied
