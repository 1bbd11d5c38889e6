"""The split backward on plain autograd: one stage's F, B, W and fused BW.

2BP (Rae et al., 2024, §3) splits a layer's backward into backward-p1, the gradient w.r.t. the layer
input (needed at once by the previous stage), and backward-p2, the gradient w.r.t. the weights (needed only
at the optimizer step). The Zero Bubble paper (Qi et al., 2024) calls them B and W. The 2BP paper
hand-writes both halves for every layer; here they come from the autograd graph of any ``nn.Module``.

How the split works, per micro-batch:

* **F** runs the module on detached copies of the inputs, so the stage's graph ends at its own inputs.
* **B** walks the graph once and classifies its nodes. *Input-path* nodes lead to an input that requires
  grad; *weight-only* nodes lead only to parameters. A *frontier* node is an input-path node with an edge
  into the weight-only region (e.g. ``AddmmBackward0`` of a Linear: its ``mat2`` edge leads to the
  weight). B calls the engine for the input grads only, so autograd's own masks skip every weight GEMM,
  while a pre-hook on each frontier node records the gradient flowing into it. ``retain_graph=True``
  keeps the saved tensors that W needs.
* **W by formula** for the nodes :mod:`lightning_twobp.engine.formulas` knows (Linear, conv, batch/layer
  norm, norm scales, broadcast biases, embeddings: every layer of the 2BP paper's four models): a
  pre-hook records the gradient flowing into the node during B, and W calls the same ATen backward the
  node would, weight outputs only. When every weight edge has a formula, B frees the graph at once.
* **W** otherwise re-enters the graph at the frontier: for each frontier node, one engine call from that node
  (rooted at the recorded gradient) to its weight-only edges. Autograd runs the node again with only the
  weight outputs enabled, so for a built-in node W costs the weight GEMMs and nothing of the input-grad chain;
  a Python ``autograd.Function`` cannot see that mask (its backward returns every gradient, and may change
  what it saved: Liger-Kernel's Triton kernels scale theirs in place), so its weight edges are taken in B, in
  its one run (said once: ``Stage._functions_in_b``), as are those of one whose backward writes a weight's
  ``.grad`` itself (``Stage._filled_in_b``). One further call
  pushes those edge gradients through the weight-only region (transposes, dtype casts, a weight used
  twice) into the parameters, and the graph is released.

The one shape this cannot defer is a weight-only node reached from two frontier nodes through a path
that starts at one of them and passes through the other (then re-entering at the first would recompute
the second). For a leaf parameter used directly by several ops the edges are instead taken in B
(typically a bias or a norm scale: cheap), unless a weight-only node feeds it too (then each op's own
share is deferred by its formula, see ``_fed_by_weights``). A weight-only *value* several input-path ops
use (a packed projection's bias split between query and key/value, a transpose taken once, a GRU's gates,
DoRA's magnitude) is deferred op by op too, each op's share by its formula, summed where W carries the
edges into the weights; where one of those ops has no formula, or the value also lies below an output that
reaches no input, the micro-batch's weight grads are all taken in B and W only accumulates them. All stay
exact; ``Stage.deferred_fraction`` tells how much was split.
Inside an activation-checkpointed block a frontier node, or a weight-only region that saved tensors, is
also taken in B (B's engine call, then carried into the weights in B's recompute group): W running it
again would recompute the block once more, or fail under selective checkpointing.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils import checkpoint as checkpoint_utils

from lightning_twobp.engine import formulas
from lightning_twobp.engine.graph import SavedUnavailable, in_checkpoint
from lightning_twobp.private import pytree, tensor_version

__all__ = ["Stage", "carried_leaves", "deferred_fraction"]


def carried_leaves(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``value``'s leaves through plain tuples and lists, nested (a bare nn.LSTM's ``(out, (h, c))``), and its
    structure to rebuild it: what a stage takes in and hands on, leaf by leaf. Any other container (a dict, a
    named tuple such as a PackedSequence) is one leaf, which cannot travel between stages."""
    return pytree.tree_flatten(value, is_leaf=lambda x: type(x) not in (tuple, list))


def deferred_fraction(stages: Iterable[Stage]) -> float:
    """Share of the weight-gradient edges of ``stages`` that W computed, all micro-batches so far
    (1.0: every weight backward deferred; below: some taken in B, see the module docstring, or in a fused
    BW, which counts each parameter as one edge taken)."""
    deferred = early = 0
    for st in stages:
        deferred += st.deferred_edges
        early += st.early_edges
    return 1.0 if deferred + early == 0 else deferred / (deferred + early)


def _in_place_named(module: nn.Module, inputs: list[Any], kwargs: dict[str, Any]) -> Any:
    """``module(*inputs, **kwargs)``; autograd's refusal of an in-place op on a stage's input (a leaf that
    requires grad: its gradient goes upstream) is said in the pipeline's terms, with the fix."""
    try:
        return module(*inputs, **kwargs)
    except RuntimeError as e:
        leaf = "leaf Variable that requires grad is being used in an in-place operation"
        if leaf not in str(e) or not any(_is_tensor_requiring_grad(x) for x in pytree.tree_leaves(inputs)):
            raise  # no input of the stage's can be the leaf: a parameter changed in place, torch's message says so
        raise RuntimeError(
            f"this pipeline stage, or a parameter of its, is changed in place ({e}): a stage's input is a leaf tensor "
            f"that requires grad, whose gradient goes to the stage before, and autograd refuses an in-place op on "
            f"it. Make the stage's first op out of place (inplace=False on an activation or dropout, `x = x + y` for "
            f"`x += y`), or start the stage at another layer (under strategy='twobp': balance=[...]). A layer that "
            f"is an in-place activation or dropout, or a Sequential starting with one, gets a copy of its input"
        ) from e


@dataclass(frozen=True)
class _Sent:
    """An output that was sent on and dropped (:meth:`Stage.drop_outputs`): its place in the graph and
    its metadata, without its storage."""

    edge: GradientEdge
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def _root(o: torch.Tensor | _Sent) -> torch.Tensor | GradientEdge:
    """What autograd starts from for an output: the tensor, or a dropped one's gradient edge."""
    return o.edge if isinstance(o, _Sent) else o


def _node(o: torch.Tensor | GradientEdge) -> Node | None:
    """The autograd node an output (or a dropped output's edge) starts from."""
    return o.node if isinstance(o, GradientEdge) else o.grad_fn


def _filled(o: torch.Tensor | _Sent, value: float) -> torch.Tensor:
    """A gradient for output ``o``, every element ``value``."""
    if isinstance(o, _Sent):
        return torch.full(o.shape, value, dtype=o.dtype, device=o.device)
    return torch.full_like(o, value)


@dataclass
class _Pending:
    """What one micro-batch holds between its F and its last B/W."""

    inputs: list[Any]  # the detached inputs, as the module saw them: leaf by leaf (carried_leaves)
    outputs: list[torch.Tensor | _Sent]  # tensor outputs that require grad (the graph's roots)
    out_spec: Any = None
    flat_out: list[Any] = field(default_factory=list)
    # Filled by B:
    frontier: list[tuple[Node, list[tuple[Node, int]]]] = field(default_factory=list)
    fast: list[tuple[formulas.FastW, tuple[Any, ...]]] = field(default_factory=list)  # with operands
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    edge_grads: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    weight_roots: list[tuple[torch.Tensor | GradientEdge, torch.Tensor]] = field(default_factory=list)
    backward_done: bool = False


def _is_tensor_requiring_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


