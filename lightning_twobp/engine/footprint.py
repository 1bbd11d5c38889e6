"""What one micro-batch of one layer costs under the split backward: the bytes its F saves, the bytes
it holds from B to W, and (given a clock) the seconds of its F, B and W, and of the fused backward BW
that a fused schedule runs instead of B and W.

The layer runs as a real :class:`~.stage.Stage` (F, then B, then W; with a clock, F again and BW), so
the split is the one the executor makes. ``twobp-plan`` calls it on the ``meta`` device (shapes only,
no compute: bytes without seconds); ``schedule="auto"`` on the training device before the first step
(both).

* **activation** (the Zero Bubble paper's M_B): the distinct storages autograd saves in F, the layer's
  parameters (and views of them) excluded, since they live anyway;
* **held** (M_W): what W still reads after B: the weight GEMMs' operands, the gradients B recorded at
  the frontier, and the gradients of edges taken in B. When W re-enters the graph (``graph_kept``: no
  direct weight formula for some op) the whole graph stays too, about ``activation`` more; the caller
  adds that per stage, since one layer that keeps it keeps its whole stage's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lightning_twobp.engine.executor import PipelineExecutor
from lightning_twobp.engine.stage import Stage
from lightning_twobp.private import pytree
from lightning_twobp.schedules.auto import LayerCost

__all__ = [
    "LayerFootprint",
    "StepMeter",
    "held_storages",
    "layer_cost",
    "measure_layer",
    "receive_buffers",
    "storage_key",
]


def storage_key(t: torch.Tensor) -> int:
    """One key per storage: views and re-saves of one tensor count once."""
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class LayerFootprint:
    """One micro-batch through one layer (see the module docstring). A layer that hands on several values
    (a ModuleList model's hidden state with the values sent beside it) has the first one's shape and dtype,
    and every value's bytes in ``out_bytes``; its inputs' and outputs' bytes below are summed over them."""

    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    activation_bytes: int
    held_bytes: int  # weight-GEMM operands and recorded gradients (without the graph)
    graph_kept: bool
    saved_input: int  # bytes of the input, when the layer saves it (0 otherwise)
    saves_output: bool  # whether the layer saves its own output (a ReLU does, a Linear does not)
    seconds: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # F, B, W, BW (zeros without a clock)
    output: Any = field(default=None, repr=False, compare=False)  # F's output, detached (a tuple: several)
    grad_output_held: int = 0  # bytes of the output's gradient, when W keeps it (a last Linear's input)
    input_held: int = 0  # bytes of the input, when W keeps it (a first Linear's operand)
    out_bytes: int = 0  # every output value's bytes: what the stage sends on
    # the output's storages, what keeping it holds: more than out_bytes for a view of a larger buffer (CPU's
    # mse_loss returns its scalar in a 64-float one), less for an expanded one (a mask); 0: as out_bytes
    out_held: int = 0


def measure_layer(
    layer: nn.Module, x: Any, needs_input_grad: bool, clock: Callable[[], float] | None = None
) -> LayerFootprint:
    """One micro-batch ``x`` (a tensor, or a tuple of the values a layer takes) through ``layer`` as a
    :class:`Stage`: F, B (from a gradient of ones per output), W; with a ``clock``, then F once more and
    the fused backward BW from the same gradients, timed (the bytes are all the first F's and B's).
    Without one (the meta planner) BW is not run: nothing to time.

    Gradients accumulate into the layer's parameters as in training, so with a clock they hold two
    micro-batches' (the split's and BW's): the caller clears them. With ``needs_input_grad=False`` (the
    first stage, fed ids or images) B runs the whole backward and W nothing, as in the executor; with
    True, the floating-point inputs require grad (not a tensor of positions sent beside them).
    """
    now = clock or (lambda: 0.0)
    params = {storage_key(q) for q in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = storage_key(t)
        if k not in params:
            saved[k] = t.untyped_storage().nbytes()
        return t

    stage = Stage(layer)
    several = isinstance(x, tuple)
    inp = tuple(_input(t, needs_input_grad, several) for t in (x if several else (x,)))
    t0 = now()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage.forward(0, *inp)
    t1 = now()
    act = sum(saved.values())
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    saved_input = _bytes_of(inp, saved)
    # every value saved, or the next layer's saved input (all of its values) must not be taken off as counted here
    saves_output = all(storage_key(t) in saved for t in outs) and any(t.requires_grad for t in outs)
    sizes = (tuple(outs[0].shape), outs[0].dtype)
    nbytes, out_held = _output_bytes(outs)
    # several values keep their requires_grad (a mask made from the inputs has none), as the next stage receives them
    detached = pytree.tree_map(lambda t: _detached(t, several or isinstance(out, tuple)), out)
    if not stage.in_flight or not stage._pending[0].outputs:  # nothing to differentiate: F's work only
        stage.discard()
        seconds = (t1 - t0, 0.0, 0.0, 0.0)
        return LayerFootprint(
            *sizes, act, 0, False, saved_input, False, seconds, detached, out_bytes=nbytes, out_held=out_held
        )
    g_out = _ones_for(outs)
    t1b = now()  # the gradients of ones are the measurement's, not B's (BW's timing leaves them out too)
    stage.backward_input(0, g_out)
    t2 = now()
    p = stage._pending[0]
    held: dict[int, int] = {}
    tensors = (
        [t for _, operands in p.fast for t in operands]
        + [t for v in p.captured.values() for t in v]
        + [g for _, g in p.edge_grads]
    )
    for t in tensors:
        if isinstance(t, torch.Tensor):
            held[storage_key(t)] = t.untyped_storage().nbytes()
    kept = bool(p.frontier)
    grad_out, inp_held = _bytes_of(g_out, held), _bytes_of(inp, held)
    t2b = now()  # reading what B left is bookkeeping, not W
    stage.backward_weight(0)
    t3 = now()
    bw = 0.0 if clock is None else _fused_seconds(stage, inp, now)
    seconds = (t1 - t0, t2 - t1b, t3 - t2b, bw)
    return LayerFootprint(
        *sizes,
        act,
        sum(held.values()),
        kept,
        saved_input,
        saves_output,
        seconds,
        detached,
        grad_out,
        inp_held,
        nbytes,
        out_held,
    )


def _output_bytes(outs: Sequence[torch.Tensor]) -> tuple[int, int]:
    """The outputs' bytes as a message carries them (their shapes) and as keeping them holds them (their
    storages, each once; none on meta, where out_bytes stands for them): ``LayerFootprint.out_bytes`` and
    ``out_held``."""
    held: dict[int, int] = {}
    _storages(outs, held)
    return sum(t.numel() * t.element_size() for t in outs), sum(held.values())


def _input(t: Any, needs_grad: bool, several: bool) -> Any:
    """An input as the stage receives it: detached, requiring grad where B computes one: a floating-point one
    alone, or one of ``several`` that required grad where it was made (:func:`_detached` kept the flag)."""
    if not isinstance(t, torch.Tensor):
        return t
    grad = needs_grad and (t.is_floating_point() or t.is_complex()) and (t.requires_grad or not several)
    return t.detach().requires_grad_(grad)


def _detached(t: Any, keep_flag: bool) -> Any:
    """F's output value, detached; with ``keep_flag``, a leaf that requires grad where the value did."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().requires_grad_(keep_flag and t.requires_grad)


def _ones_for(outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A gradient of ones for each output that requires grad, in order (what the stage differentiates)."""
    return [torch.ones_like(t) for t in outs if t.requires_grad]


def _bytes_of(tensors: Sequence[Any], found: Mapping[int, int]) -> int:
    """The bytes of the distinct storages of ``tensors`` that ``found`` holds."""
    keys = {storage_key(t) for t in tensors if isinstance(t, torch.Tensor)}
    return sum(found.get(k, 0) for k in keys)


def _fused_seconds(stage: Stage, inp: tuple, now: Callable[[], float]) -> float:
    """Seconds of one fused backward (BW) of ``inp`` through ``stage``, after an untimed second F: what
    a fused schedule runs where a split one runs B and W."""
    out = stage.forward(0, *inp)
    g_out = _ones_for([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])
    t0 = now()
    stage.backward(0, g_out)
    return now() - t0


def layer_cost(
    fp: LayerFootprint, fixed: float, seconds: tuple[float, float, float] | None = None, scale: float = 1.0
) -> LayerCost:
    """The footprint as the search's pure :class:`~lightning_twobp.schedules.auto.LayerCost`, with the
    layer's ``fixed`` bytes, ``seconds`` of F, B and W (default: the measured ones, and the measured
    fused BW; given ones are an estimate, whose BW is taken as B + W), and the saved bytes times
    ``scale`` (a layer measured in fp32 standing in for half-precision activations: 0.5)."""
    if seconds is None:
        f, b, w, bw = fp.seconds
        fused: float | None = bw
    else:
        (f, b, w), fused = seconds, None
    out_bytes = fp.out_bytes or math.prod(fp.out_shape) * fp.out_dtype.itemsize
    act, held, inp, out, g, i = (
        scale * x
        for x in (fp.activation_bytes, fp.held_bytes, fp.saved_input, out_bytes, fp.grad_output_held, fp.input_held)
    )
    kept = scale * fp.out_held if fp.out_held else None
    return LayerCost(
        f, b, w, act, held, fp.graph_kept, inp, fp.saves_output, fixed, out, g, i, bw=fused, output_held=kept
    )


def _storages(values: Any, out: dict[int, int]) -> None:
    for t in pytree.tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            out[storage_key(t)] = t.untyped_storage().nbytes()


def receive_buffers(executor: PipelineExecutor) -> list[torch.Tensor]:
    """The buffers of the receives ``executor`` has posted and not yet read: each is made as its receive is
    posted and goes to its reader when waited (``engine.p2p``), whose holdings :func:`held_storages` counts."""
    return executor.p2p.receive_buffers()


def held_storages(
    stages: Mapping[int, Stage], buffers: Iterable[torch.Tensor] = (), sent: Iterable[torch.Tensor] = ()
) -> dict[int, int]:
    """What ``stages`` hold for their micro-batches in flight, now, one entry per storage: each one's
    inputs and outputs (from F until B, or until sent where the next stage is remote), and after B
    what W reads (the formulas' operands, the recorded gradients, the edge gradients taken in B; the
    outputs too while the graph is kept); with ``buffers`` (the receive buffers) and ``sent`` (what
    the rank holds to send: ``PipelineExecutor.outgoing``). The measured side of
    :mod:`lightning_twobp.schedules.memory`'s replay, with the bytes autograd saves
    (:class:`~lightning_twobp.lightning.autoschedule.SavedBytes`)."""
    out: dict[int, int] = {}
    _storages([*buffers, *sent], out)
    for stage in stages.values():
        for p in stage._pending.values():
            _storages([p.inputs, p.outputs, [ops for _, ops in p.fast], list(p.captured.values())], out)
            _storages([[g for _, g in p.edge_grads], [list(r) for r in p.weight_roots]], out)
    return out


class _Saved(Protocol):
    """What autograd saved and holds now, per storage (:class:`~lightning_twobp.lightning.autoschedule.SavedBytes`)."""

    @property
    def live(self) -> Mapping[int, int]: ...


class StepMeter:
    """The most bytes one rank's step held at once, sampled at the end of every F, B, W and BW (pass
    :meth:`around` as the executor's ``around`` hook, and set ``executor`` and ``saved``): ``fixed``
    (storage key -> bytes: weights, gradients, optimizer state, as the caller counts them), what autograd
    saved (``saved.live``), and :func:`held_storages` (what the stages keep for their micro-batches and for
    W, the receive buffers, the sends held: the step's signature among them), each storage once, less the
    storages in ``exclude`` (a caller that counts the weights apart). The measured side of
    :mod:`lightning_twobp.schedules.memory`'s replay, for ``twobp-bench --memory-model`` and the tests
    of ``schedule="auto"``'s limit alike."""

    def __init__(self, fixed: Mapping[int, int] | None = None, exclude: Iterable[int] = ()) -> None:
        self.peak = 0
        self.fixed = dict(fixed or {})
        self.exclude = set(exclude)
        self.saved: _Saved | None = None  # sampled only while set: the measured step's
        self.executor: PipelineExecutor | None = None

    @contextmanager
    def around(self, stage: int) -> Iterator[None]:
        yield
        if self.saved is None or self.executor is None:
            return
        ex = self.executor
        live = {**self.fixed, **held_storages(ex.stages, receive_buffers(ex), ex.outgoing()), **self.saved.live}
        self.peak = max(self.peak, sum(n for key, n in live.items() if key not in self.exclude))
