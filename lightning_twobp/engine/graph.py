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

import functools
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.utils import checkpoint as checkpoint_utils

__all__ = [
    "IN_REGION",
    "READS",
    "SavedUnavailable",
    "check_checkpoint_peek",
    "check_saved_attributes",
    "edge_shape",
    "in_checkpoint",
    "peek",
    "saved",
    "unreadable",
]

# The (node name, saved attributes) the fast path reads (engine/formulas.py); for the layer nodes, in the
# order of the ATen backward's arguments, which the formulas pass them in.
READS = {
    "MmBackward0": ("self",),
    "AddmmBackward0": ("mat1", "alpha", "beta"),
    "MulBackward0": ("self", "other"),
    "AddBackward0": ("alpha",),
    "ConvolutionBackward0": (
        "input",
        "weight",
        "bias_sym_sizes_opt",
        "stride",
        "padding",
        "dilation",
        "transposed",
        "output_padding",
        "groups",
    ),
    "NativeBatchNormBackward0": (
        "input",
        "weight",
        "running_mean",
        "running_var",
        "result1",
        "result2",
        "training",
        "eps",
    ),
    "NativeLayerNormBackward0": ("input", "normalized_shape", "result1", "result2", "weight", "bias"),
    "EmbeddingBackward0": ("indices", "weight_sym_argsize_0", "padding_idx", "scale_grad_by_freq", "sparse"),
    "GroupedMmBackward0": ("self", "offs"),
}


# The saved values above that are never tensors (sizes, flags, scalars): :func:`peek` reads them straight,
# without looking for a checkpoint holder they cannot have (a failed attribute lookup per read; a
# convolution's formula reads seven of them per micro-batch).
_CONSTANTS = frozenset(
    READS["ConvolutionBackward0"][2:]  # bias sizes, stride, padding, dilation, transposed, output padding, groups
    + READS["NativeBatchNormBackward0"][6:]  # training, eps
    + READS["EmbeddingBackward0"][1:]  # num_weights, padding_idx, scale_grad_by_freq, sparse
    + ("normalized_shape", "alpha", "beta")
)


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


# What :func:`peek` returns with ``defer=True`` for a tensor saved inside a checkpointed region.
IN_REGION = object()


def peek(node: Node, name: str, defer: bool = False) -> Any:
    """What ``node`` saved as ``name``, like :func:`saved`, but a tensor saved inside a non-reentrant
    ``torch.utils.checkpoint`` region is read without using it up.

    torch lets each checkpointed tensor be unpacked once per backward (per ``GraphExecGroup``): its
    unpack hook takes the holder's handle for the group, returns the recomputed tensor and clears the
    handle. W's formulas need their operands (a Linear's input) *and* B's engine call unpacks every
    saved tensor of each node it runs, the same ones included. Read through torch's own hook with a
    stand-in holder that lets the hook read the handle but not clear it, both reads share the group's
    one recompute: B recomputes the block once and W keeps the operands it made (2 forwards per
    block per micro-batch, as a plain backward). Anything else reads as :func:`saved` does.

    The first read of a region's tensor in a group recomputes the whole region, and what it made lives
    until each node that saved it is run; so B reads a region's operands when its engine reaches their
    node (a node pre-hook), not before the engine starts, which would recompute every region of the
    stage at once. ``defer=True`` returns :data:`IN_REGION` for such a tensor instead of reading it."""
    if name in _CONSTANTS:
        return saved(node, name)
    try:
        raw = getattr(node, f"_raw_saved_{name}", None)  # tensors only: ``alpha`` and the like have none
        holder = getattr(raw, "data", None)
    except RuntimeError:  # freed: let saved() say so
        raw = holder = None
    if raw is None or not isinstance(holder, checkpoint_utils._Holder):
        return saved(node, name)
    if defer:
        return IN_REGION
    try:
        return raw.unpack_hook(_Peek(holder))
    except RuntimeError as e:  # the graph was freed, or torch's checkpoint refused the read
        raise SavedUnavailable(f"{node.name()}._saved_{name} (checkpointed): {e}") from None


