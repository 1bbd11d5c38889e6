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

from lightning_twobp.engine import StepValidation, Verdict
from lightning_twobp.lightning.placeholders import Elsewhere
from lightning_twobp.options import PipelineOptions

log = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "OptimizerChecks", "buffers_kept"]


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
        if check.check_finite:
            extra = torch.zeros(1, device=self.device)
            if losses:
                finite = torch.isfinite(torch.stack(list(losses)).float())
                # 1 + the first non-finite micro-batch, or 0: no host sync until the check's verdict
                first = torch.where(finite.all(), 0, finite.logical_not().int().argmax() + 1)
                extra = first.reshape(1).float().to(self.device)
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
