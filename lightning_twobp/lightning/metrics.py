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
the state. For the Trainer call it syncs over the data-parallel group (the same stage in every replica),
so each replica's state counts once, not once per pipeline rank; the group rides in the Metric's
``dist_sync_fn`` (a Metric holding a process group cannot be deep-copied), and the user's own
``process_group`` and ``dist_sync_fn`` are put back at teardown. ``self.metric.compute()`` in a hook is
exact on every rank for the same reason. Wrappers: a Metric whose states are those of a Metric it wraps
(ClasswiseWrapper) is left to that Metric; every state is set aside before any reset (a MinMaxMetric's
reset empties what it wraps); Metrics added during the call (MetricTracker's ``increment()``) are found
at the next step.

A ``MeanMetric`` fed one number per call (``self.val_loss(loss)``, the most common Metric of all) is the
exception: one process feeds it the batch's mean with a weight of 1, the step's code here one number per
micro-batch. Each such update is weighed by its micro-batch's share of the batch instead
(:meth:`StepMetrics.step_shadows`), so the step adds the batch's mean with a weight of 1, as ``self.log``'s
default mean does (a validation's smaller last batch, cut 2, 2, 1, 1, read 3% off before: its micro-batches
weighed alike; and a Metric fed by training and validation steps weighed each training step m times). A
``weight=`` the step passes is its own and stays, as do per-sample values (exact as they are). A
CatMetric given one number and a Running window would hold micro-batches where one process holds batches:
refused in a step; a Sum/Max/MinMetric given a float warns once (exact for a count, not for a mean).

torchmetrics has no public way to set the value Lightning logs at a step nor the update count, nor to
merge a state whose ``update`` needs the full state: :mod:`lightning_twobp.private` holds the three
doors (``metric_finish_step``, ``metric_forward_cache``, ``metric_merge``), guarded by
``tests/test_private_apis.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics import CatMetric, MaxMetric, MeanMetric, Metric, MinMetric, SumMetric
from torchmetrics.utilities import dim_zero_cat
from torchmetrics.wrappers import MinMaxMetric, Running

from lightning_twobp.private import metric_finish_step, metric_forward_cache, metric_merge

__all__ = ["MetricRef", "StepMetrics", "States"]

States = dict[str, dict[str, torch.Tensor]]  # metric path -> state name -> the step's state (lists joined)


@dataclass(frozen=True)
class MetricRef:
    """A Metric logged in a step, by its path in the LightningModule: each rank logs its own copy."""

    path: str


def _gathering_over(group: dist.ProcessGroup | None) -> Callable[..., list[torch.Tensor]]:
    """torchmetrics' gather over ``group`` whatever group a sync passes (a function deep-copies as itself)."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    def gather(result: torch.Tensor, **_: Any) -> list[torch.Tensor]:
        return gather_all_tensors(result, group=group)

    return gather


def _a_view(metric: Any) -> bool:
    """Whether ``metric``'s states are (the same objects as) those of a Metric it holds."""
    inner = [x.metric_state for x in metric.modules() if x is not metric and is_metric(x)]
    return any(v is held.get(k) for k, v in metric.metric_state.items() for held in inner)


def _one_number(value: Any) -> bool:
    """A Python number or a 0-dim tensor: a value for the whole micro-batch (its loss), not per sample (a
    micro-batch of one sample gives per-sample values of shape (1,), not 0-dim)."""
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def _weighed(update: Callable[..., Any], share: float) -> Callable[..., Any]:
    """``update`` giving one number without a weight of its own the weight ``share``; any other call as it is."""

    def weighed_update(value: Any, *args: Any, **kwargs: Any) -> Any:
        if not _one_number(value) or args or "weight" in kwargs:
            return update(value, *args, **kwargs)
        return update(value, weight=share)

    return weighed_update


def _fix(hook: str) -> str:
    if hook == "training_step":
        return "update it in on_train_batch_end from the batch's loss (outputs['loss'], on every rank)"
    return "log the value with self.log (combined over the micro-batches as one process logs it)"


def _one_number_refused(update: Callable[..., Any], path: str, hook: str, m: int) -> Callable[..., Any]:
    def update_per_sample(value: Any, *args: Any, **kwargs: Any) -> Any:
        if _one_number(value):
            raise ValueError(
                f"self.{path} (CatMetric) was given one number in {hook} under strategy='twobp': the step runs once "
                f"per micro-batch ({m} per batch), so it would hold {m} numbers per batch where one process holds "
                f"one, whether the number is a mean or a count; give it per-sample values (a loss with "
                f"reduction='none')" + (f", or {_fix(hook)}" if hook == "training_step" else "")
            )
        return update(value, *args, **kwargs)

    return update_per_sample


def raising(message: str, error: type[Exception] = ValueError) -> Callable[..., Any]:
    """A stand-in for a method the step's call refuses: raises ``error(message)`` whatever it is given."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise error(message)

    return refuse


def _running_refused(path: str, metric: Any, hook: str, m: int) -> str:
    return (
        f"self.{path} ({type(metric).__name__}, window={metric.window}) was updated in {hook} under "
        f"strategy='twobp': its window counts updates, and the step runs once per micro-batch ({m} per batch), "
        f"so the window would hold {metric.window} micro-batches, not {metric.window} batches; {_fix(hook)}, "
        f"or log the loss with self.log(..., prog_bar=True) (Lightning's progress bar shows its running mean)"
    )


def _min_max_refused(path: str, hook: str, m: int) -> str:
    return (
        f"self.{path} (MinMaxMetric) was called in {hook} under strategy='twobp': each call computes its metric "
        f"and keeps the min and max of those values, outside its states, and the step runs once per micro-batch "
        f"({m} per batch), so it would keep the micro-batches' extremes, not the batches'; call "
        f"self.{path}.update(...) in the step and compute() where the epoch ends"
    )


def is_metric(value: Any) -> bool:
    return isinstance(value, Metric)


def _never() -> bool:
    return False


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    # reset() clears list states in place; tensors are replaced, not changed, so a reference suffices
    return {k: list(v) if isinstance(v, list) else v for k, v in state.items()}


def _local_value(metric: Any) -> Any:
    """``compute()`` on this rank's state alone, not synced, not cached (the epoch's compute syncs); the
    Metrics a wrapper holds too (ClasswiseWrapper computes through its metric's own ``compute``)."""
    tree = [x for x in metric.modules() if is_metric(x)]
    users = [(x.distributed_available_fn, x.compute_with_cache) for x in tree]
    for x in tree:
        x.distributed_available_fn, x.compute_with_cache = _never, False
    try:
        return metric.compute()
    finally:
        for x, (available, cached) in zip(tree, users, strict=True):
            x.distributed_available_fn, x.compute_with_cache = available, cached


@dataclass
class _Before:
    state: dict[str, Any]
    count: int
    cache: Any
    plain: dict[str, Any]  # the numbers and flags reset() may change beside the states (Running's position)


def _plain(metric: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(metric).items() if type(v) in (int, float, bool)}


# A step's states carry this key where the step called the Metric (its forward), not only ``update``: one
# process logs a step value then only (Lightning reads the value ``forward`` left), so here too.
_CALLED = "twobp:called"


class StepMetrics:
    """The Metric modules of ``module``, for one Trainer call (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.metrics: dict[str, Any] = {}
        self._owners: dict[str, Any] = {}
        self._paths: dict[int, str] = {}
        self._gather: Callable[..., list[torch.Tensor]] | None = None  # the data-parallel sync, once set
        self._users: dict[int, tuple[Any, Any]] = {}  # each Metric's own process group and sync function
        self._before: dict[str, _Before] = {}
        self._told: set[str] = set()  # the Metrics warned about one number (see _telling), once a Trainer call
        self._find()

    def first_time(self, key: str) -> bool:
        """Whether ``key`` (a warning's) is met for the first time in this Trainer call: said once a call."""
        if key in self._told:
            return False
        self._told.add(key)
        return True

    def _find(self) -> None:
        """The module's Metrics, again where they changed: a MetricTracker adds a copy of its Metric at each
        ``increment()``, during the Trainer call (found here at the next step, so that its state reaches every
        rank of the pipeline as any other's)."""
        found = {name: m for name, m in self.module.named_modules() if is_metric(m)}
        if found.keys() == self.metrics.keys() and all(found[k] is self.metrics[k] for k in found):
            return
        for name, m in found.items():
            if m.dist_sync_on_step:
                raise ValueError(
                    f"{name} ({type(m).__name__}) has dist_sync_on_step=True: under strategy='twobp' only the last "
                    f"stage's rank runs the step past the pipelined block, so a sync inside it would wait for ranks "
                    f"that never join; drop dist_sync_on_step (the epoch's value is synced over the data-parallel "
                    f"replicas, and the step's value is the whole batch's)"
                )
        self.metrics = found
        self._paths = {id(m): name for name, m in found.items()}
        # The Metrics whose states the step sets aside and merges: not a wrapper whose states are those of the
        # Metric it wraps (ClasswiseWrapper forwards them), which would merge the states from before twice.
        self._owners = {name: m for name, m in found.items() if not _a_view(m)}
        if self._gather is not None:
            self._sync_found()

    def _sync_found(self) -> None:
        for m in self.metrics.values():
            if m.dist_sync_fn is self._gather and id(m) in self._users:
                continue
            # a copy made during the call (it has ours) gets torchmetrics' own; by sync function, not id alone:
            # a Metric made later may have a dropped one's id
            ours = m.dist_sync_fn is self._gather
            self._users[id(m)] = (None, None) if ours else (m.process_group, m.dist_sync_fn)
            m.process_group, m.dist_sync_fn = None, self._gather

    def sync_over(self, group: dist.ProcessGroup | None) -> Callable[[], None]:
        """For the Trainer call, every Metric syncs its state over ``group`` (the data-parallel replicas of
        this pipeline rank); returns the undo (the users' process groups and sync functions back). The group
        rides in a sync function, not in ``process_group``: a Metric holding a process group cannot be
        deep-copied (torch cannot pickle one), as MetricTracker, ``Metric.clone`` and a ``copy.deepcopy`` of
        the module in a hook do."""
        self._gather = _gathering_over(group)
        self._sync_found()

        def undo() -> None:
            m: Any
            for m in self.module.modules():
                if id(m) in self._users:
                    m.process_group, m.dist_sync_fn = self._users[id(m)]
                elif is_metric(m) and m.dist_sync_fn is self._gather:  # a copy made after the last step
                    m.process_group, m.dist_sync_fn = None, None
            self._gather, self._users = None, {}

        return undo

    def step_shadows(self, hook: str, m: int, share: float) -> list[tuple[Any, str, Any]]:
        """For one micro-batch's call of ``hook`` (of ``m`` per batch), holding ``share`` of the batch's
        samples: the shadows of the Metrics' ``update`` (and a Running window's ``forward``) for the call:
        a MeanMetric's one number weighed by ``share`` (see the module docstring); a CatMetric's one number
        and a Running window refused, as what they would hold differs from one process's whatever the
        number means."""
        shadows: list[tuple[Any, str, Any]] = []
        if m == 1:  # one micro-batch: every call is one process's
            return shadows
        for path, metric in self.metrics.items():
            if isinstance(metric, Running):
                refuse = raising(_running_refused(path, metric, hook, m))
                shadows += [(metric, "update", refuse), (metric, "forward", refuse)]
            elif isinstance(metric, MinMaxMetric):  # its min and max are no states: kept per call
                shadows.append((metric, "forward", raising(_min_max_refused(path, hook, m))))
            elif isinstance(metric, MeanMetric) and type(metric).update is MeanMetric.update:  # not a subclass's own
                shadows.append((metric, "update", _weighed(metric.update, share)))
            elif isinstance(metric, CatMetric):
                shadows.append((metric, "update", _one_number_refused(metric.update, path, hook, m)))
            elif isinstance(metric, (SumMetric, MaxMetric, MinMetric)) and path not in self._told:
                shadows.append((metric, "update", self._telling(metric.update, path, hook, m)))
        return shadows

    def _telling(self, update: Callable[..., Any], path: str, hook: str, m: int) -> Callable[..., Any]:
        """``update`` that warns, once a Trainer call, where a SumMetric, MaxMetric or MinMetric is given one
        floating number: it combines the micro-batches' numbers as ``self.log``'s ``reduce_fx`` of its name
        does, exact for a count, not for a mean (a loss)."""

        def update_telling(value: Any, *args: Any, **kwargs: Any) -> Any:
            if _one_number(value) and torch.is_floating_point(torch.as_tensor(value)) and self.first_time(path):
                warnings.warn(
                    f"twobp: self.{path} ({type(self.metrics[path]).__name__}) is given one number per call in "
                    f"{hook}, which runs once per micro-batch ({m} per batch): it takes the {m} micro-batches' "
                    f"numbers where one process takes the batch's one, exact for a count (tokens, hits), not for "
                    f"a mean such as the loss (a SumMetric of it reads {m}x one process's); for a mean, "
                    f"{_fix(hook)}",
                    stacklevel=2,
                )
            return update(value, *args, **kwargs)

        return update_telling

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
        self._find()
        # every state set aside before any reset: a wrapper's reset (MinMaxMetric's) resets what it wraps too
        self._before = {
            name: _Before(_copy(m.metric_state), m.update_count, metric_forward_cache(m), _plain(m))
            for name, m in self._owners.items()
        }
        for m in self._owners.values():
            m.reset()

    def clear(self) -> None:
        """Empty again (after the first stage's part of the step, which the last stage runs again)."""
        for m in self._owners.values():
            m.reset()

    def end(self) -> States:
        """On the last stage's rank, after the step's last micro-batch: each updated Metric's step state
        (for the other ranks), its step value computed, the state from before merged back in."""
        states: States = {}
        for name, m in self._owners.items():
            if m.update_count == 0:  # not updated in this step: as it was
                self._put(m, self._before[name])
                continue
            called = metric_forward_cache(m) is not None  # reset at begin: set again by a forward call only
            states[name] = {
                k: dim_zero_cat(v) if isinstance(v, list) else v  # torchmetrics' own cat: 0-dim values too
                for k, v in m.metric_state.items()
                if not (isinstance(v, list) and not v)
            }
            if called:
                states[name][_CALLED] = torch.ones(())
            self._settle(m, self._before[name], called)
        return states

    def apply(self, states: States) -> None:
        """On the pipeline's other ranks: the last stage's step states, settled as there (whatever this
        rank's part of the step, before the pipelined block, updated is dropped: the last stage ran it too)."""
        for m in self._owners.values():
            m.reset()  # all first: a wrapper's reset resets what it wraps, whose state is set next
        for name, m in self._owners.items():
            if name not in states:
                self._put(m, self._before[name])
                continue
            step = dict(states[name])
            called = step.pop(_CALLED, None) is not None
            for k, v in step.items():
                setattr(m, k, [v.to(m.device)] if isinstance(getattr(m, k), list) else v.to(m.device))
            self._settle(m, self._before[name], called)

    def undo(self) -> None:
        """The states from before the last :meth:`end` or :meth:`apply` (a step that is run again)."""
        for name, before in self._before.items():
            self._put(self._owners[name], before)

    @staticmethod
    def _settle(m: Any, before: _Before, called: bool) -> None:
        """The step's state merged after ``before``'s, one update counted as one process counts it, and the
        step's value where the step called the Metric (else the value from before, as ``update`` leaves it)."""
        metric_finish_step(m, before.count + 1, None)
        value = _local_value(m) if called else before.cache
        metric_merge(m, before.state)
        metric_finish_step(m, before.count + 1, value)

    @staticmethod
    def _put(m: Any, before: _Before) -> None:
        """``m`` as it was before the step, set, not reset (a wrapper's reset would empty what it wraps, a
        Metric that has its step's state by then)."""
        for k, v in before.state.items():
            setattr(m, k, list(v) if isinstance(v, list) else v)
        vars(m).update(before.plain)
        metric_finish_step(m, before.count, before.cache)
