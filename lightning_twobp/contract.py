"""The model contract: the pipelined part of a model is one ``nn.Sequential``.

A LightningModule (or any ``nn.Module``) names the layers to pipeline by holding exactly one
``nn.Sequential`` at the top of its module tree, or by the dotted path ``layers="model.blocks"``.
Sequentials nested inside another Sequential are part of it and do not count.
"""

from __future__ import annotations

from torch import nn

__all__ = ["find_sequential"]


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
                f"layers={layers!r} points to {type(target).__name__}, not to an nn.Sequential: wrap the layers "
                f"to pipeline in one nn.Sequential and point layers= at it"
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
        names = ", ".join(n for n, _ in found)
        raise ValueError(
            f"{type(module).__name__} holds {len(found)} nn.Sequential modules ({names}): name the one "
            f"to pipeline, e.g. layers={found[0][0]!r}"
        )
    return found[0]
