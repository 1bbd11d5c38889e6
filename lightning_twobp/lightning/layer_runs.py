"""The pipelined layers one at a time, as ``balance="time"`` and ``schedule="auto"`` run them before the cut.

Each layer runs as a module of one tensor in and one tensor out (:class:`LayerRun`; a tuple of them where a
model passes values beside the hidden state), fed the previous layer's output, so that a profiler can time
and measure it alone (F, B, W, the fused BW) on one device, one layer's weights there at a time:

* **Sequential contract**: the layer as a one-layer stage runs it (``StageModule``), the first fed the
  pipelined block's inputs for the first micro-batch, as the step passes them.
* **ModuleList contract** (Hugging Face, nanoGPT, torchtitan models): every layer becomes a stage of its
  own (:meth:`~.modulelist_contract.ModuleListContract.one_stage_per_layer`) and runs as the executor
  runs a stage, through the model's own forward: the first is fed the model call's first tensor (the
  token ids), the others the hidden state (for ``balance="time"`` and ``schedule="auto"``, with any values
  a model passes beside it: a tuple, which twobp-plan's run on the meta device refuses). The last answers
  the model's call inside the step, as the last stage does, so its run holds what follows the loop (final
  norm, head) and, in fitting, the loss (``LayerRuns.with_loss``); elsewhere the step's first tensor result
  (nothing to differentiate).

While open, what the step uses besides the layers (a ModuleList model's rotary embedding, buffers of the
LightningModule) sits on the profiling device, the step's Metrics updates are put back after, and a
ModuleList model runs as the Trainer call will run it: its cache off, torch's attention fast path off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_twobp.lightning.checks import converted_in_place
from lightning_twobp.lightning.contract import StageModule
from lightning_twobp.lightning.materialize import made_for_timing
from lightning_twobp.lightning.modulelist_contract import LoopStage, ModuleListContract, caches_off, fastpath_off
from lightning_twobp.lightning.step import StepRunner
from lightning_twobp.private import pytree

__all__ = ["HOOKS", "LayerRun", "LayerRuns", "capture_first", "layer_runs", "loop_runs", "placed", "trained_dtype"]

HOOKS = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


@dataclass(frozen=True)
class LayerRun:
    """One layer as profiling runs it."""

    layer: nn.Module  # the partition's unit: moved to the device for its run, its parameters the layer's
    call: nn.Module  # what runs it: the layer, or its stage of the ModuleList contract (one tensor in, one out)


@dataclass(frozen=True)
class LayerRuns:
    """Every layer in order, and the first one's inputs."""

    runs: list[LayerRun]
    inputs: tuple  # the first run's positional inputs (the Sequential's, as the step passes them)
    with_loss: bool  # the last run computes the step's loss too (the ModuleList contract, in fitting)
    model: nn.Module  # the LightningModule: where a meta-built layer's initialization is looked up
    device: torch.device
    cast: torch.dtype | None  # the precision's cast of the model's floating tensors ("bf16-true": bf16)
    precision: Any  # the Trainer's precision plugin: its forward context (autocast) around each forward
    # bytes each message between stages carries beside what the layers hand on: the ModuleList contract's
    # micro-batch index (a 0-d int64), held with the message; not on the message into the last stage
    sent_beside: int = 0

    def placed(self, layer: nn.Module) -> AbstractContextManager[None]:
        """``layer`` as it will train, for its run (:func:`placed`)."""
        return placed(self.model, layer, self.device, self.cast)

    def in_forward_context(self, module: nn.Module) -> nn.Module:
        """``module`` whose forward runs in the precision's forward context, as the step runs it; the
        backward outside it, as the executor runs B, W and BW (autocast off)."""
        return _InForwardContext(module, self.precision)


