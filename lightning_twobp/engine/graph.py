"""The one door to autograd nodes' private attributes.

The split backward's fast path (:mod:`lightning_twobp.engine.stage`) computes a Linear's weight
gradient and a norm's scale gradient straight from the tensors the forward saved, so B can free the
graph at once. torch offers no public way to read what a node saved; its generated ``*Backward0``
nodes expose each saved value as ``_saved_<name>``. Every such read goes through :func:`saved`, and
:func:`check_saved_attributes` (run by ``tests/test_graph.py``) builds the nodes the fast path reads
and checks each attribute still exists and holds what the formulas assume, so a torch release that
renames one fails that test loudly instead of sending every model down the slow path unseen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import Node

__all__ = ["READS", "SavedUnavailable", "check_saved_attributes", "saved"]

# The (node name, saved attribute) pairs the fast path reads.
READS = {
    "MmBackward0": ("self",),
    "AddmmBackward0": ("mat1", "alpha", "beta"),
    "MulBackward0": ("self", "other"),
}


class SavedUnavailable(RuntimeError):
    """A node does not (or no longer) hold the saved value the fast path needs."""


def saved(node: Node, name: str) -> Any:
    """What ``node`` saved as ``name`` in the forward (``node._saved_<name>``).

    Raises :class:`SavedUnavailable` when the node has no such attribute (a torch that renamed it)
    or its tensor was freed (the graph was released)."""
    try:
        return getattr(node, f"_saved_{name}")
    except AttributeError:
        raise SavedUnavailable(
            f"{node.name()} has no saved attribute {name!r} in torch {torch.__version__} (the fast W path "
            f"reads {READS.get(node.name(), ())}); tests/test_graph.py says which read changed"
        ) from None
    except RuntimeError as e:  # "Trying to backward through the graph a second time ..."
        raise SavedUnavailable(f"{node.name()}._saved_{name}: {e}") from None


def check_saved_attributes() -> None:
    """Raise ``AssertionError`` naming the read when a node the fast path reads has changed."""
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    s = torch.randn(4, requires_grad=True)
    nodes: dict[str, Any] = {  # grad_fn, typed Optional: ops on tensors that require grad record one
        "AddmmBackward0": torch.addmm(b, x, w.t()).grad_fn,
        "MmBackward0": torch.mm(x, w.t()).grad_fn,
        "MulBackward0": (x * s).grad_fn,
    }
    for name, node in nodes.items():
        assert node.name() == name, f"torch now records {node.name()} where the fast path expects {name}"
    add = nodes["AddmmBackward0"]
    assert torch.equal(saved(add, "mat1"), x), "AddmmBackward0._saved_mat1 is no longer the input"
    assert saved(add, "alpha") == 1 and saved(add, "beta") == 1, "AddmmBackward0 alpha/beta changed meaning"
    assert torch.equal(saved(nodes["MmBackward0"], "self"), x), "MmBackward0._saved_self is no longer the input"
    mul = nodes["MulBackward0"]
    assert torch.equal(saved(mul, "self"), x) and torch.equal(saved(mul, "other"), s), "MulBackward0 operands changed"