def in_checkpoint(node: Node) -> bool:
    """Whether ``node`` saved a tensor inside a non-reentrant ``torch.utils.checkpoint`` region (its raw
    saved value holds a checkpoint holder). Such a node can be run once per recompute group: W must not
    run it again after B did, or push a gradient through it after B's group closed (a second recompute
    under "full", torch's "backward an extra time" under selective checkpointing)."""
    for attr in dir(node):
        if not attr.startswith("_raw_saved_"):
            continue
        try:
            raw = getattr(node, attr)
            held = [getattr(r, "data", None) for r in (raw if isinstance(raw, (tuple, list)) else (raw,))]
        except RuntimeError:  # freed
            continue
        if any(isinstance(h, checkpoint_utils._Holder) for h in held):
            return True
    return False


class _Peek:
    """Stands in for a ``torch.utils.checkpoint`` holder: its ``handles`` read the holder's, and the
    hook's clearing write is dropped (see :func:`peek`)."""

    __slots__ = ("handles",)

    def __init__(self, holder: Any) -> None:
        self.handles = _ReadOnly(holder.handles)


class _ReadOnly(MutableMapping):
    """A dict seen through: reads go to it, writes and deletions are dropped."""

    def __init__(self, real: dict) -> None:
        self.real = real

    def __getitem__(self, key: Any) -> Any:
        return self.real[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __delitem__(self, key: Any) -> None:
        pass

    def __iter__(self) -> Iterator[Any]:
        return iter(self.real)

    def __len__(self) -> int:
        return len(self.real)


def edge_shape(node: Node, nr: int) -> torch.Size:
    """The shape of the gradient ``node`` takes on its input ``nr`` (what its forward produced there):
    ``node._input_metadata``, the metadata the engine itself checks gradients against."""
    try:
        return torch.Size(node._input_metadata[nr].shape)
    except (AttributeError, IndexError):
        raise SavedUnavailable(f"{node.name()} has no _input_metadata[{nr}] in torch {torch.__version__}") from None


_PROBES = {  # one small forward per node kind the formulas read (their values are checked by test_formulas)
    "MmBackward0": lambda: torch.mm(torch.randn(2, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)),
    "AddmmBackward0": lambda: torch.addmm(
        torch.randn(2), torch.randn(2, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    ),
    "MulBackward0": lambda: torch.randn(3, requires_grad=True) * torch.randn(3, requires_grad=True),
    "ConvolutionBackward0": lambda: torch.nn.Conv2d(2, 3, 3)(torch.randn(1, 2, 4, 4, requires_grad=True)),
    "NativeBatchNormBackward0": lambda: torch.nn.BatchNorm1d(3)(torch.randn(2, 3, requires_grad=True)),
    "NativeLayerNormBackward0": lambda: torch.nn.LayerNorm(3)(torch.randn(2, 3, requires_grad=True)),
    "EmbeddingBackward0": lambda: torch.nn.Embedding(4, 3)(torch.tensor([1, 2])),
    "AddBackward0": lambda: torch.randn(3, requires_grad=True) + torch.randn(3, requires_grad=True),
    "GroupedMmBackward0": lambda: torch.nn.functional.grouped_mm(  # rows of 16 bytes, as the kernel takes
        torch.randn(4, 4), torch.randn(2, 4, 4, requires_grad=True), offs=torch.tensor([2, 4], dtype=torch.int32)
    ),
}


@functools.cache
def unreadable(name: str) -> str | None:
    """Why the formulas cannot read what a ``name`` node saved in this torch, or None when they can.

    Probed once per process on a small forward of that node kind: W reads a micro-batch's operands
    during B (see :meth:`lightning_twobp.engine.formulas.FastW.bind`), too late to fall back, so the
    plan asks this first. It does not read the micro-batch's own nodes, which in an activation-
    checkpointed region would recompute the region for every read made outside a backward."""
    make = _PROBES.get(name)
    if make is None:
        return None
    try:
        # Outside the caller's random streams: the probe's random tensors and layer initialisations draw
        # from a forked generator, so a run resumed from a checkpoint draws the same numbers as one that
        # was not interrupted (the first probe happens at whichever step first meets the node kind).
        with torch.random.fork_rng(devices=[]):
            node = make().grad_fn
        if node.name() != name:
            return f"torch now records {node.name()} where the fast path expects {name}"
        for attr in READS[name]:
            saved(node, attr)
    except SavedUnavailable as e:
        return str(e)
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # an op this torch lacks on the CPU
        return f"the probe of {name} failed in torch {torch.__version__} ({type(e).__name__}: {e})"
    return None


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
    for name in READS:
        if name == "GroupedMmBackward0" and not hasattr(torch.nn.functional, "grouped_mm"):
            continue
        assert unreadable(name) is None, unreadable(name)
        with torch.random.fork_rng(devices=[]):
            node = _PROBES[name]().grad_fn
        for attr in set(READS[name]) & _CONSTANTS:
            assert not isinstance(saved(node, attr), torch.Tensor), f"{name}._saved_{attr} is now a tensor"
    emb = torch.nn.functional.embedding(torch.tensor([[1, 2]]), w)
    assert emb.grad_fn is not None  # w requires grad
    assert edge_shape(emb.grad_fn, 0) == emb.shape, "_input_metadata no longer gives the output's shape"
    mul = nodes["MulBackward0"]
    assert torch.equal(saved(mul, "self"), x) and torch.equal(saved(mul, "other"), s), "MulBackward0 operands changed"
    # the grouped matmul's finder reads its operands' ranks and a transposed weight's dimensions
    experts = torch.randn(2, 4, 4, requires_grad=True)
    if hasattr(torch.nn.functional, "grouped_mm"):  # torch >= 2.10; before, the node keeps the autograd path
        grouped = _PROBES["GroupedMmBackward0"]().grad_fn
        assert len(saved(grouped, "self_sym_sizes")) == 2 and len(saved(grouped, "mat2_sym_sizes")) == 3
    t = experts.transpose(-1, -2).grad_fn
    assert t is not None and {saved(t, "dim0") - (1 << 64), saved(t, "dim1") - (1 << 64)} == {-1, -2}, (
        "TransposeBackward0 no longer keeps a negative dimension as an unsigned 64-bit integer"
    )


def check_checkpoint_peek() -> None:
    """Raise ``AssertionError`` when :func:`peek` no longer shares B's recompute of a checkpointed
    region: torch's holder, its ``handles`` or its unpack hook changed (run by the activation
    checkpointing tests)."""
    assert hasattr(checkpoint_utils, "_Holder"), "torch.utils.checkpoint._Holder is gone: update engine/graph.py"
    group = getattr(checkpoint_utils, "GraphExecGroup", None)
    assert group is not None, f"torch {torch.__version__} has no torch.utils.checkpoint.GraphExecGroup"
    calls = []
    lin = torch.nn.Linear(3, 2)

    def region(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.tanh(lin(x))

    x = torch.randn(4, 3, requires_grad=True)
    y = checkpoint_utils.checkpoint(region, x, use_reentrant=False)
    addmm = y.grad_fn.next_functions[0][0]
    assert addmm.name() == "AddmmBackward0", addmm.name()
    with group():
        operand = peek(addmm, "mat1")
        (gx,) = torch.autograd.grad(y, [x], torch.ones_like(y))
    assert len(calls) == 2, f"forward + recomputes: {len(calls)}, expected 2 (the read and B share one recompute)"
    assert torch.equal(operand, x.detach()), "the peeked operand is not the region's input"
    torch.testing.assert_close(gx, (1 - torch.tanh(lin(x)) ** 2) @ lin.weight)
    # B's way: deferred before the engine call, read by a pre-hook of the node as the engine reaches it
    y = checkpoint_utils.checkpoint(region, x, use_reentrant=False)
    addmm = y.grad_fn.next_functions[0][0]
    read: list[Any] = []
    handle = addmm.register_prehook(lambda grads: read.append(peek(addmm, "mat1")))
    with group():
        assert peek(addmm, "mat1", defer=True) is IN_REGION, "a checkpointed operand was not deferred"
        assert len(calls) == 3, "the deferred read recomputed the region"
        torch.autograd.grad(y, [x], torch.ones_like(y))
    handle.remove()
    assert len(calls) == 4, f"{len(calls) - 3} recomputes in B with the pre-hook's read, expected 1"
    assert len(read) == 1 and torch.equal(read[0], x.detach()), "the pre-hook did not read the region's input"