@contextmanager
def layer_runs(
    runner: StepRunner,
    layers: list[nn.Module],
    trainer: Any,
    batch: Any,
    m: int,
    device: torch.device,
    precision: Any,
    several: bool = False,
) -> Iterator[LayerRuns]:
    """The layers as runs on ``device``, on the first of ``m`` micro-batches of ``batch`` (see the module
    docstring), in ``precision`` (the Trainer's plugin) as the Trainer call will run them: the batch
    converted as its loop converts it, the weights cast as ``convert_module`` will cast them (copies, for
    the runs: the cast comes after the cut, where a meta build is made in fp32 first, as one process
    makes it), the forward in its context. The step's state is this micro-batching's while open.
    ``several``: a run may hand the next one several values (a ModuleList model that passes values beside
    the hidden state), as a tuple; otherwise such a model is refused."""
    contract = runner.contract
    cast = trained_dtype(precision)
    with ExitStack() as scope:
        scope.enter_context(_moved(_outside(runner.module, layers), device, cast))
        if isinstance(contract, ModuleListContract):  # as the Trainer call runs it (pipeline._call_scope)
            scope.callback(caches_off(runner.module.modules()))
            scope.callback(fastpath_off())
        runner.metrics.begin()  # the step's Metrics updates, before the block and after it, put back after
        scope.callback(runner.metrics.undo)
        inputs = capture_first(runner, trainer, batch, device, precision, m)
        if not isinstance(contract, ModuleListContract):  # the Sequential contract: each layer as a stage runs it
            # (StageModule: a tuple passed on as the Sequential passes it, an in-place first layer's input cloned)
            runs = [LayerRun(layer, _InForwardContext(StageModule([layer]), precision)) for layer in layers]
            yield LayerRuns(runs, inputs, False, runner.module, device, cast, precision)
            return
        stages = scope.enter_context(contract.one_stage_per_layer(cast))
        # the micro-batch index is made on the model's device: a model called without tensors is on the CPU
        index = inputs[0].to(device)
        fitting = trainer.state.fn == TrainerFn.FITTING
        runs, first = loop_runs(runner, stages, (index, *inputs[1:]), fitting, several=several)
        runs = [LayerRun(run.layer, _InForwardContext(run.call, precision)) for run in runs]
        beside = index.untyped_storage().nbytes()
        yield LayerRuns(runs, first, fitting, runner.module, device, cast, precision, beside)


def capture_first(runner: StepRunner, trainer: Any, batch: Any, device: torch.device, precision: Any, m: int) -> tuple:
    """The step's call of the pipelined block on the first of ``m`` micro-batches of ``batch``, captured as the
    first stage captures it (its inputs), the batch handed over as the loop hands it to the step: its transfer
    hooks, on the device (every micro-batch: a ModuleList stage after the first captures them all), converted by
    the precision; the step's state is this micro-batching's after it."""
    batch = precision.convert_input(trainer.strategy.batch_to_device(batch, device))
    runner.begin(HOOKS[trainer.state.fn], (batch, 0), {}, m, exact=False)
    with precision.forward_context():
        return runner.capture(0)


def trained_dtype(precision: Any) -> torch.dtype | None:
    """The dtype ``precision.convert_module`` casts a model's floating tensors to in place (``"bf16-true"``:
    bf16), or None where it keeps fp32 (mixed precision casts inside autocast instead): seen on a probe,
    since a plugin says it only by doing it. A plugin that replaces layers is refused here as the conversion
    after the cut would refuse it (:func:`.checks.converted_in_place`), before the profile's work."""
    probe = nn.Sequential(nn.Linear(1, 1, dtype=torch.float32))
    try:
        converted_in_place(precision, probe)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a plugin that cannot convert here (a quantizing one off its device)
        rank_zero_warn(
            f"twobp: the layers are profiled in fp32: {type(precision).__name__}.convert_module could not convert a "
            f"probe here ({type(e).__name__}: {e}), so the dtype the model will train in is not known before the cut"
        )
        return None
    dtype = next(probe.parameters()).dtype
    return None if dtype == torch.float32 else dtype


def loop_runs(
    runner: StepRunner,
    stages: list[LoopStage],
    inputs: tuple,
    fitting: bool,
    attached: bool = False,
    several: bool = False,
) -> tuple[list[LayerRun], tuple]:
    """The ModuleList contract's one-layer stages as runs, and the first one's inputs; ``inputs``: the first
    stage's, ``(index, *call tensors)``. One stage alone is the last, which runs the model from its own call
    (its run's input is the call's first tensor, unused). ``attached``: outside fitting, the last run returns
    the step's first tensor result with its graph (twobp-plan's model call: the logits its loss is counted on)."""
    at = 1 if len(inputs) > 1 else 0  # the model call's first tensor (the ids); the index where it has none
    index = inputs[0]
    last = LayerRun(stages[-1].layers[0], _LastStage(stages[-1], runner, fitting, attached))
    if len(stages) == 1:
        return [last], (inputs[at],)
    runs = [LayerRun(stages[0].layers[0], _FirstStage(stages[0], inputs, at, several))]
    runs += [LayerRun(s.layers[0], _NextStage(s, index, several)) for s in stages[1:-1]]
    return [*runs, last], (inputs[at],)


def _carried(stage: LoopStage, out: Any, several: bool) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """What a stage hands the next: its output less the micro-batch index (``(*carried, index)`` where the next
    stage is not the last). Several values (``h, residual = block(h, residual)``, an encoder's output every
    decoder block reads: the values, then their positions) only where the caller takes them (``several``)."""
    carried = out[:-1] if stage.stop < stage.last_first else out if isinstance(out, tuple) else (out,)
    if len(carried) == 1:
        return carried[0]
    more = len(carried) - 2  # besides the hidden state and the positions sent after them (LoopStage.at)
    if not several:
        raise ValueError(
            f"{stage.next_block} takes {more} value(s) made on earlier layers besides the hidden state (a block "
            f"that returns several hidden states, or an encoder's output that every block reads): twobp-plan runs "
            f"the layers on the meta device from a single tensor between them, which this model does not pass; "
            f"plan it on its devices with TwoBPStrategy(schedule='auto', memory_limit=...), which measures such "
            f"layers, or name a schedule"
        )
    return carried


