"""An optimizer's own collectives, watched during the first optimizer step of a Trainer call.

Under ``strategy="twobp"`` the world's ranks hold different pipeline stages, so an optimizer that gathers,
reduces or broadcasts over the default group mixes one stage's tensors into another's: muon-optimizer's
``MuonWithAuxAdam`` splits its parameter list by ``dist.get_rank()`` / ``get_world_size()`` and
``all_gather``s the updated weights over the world (found by a trial: 1.84 off one process after 3 steps,
silently, where the stages' shapes agree; gloo's "allgather: invalid tensor size" after the first step's
compute where not). :class:`StepWatch` wraps ``torch.distributed``'s collectives for the optimizer's own step
only (from its step pre-hook to its post-hook, Lightning's closure, which runs the pipeline, left out) and
refuses one over a group holding other stages before it runs. The known ones are refused by type at setup
(:func:`world_collective_optimizer`), before any compute.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["StepWatch", "world_collective_optimizer"]

# torch.distributed's collectives that take a group (point-to-point sends name a peer, not a group: not watched)
_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
)

# allowed over the pipeline's own group, passed explicitly: a sum over the stages (each holds its own parameters)
_SUMS = ("all_reduce", "all_reduce_coalesced")

SINGLE_DEVICE_FIX = (
    "Use an optimizer that steps each rank's own parameters without communicating (muon's SingleDeviceMuon or "
    "SingleDeviceMuonWithAuxAdam, or torch.optim.Muon for the 2-D weights: each is exact under the pipeline), or "
    "give it this stage's data-parallel group where it takes one (process_group=self.trainer.strategy.group('dp'))"
)


def world_collective_optimizer(optimizers: Sequence[Any], pipeline_degree: int) -> str | None:
    """Known optimizers whose step communicates over the world group (muon-optimizer's ``Muon`` and
    ``MuonWithAuxAdam``), refused at setup with ``pipeline_degree > 1``; their single-device variants are fine."""
    muon = sys.modules.get("muon")  # not imported here: an optimizer of that package exists only where the user did
    known = tuple(getattr(muon, n) for n in ("Muon", "MuonWithAuxAdam") if isinstance(getattr(muon, n, None), type))
    found = [opt for opt in optimizers if known and isinstance(opt, known)]
    if not found or pipeline_degree == 1:
        return None
    name = next(c.__name__ for c in known if isinstance(found[0], c))
    return (
        f"muon.{name} is not supported under strategy='twobp' with pipeline_degree={pipeline_degree}: its step "
        f"splits the parameters by dist.get_rank() and dist.get_world_size() of the world group and all_gathers "
        f"the updated weights over it, but the world's ranks hold different pipeline stages (other parameters), so "
        f"one stage's weights would be written into another's (silently where the shapes agree). {SINGLE_DEVICE_FIX}"
    )


class StepWatch:
    """Refuse a ``torch.distributed`` collective that ``optimizer``'s step issues over a group holding ranks other
    than ``allowed`` (this stage's data-parallel replicas), in :meth:`around`. An ``all_reduce`` over
    ``pipeline_group`` itself (the strategy's ``"pp"`` group: a norm summed over the stages, as SAM needs) is
    fine. The closure the step runs is Lightning's, whose collectives (the pipeline's, the global gradient
    check's, a callback's) are not the optimizer's: not watched."""

    def __init__(self, optimizer: Any, allowed: Sequence[int], pipeline_degree: int, pipeline_group: Any) -> None:
        self.optimizer, self.allowed, self.pipeline_degree = optimizer, sorted(allowed), pipeline_degree
        self.pipeline_group = pipeline_group
        self._stages = sorted(dist.get_process_group_ranks(pipeline_group)) if pipeline_group is not None else []
        self._steps = 0  # inside the optimizer's step: a subclass's step calling its base's runs the hooks twice
        self._closures = 0  # inside Lightning's closure, within the step
        self.stepped = False  # the optimizer's step ran (fp16's GradScaler skips it on an overflow)
        self._thread = threading.get_ident()

    @property
    def active(self) -> bool:
        return self._steps > 0 and self._closures == 0

    def _closure(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        """``closure`` with the watch off while it runs."""

        @functools.wraps(closure)
        def run(*args: Any, **kwargs: Any) -> Any:
            self._closures += 1
            try:
                return closure(*args, **kwargs)
            finally:
                self._closures -= 1

        return run

    @contextmanager
    def around(self) -> Iterator[None]:
        """The collectives wrapped for the block: the watch on from the optimizer's step pre-hook to its
        post-hook, off while the closure passed to its step runs (Lightning's: the training step, the hooks
        before the optimizer step, the global gradient check); then put back. An optimizer that is not a
        ``torch.optim.Optimizer`` has no step hooks: not watched."""
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            yield
            return
        undo = _wrap_collectives(self._check)
        handles = [
            self.optimizer.register_step_pre_hook(self._before),
            self.optimizer.register_step_post_hook(lambda *_: self._enter(-1)),
        ]
        try:
            yield
        finally:
            self._steps = self._closures = 0
            for handle in handles:
                handle.remove()
            undo()

    def _before(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The step pre-hook: the watch on, and the step's closure (its first argument) wrapped."""
        self._enter(1)
        self.stepped = True
        if kwargs.get("closure") is not None:
            return args, {**kwargs, "closure": self._closure(kwargs["closure"])}
        if args and callable(args[0]):
            return (self._closure(args[0]), *args[1:]), kwargs
        return None

    def _enter(self, by: int) -> None:
        self._steps += by

    def _check(self, name: str, group: Any) -> None:
        if not self.active or threading.get_ident() != self._thread:
            return
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if name in _SUMS and self.pipeline_group is not None and sorted(ranks) == self._stages:
            return  # a norm summed over the stages, as the SAM warning says (strategy._CLOSURE_AGAIN_NORM): the
            # pipeline's group, or the world where it is the pipeline (one replica)
        others = [g for g in ranks if g not in self.allowed]
        if not others:
            return
        self._steps = 0  # the error's own handling may communicate
        raise RuntimeError(
            f"{type(self.optimizer).__name__}.step called torch.distributed.{name} over global ranks {ranks} under "
            f"strategy='twobp' with pipeline_degree={self.pipeline_degree}: global rank(s) {others} hold other "
            f"pipeline stages (other parameters), so what it gathers, reduces or broadcasts would mix the stages' "
            f"tensors (silently where their shapes agree). An optimizer may communicate within this stage's "
            f"data-parallel replicas only (global ranks {self.allowed}, self.trainer.strategy.group('dp')), "
            f"or all_reduce a norm or dot product over the pipeline's group (self.trainer.strategy.group('pp')). "
            f"{SINGLE_DEVICE_FIX}. Refused at the first optimizer step, before the collective ran"
        )


def _wrap_collectives(check: Callable[[str, Any], None]) -> Callable[[], None]:
    """Wrap each of torch.distributed's collectives (as ``torch.distributed.<name>`` and
    ``distributed_c10d.<name>``) to call ``check(name, group)`` first; returns the function that puts them back."""
    kept: list[tuple[Any, str, Any]] = []
    wrappers: dict[int, Any] = {}
    for module in (dist, distributed_c10d):
        for name in _COLLECTIVES:
            original = getattr(module, name, None)
            if original is None:
                continue
            if id(original) not in wrappers:
                wrappers[id(original)] = _checked(name, original, check)
            kept.append((module, name, original))
            setattr(module, name, wrappers[id(original)])

    def undo() -> None:
        for module, name, original in kept:
            setattr(module, name, original)

    return undo


def _checked(name: str, original: Callable[..., Any], check: Callable[[str, Any], None]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        try:
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        except TypeError:  # a call torch itself will refuse
            group = None
        check(name, group)
        return original(*args, **kwargs)

    return collective
