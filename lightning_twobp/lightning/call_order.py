"""Where the modules outside the pipelined blocks run, before the loop over the blocks or after it, as the
model's forward calls them: traced once before the cut, so that the ModuleList contract places each on the
first stage or the last (:meth:`~.modulelist_contract.ModuleListContract.place_by_calls`).

Registration order said it until now, and Hugging Face models do not all register in call order: OPT's
decoder registers ``final_layer_norm`` before ``layers`` and calls it after the loop, BART's encoder
``layernorm_embedding`` after ``layers`` and calls it before, as do DeBERTa-v2's encoder (``rel_embeddings``,
``LayerNorm``) and Wav2Vec2's with ``do_stable_layer_norm``. Each failed at the first step, naming a
re-registration to make by hand.

**The trace.** On the first batch of the data (as ``balance="time"`` reads it), the step's code runs up to
the model call, which is captured as a stage captures it; then a copy of the model (the module the step
calls) on the meta device (no memory, no compute) runs on those arguments, on meta, with each outside
module's calls, the ops that take its weights, and the blocks' calls recorded in order. Hugging Face's
mask checks read values, which meta does not hold: they are answered as an unpadded batch answers them,
and any other value read as zero (False) (:class:`~lightning_twobp.meta_forward.OrdinaryBatch`): the
trace wants the order of the calls, and where a wrong answer changed it, the first step names the
misplaced module. Rank 0 traces and sends the answer, so every rank places alike; the random state is
forked around it all.

**What it decides.** A module called only before the first block goes to the first stage, only after the
last to the last stage. One called on both sides or inside the loop, or not called by the model's forward
(a head the step calls itself), keeps its registration-order place; where the trace cannot run (the
forward fails on meta, no batch is found), every module keeps it, and the reason goes into
the error a misplaced module raises at its first call. The placement changes nothing for a model whose
registration order was its call order: those are the models that trained before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_twobp.lightning.layer_runs import HOOKS
from lightning_twobp.lightning.modulelist_contract import ModuleListContract, caches_off
from lightning_twobp.lightning.profile import first_batch
from lightning_twobp.lightning.step import StepRunner
from lightning_twobp.meta_forward import OrdinaryBatch
from lightning_twobp.private import drop_forward_hooks, module_copy, pytree

log = logging.getLogger(__name__)

__all__ = ["call_sides", "place_by_call_order", "place_captured", "traced_sides"]

_BLOCK = object()  # a block's call in the recorded order


def place_by_call_order(runner: StepRunner, contract: ModuleListContract, trainer: Any, precision: Any) -> None:
    """Trace the call order on rank 0, send it to every rank, and place the outside modules by it (the module
    docstring); the moves are logged."""
    device = trainer.strategy.root_device
    found: list[Any] = [None]
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        batch = _batch(trainer)
        if not dist.is_initialized() or dist.get_rank() == 0:
            found[0] = _traced(runner, contract, trainer, batch, device, precision)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0, device=device if device.type == "cuda" else None)
    sides, why = found[0]
    moved = contract.place_by_calls(sides, why)
    log.debug("twobp: call order traced in %.3f s", time.perf_counter() - start)
    if why is not None:
        log.info("twobp: the modules outside %s are placed by registration order: %s", contract.list_name, why)
    for path in moved:  # shown: a module placed against its registration order, which the user may look for
        stage = "first" if sides[path] == "before" else "last"
        rank_zero_info(f"twobp: {path} is called {sides[path]} {contract.list_name}: placed on the {stage} stage")


def _batch(trainer: Any) -> Any:
    """The first batch, or the reason there is none (every rank reads it: the data setup synchronises them)."""
    try:
        return first_batch(trainer)
    except ValueError as e:  # no dataloader: the trace cannot run
        return _NoBatch(str(e))


class _NoBatch:
    def __init__(self, why: str) -> None:
        self.why = why


def _traced(
    runner: StepRunner, contract: ModuleListContract, trainer: Any, batch: Any, device: torch.device, precision: Any
) -> tuple[dict[str, str], str | None]:
    """:func:`traced_sides` of the step's call of the model on ``batch``, or no sides and why."""
    if isinstance(batch, _NoBatch):
        return {}, f"no batch to trace it on ({batch.why})"
    try:
        _capture(runner, trainer, batch, device, precision)
    except Exception as e:  # noqa: BLE001 - the step's own error: the first step raises it again
        return {}, f"the step did not reach the model's call ({type(e).__name__}: {_first_line(e)})"
    return traced_sides(contract)


def _capture(runner: StepRunner, trainer: Any, batch: Any, device: torch.device, precision: Any) -> None:
    """The step's call of the model on the first micro-batch, captured as a stage captures it."""
    runner.metrics.begin()  # the step's Metrics updates before the call, put back
    try:
        batch = precision.convert_input(trainer.strategy.batch_to_device(batch, device))
        runner.begin(HOOKS[trainer.state.fn], (batch, 0), {}, 1, exact=False)
        with precision.forward_context():
            runner.capture(0)
    finally:
        runner.metrics.undo()