class _InForwardContext(nn.Module):
    """``inner``'s forward in the precision's forward context (autocast under mixed precision)."""

    def __init__(self, inner: nn.Module, precision: Any) -> None:
        super().__init__()
        self.inner = inner
        self._precision = precision

    def forward(self, *args: Any) -> Any:
        with self._precision.forward_context():
            return self.inner(*args)


class _FirstStage(nn.Module):
    """The first layer's stage, fed the model call's tensors with ``x`` at position ``at``."""

    def __init__(self, stage: LoopStage, inputs: tuple, at: int, several: bool) -> None:
        super().__init__()
        self.stage = stage
        self._inputs, self._at, self._several = inputs, at, several

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        args = list(self._inputs)
        args[self._at] = x
        return _carried(self.stage, self.stage(*args), self._several)


class _NextStage(nn.Module):
    """A later layer's stage, fed the hidden state of micro-batch ``index``."""

    def __init__(self, stage: LoopStage, index: torch.Tensor, several: bool) -> None:
        super().__init__()
        self.stage = stage
        self._index, self._several = index, several

    def forward(self, *carried: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return _carried(self.stage, self.stage(*carried, self._index), self._several)


class _LastStage(nn.Module):
    """The last layer as the executor's last stage runs it: inside the step, which answers the model's
    call with ``hidden``; the loss in fitting, else the first tensor the step returns, detached (F's work
    only: nothing follows it) unless ``attached``. ``stage`` is held for its parameters; the step runs it."""

    def __init__(self, stage: LoopStage, runner: StepRunner, fitting: bool, attached: bool = False) -> None:
        super().__init__()
        self.stage = stage
        self._runner, self._fitting, self._attached = runner, fitting, attached

    def forward(self, *carried: torch.Tensor) -> torch.Tensor:
        value = carried[0] if len(carried) == 1 else carried
        if self._fitting:
            return self._runner.loss(value, 0)
        found = [t for t in pytree.tree_leaves(self._runner.provide(0, value)) if isinstance(t, torch.Tensor)]
        if not found:
            return carried[0].new_zeros(())
        return found[0] if self._attached else found[0].detach()


@contextmanager
def placed(model: nn.Module, layer: nn.Module, device: torch.device, cast: torch.dtype | None) -> Iterator[None]:
    """``layer`` on ``device`` for its run, its floating tensors in ``cast`` where given, and back after (the
    same tensor objects, their data as it was); its tensors built on the meta device made there for the run
    (:func:`.materialize.made_for_timing`) and put back on ``meta``. One layer's weights at a time, so a
    model that fits only across the pipeline is still profiled."""
    with (
        _grads_aside(list(layer.parameters())),
        made_for_timing(model, layer, device, cast),
        _moved([*layer.parameters(), *layer.buffers()], device, cast),
    ):
        yield


@contextmanager
def _grads_aside(params: list[nn.Parameter]) -> Iterator[None]:
    """``params``' ``.grad`` set aside while open (the runs' gradients go to no gradient of the user's) and
    put back after, whatever the runs left, once their data is as it was (a gradient of the cast dtype
    cannot stay on an fp32 parameter)."""
    kept = [(q, q.grad) for q in params]
    for q in params:
        q.grad = None
    try:
        yield
    finally:
        for q, g in kept:
            q.grad = g


def _outside(lm: nn.Module, layers: list[nn.Module]) -> list[torch.Tensor]:
    """The parameters and buffers of ``lm`` outside ``layers`` (small: the layers hold the weights), which
    the step and the model's forward use besides them (a rotary embedding's frequencies)."""
    inside = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    return [t for t in [*lm.parameters(), *lm.buffers()] if id(t) not in inside]


@contextmanager
def _moved(tensors: list[torch.Tensor], device: torch.device, cast: torch.dtype | None) -> Iterator[None]:
    """``tensors`` (the same objects: their ``.data``) on ``device`` while open, the floating ones in ``cast``
    where given, as ``model_to_device`` and the precision's ``convert_module`` will put them; their data as
    it was after (no round trip through the cast); meta ones left alone."""
    moved = []
    try:
        with torch.no_grad():
            for t in tensors:
                dtype = cast if cast is not None and t.is_floating_point() else t.dtype
                if not t.is_meta and (t.device != device or t.dtype != dtype):
                    moved.append((t, t.data, t.grad))  # before the move: a failure part way puts back what moved
                    t.grad = None
                    t.data = t.data.to(device, dtype)
        yield
    finally:
        for t, data, grad in reversed(moved):
            t.grad = None  # a gradient of the moved copy, if the runs left one
            t.data = data
            t.grad = grad
