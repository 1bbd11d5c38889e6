"""W by formula: a node's weight gradients from the tensors its forward saved, without autograd.

The split backward (:mod:`lightning_twobp.engine.stage`) defers each weight gradient to W. Re-entering
the autograd graph for it costs one engine call per node, a second pass to push the edge gradients into
the parameters, and the whole graph kept alive from B to W. For the layers the 2BP paper uses, W instead
calls the same ATen backward the node itself would, with only the weight outputs enabled:

=========================  =====================================================================
node                       W
=========================  =====================================================================
``MmBackward0``/``Addmm``  ``grad.T @ input`` (a Linear's weight through its ``t()``; a weight-only value, a
                           slice of a 3-D weight: its edge), ``grad.sum(0)``
``MulBackward0``           ``(grad * other)`` reduced to the operand's shape (norm scales, Mamba's ``A``)
``AddBackward0``           ``grad`` reduced to the operand's shape (a bias added by broadcast)
``ConvolutionBackward0``   ``aten.convolution_backward(..., output_mask=(False, w, b))``
``NativeBatchNormBackward0`` ``aten.native_batch_norm_backward(..., (False, w, b))``
``NativeLayerNormBackward0`` ``aten.native_layer_norm_backward(..., (False, w, b))``
``EmbeddingBackward0``     ``aten.embedding_backward`` (an embedding inside a split stage)
``GroupedMmBackward0``     ``grouped_mm(input.T, grad, offs)``, a mixture of experts' weights (transposed: ``grad.T``)
=========================  =====================================================================

These are the calls ``derivatives.yaml`` makes for the fused backward, so the values are the fused ones.
A training batch norm (and a group norm) is the exception: its scale and bias gradients are the
reductions its input gradient needs, so B's own call takes them (:func:`by_product`) and W computes
nothing for it. W over several micro-batches may join each weight's calls into one (:func:`batched`).
B's engine call skips the weight halves by itself (the weight edges are not among its targets, so each
node's output mask leaves them out). A target is a parameter (accumulated into ``.grad``) or, where the
weight reaches the parameter through weight-only ops (``-exp(A_log)``, a dtype cast), the edge into that
region; the stage pushes those through in one engine call. Every saved read goes through
:func:`lightning_twobp.engine.graph.saved`, the one door to autograd's private attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from lightning_twobp.engine.graph import IN_REGION, READS, SavedUnavailable, edge_shape, peek, saved, unreadable

__all__ = ["FastW", "batch_key", "batched", "by_product", "direct", "flags", "relabel"]

Target = Union[nn.Parameter, GradientEdge]  # noqa: UP007 (a runtime alias)
Accumulate = Callable[[nn.Parameter, torch.Tensor], None]


class FastW(NamedTuple):
    """One node's deferred weight gradients: which formula, into which targets, reading what.

    ``targets`` holds one entry per output of the formula (None where that output is not wanted);
    ``positions`` the node's ``next_functions`` it covers. A NamedTuple, not a dataclass: one is made
    per weight per micro-batch in B, where a frozen dataclass's ``__init__`` costs several times more.
    ``reads`` names the node's saved values the formula takes, read by :meth:`bind` during B in the same
    ``GraphExecGroup`` as B's engine call (:func:`~lightning_twobp.engine.graph.peek`): right before it,
    or, inside an activation-checkpointed region, as the engine reaches the node, so each region is
    recomputed once, for both, one region at a time, and W keeps only these operands of what that
    recompute made; ``static`` holds what the plan already knew (a reduction's shape)."""

    kind: str
    node: Node
    targets: tuple[Target | None, ...]
    positions: tuple[int, ...]
    reads: tuple[str, ...] = ()
    static: tuple[Any, ...] = ()

    @property
    def params(self) -> list[nn.Parameter]:
        return [t for t in self.targets if isinstance(t, nn.Parameter)]

    def bind(self, defer: bool = False) -> tuple[Any, ...] | None:
        """The formula's operands, detached (an unpacked saved input comes back attached to the
        forward graph, which would keep that graph alive until W). With ``defer``, None when one of
        them lies in a checkpointed region (read it when B's engine reaches the node)."""
        operands = []
        for r in self.reads:
            x = peek(self.node, r, defer)
            if x is IN_REGION:
                return None
            operands.append(_detach(x))
        return (*operands, *self.static)

    @torch.no_grad()
    def apply(
        self, grad: torch.Tensor, operand: tuple[Any, ...], accumulate: Accumulate
    ) -> list[tuple[GradientEdge, torch.Tensor]]:
        """Accumulate the parameter targets' gradients; return the edge targets' gradients."""
        target = self.targets[0]
        if self.kind == "mm" and isinstance(target, nn.Parameter) and target.grad is not None and _wide(target.grad):
            # grad: (N, out), input: (N, in) -> (out, in), the weight's own layout, added in place
            target.grad.addmm_(grad.t(), operand[0])
            return []
        edges = []
        for t, g in zip(self.targets, _FORMULAS[self.kind](grad, operand, self), strict=True):
            if t is None or g is None:
                continue
            if isinstance(t, nn.Parameter):
                accumulate(t, g if g.dtype == t.dtype else g.to(t.dtype))  # the engine's cast
            else:
                edges.append((t, g))
        return edges


def _wide(grad: torch.Tensor) -> bool:
    """Whether ``addmm_`` into ``grad`` rounds as the fused backward's product then AccumulateGrad's add do.
    In bf16 or fp16 it rounds once where they round twice (the product to bf16, then the sum): 1 ulp off
    the fused backward per micro-batch after the first, so a 16-bit gradient takes the product, then the add."""
    return grad.dtype in (torch.float32, torch.float64)


def _mm(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor]:
    return (torch.mm(grad.t(), operand[0]),)


def _mm_in_out(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor]:
    return (torch.mm(operand[0].t(), grad),)  # a weight stored (in, out): GPT-2's Conv1D


def _sum(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor]:
    return (grad.sum(0),)


def _mul(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor]:
    other, shape = operand
    return ((grad * other).sum_to_size(shape),)  # reduce the broadcast dimensions, as autograd does


def _add(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor]:
    (shape,) = operand
    g = grad.sum_to_size(shape)
    return (g.clone() if g is grad else g,)  # never an alias of the caller's gradient


def _conv(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor | None, ...]:
    inp, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups = operand
    mask = [False, f.targets[0] is not None, f.targets[1] is not None]
    _, gw, gb = torch.ops.aten.convolution_backward(
        grad, inp, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask
    )
    return gw, gb


def _batch_norm(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor | None, ...]:
    mask = [False, f.targets[0] is not None, f.targets[1] is not None]
    _, gw, gb = torch.ops.aten.native_batch_norm_backward(grad, *operand, mask)
    return gw, gb


def _layer_norm(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor | None, ...]:
    inp, shape, mean, rstd, weight, bias = operand
    mask = [False, f.targets[0] is not None, f.targets[1] is not None]
    _, gw, gb = torch.ops.aten.native_layer_norm_backward(grad, inp, shape, mean, rstd, weight, bias, mask)
    return gw, gb


def _embedding(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor]:
    return (torch.ops.aten.embedding_backward(grad, *operand),)


def _grouped_mm(grad: torch.Tensor, operand: tuple, f: FastW) -> tuple[torch.Tensor]:
    # tokens (S, K) sorted by expert, offs their groups' ends, grad (S, N): each expert's (K, N) is its
    # tokens' input.T @ grad, the call the node makes; a weight stored (E, N, K) and used transposed (Hugging
    # Face's experts) gets grad.T @ input, the same products in its own layout, as a Linear's weight does
    # (``_mm``), where the fused backward makes the (E, K, N) product and AccumulateGrad copies it across
    x, offs, transposed = operand
    if transposed:
        return (F.grouped_mm(grad.t(), x, offs=offs),)
    return (F.grouped_mm(x.t(), grad, offs=offs),)


_FORMULAS: dict[str, Callable[[torch.Tensor, tuple, FastW], tuple[torch.Tensor | None, ...]]] = {
    "mm": _mm,
    "mm_in_out": _mm_in_out,
    "sum": _sum,
    "mul": _mul,
    "add": _add,
    "conv": _conv,
    "batch_norm": _batch_norm,
    "layer_norm": _layer_norm,
    "embedding": _embedding,
    "grouped_mm": _grouped_mm,
}


# ---------------------------------------------------------------------------------------------- batched W
# The 2BP paper's batched W (§4): the weight GEMMs of several micro-batches as one, their gradients and
# inputs concatenated along the token (or image) dimension: one call sums over all of them, which is the
# sum of the per-micro-batch calls. Per kind, the operand positions concatenated with the gradient.
_BATCHED = {"mm": (0,), "mm_in_out": (0,), "sum": (), "conv": (0,)}
# Only a micro-batch whose gradient is at most this big is concatenated: the copy costs the bytes of the
# gradient and input once more (one weight at a time, freed before the next), and pays only where one
# call per micro-batch is dominated by its fixed cost (docs/benchmarks.md, "batched W").
BATCH_BYTES = 512 * 1024


def batch_key(f: FastW, grad: torch.Tensor, operand: tuple[Any, ...], limit: int = BATCH_BYTES) -> tuple | None:
    """What the entries of several micro-batches that :func:`batched` may join share (None: apply alone,
    as a gradient over ``limit`` bytes is)."""
    cat = _BATCHED.get(f.kind)
    if cat is None or grad.numel() * grad.element_size() > limit:
        return None
    if not all(t is None or isinstance(t, nn.Parameter) for t in f.targets):
        return None  # an edge into a weight-only region: pushed through autograd per micro-batch
    joined = tuple((operand[k].shape[1:], operand[k].dtype) for k in cat)
    rest = tuple(o for k, o in enumerate(operand) if k not in cat and not isinstance(o, torch.Tensor))
    return (f.kind, f.positions, tuple(map(id, f.targets)), grad.shape[1:], grad.dtype, joined, rest)


def batched(entries: list[tuple[FastW, torch.Tensor, tuple[Any, ...]]]) -> tuple[FastW, torch.Tensor, tuple[Any, ...]]:
    """One formula call's (formula, gradient, operands) for entries of one :func:`batch_key`: gradients
    and the joined operands concatenated along dimension 0 (a conv's weight operand gives only its shape)."""
    f, _, first = entries[0]
    cat = _BATCHED[f.kind]
    grad = torch.cat([g for _, g, _ in entries])
    operand = tuple(torch.cat([o[k] for _, _, o in entries]) if k in cat else x for k, x in enumerate(first))
    return f, grad, operand


# ---------------------------------------------------------------------------------------------- finding them
def _param(node: Node | None, params: Mapping[int, nn.Parameter]) -> nn.Parameter | None:
    var = getattr(node, "variable", None)
    return var if var is not None and id(var) in params else None


def _target(edge: tuple[Node, int] | None, params: Mapping[int, nn.Parameter]) -> Target | None:
    """A weight edge's target: its parameter, or the edge itself where weight-only ops lie between."""
    if edge is None:
        return None
    param = _param(edge[0], params)
    return GradientEdge(*edge) if param is None else param


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


# No dtype checks below: each formula is the call autograd's own node makes, and ``apply`` casts a
# parameter's gradient to its dtype as the engine does before AccumulateGrad.
def _linear(node: Node, weights: Mapping[int, tuple[Node, int]], params: Mapping[int, nn.Parameter]) -> list[FastW]:
    name = node.name()
    if name == "AddmmBackward0" and (saved(node, "alpha") != 1 or saved(node, "beta") != 1):
        return []
    mat1 = ("self",) if name == "MmBackward0" else ("mat1",)
    out = []
    mat2_pos = 1 if name == "MmBackward0" else 2
    mat2 = weights.get(mat2_pos)
    if mat2 is not None and mat2[0].name() == "TBackward0":  # nn.Linear: x @ W.t()
        ((leaf, nr),) = mat2[0].next_functions
        param = _param(leaf, params)
        if param is not None and param.dim() == 2:
            out.append(FastW("mm", node, (param,), (mat2_pos,), mat1))
        elif param is None and leaf is not None:  # W a weight-only value (an expert's slice of a 3-D weight)
            out.append(FastW("mm", node, (GradientEdge(leaf, nr),), (mat2_pos,), mat1))
    elif mat2 is not None and _param(mat2[0], params) is not None:  # x @ W, W stored (in, out)
        out.append(FastW("mm_in_out", node, (_param(mat2[0], params),), (mat2_pos,), mat1))
    bias = _param(weights[0][0], params) if name == "AddmmBackward0" and 0 in weights else None
    if bias is not None and bias.dim() == 1:
        out.append(FastW("sum", node, (bias,), (0,)))
    return out


def _elementwise(
    node: Node, weights: Mapping[int, tuple[Node, int]], params: Mapping[int, nn.Parameter]
) -> list[FastW]:
    name = node.name()
    if name == "AddBackward0" and saved(node, "alpha") != 1:
        return []
    out = []
    for pos in (0, 1):
        if pos not in weights or (1 - pos in weights and name == "MulBackward0"):
            continue  # a product of two weight-only operands: left to autograd
        target = _target(weights[pos], params)
        shape = target.shape if isinstance(target, nn.Parameter) else edge_shape(*weights[pos])
        if name == "AddBackward0":
            out.append(FastW("add", node, (target,), (pos,), (), (shape,)))
        else:
            out.append(FastW("mul", node, (target,), (pos,), ("other" if pos == 0 else "self",), (shape,)))
    return out


def _layer(kind: str) -> Callable[[Node, Mapping[int, tuple[Node, int]], Mapping[int, nn.Parameter]], list[FastW]]:
    """A conv or norm node: its weight and bias are inputs 1 and 2, both from one ATen call."""

    def find(node: Node, weights: Mapping[int, tuple[Node, int]], params: Mapping[int, nn.Parameter]) -> list[FastW]:
        targets = (_target(weights.get(1), params), _target(weights.get(2), params))
        positions = tuple(pos for pos in (1, 2) if pos in weights)
        return [FastW(kind, node, targets, positions, READS[node.name()])]

    return find


def _embedding_node(
    node: Node, weights: Mapping[int, tuple[Node, int]], params: Mapping[int, nn.Parameter]
) -> list[FastW]:
    if 0 not in weights or saved(node, "sparse"):
        return []
    return [FastW("embedding", node, (_target(weights[0], params),), (0,), READS["EmbeddingBackward0"])]


def _grouped_mm_node(
    node: Node, weights: Mapping[int, tuple[Node, int]], params: Mapping[int, nn.Parameter]
) -> list[FastW]:
    """Tokens (S, K) times a weight (E, K, N) by groups of rows (``offs``): a mixture of experts. The weight
    is the parameter, or its last two dimensions transposed (stored (E, N, K))."""
    if 1 not in weights or 0 in weights or len(saved(node, "self_sym_sizes")) != 2:
        return []
    if len(saved(node, "mat2_sym_sizes")) != 3 or not hasattr(F, "grouped_mm"):
        return []  # 2-D x 3-D takes offs: grouped by rows (another grouping has no formula here)
    edge = weights[1][0]
    param = _param(edge, params)
    if param is not None:
        return [FastW("grouped_mm", node, (param,), (1,), READS["GroupedMmBackward0"], (False,))]
    if edge.name() != "TransposeBackward0":
        return []
    ((leaf, _),) = edge.next_functions
    param = _param(leaf, params)
    dims = {_signed(saved(edge, d)) % 3 for d in ("dim0", "dim1")}
    if param is None or param.dim() != 3 or dims != {1, 2}:
        return []
    return [FastW("grouped_mm", node, (param,), (1,), READS["GroupedMmBackward0"], (True,))]


def _signed(d: int) -> int:
    """A saved dimension as given: autograd keeps a negative one as an unsigned 64-bit integer."""
    return d - (1 << 64) if d >= 1 << 63 else d


_FINDERS = {
    "MmBackward0": _linear,
    "AddmmBackward0": _linear,
    "MulBackward0": _elementwise,
    "AddBackward0": _elementwise,
    "ConvolutionBackward0": _layer("conv"),
    "NativeBatchNormBackward0": _layer("batch_norm"),
    "NativeLayerNormBackward0": _layer("layer_norm"),
    "EmbeddingBackward0": _embedding_node,
    "GroupedMmBackward0": _grouped_mm_node,
}


# Nodes whose weight gradients B's own call makes for (almost) nothing: their input gradient needs the
# per-channel reductions (sum of the gradient, of the gradient times the normalised input) that the
# scale and bias gradients are, so a W formula would compute those reductions a second time. Measured
# on ResNet-50's blocks (docs/benchmarks.md): the W half of ``native_batch_norm_backward`` cost as much as
# the whole fused call's reductions. An eval-mode batch norm uses fixed statistics (its input gradient
# needs no reduction), so its weights keep the W formula. On a GPU a training batch norm runs cuDNN's (or
# MIOpen's) kernel, whose backward makes all three gradients in one call whatever is asked (torch's
# derivatives.yaml): taken in B too (not run here: no GPU; an eval-mode one goes through autograd in W).
_BY_PRODUCT = {
    "NativeBatchNormBackward0": "training",
    "CudnnBatchNormBackward0": "training",
    "MiopenBatchNormBackward0": "training",
    "NativeGroupNormBackward0": None,
}


def by_product(node: Node) -> bool:
    """Whether B should take ``node``'s weight edges as targets of its own engine call (the values the
    node computes for its input gradient anyway; no ATen call in W)."""
    name = node.name()
    if name not in _BY_PRODUCT:
        return False
    flag = _BY_PRODUCT[name]
    return flag is None or bool(saved(node, flag))


# The saved values a plan's choices read, per node kind (a plan cached per graph shape keys on them).
_FLAGS = {
    "AddmmBackward0": ("alpha", "beta"),
    "AddBackward0": ("alpha",),
    "EmbeddingBackward0": ("sparse",),
    "NativeBatchNormBackward0": ("training",),
    "CudnnBatchNormBackward0": ("training",),
    "MiopenBatchNormBackward0": ("training",),
}


def flags(node: Node) -> tuple[Any, ...]:
    """The saved values of ``node`` that :func:`direct` and :func:`by_product` decide on."""
    try:
        if node.name() == "GroupedMmBackward0":
            return _grouped_flags(node)
        return tuple(saved(node, n) for n in _FLAGS.get(node.name(), ()))
    except SavedUnavailable as e:  # planning will say so (and take the slow path): key on the reason
        return (str(e),)


def _grouped_flags(node: Node) -> tuple[Any, ...]:
    """What :func:`_grouped_mm_node` decides on: the operands' ranks and a transposed weight's dimensions
    (the same graph may transpose other dimensions in another micro-batch)."""
    ranks = (len(saved(node, "self_sym_sizes")), len(saved(node, "mat2_sym_sizes")))
    edge = node.next_functions[1][0] if len(node.next_functions) > 1 else None
    if edge is None or edge.name() != "TransposeBackward0":
        return ranks
    return (*ranks, _signed(saved(edge, "dim0")), _signed(saved(edge, "dim1")))


def relabel(f: FastW, node: Callable[[Any], Any]) -> FastW:
    """``f`` with its node and edge targets mapped through ``node`` (a cached plan's positions to this
    micro-batch's nodes, or back). A broadcast operand's shape is read again from the new edge: a
    weight-only region may be shaped by the micro-batch (a position table cut to its length)."""
    # Every micro-batch of B relabels each formula: built directly (``_replace`` costs twice as much), and
    # a target tested by its exact class (``isinstance(t, nn.Parameter)`` runs Parameter's metaclass check).
    targets = tuple(GradientEdge(node(t.node), t.output_nr) if type(t) is GradientEdge else t for t in f.targets)
    static = f.static
    edge = targets[0]
    if f.kind in ("add", "mul") and type(edge) is GradientEdge and not isinstance(edge.node, int):
        static = (edge_shape(edge.node, edge.output_nr),)
    return FastW(f.kind, node(f.node), targets, f.positions, f.reads, static)


def direct(
    node: Node, weights: Mapping[int, tuple[Node, int]], params: Mapping[int, nn.Parameter]
) -> tuple[list[FastW], set[int]]:
    """The formulas for ``node``'s weight edges ``weights`` (position in ``next_functions`` -> edge),
    and the positions they cover; the rest go back through autograd. Raises
    :class:`~lightning_twobp.engine.graph.SavedUnavailable` when a read fails."""
    finder = _FINDERS.get(node.name())
    if finder is None:
        return [], set()
    why = unreadable(node.name())
    if why is not None:
        raise SavedUnavailable(why)
    found = finder(node, weights, params)
    return found, {pos for f in found for pos in f.positions}
