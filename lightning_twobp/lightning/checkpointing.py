"""``TwoBPStrategy(activation_checkpointing=...)``: activation checkpointing on this rank's blocks.

Each chosen block's forward runs under ``torch.utils.checkpoint(use_reentrant=False)`` for the length of
the Trainer call (undone at teardown: the user's blocks are left as they were found). Under the split,
B's engine call recomputes a block once, and W's formulas keep only their operands (the weight GEMMs'
inputs), read once for all of the micro-batch's formulas (see ``engine.stage._bind``): 3 forwards per
block per micro-batch in all (F, the operands' recompute, B's), against 2 in a fused backward.

Values:

* ``None``: off (the default).
* ``"full"``: every block.
* ``k`` (an int >= 1): every k-th block of the model (layer indices 0, k, 2k, ...).

``"selective"`` (keep the matmul outputs, recompute the cheap ops) is refused for now: torch's
selective checkpointing hands each kept output to one recompute only, and the split recomputes twice.
The reentrant form (``use_reentrant=True``) is refused by the engine at the first B with a message
naming ``use_reentrant=False``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_twobp.options import check_activation_checkpointing

__all__ = ["apply_activation_checkpointing", "check_activation_checkpointing"]


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(
    blocks: Iterable[tuple[int, nn.Module]], value: str | int | None
) -> Callable[[], None]:
    """Checkpoint the chosen ``(layer index, block)`` pairs; returns the function that undoes it."""
    if value is None:
        return lambda: None
    every = value if isinstance(value, int) else 1
    chosen = [b for i, b in blocks if i % every == 0]
    for b in chosen:
        b.forward = _checkpointed(b.forward)  # an instance attribute: undone below

    def undo() -> None:
        for b in chosen:
            del b.forward

    return undo
