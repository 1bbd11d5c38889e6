"""torchmetrics ``Metric`` objects under the pipeline: their step value over the whole batch, not a mean
of micro-batch values, and their state the same on every rank of the pipeline.

A Metric keeps summable states (counts, sums, concatenated predictions), so the batch's value comes
from the batch's state, whatever the micro-batching: the macro accuracy of a batch is not the mean of
its micro-batches' macro accuracies. On the rank holding the last stage (where the step runs past the
pipelined block, once per micro-batch) :meth:`StepMetrics.begin` sets every Metric's state aside and
starts it empty, so the step's micro-batches accumulate the step's state alone; :meth:`StepMetrics.end`
takes that state, computes the step's value from it (what one process's ``metric(preds, target)`` on
the whole batch returns and Lightning logs at a step), and merges the state from before back in, as
torchmetrics' own ``forward`` does for one batch. The step's states travel to the pipeline's other
ranks with the logs, and :meth:`StepMetrics.apply` does the same there, so every rank of a pipeline
holds the same state and logs the same value.

Epoch values go through Lightning and torchmetrics as usual: Lightning calls ``compute()``, which syncs
the state over the metric's ``process_group``. For the Trainer call that is the data-parallel group (the
same stage in every replica), so each replica's state counts once, not once per pipeline rank; the
user's own ``process_group`` is put back at teardown. ``self.metric.compute()`` in a hook is exact on
every rank for the same reason.

torchmetrics has no public way to set the value Lightning logs at a step nor the update count, nor to
merge a state whose ``update`` needs the full state: :mod:`lightning_twobp.private` holds the three
doors (``metric_finish_step``, ``metric_forward_cache``, ``metric_merge``), guarded by
``tests/test_private_apis.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_twobp.private import metric_finish_step, metric_forward_cache, metric_merge

__all__ = ["MetricRef", "StepMetrics", "States"]

States = dict[str, dict[str, torch.Tensor]]  # metric path -> state name -> the step's state (lists joined)


@dataclass(frozen=True)
class MetricRef:
    """A Metric logged in a step, by its path in the LightningModule: each rank logs its own copy."""

    path: str


def _metric_class() -> type | None:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return None
    return Metric


def is_metric(value: Any) -> bool:
    cls = _metric_class()
    return cls is not None and isinstance(value, cls)


def _never() -> bool:
    return False


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    # reset() clears list states in place; tensors are replaced, not changed, so a reference suffices
    return {k: list(v) if isinstance(v, list) else v for k, v in state.items()}


def _local_value(metric: Any) -> Any:
    """``compute()`` on this rank's state alone, not synced, not cached (the epoch's compute syncs)."""
    available, cached = metric.distributed_available_fn, metric.compute_with_cache
    metric.distributed_available_fn, metric.compute_with_cache = _never, False
    try:
        return metric.compute()
    finally:
        metric.distributed_available_fn, metric.compute_with_cache = available, cached


@dataclass
class _Before:
    state: dict[str, Any]
    count: int
    cache: Any


class StepMetrics:
    """The Metric modules of ``module``, for one Trainer call (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.metrics = {name: m for name, m in module.named_modules() if is_metric(m)}
        for name, m in self.metrics.items():
            if m.dist_sync_on_step:
                raise ValueError(
                    f"{name} ({type(m).__name__}) has dist_sync_on_step=True: under strategy='twobp' only the last "
                    f"stage's rank runs the step past the pipelined block, so a sync inside it would wait for ranks "
                    f"that never join; drop dist_sync_on_step (the epoch's value is synced over the data-parallel "
                    f"replicas, and the step's value is the whole batch's)"
                )
        self._paths = {id(m): name for name, m in self.metrics.items()}
        self._before: dict[str, _Before] = {}

    def sync_over(self, group: dist.ProcessGroup | None) -> Callable[[], None]:
        """For the Trainer call, every Metric syncs its state over ``group`` (the data-parallel replicas of
        this pipeline rank); returns the undo (the user's process groups back)."""
        users = {name: m.process_group for name, m in self.metrics.items()}
        for m in self.metrics.values():
            m.process_group = group

        def undo() -> None:
            for name, m in self.metrics.items():
                m.process_group = users[name]

        return undo

    def ref(self, metric: Any, name: str) -> MetricRef:
        path = self._paths.get(id(metric))
        if path is None:
            raise TypeError(
                f"self.log({name!r}, {type(metric).__name__}) under strategy='twobp': log a Metric that is an "
                f"attribute of the LightningModule (self.acc = MulticlassAccuracy(...)), so that every rank of the "
                f"pipeline logs its own copy of it"
            )
        return MetricRef(path)

    def resolve(self, value: Any) -> Any:
        """What to log for a recorded value: this rank's Metric for a :class:`MetricRef`."""
        return self.metrics[value.path] if isinstance(value, MetricRef) else value

    def begin(self) -> None:
        """On every rank, before the step's first micro-batch: every Metric's state set aside, and empty."""
        self._before = {}
        for name, m in self.metrics.items():
            self._before[name] = _Before(_copy(m.metric_state), m.update_count, metric_forward_cache(m))
            m.reset()

    def clear(self) -> None:
        """Empty again (after the first stage's part of the step, which the last stage runs again)."""
        for m in self.metrics.values():
            m.reset()

    def end(self) -> States:
        """On the last stage's rank, after the step's last micro-batch: each updated Metric's step state
        (for the other ranks), its step value computed, the state from before merged back in."""
        states: States = {}
        for name, m in self.metrics.items():
            if m.update_count == 0:  # not updated in this step: as it was
                self._put(m, self._before[name])
                continue
            states[name] = {
                k: torch.cat(v) if isinstance(v, list) else v
                for k, v in m.metric_state.items()
                if not (isinstance(v, list) and not v)
            }
            self._settle(m, self._before[name])
        return states

    def apply(self, states: States) -> None:
        """On the pipeline's other ranks: the last stage's step states, settled as there (whatever this
        rank's part of the step, before the pipelined block, updated is dropped: the last stage ran it too)."""
        for name, m in self.metrics.items():
            m.reset()
            if name not in states:
                self._put(m, self._before[name])
                continue
            for k, v in states[name].items():
                setattr(m, k, [v.to(m.device)] if isinstance(getattr(m, k), list) else v.to(m.device))
            self._settle(m, self._before[name])

    def undo(self) -> None:
        """The states from before the last :meth:`end` or :meth:`apply` (a step that is run again)."""
        for name, before in self._before.items():
            self._put(self.metrics[name], before)

    @staticmethod
    def _settle(m: Any, before: _Before) -> None:
        metric_finish_step(m, before.count + 1, None)  # one update per step, as one process counts
        value = _local_value(m)
        metric_merge(m, before.state)
        metric_finish_step(m, before.count + 1, value)

    @staticmethod
    def _put(m: Any, before: _Before) -> None:
        m.reset()
        for k, v in before.state.items():
            setattr(m, k, list(v) if isinstance(v, list) else v)
        metric_finish_step(m, before.count, before.cache)
