"""torch.compile and the split: refused before the first step, never silently dropped.

The split backward (:mod:`lightning_twobp.engine.stage`) leaves each weight gradient to W by reading the
eager autograd graph. Compiled code has none to read: AOTAutograd makes a compiled region's backward
one node that returns the input and the weight gradients together, so B would run the weights' half
and W again. And a compile wrapper *around* the pipelined layers is bypassed: the strategy pipelines
the module under it, so nothing is compiled (dynamo counts 0 graphs). Both cases stop here, at setup,
with what is compiled and what to do. Compiling what holds no weights inside a block (an activation,
an attention core) keeps the split exact and stays allowed; the engine refuses a compiled region with
weights on its own (``Stage.backward_input``), for users of the bare engine.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["check_not_compiled"]

_DO = (
    "TwoBPStrategy splits each layer's backward into B (input gradients) and W (weight gradients) on the "
    "eager autograd graph, which compiled code does not have. Remove that torch.compile call (run eager), "
    "or compile only parts of a block that hold no weights (e.g. its activation or attention core), which "
    "the split keeps"
)


def check_not_compiled(lm: nn.Module, contract: Any) -> None:
    """Raise ``ValueError`` when torch.compile wraps the LightningModule, the pipelined layers or a
    part of one that holds weights."""
    what = _compiled(lm, contract)
    if what is not None:
        raise ValueError(f"{what}. {_DO}.")


def _compiled(lm: nn.Module, contract: Any) -> str | None:
    if getattr(lm, "_compiler_ctx", None):  # Lightning's record of Trainer.fit(torch.compile(model))
        return (
            f"torch.compile({type(lm).__name__}) would be silently dropped: the pipeline runs the layers "
            f"outside the compiled training_step (lightning.pytorch.utilities.compile.to_uncompiled(model) "
            f"gives the module back)"
        )
    parts = contract.name.split(".")
    if "_orig_mod" in parts:
        wrapped = ".".join(parts[: parts.index("_orig_mod")]) or type(lm).__name__
        return (
            f"torch.compile({wrapped}) would be silently dropped: the pipeline runs the layers under the "
            f"compile wrapper ({contract.name}) directly"
        )
    ancestors = getattr(contract, "ancestors", None)  # a ModuleList's holders, the LightningModule first
    if ancestors is not None:  # its name is the top holder's alone
        around = next((n for n, m in ancestors[1:] if _is_compiled(m)), None)
    else:
        around = _compiled_around(lm, parts)
    if around is not None:
        layers = getattr(contract, "list_name", contract.name)
        return (
            f"{around} is compiled with torch.compile and its forward runs the pipelined layers ({layers}), "
            f"which the pipeline cuts into stages: compiled code cannot be cut (it failed in the first step, "
            f"inside torch's compiler)"
        )
    for i, layer in enumerate(contract.layers()):
        for name, sub in layer.named_modules():
            if _is_compiled(sub) and any(q.requires_grad for q in sub.parameters()):
                path_of = getattr(layer, "path_of", None)  # a ModuleList contract's group: the model's own name
                where = (
                    f"{path_of(name)} (in {contract.describe(i)})"
                    if path_of is not None and name
                    else f"{contract.describe(i)}{'.' + name if name else ''}"
                )
                return f"{where} is compiled with torch.compile and holds weights, so its backward cannot be split"
    return None


def _compiled_around(lm: nn.Module, parts: list[str]) -> str | None:
    """The first module from ``lm`` down to the pipelined layers' container that is compiled, by name
    (``model.compile()`` in place, or ``torch.compile(model)`` reached by attribute)."""
    module: Any = lm
    for k, part in enumerate(parts):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
        if _is_compiled(module):
            return ".".join(parts[: k + 1])
    return None


def _is_compiled(module: nn.Module) -> bool:
    """``torch.compile(module)`` (an OptimizedModule, which holds the original as ``_orig_mod``) or
    ``module.compile()`` (in place: nn.Module keeps the compiled call in ``_compiled_call_impl``)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None
