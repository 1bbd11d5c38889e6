"""The user's data loaders under the pipeline: with one data-parallel replica they stay as given.

Every rank of a pipeline must read the same batches. With several replicas Lightning's injected
``DistributedSampler`` does that (split by the strategy's ``distributed_sampler_kwargs``: data-parallel
rank and size). With one replica there is nothing to split, yet Lightning would still replace the
loader's sampler with a shuffling ``DistributedSampler`` (it shuffles every training loader it
rebuilds), so a ``shuffle=False`` loader would be read in another order than by one process. Here
the loader is left alone, as ``Trainer(use_distributed_sampler=False)`` leaves it: every rank builds
the same loader and, with the same seed, draws the same order (the stages' random draws go to
streams of their own, :mod:`.rng`, so the global generator a ``RandomSampler`` reads stays in step
across the ranks).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from lightning_twobp.private import without_distributed_sampler

__all__ = ["keep_users_sampler"]


def keep_users_sampler(trainer: Any) -> Callable[[], None]:
    """For this Trainer call, tell Lightning not to inject a distributed sampler; return the undo.

    Lightning reads ``Trainer(use_distributed_sampler=...)`` from its accelerator connector when it
    prepares each loader (after the strategy's ``setup``); there is no public setter, so this is the
    one place that writes the private attribute (``tests/test_strategy.py`` guards it: a pipeline-only
    fit on a ``shuffle=False`` loader must match one process)."""
    undo = without_distributed_sampler(trainer)
    if undo is None:
        warnings.warn(
            "twobp: this Lightning version keeps its distributed-sampler switch elsewhere, so with one "
            "data-parallel replica Lightning's shuffling DistributedSampler replaces the loader's sampler; "
            "pass Trainer(use_distributed_sampler=False) to read batches in the loader's order",
            stacklevel=2,
        )
        return lambda: None
    return undo
