"""A training epoch's logged values computed on every rank where Lightning's progress bar computes them on one.

At a training epoch's end Lightning calls the callbacks' ``on_train_epoch_end`` first, the LightningModule's
next, and computes the epoch's logged values last (``_logger_connector.on_epoch_end``), except that the
progress bar's hook, enabled on global rank 0 alone, computes them early, there: a ``sync_dist=True`` value's
reduce over its replicas, which the others make only after the LightningModule's hook and the checkpoint
callbacks' agreements. A collective in between on the other ranks met rank 0 waiting in that reduce: a
number read from a sharded weight in the module's ``on_train_epoch_end`` (``float(w.norm())``: a gather over
the weight's replicas, :mod:`.shard_reads`), or ``self.log`` of it, hung every rank at the first epoch's end
(stop 59; gone with ``enable_progress_bar=False``).

So every rank computes them at the progress bar's turn (``trainer.progress_bar_metrics``, the call the bar
makes), in the same order: rank 0's bar then reads what is computed, and every rank meets every later
collective in one order. The values are rank 0's as before; the other ranks now compute them where rank 0
does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["computed_at_the_bars_turn"]


class _ComputedFirst:
    """The progress bar's ``on_train_epoch_end``, after the epoch's logged values are computed on this rank (an
    object, not a closure: a callback pickled during the call stays picklable)."""

    def __init__(self, hook: Callable[[Any, Any], None]) -> None:
        self.hook = hook

    def __call__(self, trainer: Any, pl_module: Any) -> None:
        trainer.progress_bar_metrics  # noqa: B018 - computes the epoch's values (and their reduces) here
        self.hook(trainer, pl_module)


def computed_at_the_bars_turn(trainer: Any) -> Callable[[], None]:
    """Where the Trainer has a progress bar (enabled on global rank 0): its ``on_train_epoch_end`` shadowed by
    :class:`_ComputedFirst` on every rank, as an instance attribute. Returns the undo."""
    bar = trainer.progress_bar_callback
    if bar is None or "on_train_epoch_end" in vars(bar):
        return lambda: None
    vars(bar)["on_train_epoch_end"] = _ComputedFirst(bar.on_train_epoch_end)
    return lambda: vars(bar).pop("on_train_epoch_end", None)
