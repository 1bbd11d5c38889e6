"""The common base of the paper's models: one ``nn.Sequential``, one loss, AdamW with warmup and decay.

A :class:`PipelineModule` holds its pipelined layers in ``self.layers`` (the strategy's contract: the
module's one outermost ``nn.Sequential``, called once per step). ``training_step`` is

    output = self.layers(self.sequential_input(batch))   # first stage: everything before this call
    loss = self.compute_loss(output, batch)               # last stage: everything after it

so a subclass defines the layers, :meth:`compute_loss`, and :meth:`sample_input` (one input of the
Sequential, shaped for a memory planner); :class:`LanguageModel` defines both for models on token ids.
Constructors take flat keyword arguments, as Hydra passes them from yaml, and call
``save_hyperparameters()`` themselves; this package's models take PipelineModule's own as ``**training``
(:class:`Training`, filled in by :func:`training_arguments`).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import TypedDict, override

__all__ = ["LanguageModel", "PipelineModule", "Training", "WarmupThenDecay", "training_arguments"]

_DECAYS = ("constant", "cosine")


class Training(TypedDict, total=False):
    """:class:`PipelineModule`'s arguments (see its Args), which a model takes as ``**training: Unpack[Training]``
    after its own and passes on."""

    lr: float
    weight_decay: float
    warmup_steps: int
    lr_decay: str
    seed: int | None


_DEFAULTS: Training = {"weight_decay": 0.0, "warmup_steps": 0, "lr_decay": "constant", "seed": 0}


def training_arguments(given: Training, lr: float) -> Training:
    """All five training arguments: ``given``, else the model's default ``lr`` and PipelineModule's defaults.

    A model rebinds its ``training`` to this before it calls ``save_hyperparameters()``, which records the
    calling ``__init__``'s ``**training`` as it stands then: the hyperparameters hold all five, defaults
    included, in this order, as when every model listed them in its own signature."""
    return {"lr": lr, **_DEFAULTS, **given}


class WarmupThenDecay:
    """LR multiplier per optimizer step: linear warmup over ``warmup_steps``, then constant, or a
    cosine from 1 down to ``min_ratio`` at ``total_steps``. A callable object rather than a lambda,
    so ``LambdaLR.state_dict`` saves it with the checkpoint."""

    def __init__(self, warmup_steps: int, total_steps: int, decay: str, min_ratio: float = 0.1) -> None:
        self.warmup_steps, self.total_steps, self.decay, self.min_ratio = warmup_steps, total_steps, decay, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps  # step 0 already trains, at lr / warmup_steps
        if self.decay == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PipelineModule(pl.LightningModule):
    """A LightningModule whose layers are ``self.layers: nn.Sequential``.

    Args:
        lr: peak learning rate of AdamW (betas 0.9, 0.95).
        weight_decay: AdamW's decoupled weight decay, on matrices only (see :meth:`configure_optimizers`).
        warmup_steps: optimizer steps of linear warmup (0: none).
        lr_decay: ``"constant"`` after warmup, or ``"cosine"`` down to 10% at ``trainer.max_steps``.
    """

    layers: nn.Sequential

    def __init__(
        self,
        lr: float,
        weight_decay: float = _DEFAULTS["weight_decay"],
        warmup_steps: int = _DEFAULTS["warmup_steps"],
        lr_decay: str = _DEFAULTS["lr_decay"],
        seed: int | None = _DEFAULTS["seed"],
    ) -> None:
        super().__init__()
        if seed is not None:  # before the subclass builds its layers: every process builds the same weights
            torch.manual_seed(seed)
        if lr_decay not in _DECAYS:
            raise ValueError(f"lr_decay={lr_decay!r}: choose one of {', '.join(_DECAYS)}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.lr, self.weight_decay, self.warmup_steps, self.lr_decay = lr, weight_decay, warmup_steps, lr_decay

    # ------------------------------------------------------------------ what a model defines
    def sequential_input(self, batch: Any) -> torch.Tensor:
        """The Sequential's input in ``batch``: the first element (ids or images) by default."""
        return batch[0]

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        """The training loss from the Sequential's output and the batch (runs on the last stage)."""
        raise NotImplementedError(f"{type(self).__name__} must define compute_loss(output, batch)")

    def log_metrics(self, stage: str, output: torch.Tensor, batch: Any) -> None:
        """Further metrics to log besides ``{stage}_loss`` (``stage``: train, val or test)."""

    def sample_input(self, batch_size: int) -> torch.Tensor:
        """One input of ``self.layers`` for ``batch_size`` samples (zeros), on the device of the model's
        first parameter (:attr:`_parameters_device`), which may be ``meta``."""
        raise NotImplementedError(f"{type(self).__name__} must define sample_input(batch_size)")

    def model_output(self, batch: Any) -> torch.Tensor:
        """The output that :meth:`compute_loss` scores: ``self.layers(self.sequential_input(batch))``.

        This is the one Sequential call: under strategy='twobp' the first stage stops here with the input
        captured, and the last stage resumes here with the pipeline's output. A model whose blocks sit in
        an ``nn.ModuleList`` (the loop contract) returns its forward's output instead."""
        return self.layers(self.sequential_input(batch))

    @property
    def _parameters_device(self) -> torch.device:
        # Under strategy='twobp' the layers of other ranks are placeholders without parameters.
        first = next(self.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        output = self.model_output(batch)
        loss = self.compute_loss(output, batch)
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log_metrics(stage, output, batch)
        return loss

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "test")

    @override
    def configure_optimizers(self) -> Any:
        """AdamW over the parameters this rank holds (under strategy='twobp', its stages only).

        Weight decay applies to matrices (Linear, conv, embedding weights); biases, norm scales and
        parameters flagged ``_no_weight_decay`` (Mamba's ``A_log`` and ``D``) are not decayed, as in
        the reference implementations (LLaMa, Mamba, BERT's AdamW)."""
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for q in self.parameters():
            if not q.requires_grad:
                continue
            (no_decay if q.ndim < 2 or getattr(q, "_no_weight_decay", False) else decay).append(q)
        groups = [
            g
            for g in ({"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        total: float = 0  # max_steps, or Lightning's estimate (inf without a bound)
        if self.lr_decay == "cosine":
            total = self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches
            if not math.isfinite(total):
                raise ValueError(
                    "lr_decay='cosine' decays over the run's optimizer steps, but the Trainer has no max_steps "
                    "and no max_epochs: set max_steps (or use lr_decay='constant')"
                )
        factor = WarmupThenDecay(self.warmup_steps, int(total), self.lr_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LanguageModel(PipelineModule):
    """A :class:`PipelineModule` on token ids: batches ``(ids, targets, ...)``, both ``(B, T)`` int64.

    The loss is the cross-entropy of the logits ``(B, T, V)`` against ``targets``; targets of -100 (not
    masked, or padding) are not scored. :meth:`sample_input` is ``max_seq_len`` token ids, so a subclass
    sets ``self.max_seq_len``.
    """

    max_seq_len: int

    @override
    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        targets = batch[1]  # (B, T)
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)

    @override
    def sample_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, self.max_seq_len, dtype=torch.long, device=self._parameters_device)
