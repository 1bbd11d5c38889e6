"""The pipelined layers of a meta-built model, as ``twobp-plan`` measures them: one tensor in, one out.

* **Sequential contract**: each layer of the Sequential, fed ``lm.sample_input(b)`` and then the previous
  layer's output.
* **ModuleList contract** (Hugging Face, nanoGPT, torchtitan models): each layer runs as a stage of its own
  (:meth:`~.modulelist_contract.ModuleListContract.one_stage_per_layer`) through the model's own forward,
  as ``schedule="auto"`` runs it before the cut (:mod:`.lightning.layer_runs`). The model's call is
  ``lm(lm.sample_input(b))``: the first layer's run is fed the token ids, the last one's returns the
  model's output (the head's logits), which the plan's loss is counted on.

What the meta device does differently from a device is put right while the layers are open
(:mod:`.meta_forward`): attention saves what the fused kernels save, and Hugging Face's mask checks are
answered as an unpadded batch answers them (the plan notes where).

Under the ModuleList contract every layer is measured on its own (:meth:`PlannedLayers.key`): blocks of one
class may differ by what the loop hands them (Qwen2's sliding-window layers get a mask, the others none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from lightning_twobp.lightning.call_order import place_captured
from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing, keep_products
from lightning_twobp.lightning.contract import SequentialContract, find_contract
from lightning_twobp.lightning.layer_runs import loop_runs
from lightning_twobp.lightning.metrics import StepMetrics
from lightning_twobp.lightning.modulelist_contract import ModuleListContract, caches_off, fastpath_off
from lightning_twobp.lightning.step import StepRunner
from lightning_twobp.meta_forward import OrdinaryBatch, attention_fused, forwards_wrapped
from lightning_twobp.private import TorchDispatchMode, pytree

__all__ = ["PlannedLayers", "planned_layers"]


@dataclass(frozen=True)
class PlannedLayers:
    """Every layer of a meta-built model in order, as the plan measures it."""

    units: list[nn.Module]  # the partition's units: a Sequential's layers, the contract's LayerGroups
    calls: list[nn.Module]  # what runs each unit: one tensor in, one tensor out
    x: torch.Tensor  # the first call's input, in the activations' dtype where the model runs in it
    scale: float  # the factor left to apply to the bytes (a model that does not run cast: see planned_layers)
    contract: SequentialContract | ModuleListContract
    answered: dict[str, int] = field(default_factory=dict)  # mask checks answered on meta, by place

    def checkpointed(self, i: int, mode: str) -> Callable[[], None]:
        """Layer ``i`` checkpointed as the strategy checkpoints it in ``mode``; returns the undo."""
        loop = self.contract if isinstance(self.contract, ModuleListContract) else None
        return apply_activation_checkpointing([(i, self.units[i])], mode, None, loop)

    def key(self, i: int) -> int | None:
        """What besides its signature tells layer ``i``'s bytes apart: its index under the ModuleList contract
        (see the module docstring), nothing for a Sequential's layer (identical layers are measured once)."""
        return i if isinstance(self.contract, ModuleListContract) else None

    def kept_products(self, i: int, x: torch.Tensor) -> int:
        """What a ``"selective"`` layer ``i``'s F keeps besides its input: the outputs of the matrix products
        inside its block (:func:`keep_products`; not those of the rest of the model's forward its run goes
        through: the other blocks' stand-ins, the head)."""
        block = self.contract.blocks[i] if isinstance(self.contract, ModuleListContract) else self.units[i]
        products = _Products()
        with forwards_wrapped([block], products.counting), torch.no_grad(), products:
            self.calls[i](x)
        return products.bytes

    def params(self) -> int:
        """Parameters of the pipelined layers, a tied one once (each stage holding it keeps a copy)."""
        return sum(q.numel() for q in {id(q): q for u in self.units for q in u.parameters()}.values())


