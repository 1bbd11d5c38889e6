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
hook ran then, and each ``torch.Generator`` of the loader and its samplers as the hook made it (the profile
read a batch from it: a shuffling loader's own generator had moved on, and trained in another order). Where
something drew random numbers in between (an ``on_fit_start`` hook drawing), the hook runs again: its draws
would differ from one process's otherwise. A sampler keeping other state that iterating moves (its own
NumPy generator) is not put back.
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
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []  # the loader's own, as made

    def __call__(self) -> Any:
        now = _states()
        if self.made is not None:
            loader, before, after = self.made
            if _same(now, after) or _same(now, before):  # nothing drew since, or its draws were forked away
                set_rng_states(after)  # as though the hook ran now
                for g, state in self.generators:
                    g.set_state(state)
                return loader
        loader = type(self.source).dataloader(self.source)
        self.made = (loader, now, _states())
        self.generators = [(g, g.get_state()) for g in _generators(loader)]
        return loader


def hold(trainer: Any) -> Callable[[], None]:
    """Shadow the fit loop's source until the returned release is called (when training starts, or at
    teardown): see the module docstring. A loader given to the Trainer call runs no hook: nothing to hold."""
    source = data_source(trainer.fit_loop)
    if source is None or not source.is_module() or "dataloader" in vars(source):
        return lambda: None
    source.dataloader = _Once(source)
    return lambda: vars(source).pop("dataloader", None)


def _generators(loaders: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects of ``loaders`` (one, a collection, a CombinedLoader) and their samplers."""
    found: dict[int, torch.Generator] = {}
    for loader in pytree.tree_leaves(getattr(loaders, "iterables", loaders)):
        holders = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
        holders.append(getattr(holders[-1], "sampler", None))
        for holder in holders:
            g = getattr(holder, "generator", None)
            if isinstance(g, torch.Generator):
                found[id(g)] = g
    return list(found.values())


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
