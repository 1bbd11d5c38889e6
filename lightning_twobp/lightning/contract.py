"""The model contract: which part of a LightningModule is pipelined, and how its call is intercepted.

Two kinds:

* :class:`SequentialContract`: the pipelined layers are one ``nn.Sequential``, found at the top of the
  module tree or named by ``layers="model.blocks"``, and ``training_step`` calls it once. Sequentials
  nested inside another Sequential are part of it and do not count.
* :class:`~lightning_twobp.lightning.modulelist_contract.ModuleListContract`: blocks in an ``nn.ModuleList`` that the
  model's own forward calls in a loop with keyword side inputs (Hugging Face, nanoGPT, torchtitan),
  named by ``layers="model.transformer.h"`` or found as the one ModuleList of identical blocks.

The strategy talks to a contract only through :class:`Contract` (the layers as a list, a stage built
from a run of them, the call intercepted for the length of a ``with``, layers swapped in and out);
:func:`find_contract` picks the kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from lightning_twobp.lightning.checks import CARRY_AUX, grad_scalars, stored_for_loss
from lightning_twobp.lightning.in_place import starts_in_place
from lightning_twobp.lightning.modulelist_contract import ModuleListContract, identical_blocks

__all__ = [
    "Contract",
    "ModuleListContract",
    "SequentialContract",
    "StageModule",
    "find_contract",
    "find_sequential",
]


class Contract(Protocol):
    """What the strategy needs of the pipelined part of a model."""

    name: str  # dotted path in the LightningModule ("" for the module itself)

    def layers(self) -> list[nn.Module]:
        """The pipelined layers, in order (the unit the partition cuts between)."""

    def stage_module(self, first: int, stop: int, bounds: Sequence[int]) -> nn.Module:
        """Layers ``first .. stop - 1`` as one module, called with the stage's positional inputs
        (``bounds``: every stage's first layer, and the number of layers)."""

    def intercept(self, call: Callable[..., Any]) -> Any:
        """A context manager: while it is open, calling the pipelined block calls ``call(*args)``."""

    def swap(self, replacements: Mapping[int, nn.Module]) -> dict[int, nn.Module]:
        """Put ``replacements`` in at the given layer indices; return the layers they replaced."""

    def bind(self, runner: Any) -> None:
        """The step runner that calls :meth:`intercept` (a contract may re-run the step through it)."""

    def describe(self, i: int) -> str:
        """Layer ``i``, for messages."""

    def parts(self, layer: nn.Module) -> list[nn.Module]:
        """The modules a user can call in ``layer`` (guarded when their weights are elsewhere)."""

    def parameter_name(self, i: int, name: str) -> str:
        """The name of parameter ``name`` of layer ``i``, relative to :attr:`name`."""


class StageModule(nn.Module):
    """A run of a Sequential's layers as one pipeline stage, called as the Sequential calls them.

    The executor passes a stage's inputs positionally (a tuple of tensors between stages, since
    only tensors travel): one input is the layer's argument, several are given to the first layer as
    the one tuple the previous layer returned, as ``nn.Sequential`` does. When the first layer works
    in place (``nn.ReLU(inplace=True)``) the stage's inputs, which are leaves that require grad, are
    cloned first: autograd refuses an in-place op on such a leaf.

    A stage that is not the last (``names`` given: the layers' names in the model) looks once, at its
    first training forward, for values its layers' forward stored on themselves (:func:`stored_for_loss`).
    """

    def __init__(self, layers: list[nn.Module], names: list[str] | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)  # shared with the user's Sequential, not copied
        self._clone_inputs = starts_in_place(self.layers)
        self._look_for_stored = names  # None: the last stage (the step reads its layers), or nothing to look at

    def forward(self, *inputs: Any) -> Any:
        if self._clone_inputs:
            inputs = tuple(x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in inputs)
        x = inputs[0] if len(inputs) == 1 else inputs
        names = self._look_for_stored if self.training and torch.is_grad_enabled() else None
        before = grad_scalars(self.layers) if names else set()
        for layer in self.layers:
            x = layer(x)
        if names:
            self._look_for_stored = None
            name_of = lambda k, sub: ".".join([names[k], *([sub] if sub else [])])  # noqa: E731
            stored_for_loss(self.layers, name_of, before, CARRY_AUX, out=x)
        return x


def _once(call: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``call`` for the step's first call of the pipelined block; a second call raises. The last stage
    answers every call with the pipeline's one output, so a second call would get the first one's."""
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if calls[0]:
            raise RuntimeError(
                f"the step called {name} a second time: under strategy='twobp' it must call the pipelined "
                f"Sequential once per step (the pipeline runs it once per micro-batch); call it once on all its "
                f"inputs (e.g. {name}(torch.cat([x, -x]))) and split the output"
            )
        calls[0] += 1
        return call(*args, **kwargs)

    return forward


class SequentialContract:
    """The pipelined part is one ``nn.Sequential`` (see the module docstring)."""

    def __init__(self, name: str, seq: nn.Sequential) -> None:
        self.name = name
        self.seq = seq

    def layers(self) -> list[nn.Module]:
        return list(self.seq)

    def stage_module(self, first: int, stop: int, bounds: Sequence[int]) -> nn.Module:
        last = stop == bounds[-1]  # the step's code reads its layers' attributes: nothing to look for there
        names = None if last else [self.describe(i) for i in range(first, stop)]
        return StageModule([self.seq[i] for i in range(first, stop)], names)

    @contextmanager
    def intercept(self, call: Callable[..., Any]) -> Iterator[None]:
        # An instance attribute shadows the class's forward for this ``with`` only; nothing stays.
        self.seq.forward = _once(call, self.name or "the Sequential")  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.seq.forward

    def swap(self, replacements: Mapping[int, nn.Module]) -> dict[int, nn.Module]:
        old = {}
        for i, module in replacements.items():
            old[i] = self.seq[i]
            self.seq[i] = module
        return old

    def bind(self, runner: Any) -> None:
        pass  # the runner captures and provides; nothing to keep

    def describe(self, i: int) -> str:
        return f"{self.name or 'the Sequential'}[{i}]"

    def parts(self, layer: nn.Module) -> list[nn.Module]:
        return [layer]

    def parameter_name(self, i: int, name: str) -> str:
        return f"{i}.{name}"


def find_contract(module: nn.Module, layers: str | None = None) -> SequentialContract | ModuleListContract:
    """The contract of ``module``: a :class:`SequentialContract` or a
    :class:`~lightning_twobp.lightning.modulelist_contract.ModuleListContract`.

    With ``layers`` the Sequential or ModuleList at that dotted path. Without it, the one outermost
    Sequential or ModuleList of identical blocks (walking the module tree, a Sequential's or such a
    ModuleList's insides do not count). Raises ``ValueError`` naming the candidates and the fix.
    """
    if layers is not None and not isinstance(layers, str):
        raise ValueError(
            f"layers={layers!r}: give one dotted path (e.g. layers='model.transformer.h'); pipelining several "
            f"ModuleLists or Sequentials in one pipeline is not supported"
        )
    found = _outermost_pipelines(module)
    if layers is not None:
        try:
            target = module.get_submodule(layers)
        except AttributeError:
            names = [f"{n} ({type(m).__name__})" for n, m in found] or ["(none)"]
            raise ValueError(
                f"layers={layers!r} names no submodule of {type(module).__name__}; candidates found: {', '.join(names)}"
            ) from None
        if isinstance(target, nn.Sequential):
            return _sequential_contract(module, layers, target)
        if isinstance(target, nn.ModuleList):
            return ModuleListContract(module, layers, target)
        raise ValueError(
            f"layers={layers!r} points to {type(target).__name__}, not to an nn.Sequential or an nn.ModuleList: point "
            f"layers= at the blocks the model's forward loops over (an nn.ModuleList, e.g. "
            f"layers='model.transformer.h'), "
            f"or put the layers in one nn.Sequential called once in training_step"
        )
    if isinstance(module, nn.Sequential):
        return SequentialContract("", module)
    if not found:
        raise ValueError(
            f"{type(module).__name__} holds no nn.Sequential and no nn.ModuleList of blocks with parameters: keep the "
            f"blocks the model's forward loops over in an nn.ModuleList (self.blocks = nn.ModuleList(...)), or put "
            f"the layers to pipeline in one nn.Sequential called once in each step{_mixed_lists(module)}"
        )
    lists = [(n, m) for n, m in found if isinstance(m, nn.ModuleList)]
    if not lists:
        return _sequential_contract(module, *find_sequential(module))
    if len(found) > 1:
        listed = ", ".join(f"{n} ({type(m).__name__}, {len(m)} layers)" for n, m in found)
        # Candidates inside the blocks of a list of several classes (Zamba2's hybrid layers, each holding an adapter
        # list) may be parts of those blocks: that list is an option too.
        around = [(n, ml) for n, ml in _mixed(module) if any(c.startswith(f"{n}.") for c, _ in found)]
        if around:
            listed += f"; around them, blocks of different classes: {_listed(around)}"
        # the example: the longest ModuleList (Gemma3n's first by name, altup_projections, holds 1 projection)
        example = max([*lists, *around], key=lambda nm: len(nm[1]))[0]
        raise ValueError(
            f"{type(module).__name__} holds {len(found)} candidates for the pipeline ({listed}): name the one to "
            f"pipeline with layers=..., e.g. layers={example!r} for the blocks its forward loops over; the others "
            f"then run whole on the first or last stage (an encoder-decoder: name the decoder's blocks, and the "
            f"encoder runs whole on the first stage, its output sent on beside the hidden state: docs/strategy.md, "
            f"'Values passed between stages')"
        )
    return ModuleListContract(module, *lists[0])


def _sequential_contract(module: nn.Module, name: str, seq: nn.Sequential) -> SequentialContract | ModuleListContract:
    """The contract of the Sequential ``seq`` at ``name``: its layers pipelined as the step's one call of it
    (:class:`SequentialContract`); or, nested in a model that holds trainable parameters beside it (timm's ViT
    ``blocks`` between its patch embedding and head, ConvNeXt's ``stages``), as the blocks of a loop: a Sequential
    runs its layers one after the other as a loop over a ModuleList does, and the loop contract places the modules
    around it on the first and last stages. The step contract would refuse those parameters at the first step:
    its stages train only the Sequential's."""
    if "." in name:
        # the model around it (``model`` for ``model.blocks``): a module with a forward of its own that holds
        # trainable parameters beside the Sequential, which its forward runs around it. A bare container (an
        # nn.Module() grouping it) or trainable modules elsewhere in the LightningModule (a head or a teacher the
        # step calls, a probe it never does) leave the Sequential the step's own call, as before.
        outer = module.get_submodule(name.split(".")[0])
        inside = {id(q) for q in seq.parameters()}
        if type(outer).forward is not nn.Module.forward and any(
            q.requires_grad and id(q) not in inside for q in outer.parameters()
        ):
            return ModuleListContract(module, name, seq)
    return SequentialContract(name, seq)


def _mixed(module: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The ModuleLists of blocks of several classes with parameters (Jamba's Mamba and attention layers), the
    longest first: discovery does not take them (a list of heads or experts is no stack of layers), ``layers=``
    does."""
    mixed = [
        (name, ml)
        for name, ml in module.named_modules()
        if isinstance(ml, nn.ModuleList) and len({type(m) for m in ml}) > 1 and next(ml.parameters(), None) is not None
    ]
    return sorted(mixed, key=lambda nm: -len(nm[1]))


def _listed(mixed: list[tuple[str, nn.ModuleList]]) -> str:
    return ", ".join(
        f"{name} ({len(ml)} blocks: {', '.join(sorted({type(m).__name__ for m in ml}))})" for name, ml in mixed[:3]
    )


def _mixed_lists(module: nn.Module) -> str:
    """For the not-found error: the ModuleLists of blocks of several classes, and the ``layers=`` that takes one."""
    mixed = _mixed(module)
    if not mixed:
        return ""
    return (
        f". Its ModuleLists of blocks of different classes are not taken on their own: {_listed(mixed)}; if its "
        f"forward loops over one, name it, e.g. layers={mixed[0][0]!r}"
    )


def _outermost_pipelines(module: nn.Module) -> list[tuple[str, nn.Sequential | nn.ModuleList]]:
    """Outermost Sequentials and ModuleLists of identical blocks below ``module``, by name."""
    found: list[tuple[str, nn.Sequential | nn.ModuleList]] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        name, mod = stack.pop()
        if mod is not module and (
            isinstance(mod, nn.Sequential) or (isinstance(mod, nn.ModuleList) and identical_blocks(mod))
        ):
            found.append((name, mod))
            continue
        stack.extend((f"{name}.{n}" if name else n, child) for n, child in reversed(list(mod.named_children())))
    return sorted(found, key=lambda item: item[0])


def _outermost_sequentials(module: nn.Module) -> list[tuple[str, nn.Sequential]]:
    found: list[tuple[str, nn.Sequential]] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        name, mod = stack.pop()
        if isinstance(mod, nn.Sequential) and mod is not module:
            found.append((name, mod))
            continue  # what is inside belongs to it
        stack.extend((f"{name}.{n}" if name else n, child) for n, child in reversed(list(mod.named_children())))
    return sorted(found, key=lambda item: item[0])


def find_sequential(module: nn.Module, layers: str | None = None) -> tuple[str, nn.Sequential]:
    """The ``(dotted name, Sequential)`` to pipeline in ``module``.

    With ``layers`` the Sequential at that dotted path; without it, the one outermost
    Sequential. Raises ``ValueError`` naming the candidates and the fix.
    """
    if layers is not None:
        try:
            target = module.get_submodule(layers)
        except AttributeError:
            names = [n for n, _ in _outermost_sequentials(module)] or ["(none)"]
            raise ValueError(
                f"layers={layers!r} names no submodule of {type(module).__name__}; Sequentials found: "
                f"{', '.join(names)}"
            ) from None
        if not isinstance(target, nn.Sequential):
            raise ValueError(
                f"layers={layers!r} points to {type(target).__name__}, not to an nn.Sequential: put the layers "
                f"to pipeline in one nn.Sequential (nn.Sequential(*blocks), called once in training_step) and "
                f"point layers= at it"
            )
        return layers, target
    found = _outermost_sequentials(module)
    if isinstance(module, nn.Sequential):
        return "", module
    if not found:
        raise ValueError(
            f"{type(module).__name__} holds no nn.Sequential: put the layers to pipeline in one "
            f"nn.Sequential (e.g. self.blocks = nn.Sequential(...)) and call it once in each step"
        )
    if len(found) > 1:
        listed = ", ".join(n for n, _ in found)
        longest = max(found, key=lambda nm: len(nm[1]))[0]
        raise ValueError(
            f"{type(module).__name__} holds {len(found)} nn.Sequential modules ({listed}): name the one to "
            f"pipeline with layers=..., e.g. layers={longest!r}. The one training_step calls is cut between its "
            f"layers; one that another module's forward calls (torchvision's ResNet calls layer1..layer4) between "
            f"its blocks, that forward running the modules before it on the first stage and those after it on the "
            f"last. To cut anywhere in such a model, build one nn.Sequential of its parts in order (e.g. "
            f"nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, ..., m.avgpool, nn.Flatten(1), m.fc)) "
            f"and call that"
        )
    return found[0]