@contextmanager
def planned_layers(
    lm: nn.Module, layers: str | None, batch_size: int, act_dtype: torch.dtype
) -> Iterator[PlannedLayers]:
    """The layers of ``lm`` (built on meta) at ``layers`` (or found), for ``batch_size`` samples, the model in
    ``act_dtype``: autocast's activations, approximately (norms and softmax that autocast keeps in fp32 are
    counted at half). A model that does not run in that dtype on meta is measured in the other and its
    activations scaled: one whose forward mixes dtypes by hand in fp32 (halved for bf16 and fp16), one with a
    kernel that takes bf16 only there (Hugging Face's grouped expert matmul, as on a GPU) in bf16 (doubled for
    fp32). The model stays as this left it: the plan's own."""
    contract = find_contract(lm, layers)
    measured = act_dtype
    for dtype in (act_dtype, torch.bfloat16 if act_dtype == torch.float32 else torch.float32):
        lm.to(dtype)
        try:
            with _open(lm, contract, batch_size, dtype) as planned, torch.no_grad():
                _run_through(planned)  # on meta: shapes and dtypes only, no compute
        except RuntimeError:
            continue
        measured = dtype
        break
    else:  # neither runs: measured as asked, where the failing layer is named (plan._footprint)
        lm.to(act_dtype)
    scale = torch.finfo(act_dtype).bits / torch.finfo(measured).bits
    with _open(lm, contract, batch_size, measured, scale) as planned:
        yield planned


def _run_through(planned: PlannedLayers) -> None:
    x = planned.x
    for call in planned.calls:
        x = call(x)


@contextmanager
def _open(
    lm: nn.Module,
    contract: SequentialContract | ModuleListContract,
    batch_size: int,
    act_dtype: torch.dtype,
    scale: float = 1.0,
) -> Iterator[PlannedLayers]:
    sample = getattr(lm, "sample_input", None)
    if not callable(sample):
        raise ValueError(
            f"twobp-plan feeds the model one input made by {type(lm).__name__}.sample_input(batch_size), which it "
            f"does not define: add `def sample_input(self, batch_size)` returning one input of "
            + (
                f"{contract.name} (the pipelined Sequential)"
                if isinstance(contract, SequentialContract)
                else "the model's call, self(x) (token ids of shape (batch_size, seq_len) for a language model)"
            )
            + ", on the device of the model's parameters (meta here)"
        )
    x = sample(batch_size)
    if x.is_floating_point():
        x = x.to(act_dtype)
    if isinstance(contract, SequentialContract):
        units = contract.layers()
        with attention_fused(units):
            yield PlannedLayers(units, units, x, scale, contract)
        return
    answered: dict[str, int] = {}
    with ExitStack() as scope:
        scope.enter_context(attention_fused(list(contract.blocks)))
        scope.callback(caches_off(lm.modules()))  # as the Trainer call runs it (pipeline._call_scope)
        scope.callback(fastpath_off())
        scope.enter_context(OrdinaryBatch(type(lm).__name__, answered))
        runner = StepRunner(lm, contract, StepMetrics(lm))
        runner.begin("forward", (x,), {}, 1, exact=False)  # the model's call: lm(x)
        _, *tensors = runner.capture(0)
        place_captured(contract)  # the modules outside the blocks where the forward calls them, as the strategy does
        stages = scope.enter_context(contract.one_stage_per_layer(act_dtype))
        # the micro-batch index (0, the plan's one micro-batch) on the host, where a forward without grad reads
        # it: the captured one is on meta, which holds no value
        index = torch.zeros((), dtype=torch.long)
        runs, first = loop_runs(runner, stages, (index, *tensors), fitting=False, attached=True)
        yield PlannedLayers([r.layer for r in runs], [r.call for r in runs], first[0], scale, contract, answered)


class _Products(TorchDispatchMode):
    """Bytes of the outputs the ``"selective"`` policy (:func:`keep_products`) keeps from F to B, counted
    while a forward :meth:`counting` wraps runs."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self._inside = 0

    def counting(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._inside += 1
            try:
                return forward(*args, **kwargs)
            finally:
                self._inside -= 1

        return run

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._inside and keep_products(None, func) == CheckpointPolicy.MUST_SAVE:
            leaves = pytree.tree_flatten(out)[0]
            self.bytes += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return out
