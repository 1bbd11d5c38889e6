"""Each parameter's optimizer settings as one process gives them, checked on this rank.

``configure_optimizers`` runs on every rank and sees that rank's parameters only. Param groups chosen by
name or module (``named_parameters()``, a ``no_decay`` list) hold the same parameters with the same settings
as in one process; groups cut by position in ``self.parameters()`` (``p[:3]`` and ``p[3:]``) do not: on
pipeline rank 1 ``p[:3]`` is the first three of *its* parameters. A cold review found it trained 5.8
relative off one process, silently. So at setup, before the pipeline cuts the model, the whole model's
``configure_optimizers`` runs once more (its random state put back, unless it built the training loader; its
optimizers hold no state yet and are dropped) and each parameter's place is kept by name: which optimizer,
with which settings (the group's entries but its parameters and the kernels that step them). After
Lightning's own call on this rank's stages every parameter of the rank must have the same place; the first
that does not is named with both settings and the fix.

A tied weight is one parameter in one process and one copy per stage here (``lm_head.weight`` beside
``wte.weight``): each copy's name must have the tied weight's place, or the copies would step apart. Where
the whole model's call raises (a fused optimizer over weights still on the meta device) nothing is compared:
Lightning's own call, on the rank's real weights, is checked as before (:func:`.checks.checked_optimizers`).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["OneProcess", "Place", "moved_from_one_process", "optimizers_in", "places", "whole_model_places"]

log = logging.getLogger(__name__)

# Which parameters, not how they are stepped; and which kernels step them (the same update): code that picks
# them by device (nanoGPT's ``fused=device_type == "cuda"``, ``foreach``, ``capturable``) sees the whole model
# on the CPU here, before the strategy moves it, and this rank's stages on the GPU in Lightning's call.
_NOT_SETTINGS = ("params", "param_names", "foreach", "fused", "capturable", "differentiable")


@dataclass(frozen=True)
class Place:
    """Where an optimizer steps a parameter: the optimizer's position among those ``configure_optimizers``
    returned, its type and its group's settings."""

    optimizer: int
    kind: str
    settings: tuple[tuple[str, Any], ...]

    def describe(self, also: Sequence[str] = ()) -> str:
        """``also``: settings named besides the usual ones (those that differ from the other place's)."""
        shown = ", ".join(f"{k}={v}" for k, v in self.settings if k in _SHOWN or k in also) or "default settings"
        return f"optimizer {self.optimizer} ({self.kind}, {shown})"


# The settings a message names (the others are compared too): what users set per group.
_SHOWN = ("lr", "weight_decay", "momentum", "betas", "eps", "nesterov", "initial_lr")


_VALUES = (type(None), bool, int, str, bytes, torch.dtype, torch.device, enum.Enum)


class _Unknown:
    """A setting whose value the whole model's call cannot tell: a tensor on the meta device (made on the device
    of a parameter another rank holds, ``lr=torch.tensor(1e-3, device=p.device)``); equal to any value."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "(on the meta device)"


_UNKNOWN = _Unknown()


def _plain(value: Any) -> Any:
    """A group's setting as a value ``==`` compares, and compares alike in two calls of the same code: a tensor
    (``lr=torch.tensor(0.1)``) or an array by its values, a NaN as a NaN, containers by their items. Anything
    else (a function, a generator, an object of the user's: another object each call, equal only to itself) is
    compared by its type: ``==`` between two calls' would refuse every parameter, or raise (an array's). A tensor
    on the meta device (the whole model's call sees other ranks' weights there) compares equal to anything."""
    if isinstance(value, torch.Tensor):
        return _UNKNOWN if value.is_meta else _plain(value.tolist())
    if isinstance(value, float):
        return ("nan",) if math.isnan(value) else value
    if isinstance(value, complex):
        return ("complex", _plain(value.real), _plain(value.imag))
    if isinstance(value, _VALUES):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return ("dict", tuple(sorted(((repr(k), _plain(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    tolist = getattr(value, "tolist", None)  # a numpy array or scalar
    if callable(tolist) and type(value).__module__.startswith("numpy"):
        return _plain(tolist())
    return ("object", f"{type(value).__module__}.{type(value).__qualname__}")


@dataclass(frozen=True)
class OneProcess:
    """Where one process's optimizers step each parameter, by every name it has; and each name of a tied
    parameter (one parameter under several names there, a copy per stage here) with its other names."""

    places: Mapping[str, Place | None]
    tied: Mapping[str, tuple[str, ...]]


def places(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Place | None]:
    """Each of ``module``'s parameters by every name it has (tied ones have several), and its place in
    ``optimizers`` (None: in none of them)."""
    found: dict[int, Place] = {}
    for k, opt in enumerate(optimizers):
        for group in opt.param_groups:
            found_settings = ((key, _plain(v)) for key, v in group.items() if key not in _NOT_SETTINGS)
            settings = tuple(sorted(found_settings, key=lambda kv: str(kv[0])))
            for q in group["params"]:
                found[id(q)] = Place(k, type(opt).__name__, settings)
    named = module.named_parameters(remove_duplicate=False)
    return {name: found.get(id(q)) for name, q in named}


def optimizers_in(found: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in whatever ``configure_optimizers`` returned (one, lists, dicts, tuples)."""
    if isinstance(found, torch.optim.Optimizer):
        return [found]
    if isinstance(found, dict):
        found = list(found.values())
    if isinstance(found, (list, tuple)):
        return [o for item in found for o in optimizers_in(item)]
    return []


