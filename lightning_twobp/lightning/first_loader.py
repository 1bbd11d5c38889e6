"""The training loader a fit's ``train_dataloader()`` hook makes, made once, as in one process.

``schedule="auto"`` and ``balance="time"`` read the first batch in setup (:func:`.profile.first_batch`),
and a resumed fit whose ``configure_optimizers`` read ``trainer.estimated_stepping_batches`` sets the data
up again after the restore (:mod:`.checkpoint_hooks`): each asked the fit loop's source for the training
loader before Lightning's own set-up, which then asked again. A hook ran up to three times where one
process runs it once, and one that hands out the next shard, or counts its calls, trained on other data
(found by a trial of the sanity check's own early call, since removed).

From setup until training starts the source's ``dataloader()`` is shadowed: its first call runs the hook,
every later one gets that loader back, with the random state the hook left (where the state is the one
the hook started from: the profile forks its draws, so Lightning's own call finds it so), as though the
hook ran then. Where something drew random numbers in between, the hook runs again: its draws would
differ from one process's otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lightning_twobp.private import collect_rng_states, data_source, pytree, set_rng_states

__all__ = ["hold"]


class _Once:
    """The shadow of a data source's ``dataloader()`` (see the module docstring)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.made: tuple[Any, dict[str, Any], dict[str, Any]] | None = None  # loader, states before, after

    def __call__(self) -> Any:
        now = _states()
        if self.made is not None:
            loader, before, after = self.made
            if _same(now, after):  # asked again before anything drew: the state is the hook's already
                return loader
            if _same(now, before):  # the draws in between were forked away: as though the hook ran now
                set_rng_states(after)
                return loader
        loader = type(self.source).dataloader(self.source)
        self.made = (loader, now, _states())
        return loader


def hold(trainer: Any) -> Callable[[], None]:
    """Shadow the fit loop's source until the returned release is called (when training starts, or at
    teardown): see the module docstring. A loader given to the Trainer call runs no hook: nothing to hold."""
    source = data_source(trainer.fit_loop)
    if source is None or not source.is_module() or "dataloader" in vars(source):
        return lambda: None
    source.dataloader = _Once(source)
    return lambda: vars(source).pop("dataloader", None)


def _states() -> dict[str, Any]:
    return collect_rng_states(include_cuda=torch.cuda.is_available())


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    left, right = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(left) == len(right) and all(_equal(x, y) for x, y in zip(left, right, strict=True))


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and np.array_equal(x, y)
    return bool(x == y)
