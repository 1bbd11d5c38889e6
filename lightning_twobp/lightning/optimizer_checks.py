"""The global checks of each optimizer step: clipping by the norm over every stage, and what happens
when a gradient is not finite (``on_nonfinite``), with the message that names the step, the stages and
the micro-batch. One :class:`OptimizerChecks` per Trainer call, one
:class:`~lightning_twobp.engine.StepValidation` per optimizer inside it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.tensor import DTensor

from lightning_twobp.engine import StepValidation, Verdict
from lightning_twobp.lightning.placeholders import Elsewhere
from lightning_twobp.options import PipelineOptions

log = logging.getLogger(__name__)

__all__ = ["HookScaleError", "NonFiniteError", "OptimizerChecks", "buffers_kept", "hooks_may_scale_grads"]

# The user's code that runs between the pipeline's gradients and the optimizer step.
_GRAD_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def hooks_may_scale_grads(lm: Any, callbacks: Sequence[Any]) -> bool:
    """Whether the module or a callback (not this package's) overrides a hook that runs between the
    pipeline's gradients and the optimizer step, where a user may clip by hand."""
    if any(is_overridden(h, lm) for h in (*_GRAD_HOOKS, "configure_gradient_clipping")):
        return True
    return any(
        is_overridden(h, cb, Callback)
        for cb in callbacks
        if not type(cb).__module__.startswith("lightning_twobp.")
        for h in _GRAD_HOOKS
    )


def _grad_norms(params: Sequence[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """Each parameter's gradient norm (0 for none; a DTensor's local shard), on ``device``, no host sync."""
    norms = [
        torch.linalg.vector_norm(g.to_local() if isinstance(g, DTensor) else g, dtype=torch.float32)
        if (g := q.grad) is not None
        else torch.zeros((), device=device)
        for q in params
    ]
    return torch.stack(norms).to(device) if norms else torch.zeros(0, device=device)


# What a rank's hooks did to its gradients, one number in its slot of the step's reduction: 2 nothing,
# 1 + r all of them scaled by r, 0.5 something else (per element: clip_grad_value_, noise; not judged),
# 0 no gradient to scale (a frozen stage, all zeros: any factor gives what one process gives).
_UNCHANGED, _OTHER, _NOTHING = 2.0, 0.5, 0.0


def _hook_code(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    if before.numel() == 0:
        return torch.tensor(_NOTHING, device=before.device)
    moved = before > 0
    ratio = after / before.clamp_min(torch.finfo(torch.float32).tiny)
    hi = torch.where(moved, ratio, -torch.inf).max()
    lo = torch.where(moved, ratio, torch.inf).min()
    uniform = (hi - lo <= 1e-5 * hi) & (after[~moved] == 0).all() & torch.isfinite(hi)
    changed = (after != before).any()
    code = torch.where(changed, torch.where(uniform, 1.0 + hi, _OTHER), _UNCHANGED)
    return torch.where(moved.any() | changed, code, _NOTHING)


class HookScaleError(RuntimeError):
    """A hook before the optimizer step scaled each pipeline rank's gradients by another factor (a
    ``clip_grad_norm_`` over the rank's own stages): raised on every rank at once."""


def buffers_kept(module: torch.nn.Module) -> Callable[[], None]:
    """A copy of this rank's buffers of ``module``; the returned function writes it back. A pipeline step
    that ran on a speculative optimizer step's weights runs again once that step is redone, and its first
    run's buffer writes (a training BatchNorm's running statistics and batch count) must not count twice.
    Other stages' buffers (on the meta device, or placeholders) are left alone."""
    kept = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta and not isinstance(b, Elsewhere)]

    def put_back() -> None:
        with torch.no_grad():
            for b, copy in kept:
                b.copy_(copy)

    return put_back


class NonFiniteError(RuntimeError):
    """A loss or gradient was inf or NaN under ``on_nonfinite="stop"``: raised on every rank at once."""


@dataclass(eq=False)  # one per Trainer call, compared by identity
class OptimizerChecks:
    """Clipping and the non-finite policy over the pipeline group, per optimizer.

    ``stages_of(rank)`` names a pipeline rank's stages in messages; ``not_counted`` are the parameters
    another rank counts in the global norm (tied copies). ``group`` is the pipeline's, or the world's
    under ``data_parallel="shard"`` (``pipeline_degree`` then maps its ranks to pipeline ranks)."""

    options: PipelineOptions
    group: dist.ProcessGroup | None
    device: torch.device
    stages_of: Callable[[int], Sequence[int]]
    pp_rank: int
    not_counted: Any
    pipeline_degree: int | None = None
    checks: dict[int, StepValidation] = field(init=False, default_factory=dict)  # by id(optimizer)
    # this step's clipping, by id(optimizer), if Lightning asked
    max_norms: dict[int, float] = field(init=False, default_factory=dict)
    counts: dict[str, int] = field(init=False, default_factory=lambda: {"clipped": 0, "skipped": 0, "redone": 0})
    # a step that left non-finite weights: nothing is saved
    nonfinite_step: int | None = field(init=False, default=None)
    # the user's hooks may touch the gradients (hooks_may_scale_grads): watch what they do to them
    watch_hooks: bool = False
    _before_hooks: dict[int, tuple[list[Any], torch.Tensor]] = field(init=False, default_factory=dict)

    def grads_before_hooks(self, optimizer: Any) -> None:
        """The step's gradients are complete and the user's hooks come next (``on_after_backward``): note
        each one's norm, to tell at the step what the hooks did to them (see :meth:`_judge_hooks`)."""
        if self.watch_hooks:
            params = [q for g in optimizer.param_groups for q in g["params"] if q.grad is not None]
            self._before_hooks[id(optimizer)] = (params, _grad_norms(params, self.device))

    def _hook_slots(self, optimizer: Any) -> torch.Tensor:
        """This rank's code (``_hook_code``) in its slot of the check's group, zeros elsewhere."""
        params, before = self._before_hooks.pop(id(optimizer), ([], torch.zeros(0, device=self.device)))
        me, size = (dist.get_rank(self.group), dist.get_world_size(self.group)) if dist.is_initialized() else (0, 1)
        slots = torch.zeros(size, device=self.device)
        slots[me] = _hook_code(before, _grad_norms(params, self.device))
        return slots

    def nonfinite_refusal(self) -> str | None:
        """Why no checkpoint may be written now (the weights are known not to be finite), or None."""
        if self.nonfinite_step is None:
            return None
        return f"the optimizer step at global step {self.nonfinite_step} made the weights non-finite"

    def clip_by_norm(self, optimizer: Any, max_norm: float) -> None:
        """Lightning asks to clip by norm: by the global norm over every stage, in :meth:`before_step`."""
        self.max_norms[id(optimizer)] = max_norm

    @property
    def pending(self) -> bool:
        """A speculative optimizer step waits for its verdict (``post_validation``)."""
        return any(c.pending for c in self.checks.values())

    def validate(self, lm: Any) -> Verdict | None:
        """The pending speculative optimizer step's verdict, if any (see ``post_validation``)."""
        verdict = None
        for check in self.checks.values():
            verdict = self._judge(lm, check, check.validate(), done=True) or verdict
        return verdict

    def before_step(self, lm: Any, optimizer: Any, scaler: Any, losses: Sequence[torch.Tensor]) -> None:
        """Right before each optimizer step: the pipeline's global check, with this step's clipping
        threshold and a flag of the last stage's first non-finite micro-batch loss riding along.
        Checked first, or after the step with ``post_validation``. ``losses``: this rank's micro-batch
        losses (the last stage's; empty elsewhere)."""
        fp16 = scaler is not None and scaler.is_enabled()  # the GradScaler owns the inf/NaN check then
        max_norm = self.max_norms.pop(id(optimizer), None)
        check = self.checks.get(id(optimizer))
        if check is None:
            check = self.checks[id(optimizer)] = self._new_check(optimizer, max_norm, fp16)
        check.max_norm = max_norm
        self._judge(lm, check, check.validate(), done=True)  # nothing pending normally: training_step judged it
        extra = None
        if check.check_finite or (self.watch_hooks and check.active):
            extra = torch.zeros(1, device=self.device)
            if losses and check.check_finite:
                finite = torch.isfinite(torch.stack(list(losses)).float())
                # 1 + the first non-finite micro-batch, or 0: no host sync until the check's verdict
                first = torch.where(finite.all(), 0, finite.logical_not().int().argmax() + 1)
                extra = first.reshape(1).float().to(self.device)
            if self.watch_hooks:
                extra = torch.cat([extra, self._hook_slots(optimizer)])
        self._judge(lm, check, check.before_step(extra=extra), done=False)

    def _new_check(self, optimizer: Any, max_norm: float | None, fp16: bool) -> StepValidation:
        overlap = self.options.overlaps(fp16)
        # A copy to put back is needed to redo a clipped step or skip a non-finite one; stopping on a
        # non-finite step needs none (no memory, no copying every step).
        rollback = max_norm is not None or self.options.on_nonfinite == "skip"
        return StepValidation(
            optimizer,
            max_norm=max_norm,
            check_finite=not fp16,
            group=self.group,
            device=self.device,
            overlap=overlap,
            not_counted=self.not_counted,
            rollback=rollback or not overlap,
        )

    def _count(self) -> None:
        checks = self.checks.values()
        self.counts = {
            "clipped": sum(c.clipped_steps for c in checks),
            "skipped": sum(c.skipped_steps for c in checks),
            "redone": sum(c.redone_steps for c in checks),
        }

    def _judge(self, lm: Any, check: StepValidation, verdict: Verdict | None, done: bool) -> Verdict | None:
        """Count the verdict; a step skipped for a non-finite gradient stops training on every rank
        (``on_nonfinite="stop"``) or is logged (``"skip"``). Every rank sees the same verdict."""
        self._count()
        if verdict is not None and self.watch_hooks:
            self._judge_hooks(lm, verdict, done)
        if verdict is None or not verdict.nonfinite:
            return verdict
        # ``done``: the step counter has moved past the step the verdict is about (a speculative step)
        step = lm.trainer.global_step - int(done)
        where = self._where(verdict, step)
        if self.options.on_nonfinite == "stop":
            if not verdict.skipped:
                self.nonfinite_step = step  # save_checkpoint writes nothing from now on
            self._stop(lm, check, verdict, where)
        log.warning(
            "twobp: %s; the step was skipped on every rank (%d skipped so far; on_nonfinite='skip')",
            where,
            self.counts["skipped"],
        )
        return verdict

    def _judge_hooks(self, lm: Any, verdict: Verdict, done: bool) -> None:
        """Stop when the user's hooks scaled every rank's gradients, each by another factor: computed from
        the rank's own stages (``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` in a hook clips
        by this rank's norm), it differs from what one process computes from the whole model. Factors that
        agree (none, a constant) and changes of another kind (per element) are the model's own."""
        if verdict.extra is None or verdict.extra.numel() < 2:
            return
        slots = verdict.extra[1:].tolist()
        codes = [c for c in slots if c != _NOTHING]
        if not codes or min(codes) < 1.0 or max(codes) - min(codes) <= 1e-5 * max(codes):
            return
        ranks = [r % self.pipeline_degree if self.pipeline_degree else r for r in range(len(slots))]
        factors = ", ".join(
            f"pipeline rank {r}: {c - 1:.4g}" for r, c in zip(ranks, slots, strict=True) if c != _NOTHING
        )
        step = lm.trainer.global_step - int(done)
        taken = "was taken (post-validation checks after the step)" if done else "was not taken"
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(torch.zeros(1, device=self.device))  # meet first, as _stop does
        raise HookScaleError(
            f"twobp: training stopped at the optimizer step at global step {step} (the step {taken}): a hook "
            f"before it (on_after_backward, on_before_optimizer_step or configure_gradient_clipping) scaled the "
            f"gradients by another factor on each pipeline rank ({factors}). Each rank holds only its own "
            f"stages' gradients, so a factor computed from them is not the one process's: "
            f"torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm) there clips by this rank's stages' "
            f"norm, not the model's. Clip with Trainer(gradient_clip_val=max_norm), or with "
            f"self.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm='norm') in "
            f"configure_gradient_clipping: both clip by the global norm over every stage"
        )

    def _where(self, verdict: Verdict, step: int) -> str:
        ranks = sorted({r % self.pipeline_degree if self.pipeline_degree else r for r in verdict.nonfinite_ranks})
        stages = sorted(s for r in ranks for s in self.stages_of(r))
        where = (
            f"the optimizer step at global step {step}: a gradient was not finite on pipeline rank(s) "
            f"{ranks} (stage(s) {stages})"
        )
        bad_mb = int(verdict.extra[0].item()) - 1 if verdict.extra is not None else -1
        if bad_mb >= 0:
            where += f", and the loss of micro-batch {bad_mb} already was"
        return where

    def _stop(self, lm: Any, check: StepValidation, verdict: Verdict, where: str) -> None:
        ids = {id(q) for q in check.nonfinite_params}
        names = [n for n, q in lm.named_parameters() if id(q) in ids]
        mine = (
            f" On pipeline rank {self.pp_rank}: {', '.join(names[:4]) or 'none'}"
            + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            + "."
        )
        taken = (
            "the step was not taken on any rank"
            if verdict.skipped
            else "the step was taken before the check (post-validation keeps no copy to undo it when not "
            "clipping), so the weights in memory are not finite; no checkpoint is written from them "
            "(save_on_exception included): those on disk are from before"
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank raises here; meet first, so that no rank tears down its connections while
            # another still receives this step's last messages (it would see a lost peer instead).
            dist.all_reduce(torch.zeros(1, device=self.device))
        raise NonFiniteError(
            f"twobp: training stopped at {where}; {taken} (on_nonfinite='stop')."
            f"{mine} Skip such steps with TwoBPStrategy(on_nonfinite='skip'), lower the learning rate, "
            f"clip gradients (Trainer(gradient_clip_val=...)), or find the operation with "
            f"torch.autograd.detect_anomaly (docs/troubleshooting.md)"
        )