def whole_model_places(lm: Any) -> OneProcess | None:
    """The places one process's ``configure_optimizers`` gives the whole model's parameters (``lm`` still
    whole), or None where that call raises (see the module docstring)."""
    trainer = getattr(lm, "_trainer", None)
    loaded = trainer is not None and trainer.train_dataloader is not None
    state = torch.get_rng_state()
    try:
        built = optimizers_in(lm.configure_optimizers())
    except Exception as e:  # noqa: BLE001 - a check we cannot make; Lightning's own call is checked
        log.info("twobp: the param groups are not compared with one process's (%s: %s)", type(e).__name__, e)
        return None
    finally:
        # The random state is put back, unless the call built the training loader (trainer.estimated_stepping_batches
        # in it): that is built once, here, and one process's random state goes on from its draws (a subset drawn
        # in train_dataloader, a dataset of random samples); put back, the sampler's shuffle and every later draw
        # came from another state, and the run read other batches than one process's.
        if loaded or trainer is None or trainer.train_dataloader is None:
            torch.set_rng_state(state)
    names: dict[int, list[str]] = {}
    for name, q in lm.named_parameters(remove_duplicate=False):
        names.setdefault(id(q), []).append(name)
    tied = {n: tuple(m for m in ns if m != n) for ns in names.values() if len(ns) > 1 for n in ns}
    return OneProcess(places(lm, built), tied)


def moved_from_one_process(
    whole: OneProcess | None,
    lm: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    pp_rank: int,
) -> str | None:
    """The problem, where a parameter of this rank is stepped otherwise than one process steps it (a name
    one process's model does not have is not compared)."""
    if whole is None:
        return None
    try:
        here, there = places(lm, optimizers), whole.places
        moved = [name for name, place in here.items() if name in there and place != there[name]]
    except Exception as e:  # noqa: BLE001 - never on one rank alone: the others wait in checked_optimizers
        log.info("twobp: the param groups are not compared with one process's (%s: %s)", type(e).__name__, e)
        return None
    if not moved:
        return None
    name = moved[0]
    differ = _differing(here[name], there[name])
    said = (
        f"configure_optimizers on pipeline rank {pp_rank} steps {len(moved)} of its parameters otherwise than one "
        f"process does: {name} is in {_where(here[name], differ)} here and in {_where(there[name], differ)} in one "
        f"process (the whole model's configure_optimizers, run once more at setup). "
    )
    if name in whole.tied:
        return said + (
            f"It is a weight tied to {', '.join(whole.tied[name])}: one parameter in one process, where "
            f"self.named_parameters() lists it under one name only, and a copy per stage here, each listed under its "
            f"own name. Give every name of a tied weight the same optimizer and settings (or choose its group by "
            f"the name one process lists)"
        )
    return said + (
        "Under strategy='twobp' self.parameters() lists this rank's parameters only, so param groups cut by "
        "position in it (p = list(self.parameters()); [{'params': p[:3]}, {'params': p[3:]}]) hold other "
        "parameters on each rank: choose each group's parameters by name or module (self.named_parameters(), "
        "isinstance(module, nn.LayerNorm))"
    )


def _differing(a: Place | None, b: Place | None) -> tuple[str, ...]:
    """The settings whose values differ between two places (named in the message beside the usual ones)."""
    if a is None or b is None:
        return ()
    x, y = dict(a.settings), dict(b.settings)
    return tuple(k for k in sorted(x.keys() | y.keys()) if x.get(k, _MISSING) != y.get(k, _MISSING))


_MISSING = object()


def _where(place: Place | None, also: Sequence[str] = ()) -> str:
    return place.describe(also) if place is not None else "no optimizer"
