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
from lightning_twobp.engine.executor import keep_buffers
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


def _say_checked_first() -> None:
    log.info(
        "twobp: clipping by norm began in a hook that schedule='auto' could not see at setup (self.clip_gradients "
        "in on_before_optimizer_step?): a step checked after it is taken would need a copy of the weights and "
        "optimizer state that memory_limit was chosen without, so this optimizer's steps are checked before they "
        "are taken from now on (the same steps; the check waits for every stage's last W). Pass gradient_clip_val "
        "to the Trainer, or override configure_gradient_clipping, for auto to count the copy"
    )


def _local(g: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a sparse gradient's (``nn.Embedding(sparse=True)``) coalesced values."""
    if isinstance(g, DTensor):
        return g.to_local()
    return g.coalesce().values() if g.is_sparse else g


def _grad_norms(params: Sequence[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """Each parameter's gradient norm (0 for none; a DTensor's local shard), on ``device``, no host sync."""
    norms = [
        torch.linalg.vector_norm(_local(g), dtype=torch.float32)
        if (g := q.grad) is not None
        else torch.zeros((), device=device)
        for q in params
    ]
    return torch.stack(norms).to(device) if norms else torch.zeros(0, device=device)


# What a rank's hooks did to its gradients (``_hook_code``): 1 nothing, r > 0 all of them scaled by r, -1
# something else (per element: clip_grad_value_, noise; not judged), 0 no gradient left to judge: none (a
# frozen stage), or all zero after the hooks (set to None, zeroed), which a clip by the rank's own norm never
# gives; such a rank is left out of the comparison (one process's norm over the model then is the other
# ranks' own: a hand clip there is exact). The factor itself travels, not 1 + r: compared relative to
# 1 + r, factors under 1e-5 (a clip far below the norms) all looked alike (Adam: 8.7e-3 off one process).
_UNCHANGED, _OTHER, _NONE = 1.0, -1.0, 0.0


def _hook_rtol(params: Sequence[torch.nn.Parameter]) -> float:
    """How far apart two ratios may be and still be one factor: 1e-5, or a 16-bit gradient's eps, as
    ``g.mul_(factor)`` rounds each bf16 element by up to half of it (a hand clip under bf16-true moved each
    parameter's norm by a ratio ~1e-3 off the factor: counted as a change per element, it trained on)."""
    half = (torch.bfloat16, torch.float16)
    return max([1e-5, *(torch.finfo(q.grad.dtype).eps for q in params if q.grad is not None and q.grad.dtype in half)])


def _hook_code(before: torch.Tensor, after: torch.Tensor, rtol: float) -> torch.Tensor:
    if before.numel() == 0:
        return torch.tensor(_NONE, device=before.device)
    # a gradient dropped (None) or zeroed beside scaled ones leaves the others' factor: a clip never gives 0
    moved = (before > 0) & (after != 0)
    ratio = after / before.clamp_min(torch.finfo(torch.float32).tiny)
    hi = torch.where(moved, ratio, -torch.inf).max()
    lo = torch.where(moved, ratio, torch.inf).min()
    uniform = (hi - lo <= rtol * hi) & (after[~moved] == 0).all() & torch.isfinite(hi)
    changed = (after != before).any()
    code = torch.where(changed, torch.where(uniform, hi, _OTHER), _UNCHANGED)
    return torch.where((after == 0).all(), _NONE, code)


class HookScaleError(RuntimeError):
    """A hook before the optimizer step scaled each pipeline rank's gradients by another factor (a
    ``clip_grad_norm_`` over the rank's own stages): raised on every rank at once."""


def buffers_kept(module: torch.nn.Module) -> Callable[[], None]:
    """A copy of this rank's buffers of ``module``; the returned function writes it back. A pipeline step
    that ran on a speculative optimizer step's weights runs again once that step is redone, and its first
    run's buffer writes (a training BatchNorm's running statistics and batch count) must not count twice.
    Other stages' buffers (on the meta device, or placeholders) are left alone."""
    return keep_buffers(module, lambda b: not b.is_meta and not isinstance(b, Elsewhere))


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
    # a step taken with gradients the hooks scaled by per-rank factors (HookScaleError): nothing is saved
    scaled_step: int | None = field(init=False, default=None)
    # the user's hooks may touch the gradients (hooks_may_scale_grads): watch what they do to them
    watch_hooks: bool = False
    # a copy to put back a step checked after it is taken fits the memory planned: False where schedule="auto"
    # chose within memory_limit counting none (no clipping by norm it could see, on_nonfinite="stop")
    copy_counted: bool = True
    _before_hooks: dict[int, tuple[list[Any], torch.Tensor, float]] = field(init=False, default_factory=dict)

    def grads_before_hooks(self, optimizer: Any) -> None:
        """The step's gradients are complete and the user's hooks come next (``on_after_backward``): note
        each one's norm, to tell at the step what the hooks did to them (see :meth:`_judge_hooks`)."""
        if self.watch_hooks:
            params = [q for g in optimizer.param_groups for q in g["params"] if q.grad is not None]
            self._before_hooks[id(optimizer)] = (params, _grad_norms(params, self.device), _hook_rtol(params))

    def _hook_slots(self, optimizer: Any) -> torch.Tensor:
        """This rank's factor (``_hook_code``, 0 for none or another change) in its slot of the check's group,
        then its tolerance in its slot of a second such block (the largest of them compares the factors; inf
        for another change: nothing is compared), zeros elsewhere: every slot >= 0, as a MAX reduction
        (clipping by the inf-norm) keeps."""
        params, before, rtol = self._before_hooks.pop(id(optimizer), ([], torch.zeros(0, device=self.device), 0.0))
        me, size = (dist.get_rank(self.group), dist.get_world_size(self.group)) if dist.is_initialized() else (0, 1)
        slots = torch.zeros(2 * size, device=self.device)
        code = _hook_code(before, _grad_norms(params, self.device), rtol)
        slots[me] = code.clamp_min(_NONE)
        slots[size + me] = torch.where(code == _OTHER, torch.inf, rtol)
        return slots

    def save_refusal(self) -> str | None:
        """Why no checkpoint may be written now (the weights are known not to be finite, or to have taken a
        step the user's hooks scaled by each rank's own factor), or None."""
        if self.nonfinite_step is not None:
            return f"the optimizer step at global step {self.nonfinite_step} made the weights non-finite"
        if self.scaled_step is not None:
            return (
                f"the optimizer step at global step {self.scaled_step} was taken (post-validation) with gradients "
                f"a hook scaled by another factor on each pipeline rank (HookScaleError): not one process's step"
            )
        return None

    def clip_by_norm(self, optimizer: Any, max_norm: float) -> None:
        """Lightning asks to clip by norm: by the global norm over every stage, in :meth:`before_step`."""
        self.max_norms[id(optimizer)] = max_norm

    @property
    def pending(self) -> bool:
        """A speculative optimizer step waits for its verdict (``post_validation``)."""
        return any(c.pending for c in self.checks.values())

    @property
    def may_redo(self) -> bool:
        """A speculative optimizer step waits for its verdict and would be redone, by ``optimizer.step()``
        without a closure, should it be clipped or skipped."""
        return any(c.pending and c.rollback for c in self.checks.values())

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
        # nothing pending normally (training_step judged it); else judged as it was taken: before this step's
        # threshold (a rollback begun now has no copy of that step to put back)
        self._judge(lm, check, check.validate(), done=True)
        check.max_norm = max_norm
        if max_norm is not None and check.overlap and not check.rollback:
            self._clipping_began(check)
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

    def _clipping_began(self, check: StepValidation) -> None:
        """Clipping that starts after the check's first step (``configure_gradient_clipping`` clipping from a
        later step on): a clipped step is put back and redone, so it needs the copy from now on (without it,
        ``validate()`` let the speculative, unclipped step stand: not one process's step). Where
        ``schedule="auto"`` chose within ``memory_limit`` without a copy, the steps are checked before they are
        taken instead (no copy; the check then waits for every stage's last W), and the log says so."""
        if self.copy_counted:
            check.rollback = True
            return
        check.overlap = False
        _say_checked_first()

    def _new_check(self, optimizer: Any, max_norm: float | None, fp16: bool) -> StepValidation:
        # A copy to put back is needed to redo a clipped step or skip a non-finite one; stopping on a
        # non-finite step needs none (no memory, no copying every step).
        rollback = max_norm is not None or self.options.on_nonfinite == "skip"
        overlap = self.options.overlaps(fp16)
        if overlap and rollback and not self.copy_counted:  # clipping from the first step: see _clipping_began
            overlap = False
            _say_checked_first()
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
        hooks = verdict.extra[1:].tolist()
        size = len(hooks) // 2
        judged = [(r, f) for r, f in enumerate(hooks[:size]) if f > _NONE]
        codes, rtol = [f for _, f in judged], max(hooks[size:], default=1e-5)
        if not codes or max(codes) - min(codes) <= rtol * max(codes):
            return
        # by pipeline rank: under data_parallel="shard" each replica's rank is named once
        named = {r % self.pipeline_degree if self.pipeline_degree else r: c for r, c in judged}
        factors = ", ".join(f"pipeline rank {r}: {f:.4g}" for r, f in sorted(named.items()))
        step = lm.trainer.global_step - int(done)
        taken = "was taken (post-validation checks after the step)" if done else "was not taken"
        if done:
            self.scaled_step = step
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