def place_captured(contract: ModuleListContract) -> list[str]:
    """Place the outside modules by the call order of the model call the contract has captured (``twobp-plan``'s
    single process, whose call is on meta already); returns the modules moved."""
    return contract.place_by_calls(*traced_sides(contract))


def traced_sides(contract: ModuleListContract) -> tuple[dict[str, str], str | None]:
    """``(sides, why)``: each outside module's side of the loop in the model call the contract captured
    (``"before"``, ``"after"``, ``"both"``: :func:`call_sides`) and None, or no sides and why none were traced."""
    call = contract.captured_call(0)
    path = next(p for p, m in contract.ancestors if m is call.owner)
    args, kwargs = call.rebuild([torch.empty_like(t, device="meta") for t in call.tensors])
    try:
        return call_sides(call.owner, path, contract, args, kwargs), None
    except Exception as e:  # noqa: BLE001 - any failure leaves registration order, and says why
        return {}, f"the model's forward did not run on the meta device ({type(e).__name__}: {_first_line(e)})"


def call_sides(owner: nn.Module, path: str, contract: ModuleListContract, args: tuple, kwargs: dict) -> dict[str, str]:
    """Each outside module of ``contract`` inside ``owner`` (at ``path``) that ``owner(*args, **kwargs)`` calls,
    run as a meta copy: ``"before"`` the first block, ``"after"`` the last, or ``"both"``."""
    twin = _meta_copy(owner)
    within = path + "." if path else ""  # "": the LightningModule's own forward, called by the step as self(x)
    inside = {p: p[len(within) :] for p, _ in contract.outside() if p.startswith(within)}
    order: list[Any] = []
    with ExitStack() as scope:
        owned: dict[int, str] = {}  # each outside module's parameters (their uses outside a call: DeBERTa's
        for p, rel in inside.items():  # rel_embeddings.weight, read by the encoder before its loop)
            for module in twin.get_submodule(rel).modules():
                scope.callback(module.register_forward_pre_hook(_recorder(order, p)).remove)
            owned.update((id(q), p) for q in twin.get_submodule(rel).parameters())
        for block in twin.get_submodule(contract.list_name[len(within) :]).children():
            scope.callback(block.register_forward_pre_hook(_recorder(order, _BLOCK)).remove)
            scope.callback(block.register_forward_hook(_recorder(order, _BLOCK)).remove)
        scope.callback(caches_off(twin.modules()))  # as the Trainer call runs it
        scope.enter_context(torch.no_grad())
        scope.enter_context(OrdinaryBatch(type(owner).__name__, {}, strict=False, zero_otherwise=True))
        scope.enter_context(_ParameterUses(owned, order))
        twin(*args, **kwargs)
    return _sides(order)


class _ParameterUses(TorchFunctionMode):
    """Each op that takes a parameter of ``owned`` records its module's path in ``order``."""

    def __init__(self, owned: dict[int, str], order: list[Any]) -> None:
        super().__init__()
        self._owned, self._order = owned, order

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for x in pytree.tree_leaves((args, kwargs or {})):
            path = self._owned.get(id(x)) if isinstance(x, nn.Parameter) else None
            if path is not None:
                self._order.append(path)
        return func(*args, **(kwargs or {}))


def _recorder(order: list[Any], what: Any) -> Callable[..., None]:
    def record(*_: Any) -> None:
        order.append(what)

    return record


def _sides(order: list[Any]) -> dict[str, str]:
    """Each module's side of the loop in the recorded ``order`` (the blocks' calls are ``_BLOCK``)."""
    blocks = [k for k, x in enumerate(order) if x is _BLOCK]
    if not blocks:
        raise RuntimeError("the model's forward called none of the blocks")
    first, last = blocks[0], blocks[-1]
    sides: dict[str, str] = {}
    for k, x in enumerate(order):
        if x is _BLOCK:
            continue
        side = "before" if k < first else "after" if k > last else "both"
        sides[x] = side if sides.get(x, side) == side else "both"
    return sides


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on the meta device (no data; its other attributes shared, a
    LightningModule's trainer among them), without forward hooks (the user's would run on the trace's meta values)
    nor the instance forwards the ModuleList contract installs (they call the original modules)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    twin = module_copy(module, memo)
    for m in twin.modules():
        drop_forward_hooks(m)
        forward = m.__dict__.get("forward")
        if forward is not None and getattr(forward, "__qualname__", "").startswith(ModuleListContract.__qualname__):
            del m.__dict__["forward"]
    return twin


def _first_line(e: BaseException) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return line[:300]
