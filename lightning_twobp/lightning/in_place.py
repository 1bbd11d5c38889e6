"""Which modules change their input in place at once: a pipeline stage's input (a leaf that requires grad)
cannot be, and a checkpointed block's cannot either (its recompute starts from it), so such a module gets a
copy (``contract.StageModule``, ``modulelist_contract``, ``checkpointing``)."""

from __future__ import annotations

from torch import nn

__all__ = ["starts_in_place"]


def starts_in_place(module: nn.Module) -> bool:
    """Does ``module`` start by changing its input in place? torch's in-place activations and dropouts say so
    in their ``inplace`` attribute; a Sequential starts with its first layer (torchvision's EfficientNet
    classifier: ``Sequential(Dropout(p, inplace=True), Linear)``). A forward of other code is not looked
    into: there, a pipeline stage's input changed in place is refused by name (``Stage.forward``). A
    ModuleList is read as the run of layers a stage makes of it."""
    if isinstance(module, (nn.Sequential, nn.ModuleList)):  # its first layer that does something
        first = next((m for m in module if not _passes_through(m)), None)
        return first is not None and starts_in_place(first)
    return bool(getattr(module, "inplace", False))


def _passes_through(module: nn.Module) -> bool:
    """An Identity, or a Sequential of nothing else: its input goes on as it came."""
    return isinstance(module, nn.Identity) or (
        isinstance(module, (nn.Sequential, nn.ModuleList)) and all(_passes_through(m) for m in module)
    )