class Stage:
    """One pipeline stage: forward, backward for inputs (B), backward for weights (W), fused (BW).

    ``Stage(module)`` wraps any ``nn.Module``; the same module may be wrapped once per stage. Every call
    takes the micro-batch id ``mb`` so several micro-batches can be in flight (F of mb 3 while mb 1 waits
    for its W). Tensor inputs that require grad get gradients from :meth:`backward_input` /
    :meth:`backward`; other inputs (ints, masks, token ids) pass through. Parameter gradients accumulate
    into ``.grad`` exactly as ``loss.backward()`` would.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._pending: dict[int, _Pending] = {}
        self._params: dict[int, nn.Parameter] = {}
        self.refresh_parameters()
        # Counters for the split's coverage: edges deferred to W vs taken in B.
        self.deferred_edges = 0
        self.early_edges = 0
        self._warned: set[str] = set()  # the kinds of warning given: each once per stage (_warn_once)
        self._looked = False  # the first F's graph searched for a reentrant checkpoint and foreign parameters
        self.names: dict[int, str] = {}  # id(parameter) -> its name, for messages (set by the caller)
        self._plans = _PlanCache()  # B's plan per graph shape: every micro-batch after the first reuses it
        # ids of parameters whose .grad a node's own backward wrote during B (see _filled_in_b): the nodes above
        # them are taken in B, never re-entered by W
        self._filled: frozenset[int] = frozenset()
        # W of several micro-batches joins each weight's gradients up to this many bytes per micro-batch into
        # one call (formulas.batch_key). Off by default: the joined sum rounds differently from the fused
        # backward's per-micro-batch accumulation (fp32: ~1e-7 of the gradient's largest value, not
        # bit-equal); formulas.BATCH_BYTES turns it on where the benchmark shows it pays.
        self.batch_w_bytes = 0

    # ------------------------------------------------------------------ bookkeeping
    def refresh_parameters(self) -> None:
        """Re-read the module's parameters (call after replacing or moving them)."""
        self._params = {id(p): p for p in self.module.parameters() if p.requires_grad}
        self._plans = _PlanCache()

    def follow_requires_grad(self) -> None:
        """Re-read the parameters if one's ``requires_grad`` changed since they were read (a callback that
        freezes or unfreezes layers between steps): a parameter frozen since would be waited for in B, one
        unfrozen since would get no gradient. Cheap when nothing changed (one pass over the parameters)."""
        now = [p for p in self.module.parameters() if p.requires_grad]
        if len(now) != len(self._params) or any(id(p) not in self._params for p in now):
            self.refresh_parameters()

    def discard(self) -> None:
        """Drop every micro-batch in flight (after a failed step) so the next step starts clean."""
        self._pending.clear()

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Micro-batches whose activations this stage still holds."""
        return tuple(sorted(self._pending))

    @property
    def deferred_fraction(self) -> float:
        """Share of weight-gradient edges that W computed (1.0 = the whole weight backward deferred)."""
        return deferred_fraction([self])

    # ------------------------------------------------------------------ F
    def forward(self, mb: int, *inputs: Any, **kwargs: Any) -> Any:
        """F: run the module on micro-batch ``mb``. Tensors requiring grad are detached here, inside tuples and
        lists too (:func:`carried_leaves`), so the stage's graph ends at its inputs; their gradients come back from
        B/BW, one per leaf."""
        if mb in self._pending:
            raise RuntimeError(
                f"micro-batch {mb} is already in flight on this stage; finish its backward "
                f"(and W) before running its forward again"
            )
        leaves, in_spec = carried_leaves(inputs)
        local = [x.detach().requires_grad_() if _is_tensor_requiring_grad(x) else x for x in leaves]
        args = list(pytree.tree_unflatten(local, in_spec))
        if torch.is_grad_enabled():
            out = _in_place_named(self.module, args, kwargs)
        else:  # forward-only (evaluation): nothing to hold
            return self.module(*args, **kwargs)
        flat_out, spec = pytree.tree_flatten(out)
        roots = [t for t in flat_out if _is_tensor_requiring_grad(t)]
        if not self._looked:  # the stage's first F: refuse what B cannot split before any backward runs
            self._looked = True
            order = _walk([t.grad_fn for t in roots if t.grad_fn is not None])[0]
            _refuse_reentrant(order)
            self._refuse_foreign(order, local)
        self._pending[mb] = _Pending(inputs=local, outputs=roots, out_spec=spec, flat_out=flat_out)
        return out

    def _refuse_foreign(self, order: list[Node], inputs: list[Any]) -> None:
        """A parameter in the graph that is not this stage's gets no gradient from B or W (they compute the
        stage's own): under Lightning, a penalty of another stage's weight in the loss on a rank that holds
        that stage too (ZB-V puts stages 0 and 3 on rank 0) trained silently without it (a trial: 0.003 off
        one process after 3 steps). ``names`` (id -> name) names it where the caller gave them."""
        given = {id(x) for x in inputs if isinstance(x, torch.Tensor)}
        for node in order:
            var = getattr(node, "variable", None)
            if isinstance(var, nn.Parameter) and id(var) not in self._params and id(var) not in given:
                name = self.names.get(id(var), f"a parameter of shape {tuple(var.shape)}")
                if var.is_meta:  # a weight of a layer set aside on this rank, reached directly, not through its module
                    raise RuntimeError(
                        f"{name} is used by this pipeline stage's forward, but this rank does not hold it (only its "
                        f"shape, on the meta device): the forward reached the weight directly, not through its module, "
                        f"so no placeholder stood in for it (a head tied by a reference kept outside the module tree, "
                        f"as torchtune's TiedLinear keeps `tied_module`, the embedding). Tie a head as a module of its "
                        f"own, called after the loop: `head = nn.Linear(dim, vocab, bias=False); head.weight = "
                        f"embed.weight` in place of the reference (torchtune: `model.output = head` with "
                        f"`model.tok_embeddings.weight`); tied modules on two stages are kept in sync"
                    )
                raise RuntimeError(
                    f"{name} is used in the graph of this pipeline stage, but is not one of the stage's own "
                    f"parameters: the stage's backward computes gradients of its own parameters only, so its "
                    f"gradient would be lost (under Lightning: a penalty of another stage's weight in the loss, "
                    f"which the last stage computes, or a module outside the pipelined layers called in the step). "
                    f"Add such a term's gradient in on_after_backward instead: `for p in self.layers[0].parameters(): "
                    f"p.grad.add_(c * p.sign())` for an L1 penalty (a layer of another rank has no parameters there), "
                    f"or move the module into the pipelined layers; for a weight of another stage's module read "
                    f"directly by this stage's forward (a head tied by `h @ embed.weight.T`, or torchtune's "
                    f"TiedLinear), tie the head as a module of its own: `head = nn.Linear(dim, vocab, bias=False); "
                    f"head.weight = embed.weight`, called after the loop"
                )

    def drop_outputs(self, mb: int) -> None:
        """Let go of micro-batch ``mb``'s outputs once the caller has sent them on (it holds them for
        the send): B needs each output's place in the graph and its shape, not its storage.

        Megatron-LM's ``deallocate_output_tensor`` replaces the output's ``.data`` and calls the C++
        engine past the shape check; here the stage keeps the output's :class:`GradientEdge` and
        metadata instead and B starts from the edge, so the user's tensors are never altered. The
        storage goes when its last holder lets go (the send; not where autograd saved the output
        itself, as a ReLU's, which then lives until B as before). Outputs without a ``grad_fn``
        (an input passed through, a parameter) are kept: dropping them would free nothing.
        """
        p = self._take(mb)
        sent = {
            id(t): _Sent(get_gradient_edge(t), t.shape, t.dtype, t.device)
            for t in p.outputs
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        }
        p.outputs = [sent.get(id(t), t) for t in p.outputs]
        p.flat_out = [sent.get(id(x), x if _is_tensor_requiring_grad(x) else None) for x in p.flat_out]

    # ------------------------------------------------------------------ helpers
    def _grad_outputs(self, mb: int, p: _Pending, grad_outputs: Any) -> list[torch.Tensor]:
        """Align ``grad_outputs`` with the outputs that require grad."""
        if grad_outputs is None:
            if len(p.outputs) != 1 or math.prod(p.outputs[0].shape) != 1:
                shapes = [tuple(t.shape) for t in p.outputs]
                raise ValueError(
                    f"grad_outputs=None means dL/dL = 1, which needs a single scalar output (the loss); "
                    f"micro-batch {mb} produced outputs requiring grad of shapes {shapes}: pass their grads"
                )
            return [_filled(p.outputs[0], 1.0)]
        if isinstance(grad_outputs, torch.Tensor):
            grads: list[torch.Tensor | None] = [grad_outputs]
        else:
            flat, _ = pytree.tree_flatten(grad_outputs)
            if len(flat) == len(p.flat_out):  # given for every output: keep those that require grad
                grads = [
                    g
                    for g, o in zip(flat, p.flat_out, strict=False)
                    if isinstance(o, _Sent) or _is_tensor_requiring_grad(o)
                ]
            else:
                grads = [g for g in flat if g is None or isinstance(g, torch.Tensor)]
        if len(grads) != len(p.outputs):
            raise ValueError(
                f"micro-batch {mb}: got {len(grads)} grad_outputs for {len(p.outputs)} outputs that "
                f"require grad; pass one gradient (or None) per such output, in output order"
            )
        return [_filled(o, 0.0) if g is None else g for g, o in zip(grads, p.outputs, strict=False)]

    def _input_grads(self, p: _Pending, grads: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
        """One entry per input leaf (:func:`carried_leaves`): its gradient, or None (non-tensor or no grad)."""
        it = iter(grads)
        out: list[torch.Tensor | None] = []
        for x in p.inputs:
            if _is_tensor_requiring_grad(x):
                g = next(it)
                out.append(torch.zeros_like(x) if g is None else g)
            else:
                out.append(None)
        return tuple(out)

    @staticmethod
    def _accumulate(param: nn.Parameter, grad: torch.Tensor, fresh: bool = False) -> None:
        """Add ``grad`` into ``param.grad`` as AccumulateGrad does.

        The first gradient is copied into a tensor laid out like the parameter unless ``fresh``
        says this code just made it: one from autograd may alias a caller's ``grad_outputs`` (for
        ``x + b`` with ``b`` shaped like ``x``) or be a stride-0 broadcast, and later in-place adds
        must neither write through the alias nor fail on the overlap.
        """
        if param.grad is None:
            if fresh and grad.dtype == param.dtype:
                param.grad = grad
            else:
                param.grad = torch.empty_like(param, memory_format=torch.preserve_format).copy_(grad)
        else:
            param.grad.add_(grad)

    def _full_backward(
        self,
        outputs: list[torch.Tensor | GradientEdge],
        grads_out: list,
        inputs: list[torch.Tensor],
        retain_graph: bool = False,
    ) -> tuple[torch.Tensor | None, ...]:
        """The whole backward in one autograd call: accumulate every parameter's grad and return
        the grads of ``inputs``.

        ``torch.autograd.backward`` with ``inputs=``, not ``torch.autograd.grad``: the engine's own
        AccumulateGrad then adds each weight gradient into ``.grad`` as it is produced, exactly as
        ``loss.backward()`` does. Capturing them with ``grad`` and adding afterwards costs an extra
        pass over every gradient and holds all of them at once (measured: 6% slower than torch's
        stage on a LLaMa stage's fused backward).
        """
        params = list(self._params.values())
        leaves = inputs + params
        if not leaves:
            return ()
        for x in inputs:
            x.grad = None
        # A list mixing tensors and edges (a dropped output's) is accepted; torch's hint names one kind.
        torch.autograd.backward(cast(list[torch.Tensor], outputs), grads_out, inputs=leaves, retain_graph=retain_graph)
        grads = tuple(x.grad for x in inputs)
        for x in inputs:
            x.grad = None  # the caller owns the gradient now; the detached input is dropped with the graph
        return grads

    def _take(self, mb: int) -> _Pending:
        try:
            return self._pending[mb]
        except KeyError:
            raise RuntimeError(
                f"micro-batch {mb} has no forward in flight on this stage (in flight: {self.in_flight}); "
                f"run F before B/BW, and B before W"
            ) from None

    # ------------------------------------------------------------------ BW
    def backward(self, mb: int, grad_outputs: Any = None) -> tuple[Any, ...]:
        """BW: the fused backward. Returns the input grads and accumulates the parameter grads."""
        p = self._take(mb)
        if p.backward_done:
            raise RuntimeError(f"micro-batch {mb} already ran B; run W next, not BW")
        grads_out = self._grad_outputs(mb, p, grad_outputs)
        inputs = [x for x in p.inputs if _is_tensor_requiring_grad(x)]
        del self._pending[mb]
        # a split schedule may fuse some micro-batches (schedules.fusion): their weights count as taken in B,
        # one edge per parameter (no graph walk for a count)
        self.early_edges += len(self._params)
        if not p.outputs:
            return self._input_grads(p, [None] * len(inputs))
        return self._input_grads(p, self._full_backward([_root(o) for o in p.outputs], grads_out, inputs))

    # ------------------------------------------------------------------ B
    def backward_input(self, mb: int, grad_outputs: Any = None) -> tuple[Any, ...]:
        """B (2BP's backward-p1): gradients w.r.t. the tensor inputs that require grad, computed
        without the weight GEMMs; the weight half waits for :meth:`backward_weight`."""
        p = self._take(mb)
        if p.backward_done:
            raise RuntimeError(f"micro-batch {mb} already ran B")
        grads_out = self._grad_outputs(mb, p, grad_outputs)
        inputs = [x for x in p.inputs if _is_tensor_requiring_grad(x)]
        p.backward_done = True
        if not p.outputs:
            return self._input_grads(p, [None] * len(inputs))
        roots = [_root(o) for o in p.outputs]
        plan = self._plans.plan(roots, inputs, self._params, self._filled) if inputs else None
        if plan is None or plan.fallback:
            # No input needs a gradient (a first stage fed token ids): nothing upstream waits for
            # this B and there is no input-grad half to split off; deferring would only hold the
            # activations until W. Or the graph cannot be split (see the module docstring). Either
            # way B runs the whole backward, accumulates .grad and frees the graph; W is a no-op.
            # (2BP's first stage, too, runs backward-p1 through every layer.)
            self.early_edges += 1 if plan is None else plan.num_early
            if plan is not None:
                self._fell_back(plan.why, plan.why_params)
            grads = self._input_grads(p, self._full_backward(roots, grads_out, inputs))
            # nothing is left for W: the graph and the inputs go now, not at W (a first stage held its
            # micro-batch of data until then, which the memory model does not count)
            p.outputs, p.inputs = [], []
            return grads
        self.deferred_edges += plan.num_deferred
        self.early_edges += plan.num_early
        if plan.unreadable:
            self._warn_once(
                "slow path",
                f"{len(plan.unreadable)} weight gradient(s) that have a direct formula could not read their saved "
                f"operand ({plan.unreadable[0]}), so they take the slow path: B keeps the micro-batch's whole autograd "
                f"graph (about its activation memory, M_act in twobp-plan) until W, for every micro-batch in flight.",
                stacklevel=3,
            )
        # Outputs that do not reach any input (``return y, self.scale * 2``) feed only weights:
        # their whole backward is W's, from the output itself.
        p.weight_roots = [(roots[i], grads_out[i]) for i in plan.weight_roots]

        fast_nodes = list(dict.fromkeys(f.node for f in plan.fast))
        # Usually no parameter to watch: none without a leaf, and no frontier node W re-enters (a LLaMa block)
        with _Hidden([self._params[i] for i in plan.unseen + plan.watch]) as hidden:
            grads, operands = self._input_half(p, plan, roots, inputs + plan.early_edges, grads_out, fast_nodes)
        n_early = len(inputs) + len(plan.early_edges)
        for node, g in zip(fast_nodes, grads[n_early:], strict=True):
            p.captured.setdefault(node, (g,))
        # A checkpointed node left unread is one the engine did not run: no gradient reached it, W has
        # nothing to do for it.
        p.fast = [(f, o) for f, o in zip(plan.fast, operands, strict=True) if o is not None]
        if len(p.fast) < len(plan.fast) and any(
            o is None and p.captured[f.node][0] is not None for f, o in zip(plan.fast, operands, strict=True)
        ):
            raise RuntimeError("2BP split: B's engine did not run a node whose weight gradient W needs")
        p.frontier = plan.frontier
        if not plan.frontier:
            p.outputs = []
        early = zip(plan.early_edges, grads[len(inputs) : n_early], strict=True)
        p.edge_grads = [(e, g) for e, g in early if g is not None]
        if hidden.hit:
            unseen = set(plan.unseen)
            if hidden.hit & unseen:
                self._hidden_in_b(hidden.hit & unseen)
            if hidden.hit - unseen:
                self._filled_in_b(p, hidden.hit - unseen)
        if plan.in_b_nodes and "checkpointed" not in self._warned:
            self._checkpointed_in_b(plan)
        if plan.in_b_functions and "function" not in self._warned:
            self._functions_in_b(plan)
        return self._input_grads(p, grads[: len(inputs)])

    def _input_half(
        self,
        p: _Pending,
        plan: _Plan,
        roots: list[torch.Tensor | GradientEdge],
        targets: list[torch.Tensor | GradientEdge],
        grads_out: list[torch.Tensor],
        fast_nodes: list[Node],
    ) -> tuple[tuple[torch.Tensor | None, ...], list[tuple[Any, ...] | None]]:
        """B's engine call: the gradients of ``targets``, then of each formula node's input (captured
        by the engine itself: an edge among the targets, no Python call per node); and the formulas'
        operands, read before the call frees the graph. A frontier node needs every output's gradient:
        a pre-hook records them.

        An operand inside an activation-checkpointed region is read by a pre-hook on its node when the
        engine reaches it, after the region's one recompute, so B holds one recomputed region at a
        time, as a plain backward (read before the call, each read would recompute its region and all
        of them would be held at once); the rest are read at once, at no per-node cost. The plan's ``in_b``
        edges (checkpointed weight-only regions) are taken by the same call and carried into the weights
        in the same recompute group; their gradients are not returned."""
        operands = [f.bind(defer=True) for f in plan.fast]
        hooks = [node.register_prehook(_Recorder(p.captured, node)) for node, _ in plan.frontier]
        if None in operands:  # some lie in a checkpointed region: read as the engine reaches their node
            later: dict[Node, _Binder] = {}
            for k, (f, o) in enumerate(zip(plan.fast, operands, strict=True)):
                if o is None:
                    later.setdefault(f.node, _Binder(operands, [])).entries.append((k, f))
            hooks += [node.register_prehook(b) for node, b in later.items()]
        try:
            with _one_recompute():
                grads = torch.autograd.grad(
                    cast(list[torch.Tensor], roots),  # tensors and edges, as in _full_backward
                    cast(list[torch.Tensor], targets + plan.in_b + [GradientEdge(n, 0) for n in fast_nodes]),
                    grads_out,
                    allow_unused=True,
                    # W re-enters the graph only at frontier nodes without a direct formula. When every
                    # weight grad has one, the graph goes now and a micro-batch keeps only the saved
                    # operands and recorded grads those formulas need. (``in_b`` regions are pushed below.)
                    retain_graph=plan.keep_graph,
                )
                taken = grads[len(targets) : len(targets) + len(plan.in_b)]
                # A Function's weight-only region kept: W's own push may pass through the same nodes (a weight made
                # once, read by a Function and by a Linear whose W formula carries its share through them)
                pushed = [(e, g) for e, g in zip(plan.in_b, taken, strict=True) if g is not None]
                self._push_to_params(pushed, retain=bool(plan.in_b_functions))
        finally:
            for h in hooks:
                h.remove()
        return grads[: len(targets)] + grads[len(targets) + len(plan.in_b) :], operands

    def _warn_once(self, kind: str, message: str, stacklevel: int = 4) -> None:
        """A RuntimeWarning about this stage's split, the first time only for each ``kind``; ``stacklevel``
        points it at the caller of ``backward_input`` (4: through one method of B's in between)."""
        if kind in self._warned:
            return
        self._warned.add(kind)
        warnings.warn(
            f"2BP split of {type(self.module).__name__}: {message} Warned once per stage.",
            RuntimeWarning,
            stacklevel=stacklevel,
        )

    def _fell_back(self, why: str, params: tuple[int, ...] = ()) -> None:
        """Say once per stage that a micro-batch's weights were all taken in B: a split that runs fused."""
        names = [self.names.get(id(q), n) for n, q in self.module.named_parameters() if id(q) in params]
        if names:  # the parameters that value is made from (peft's DoRA: lora_magnitude_vector...)
            why += f", made from {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        self._warn_once(
            "fallback",
            f"a micro-batch's weight gradients were all taken in B, none deferred to W ({why}). Exact, but B runs "
            f"the whole backward and W has nothing to do, so the split gains nothing on this stage (deferred_fraction "
            f"counts them as taken in B). To defer them, compute that value where each op uses it, from the "
            f"parameter; or train this model with a fused schedule (split_backward=False).",
        )

    def _hidden_in_b(self, hit: set[int]) -> None:
        """Count parameters that B's engine call filled from inside a node as taken in B, and say so once."""
        self.early_edges += len(hit)
        first = next(self.names.get(id(q), n) for n, q in self.module.named_parameters() if id(q) in hit)
        self._warn_once(
            "hidden",
            f"{len(hit)} parameter(s) ({first} first) got their gradients in B from inside a node of the graph, not "
            f"through an edge the split can defer: a custom autograd.Function whose backward runs its own backward "
            f"(Hugging Face Reformer's reversible layers). Their weight backward runs in B: exact, but not deferred "
            f"to W; deferred_fraction counts them as taken in B.",
        )

    def _filled_in_b(self, p: _Pending, hit: set[int]) -> None:
        """Parameters below a frontier node whose ``.grad`` changed during B although B was not to compute them: the
        node's own backward wrote it (a custom autograd.Function that accumulates its weight's gradient itself and
        returns None for it, as fused weight-gradient-accumulation Linears do). W re-entering that node would run
        that backward again and add the gradient a second time. This micro-batch's re-entry runs now, with those
        ``.grad`` kept as B left them (one copy each, once: a micro-batch planned before it was seen); from the next
        micro-batch on the plan takes such a node's weight edges in B (:func:`_plan`'s ``filled``), so its backward
        runs once. Exact; counted as taken in B, and said once."""
        self._filled = self._filled | hit
        self._plans = _PlanCache()  # re-plan with those nodes taken in B
        protect = [self._params[i] for i in hit]
        keep: list[tuple[Node, list[tuple[Node, int]]]] = []
        nodes: list[str] = []
        for node, edges in p.frontier:
            if not {id(q) for q in _params_below([n for n, _ in edges], self._params)} & hit:
                keep.append((node, edges))
                continue
            nodes.append(node.name())
            self.deferred_edges -= len(edges)
            self.early_edges += len(edges)
            p.edge_grads.extend(self._reenter(p, node, edges, protect))
        p.frontier = keep
        if not keep:
            p.outputs = []
        first = next(self.names.get(id(q), n) for n, q in self.module.named_parameters() if id(q) in hit)
        self._warn_once(
            "filled",
            f"the backward of {', '.join(dict.fromkeys(nodes)) or 'a node'} wrote the .grad of {len(hit)} parameter(s) "
            f"({first} first) itself during B, where B computes input gradients only (a custom autograd.Function that "
            f"accumulates a weight's gradient inside its backward and returns None for it, as fused "
            f"weight-gradient-accumulation Linears do). W re-entering that node for its weight edges would run that "
            f"backward again and add the gradient twice, so its weight gradients are taken in B instead: exact, but "
            f"not deferred to W (deferred_fraction counts them as taken in B). To defer them, return the weight's "
            f"gradient from backward instead of writing .grad; or train this model with split_backward=False.",
        )

    def _named(self, ids: Iterable[int]) -> str:
        """`` (first.name and N more)`` for the stage's parameters among ``ids``, or "" where none is."""
        wanted = set(ids)
        names = [self.names.get(id(q), n) for n, q in self.module.named_parameters() if id(q) in wanted]
        return f" ({names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") + ")" if names else ""

    def _checkpointed_in_b(self, plan: _Plan) -> None:
        """Say once that an activation-checkpointed node without a W formula had its weight gradients taken in B."""
        made = self._named(plan.in_b_params)
        self._warn_once(
            "checkpointed",
            f"in an activation-checkpointed block, {', '.join(plan.in_b_nodes)} has no W formula, so the weight "
            f"gradients it leads to{made} are taken in B, in the block's one recompute: W re-entering the node would "
            f"recompute the block once more (or fail under selective checkpointing). Exact, but not deferred to W "
            f"(deferred_fraction counts them as taken in B). To defer them, run that op outside the checkpointed "
            f"block, or use ops with a W formula there (docs/guide.md, 'How it works'); or train this model with "
            f"split_backward=False.",
        )

    def _functions_in_b(self, plan: _Plan) -> None:
        """Say once that a Python ``autograd.Function``'s weight gradients were taken in B (see ``_Split.add``)."""
        made = self._named(plan.function_params)
        self._warn_once(
            "function",
            f"{', '.join(plan.in_b_functions)} is a Python autograd.Function (a custom Function, a Triton kernel's "
            f"wrapper such as Liger-Kernel's, flex_attention with a parameter in score_mod, torchao's float8 matmul): "
            f"its backward returns every gradient at once and may change what it saved, so W cannot run it again for "
            f"the weights alone. The weight gradients it leads to{made} are taken in B, in its one run: exact, but not "
            f"deferred to W (deferred_fraction counts them as taken in B). To defer them, compute those weights "
            f"with ops that have a W formula (docs/guide.md, 'How it works'); or train this model with "
            f"split_backward=False.",
        )

    # ------------------------------------------------------------------ W
    def backward_weight(self, mb: int | Iterable[int]) -> None:
        """W (2BP's backward-p2): the parameter gradients of one or several micro-batches, accumulated
        into ``.grad``; frees everything those micro-batches held."""
        mbs = [mb] if isinstance(mb, int) else list(mb)
        if len(set(mbs)) != len(mbs):
            raise ValueError(f"W got micro-batch ids {mbs} with repeats; name each micro-batch once")
        pend = []
        for m in mbs:
            p = self._take(m)
            if not p.backward_done:
                raise RuntimeError(f"micro-batch {m} has not run B yet; W needs B first")
            pend.append(p)
        edge_grads: list[tuple[GradientEdge, torch.Tensor]] = []
        for p in pend:
            if p.weight_roots:
                # kept for the push below: a weight-only node the input path's share also goes through
                # (freed here, the push failed with "backward through the graph a second time")
                self._full_backward([t for t, _ in p.weight_roots], [g for _, g in p.weight_roots], [], True)
            edge_grads.extend(p.edge_grads)
        edge_grads.extend(self._apply_formulas(pend))
        for p in pend:
            for node, edges in p.frontier:
                edge_grads.extend(self._reenter(p, node, edges))
        self._push_to_params(edge_grads)
        for m in mbs:
            del self._pending[m]

    @staticmethod
    def _reenter(
        p: _Pending, node: Node, edges: list[tuple[Node, int]], protect: Sequence[nn.Parameter] = ()
    ) -> list[tuple[GradientEdge, torch.Tensor]]:
        """W at a frontier node: one engine call rooted at the gradient B recorded there, for its weight edges only;
        their gradients, to push into the parameters. ``protect``: parameters whose ``.grad`` the node's backward
        writes itself (see :meth:`Stage._filled_in_b`), put back as they were."""
        recorded = p.captured.get(node)
        if recorded is None:
            return []
        roots = [(GradientEdge(node, i), g) for i, g in enumerate(recorded) if g is not None]
        if not roots:
            return []
        targets = [GradientEdge(n, i) for n, i in edges]
        kept = [(q, q.grad, None if q.grad is None else q.grad.clone()) for q in protect]
        try:
            got = torch.autograd.grad(
                [r for r, _ in roots],
                targets,
                [g for _, g in roots],
                allow_unused=True,
                retain_graph=False,  # this node's saved tensors are not needed again
            )
        finally:
            for q, grad, value in kept:
                q.grad = grad
                if grad is not None and value is not None:
                    grad.copy_(value)
        return [(e, g) for e, g in zip(targets, got, strict=False) if g is not None]

    def _apply_formulas(self, pend: list[_Pending]) -> list[tuple[GradientEdge, torch.Tensor]]:
        """Every formula of ``pend``'s micro-batches; a weight's small micro-batches joined into one call
        (:func:`formulas.batched`). Returns the gradients of edge targets, to push through autograd."""
        edge_grads: list[tuple[GradientEdge, torch.Tensor]] = []
        groups: dict[tuple, list[tuple[formulas.FastW, torch.Tensor, tuple[Any, ...]]]] = {}
        for p in pend:
            for f, operand in p.fast:
                recorded = p.captured.get(f.node)
                if recorded is None or recorded[0] is None:
                    continue
                key = formulas.batch_key(f, recorded[0], operand, self.batch_w_bytes) if len(pend) > 1 else None
                if key is None:
                    edge_grads.extend(f.apply(recorded[0], operand, self._accumulate_fresh))
                else:
                    groups.setdefault(key, []).append((f, recorded[0], operand))
        for entries in groups.values():
            f, grad, operand = entries[0] if len(entries) == 1 else formulas.batched(entries)
            edge_grads.extend(f.apply(grad, operand, self._accumulate_fresh))
        return edge_grads

    @classmethod
    def _accumulate_fresh(cls, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Accumulate a gradient a W formula just made (never an alias of the caller's tensors)."""
        cls._accumulate(param, grad, fresh=grad.stride() == param.stride())

    def _push_to_params(self, edge_grads: list[tuple[GradientEdge, torch.Tensor]], retain: bool = False) -> None:
        """Carry weight-edge gradients through the weight-only region into the parameters (``retain``: keep that
        region's saved tensors for a later push through it)."""
        through: list[tuple[GradientEdge, torch.Tensor]] = []
        for e, g in edge_grads:
            var = getattr(e.node, "variable", None)
            if var is not None and id(var) in self._params:  # the edge is the parameter itself
                self._accumulate(var, g)
            else:
                through.append((e, g))
        if not through:
            return
        params = _params_below([e.node for e, _ in through], self._params)
        if not params:
            return
        grads = torch.autograd.grad(
            [e for e, _ in through], params, [g for _, g in through], allow_unused=True, retain_graph=retain
        )
        for q, g in zip(params, grads, strict=False):
            if g is not None:
                self._accumulate(q, g)


class _Hidden:
    """Finds the watched parameters whose ``.grad`` changed during B (a new tensor, or the same one written in
    place: its ``_version``), where B computes no parameter's gradient: a custom ``autograd.Function`` filled
    it from inside its own backward. Watched are the parameters without a leaf in B's graph (Reformer's
    reversible layers recompute theirs and call ``torch.autograd.backward`` inside the Function's backward, or
    assign ``.grad``), and those below a frontier node W re-enters (a Function that accumulates its weight's
    ``.grad`` itself and returns None for it). Usually none. No hook: a direct ``.grad`` write fires none."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.hit: set[int] = set()  # ids of the parameters filled
        self.before: list[tuple[torch.Tensor | None, int]] = []

    def __enter__(self) -> _Hidden:
        self.before = [(q.grad, -1 if q.grad is None else tensor_version(q.grad)) for q in self.params]
        return self

    def __exit__(self, *exc: object) -> None:
        for q, (grad, version) in zip(self.params, self.before, strict=True):
            if q.grad is not grad or (grad is not None and tensor_version(grad) != version):
                self.hit.add(id(q))
        self.before = []


class _Recorder:
    """Pre-hook that records the gradient flowing into a frontier node during B."""

    __slots__ = ("store", "node")

    def __init__(self, store: dict, node: Node) -> None:
        self.store = store
        self.node = node

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        self.store[self.node] = tuple(grad_outputs)


class _Binder:
    """Pre-hook that reads a node's formulas' operands when B's engine reaches it (see
    :meth:`Stage._input_half`): ``entries`` are (index into ``operands``, formula)."""

    __slots__ = ("operands", "entries")

    def __init__(self, operands: list[tuple[Any, ...] | None], entries: list[tuple[int, formulas.FastW]]) -> None:
        self.operands = operands
        self.entries = entries

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        for k, f in self.entries:
            self.operands[k] = f.bind()


@contextlib.contextmanager
def _one_recompute() -> Iterator[None]:
    """One recompute of each ``torch.utils.checkpoint(use_reentrant=False)`` region for all of B: W's
    operand reads (:func:`~lightning_twobp.engine.graph.peek`, which does not use up a checkpointed
    tensor's one unpack) and B's engine call, inside one ``GraphExecGroup``. Without it each would
    recompute the region (3 forwards per block per micro-batch, against 2 in a plain backward)."""
    group = getattr(checkpoint_utils, "GraphExecGroup", None)
    with contextlib.ExitStack() as stack:
        try:
            if group is not None:  # an older torch has none: each read recomputes (exact, only slower)
                stack.enter_context(group())
        except RuntimeError as e:
            if "cannot be nested" not in str(e):
                raise  # else the caller's own group: its recompute is shared already
        yield


@dataclass
class _Plan:
    frontier: list[tuple[Node, list[tuple[Node, int]]]]  # (frontier node, its deferred weight edges)
    fast: list[formulas.FastW]  # deferred weight grads W computes without autograd
    early_edges: list[GradientEdge]  # weight edges taken in B
    weight_roots: list[int]  # outputs that reach parameters but no input
    fallback: bool
    num_deferred: int
    num_early: int
    unreadable: list[str] = field(default_factory=list)  # fast-path reads that failed (see engine.graph)
    in_b: list[GradientEdge] = field(default_factory=list)  # taken and carried into the parameters in B
    unseen: tuple[int, ...] = ()  # ids of the stage's parameters with no leaf in this graph (see _Hidden)
    why: str = ""  # why the fallback (see Stage._fell_back)
    why_params: tuple[int, ...] = ()  # ids of the parameters that value is made from, to name them
    watch: tuple[int, ...] = ()  # ids of the parameters below the frontier nodes W re-enters (see _Hidden)
    in_b_nodes: tuple[str, ...] = ()  # checkpointed nodes without a formula, taken in B (Stage._checkpointed_in_b)
    in_b_params: tuple[int, ...] = ()  # ids of the parameters they lead to
    in_b_functions: tuple[str, ...] = ()  # Python Functions whose weights are taken in B (Stage._functions_in_b)
    function_params: tuple[int, ...] = ()  # ids of the parameters they lead to
    keep_graph: bool = True  # B's engine call retains the graph's saved tensors (see _keep_graph)


_REENTRANT = (
    "2BP split: this stage calls torch.utils.checkpoint with use_reentrant=True, whose backward runs the "
    "block's whole backward (weights included) inside one opaque node, so B cannot leave the weight "
    "gradients to W. Pass use_reentrant=False: the same gradients, and the split recomputes the block once, "
    "in B, where W keeps the weight GEMMs' inputs of that recompute. (A Hugging Face model's "
    "gradient_checkpointing_enable() needs no change under TwoBPStrategy, which runs it non-reentrant; with "
    "the bare engine pass gradient_checkpointing_kwargs={'use_reentrant': False}.)"
)

_COMPILED = (
    "2BP split: a torch.compile'd region of this stage holds weights. Its backward is one node that returns "
    "the input and the weight gradients together, so B cannot leave the weights to W. Run the layers with "
    "weights eagerly (remove that torch.compile call), or compile only parts that hold no weights."
)


def _leaf_param(node: Node, params: dict[int, nn.Parameter]) -> nn.Parameter | None:
    var = getattr(node, "variable", None)
    return var if var is not None and id(var) in params else None


def _plan(
    outputs: Sequence[torch.Tensor | GradientEdge],
    inputs: Sequence[torch.Tensor],
    params: dict[int, nn.Parameter],
    walked: tuple[list[Node], dict[Node, list[tuple[Node, int]]]] | None = None,
    read: list[Node] | None = None,
    filled: frozenset[int] = frozenset(),
) -> _Plan:
    """Classify the graph below ``outputs`` (tensors, or a dropped output's edge): input path,
    weight-only region, frontier edges. ``read``, when given, receives the nodes whose saved flags the
    choices read (see :class:`_PlanCache`). ``filled``: ids of parameters whose ``.grad`` a node's own
    backward writes; the nodes above them are taken in B."""
    nodes = [_node(o) for o in outputs]
    order, children = walked or _walk([n for n in nodes if n is not None])
    _refuse_reentrant(order)
    reach = _reach(order, children, {id(x) for x in inputs}, params)
    split = _Split(
        reach,
        _sources(order, children, reach, [n for n in nodes if n is not None and not reach.to_input[n]]),
        params,
        _used_outputs(children),
        [] if read is None else read,
        _fed_by_weights(order, children, reach),
        filled=filled,
    )
    for node in reversed(order):  # parents first: the order B reaches them
        if reach.to_input[node] and getattr(node, "variable", None) is None:
            split.add(node)
    split.check_b_targets()
    to_input, to_param = reach.to_input, reach.to_param
    weight_roots = [
        i
        for i, (o, n) in enumerate(zip(outputs, nodes, strict=True))
        if (n is None and id(o) in params) or (n is not None and not to_input[n] and to_param[n])
    ]
    if split.fallback:
        num_early = split.num_deferred + len(split.early) + len(split.in_b)
        return _Plan([], [], [], [], True, 0, num_early, split.unreadable, why=split.why, why_params=split.why_params)
    # B checks that no node's own backward writes the .grad of a parameter below a frontier node W re-enters
    # (_Hidden): W would write it again. Those carried into the parameters in B itself are not watched.
    pushed = {id(q) for q in _params_below([e.node for e in split.in_b], params)}
    watch = _params_below([n for _, edges in split.frontier for n, _ in edges], params)
    return _Plan(
        split.frontier,
        split.fast,
        split.early + split.free,
        weight_roots,
        False,
        split.num_deferred,
        len(split.early) + len(split.in_b),
        split.unreadable,
        split.in_b,
        tuple(params.keys() - {id(getattr(n, "variable", None)) for n in order}),
        watch=tuple(id(q) for q in watch if id(q) not in pushed),
        in_b_nodes=tuple(dict.fromkeys(n.name() for n, _ in split.checkpointed)),
        in_b_params=tuple(id(q) for q in _params_below([m for _, ms in split.checkpointed for m in ms], params)),
        in_b_functions=tuple(dict.fromkeys(n.name() for n, _ in split.functions)),
        function_params=tuple(id(q) for q in _params_below([e.node for _, es in split.functions for e in es], params)),
        keep_graph=_keep_graph(split),
    )


def _keep_graph(split: _Split) -> bool:
    """Whether B's engine call must retain the graph's saved tensors: for W's re-entry at the frontier, and for the
    push of ``in_b`` edges taken in a checkpointed block or from a node that writes ``.grad`` (pushed within B's
    recompute group). A Python Function's edges need it only where B's call runs a node of the weight-only region
    below one of them (another of its targets lies there), which frees it before B pushes through it; otherwise B
    frees the graph at once and the micro-batch keeps only the formulas' operands until W, as without them."""
    theirs = [e for _, edges in split.functions for e in edges]
    if split.frontier or len(split.in_b) > len(theirs):
        return True
    targets = {e.node for e in split.early + split.free + split.in_b}
    return any(_below([e.node]) & targets for e in theirs)


class _PlanCache:
    """:func:`_plan` once per graph shape. Every micro-batch of a stage builds the same graph (new node
    objects, same structure), and planning it classifies every node in Python: measured 0.1 ms on a
    ResNet-50 block and 0.9 ms on a Mamba block (5-15% of its fused backward). The key is the graph's
    structure (:func:`_structure`: each node's kind and edges, each leaf's identity: a parameter, the
    k-th input, another tensor), so a micro-batch routed through other weights gets its own plan; the
    saved flags the formulas decided on (``formulas.flags``) are checked on each reuse, for the few nodes
    with weight edges. A cached plan holds the nodes' numbers in that walk, never nodes (a node would keep
    its micro-batch's graph alive). The key's walk is all a reuse costs: 0.05 ms on a LLaMa block's 84
    nodes, measured alone."""

    LIMIT = 8  # graph shapes kept per stage (a stage that sees more re-plans the oldest)

    def __init__(self) -> None:
        self._plans: dict[tuple, tuple[_Plan, list[tuple[int, tuple]]]] = {}

    def plan(
        self,
        outputs: Sequence[torch.Tensor | GradientEdge],
        inputs: Sequence[torch.Tensor],
        params: dict[int, nn.Parameter],
        filled: frozenset[int] = frozenset(),
    ) -> _Plan:
        nodes = [_node(o) for o in outputs]
        roots = [n for n in nodes if n is not None]
        met, key = _structure(roots, {id(x): k for k, x in enumerate(inputs)}, params)
        # Which outputs are graph roots, parameters or other leaves, in order: the plan's weight roots
        # are output positions, and an output passed through (an input) may move between micro-batches.
        out_kinds = tuple(None if n is not None else id(o) in params for o, n in zip(outputs, nodes, strict=True))
        key = (out_kinds, key)
        cached = self._plans.get(key)
        if cached is not None and all(formulas.flags(met[k]) == v for k, v in cached[1]):
            return _relabel(cached[0], met.__getitem__)
        read: list[Node] = []
        plan = _plan(outputs, inputs, params, _walk(roots), read, filled)
        index = {n: k for k, n in enumerate(met)}
        if len(self._plans) >= self.LIMIT:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = (_relabel(plan, index.__getitem__), [(index[n], formulas.flags(n)) for n in read])
        return plan


def _relabel(plan: _Plan, node: Callable[[Any], Any]) -> _Plan:
    """``plan`` with every node ``n`` replaced by ``node(n)`` (a node by its walk position, or back)."""
    return replace(
        plan,
        frontier=[(node(n), [(node(m), i) for m, i in edges]) for n, edges in plan.frontier],
        fast=[formulas.relabel(f, node) for f in plan.fast],
        early_edges=[GradientEdge(node(e.node), e.output_nr) for e in plan.early_edges],
        in_b=[GradientEdge(node(e.node), e.output_nr) for e in plan.in_b],
    )


def _walk(roots: list[Node]) -> tuple[list[Node], dict[Node, list[tuple[Node, int]]]]:
    """Every node below ``roots`` in post-order (children before parents), and each node's children."""
    order: list[Node] = []
    children: dict[Node, list[tuple[Node, int]]] = {}
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:  # iterative: a deep model's graph would overflow Python's recursion limit
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        kids = [(n, i) for n, i in node.next_functions if n is not None]
        children[node] = kids
        stack.append((node, True))
        stack.extend((n, False) for n, _ in kids if n not in children)
    return order, children


def _structure(
    roots: list[Node], input_pos: dict[int, int], params: dict[int, nn.Parameter]
) -> tuple[list[Node], tuple]:
    """Every node below ``roots``, numbered in the order a breadth-first walk first meets it, and the
    graph's structure in those numbers (each node's kind and edges, each leaf's identity: a parameter,
    the k-th input, another tensor): the key of :class:`_PlanCache`, the same for the same structure.

    Every micro-batch pays for this walk, so it does only that, into one flat tuple: a node's kind (never
    an int), then its edges' (number, output) ints, or a leaf's identity. The kind is the node's Python
    type, one per kind of node (a class per C++ node kind, the Function's own class for a custom
    Function), a fifth of ``node.name()``'s cost; torch gives a C++ node kind it has not registered one
    shared ``CppFunction`` type, so that one is named. Most of the walk's time is torch making each node's
    Python object on first touch: 64 of 100 us on a LLaMa block's 85 fresh nodes, measured."""
    number: dict[Node, int] = {}
    met: list[Node] = []
    for r in roots:
        if r not in number:
            number[r] = len(met)
            met.append(r)
    key: list[Any] = [tuple(number[r] for r in roots)]
    add = key.append
    for node in met:  # grows as the walk meets new nodes: breadth-first
        kind = type(node)
        add(node.name() if kind.__name__ == "CppFunction" else kind)
        nexts = node.next_functions
        if not nexts:  # a leaf: which tensor it accumulates into decides the plan
            var = getattr(node, "variable", None)
            ident = -1 if var is None else id(var)
            add(("p", ident) if ident in params else ("i", input_pos.get(ident, ident)))
            continue
        for n, i in nexts:
            if n is None:
                j = -1
            else:
                j = number.get(n, -2)
                if j == -2:
                    j = number[n] = len(met)
                    met.append(n)
            add(j)
            add(i)
    return met, tuple(key)


def _refuse_reentrant(order: list[Node]) -> None:
    for node in order:
        if node.name() == "CheckpointFunctionBackward":
            raise RuntimeError(_REENTRANT)


def _used_outputs(children: dict[Node, list[tuple[Node, int]]]) -> set[tuple[Node, int]]:
    """(node, output index) pairs some node takes a gradient from, beyond each node's first output."""
    return {(n, i) for kids in children.values() for n, i in kids if i}


@dataclass
class _Reach:
    """Per node: does it lead to an input that requires grad, to a parameter."""

    to_input: dict[Node, bool]
    to_param: dict[Node, bool]


def _reach(
    order: list[Node],
    children: dict[Node, list[tuple[Node, int]]],
    input_ids: set[int],
    params: dict[int, nn.Parameter],
) -> _Reach:
    to_input: dict[Node, bool] = {}
    to_param: dict[Node, bool] = {}
    for node in order:  # children first: a node's answer is known from its children's
        var = getattr(node, "variable", None)
        if var is not None:
            to_input[node] = id(var) in input_ids
            to_param[node] = id(var) in params
            continue
        kids = children[node]
        to_input[node] = any(to_input[n] for n, _ in kids)
        to_param[node] = any(to_param[n] for n, _ in kids)
    return _Reach(to_input, to_param)


def _sources(
    order: list[Node], children: dict[Node, list[tuple[Node, int]]], reach: _Reach, weight_roots: list[Node]
) -> dict[Node, set[Node]]:
    """Weight-only entry nodes and the input-path nodes that feed them, directly or through
    weight-only nodes (walked parents-first so a node's sources are known before its children).
    An output that reaches no input (its node among ``weight_roots``) is a source of its own: W runs its
    whole backward in one call, so a weight-only node it shares with the input path is shared."""
    to_input, to_param = reach.to_input, reach.to_param
    sources: dict[Node, set[Node]] = {r: {r} for r in weight_roots}
    for node in reversed(order):
        if not to_input[node]:
            continue
        for n, _ in children[node]:
            if not to_input[n] and to_param[n]:
                sources.setdefault(n, set()).add(node)
    for node in reversed(order):
        if to_input[node] or not to_param[node] or node not in sources:
            continue
        for n, _ in children[node]:
            if to_param[n]:
                sources.setdefault(n, set()).update(sources[node])
    return sources


@dataclass
class _Split:
    """The plan's choices, one input-path node at a time: each weight edge deferred to W (by formula
    or through the frontier), taken in B, or the whole micro-batch's weights taken in B (fallback)."""

    reach: _Reach
    sources: dict[Node, set[Node]]
    params: dict[int, nn.Parameter]
    used_outputs: set[tuple[Node, int]]
    read: list[Node]  # nodes with weight edges: their saved flags decided (formulas.flags)
    mixed: set[Node]  # parameters' leaves also fed by a weight-only node (see _fed_by_weights)
    shared: set[Node] = field(default_factory=set)  # weight-only values several input-path ops use directly
    frontier: list[tuple[Node, list[tuple[Node, int]]]] = field(default_factory=list)
    fast: list[formulas.FastW] = field(default_factory=list)
    early: list[GradientEdge] = field(default_factory=list)
    early_seen: set[tuple[Node, int]] = field(default_factory=set)
    free: list[GradientEdge] = field(default_factory=list)  # taken in B at no cost: see formulas.by_product
    in_b: list[GradientEdge] = field(default_factory=list)  # checkpointed: taken and carried to the weights in B
    num_deferred: int = 0
    fallback: bool = False
    why: str = ""  # the first reason for the fallback, for its warning
    why_params: tuple[int, ...] = ()  # ids of the parameters below the shared value of ``why``
    unreadable: list[str] = field(default_factory=list)
    filled: frozenset[int] = frozenset()  # parameters a node's own backward writes (Stage._filled_in_b)
    # checkpointed nodes without a formula whose weight edges are taken in B, with those edges' nodes
    checkpointed: list[tuple[Node, list[Node]]] = field(default_factory=list)
    # Python autograd.Functions whose weight edges are taken in B (in ``in_b`` too), with those edges
    functions: list[tuple[Node, list[GradientEdge]]] = field(default_factory=list)

    def add(self, node: Node) -> None:
        single = self._weight_edges(node)
        if (single or self.early_seen) and node.name() == "CompiledFunctionBackward":
            raise RuntimeError(_COMPILED)
        if single:
            self.read.append(node)
        if single and formulas.by_product(node):
            # A training batch norm: B's call makes these from the reductions its input gradient needs.
            edges = list(single.values())
            if self._take_all_in_b(edges) or self._shared_unsplit(edges, edges, ", one a batch norm's, taken in B"):
                return
            self.free.extend(GradientEdge(*e) for e in single.values())
            return
        # A weight-only region that saved tensors inside an activation-checkpointed block can be run once
        # per recompute: its edge is taken in B's engine call and carried into the weights in B's group
        # (see graph.in_checkpoint). Cheap where it happens: a PReLU slope, Mamba's -exp(A_log).
        checkpointed = [pos for pos, (n, _) in single.items() if _region_checkpointed(n)]
        in_region = [single[pos] for pos in checkpointed]
        if self._shared_unsplit(in_region, list(single.values()), ", one in a checkpointed region, taken in B"):
            return
        for pos in checkpointed:
            self.in_b.append(GradientEdge(*single.pop(pos)))
        try:
            # A node whose second or third output feeds on (``native_batch_norm``'s saved mean) gets
            # a gradient there that the formulas do not take: leave it to autograd.
            whole = single and not any((node, k) in self.used_outputs for k in (1, 2))
            direct, covered = formulas.direct(node, single, self.params) if whole else ([], set())
        except SavedUnavailable as e:
            direct, covered = [], set()
            self.unreadable.append(str(e))
        self.fast.extend(direct)
        self.num_deferred += len(covered)
        deferred = [e for pos, e in single.items() if pos not in covered]
        if self._take_all_in_b(deferred) or self._shared_unsplit(
            deferred, deferred, ", one of them without a W formula"
        ):
            return
        if deferred and in_checkpoint(node):  # W would run this node again: B runs it once, for both halves
            self.in_b.extend(GradientEdge(*e) for e in deferred)
            self.checkpointed.append((node, [n for n, _ in deferred]))
            deferred = []
        if (
            deferred
            and self.filled
            and {id(q) for q in _params_below([n for n, _ in deferred], self.params)} & self.filled
        ):
            # its backward writes a weight's .grad itself: W running it again would add that twice (see
            # Stage._filled_in_b); B runs it once, for both halves
            self.in_b.extend(GradientEdge(*e) for e in deferred)
            deferred = []
        if deferred and isinstance(node, BackwardCFunction):
            # A Python autograd.Function's backward returns all its gradients at once (ctx.needs_input_grad is
            # fixed at forward), and need not give the same answer twice: Liger-Kernel's fused cross-entropy
            # scales its saved gradients in place by the incoming one, its RMSNorm overwrites that incoming
            # gradient. W re-entering it would run it again: twice the cost, and for such kernels another
            # weight gradient, and the input gradient B already sent scaled again. B runs it once, for both.
            edges = [GradientEdge(*e) for e in deferred]
            self.in_b.extend(edges)
            self.functions.append((node, edges))
            deferred = []
        nested = _nested([n for n, _ in deferred])
        if nested is not None:  # W's re-entry would take the upper value's share at both: counted twice
            why = f"W re-entering {node.name()} would take a gradient at {nested.name()} and at a value above it"
            self._fall_back(nested, len(deferred), why=why)
            return
        if deferred:
            self.frontier.append((node, deferred))
            self.num_deferred += len(deferred)

    def _weight_edges(self, node: Node) -> dict[int, tuple[Node, int]]:
        """``node``'s edges into the weight-only region that only it feeds (position -> edge); a
        parameter several input-path ops use directly goes to ``early``; anything else shared: fallback."""
        to_input, to_param = self.reach.to_input, self.reach.to_param
        single: dict[int, tuple[Node, int]] = {}
        for pos, (n, i) in enumerate(node.next_functions):
            if n is None or to_input[n] or not to_param[n]:
                continue
            if len(self.sources[n]) == 1 or n in self.mixed:  # mixed: each op's own share, see _fed_by_weights
                single[pos] = (n, i)
            elif getattr(n, "variable", None) is not None:
                # A parameter used directly by several input-path ops: take its edges in B.
                if (n, i) not in self.early_seen:
                    self.early_seen.add((n, i))
                    self.early.append(GradientEdge(n, i))
            elif all(to_input[s] for s in self.sources[n]):
                # A weight-only value several input-path ops use (a packed projection's bias split between
                # query and key/value, nn.TransformerDecoderLayer's cross-attention): each op's share by its
                # formula, summed where W carries the edges into the weights (see _shared_unsplit).
                single[pos] = (n, i)
                self.shared.add(n)
            else:  # also below an output that reaches no input, whose backward W runs whole (freeing it)
                self._fall_back(n, 1)
        return single

    def check_b_targets(self) -> None:
        """After every node: fall back where B's engine call would take a gradient at two weight values one
        below the other (a training batch norm's scale ``s`` and bias ``-s``; a checkpointed op using ``s`` and
        ``-s``), or where a checkpointed region B carries into the weights lies below a shared value: the lower
        capture holds the upper's share, pushed again from there; and B's push frees what W's goes through."""
        targets = [e.node for e in self.early + self.free + self.in_b]
        nested = _nested(targets)
        if nested is not None:
            self._fall_back(
                nested, 0, why=f"B's engine call would take a gradient at {nested.name()} and at a value above it"
            )
            return
        carried = _below([e.node for e in self.in_b])
        shared = next((n for n in self.shared if n in carried), None)
        if shared is not None:
            self._fall_back(shared, 0, ", and a checkpointed region taken in B goes through it")

    def _shared_unsplit(self, edges: list[tuple[Node, int]], counted: list[tuple[Node, int]], detail: str) -> bool:
        """Fall back (the micro-batch's weights all in B; ``counted``: this node's edges, taken in B) when ``edges``
        lead into a shared weight-only value (several input-path ops use it) and no formula takes this op's share:
        an engine call into it, B's or W's re-entry at this node, gets the share of every op it passes through,
        which their own W adds too."""
        shared = [n for n, _ in edges if n in self.shared]
        if shared:
            self._fall_back(shared[0], len(counted), detail)
        return bool(shared)

    def _fall_back(self, shared: Node, edges: int, detail: str = "", why: str = "") -> None:
        self.fallback = True
        self.num_deferred += edges  # counted as taken in B by the plan
        if not self.why:
            uses = len(self.sources.get(shared, ()))
            self.why = (
                why or f"the weight-only value that {shared.name()} makes feeds {uses} ops on the input path{detail}"
            )
            self.why_params = tuple(id(q) for q in _params_below([shared], self.params))

    def _take_all_in_b(self, edges: list[tuple[Node, int]]) -> bool:
        """Fall back (the micro-batch's weights all in B) when ``edges`` hold a mixed leaf that no formula
        took: as a target of an engine call (B's, or W's re-entry at this node) it would collect the weight-only
        region's share too, which W pushes into the parameter again."""
        if not any(n in self.mixed for n, _ in edges):
            return False
        self.fallback = True
        self.num_deferred += len(edges)  # counted as taken in B by the plan
        self.why = self.why or "a parameter that a weight-only value also feeds meets an op without a W formula"
        return True


def _fed_by_weights(order: list[Node], children: dict[Node, list[tuple[Node, int]]], reach: _Reach) -> set[Node]:
    """The leaves that a weight-only node feeds: a bias a Linear adds both to the input's product and to a
    weight-only one (DeBERTa-v2's ``query_proj`` on its relative embeddings), or a parameter also returned
    through an output that reaches no input. An engine call that targets such a leaf gets its whole gradient,
    the weight-only path's share included, and W pushes that share again when it carries the region into the
    parameters: taken in B (early) it would count twice. Each input-path op's edge into it is deferred on its
    own instead, by formula (exactly that op's share), or the micro-batch falls back."""
    to_input = reach.to_input
    return {
        n
        for node in order
        if not to_input[node] and getattr(node, "variable", None) is None
        for n, _ in children[node]
        if getattr(n, "variable", None) is not None
    }


def _region(tops: Iterable[Node]) -> Iterator[Node]:
    """``tops`` and every node below them, each once, as met (the weight-only region is small: a walk is
    cheap, and a caller that stops early walks less)."""
    seen: set[Node] = set()
    stack = list(tops)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            yield node
            stack.extend(n for n, _ in node.next_functions if n is not None)


def _below(tops: Iterable[Node]) -> set[Node]:
    """Every node strictly below ``tops``."""
    return set(_region(n for top in tops for n, _ in top.next_functions if n is not None))


def _nested(targets: list[Node]) -> Node | None:
    """A node among ``targets`` that lies below another of them (an engine call's gradient there would hold
    the other's share too), or None."""
    if len(targets) < 2:
        return None
    wanted = set(targets)
    for top in wanted:
        below = _below([top]) & wanted
        if below:
            return next(iter(below))
    return None


def _region_checkpointed(top: Node) -> bool:
    """Whether a node of the weight-only region from ``top`` down saved a tensor in a checkpointed block."""
    return any(in_checkpoint(node) for node in _region([top]))


def _params_below(nodes: Iterable[Node], params: dict[int, nn.Parameter]) -> list[nn.Parameter]:
    """The parameters reachable from ``nodes``."""
    found = {id(q): q for q in (_leaf_param(node, params) for node in _region(nodes)) if q is not None}
    return list(found.values())
