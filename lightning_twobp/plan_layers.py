"""The pipelined layers of a meta-built model, as ``twobp-plan`` measures them: one tensor in, one out.

* **Sequential contract**: each layer of the Sequential, fed ``lm.sample_input(b)`` and then the previous
  layer's output.
* **ModuleList contract** (Hugging Face, nanoGPT, torchtitan models): each layer runs as a stage of its own
  (:meth:`~.modulelist_contract.ModuleListContract.one_stage_per_layer`) through the model's own forward,
  as ``schedule="auto"`` runs it before the cut (:mod:`.lightning.layer_runs`). The model's call is
  ``lm(lm.sample_input(b))``: the first layer's run is fed the token ids, the last one's returns the
  model's output (the head's logits), which the plan's loss is counted on.

Attention runs as the fused kernels run it in training (:class:`_FusedAttention`): on meta,
``scaled_dot_product_attention`` would take its math path and save every head's probabilities (T x T), which
the flash and memory-efficient kernels on a GPU, and the flash kernel on a CPU, do not keep (they save the
output and a log-sum-exp per row). Routed to the CPU flash kernel's op, whose meta form saves what those do,
in every block's forward (its own: what a checkpointed block's recompute runs too, inside the backward, where
a mode entered around the plan's calls is not active).

The meta device holds shapes, not values, and a model's forward may read one: Hugging Face's mask code asks
whether the batch is packed (``(...).all()``), or, given a mask, whether it pads. Those checks are answered as
an ordinary batch answers them, every ``all()`` true and every ``any()`` false: no padding, one sequence per
row (:class:`_OrdinaryBatch`); the plan notes each answer. Any other value read is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing
from lightning_twobp.lightning.contract import SequentialContract, find_contract
from lightning_twobp.lightning.layer_runs import loop_runs
from lightning_twobp.lightning.metrics import StepMetrics
from lightning_twobp.lightning.modulelist_contract import ModuleListContract, caches_off, fastpath_off
from lightning_twobp.lightning.step import StepRunner
from lightning_twobp.private import TorchDispatchMode, flash_attention_cpu, local_scalar_dense

__all__ = ["PlannedLayers", "planned_layers"]

_MISSING = object()
# The ordinary batch's answer to a check of all entries or of any entry (see the module docstring).
_ORDINARY = {"all": True, "any": False}


@dataclass(frozen=True)
class PlannedLayers:
    """Every layer of a meta-built model in order, as the plan measures it."""

    units: list[nn.Module]  # the partition's units: a Sequential's layers, the contract's LayerGroups
    calls: list[nn.Module]  # what runs each unit: one tensor in, one tensor out
    x: torch.Tensor  # the first call's input, in the activations' dtype where the model runs in it
    scale: float  # the factor left to apply to the bytes (a model that does not run cast: see planned_layers)
    contract: SequentialContract | ModuleListContract
    reads: dict[str, int] = field(default_factory=dict)  # values the forward read on meta, by check

    def checkpointed(self, i: int, mode: str) -> Callable[[], None]:
        """Layer ``i`` checkpointed as the strategy checkpoints it in ``mode``; returns the undo."""
        loop = self.contract if isinstance(self.contract, ModuleListContract) else None
        return apply_activation_checkpointing([(i, self.units[i])], mode, None, loop)

    def params(self) -> int:
        """Parameters of the pipelined layers, a tied one once (each stage holding it keeps a copy)."""
        return sum(q.numel() for q in {id(q): q for u in self.units for q in u.parameters()}.values())


@contextmanager
def planned_layers(
    lm: nn.Module, layers: str | None, batch_size: int, act_dtype: torch.dtype
) -> Iterator[PlannedLayers]:
    """The layers of ``lm`` (built on meta) at ``layers`` (or found), for ``batch_size`` samples, the model in
    ``act_dtype``: autocast's activations, approximately (norms and softmax that autocast keeps in fp32 are
    counted at half). A model whose forward mixes dtypes by hand cannot run cast; it is measured in fp32 and
    the activations are scaled (halved for bf16 and fp16). The model stays as this left it: the plan's own."""
    contract = find_contract(lm, layers)
    scale = 1.0
    if act_dtype != torch.float32:
        lm.to(act_dtype)
        try:
            with _open(lm, contract, batch_size, act_dtype) as planned, torch.no_grad():
                _run_through(planned)  # on meta: shapes and dtypes only, no compute
        except RuntimeError:
            lm.to(torch.float32)
            act_dtype, scale = torch.float32, torch.finfo(act_dtype).bits / 32
    with _open(lm, contract, batch_size, act_dtype, scale) as planned:
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
    x = lm.sample_input(batch_size)  # type: ignore[operator]  # the recipe model's
    if x.is_floating_point():
        x = x.to(act_dtype)
    if isinstance(contract, SequentialContract):
        units = contract.layers()
        with _attention_fused(units):
            yield PlannedLayers(units, units, x, scale, contract)
        return
    reads: dict[str, int] = {}
    with ExitStack() as scope:
        scope.enter_context(_attention_fused(list(contract.blocks)))
        scope.callback(caches_off(lm.modules()))  # as the Trainer call runs it (pipeline._call_scope)
        scope.callback(fastpath_off())
        scope.enter_context(_OrdinaryBatch(type(lm).__name__, reads))
        runner = StepRunner(lm, contract, StepMetrics(lm))
        runner.begin("forward", (x,), {}, 1, exact=False)  # the model's call: lm(x)
        _, *tensors = runner.capture(0)
        stages = scope.enter_context(contract.one_stage_per_layer(act_dtype))
        # the micro-batch index (0, the plan's one micro-batch) on the host, where a forward without grad reads
        # it: the captured one is on meta, which holds no value
        index = torch.zeros((), dtype=torch.long)
        runs, first = loop_runs(runner, stages, (index, *tensors), fitting=False, attached=True)
        yield PlannedLayers([r.layer for r in runs], [r.call for r in runs], first[0], scale, contract, reads)


class _OrdinaryBatch(TorchDispatchMode):
    """A value read on meta (``.item()``, ``bool``) of an ``all()`` or ``any()`` answered as an ordinary batch
    answers it (see the module docstring), counted in ``reads``; any other refused."""

    def __init__(self, model: str, reads: dict[str, int]) -> None:
        super().__init__()
        self._model, self._reads = model, reads
        self._checks: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # a check's result -> "all" / "any"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is local_scalar_dense and args[0].is_meta:
            check = self._checks.get(args[0])
            if check is None:
                raise ValueError(
                    f"twobp-plan builds {self._model} on the meta device, which holds shapes but no values, and its "
                    f"forward reads a value (Tensor.item(), or a Python bool, int or float of a tensor) that is not a "
                    f"check of all or any entries: it cannot be planned there. Train it with schedule='auto' and a "
                    f"memory_limit instead, which measures each layer on the device before the cut"
                )
            self._reads[check] = self._reads.get(check, 0) + 1
            return _ORDINARY[check]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _ORDINARY and isinstance(out, torch.Tensor) and out.is_meta and out.numel() == 1:
            self._checks[out] = name
        return out


@contextmanager
def _attention_fused(blocks: list[nn.Module]) -> Iterator[None]:
    """Each of ``blocks`` runs its forward under :class:`_FusedAttention` while open (an instance ``forward``,
    which the ModuleList contract's block calls and the activation checkpointing wrap in turn)."""
    installed: list[tuple[nn.Module, Any]] = []
    try:
        for block in blocks:
            installed.append((block, block.__dict__.get("forward", _MISSING)))
            block.__dict__["forward"] = _fused(block.forward)
        yield
    finally:
        for block, before in reversed(installed):
            if before is _MISSING:
                del block.__dict__["forward"]
            else:
                block.__dict__["forward"] = before


def _fused(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with _FusedAttention():
            return forward(*args, **kwargs)

    return run


class _FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` of meta tensors as the flash kernel (see the module docstring):
    its output, with the flash kernel's saved tensors (grouped-query attention's key and value heads as they
    come, as the kernel takes them)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not args[0].is_meta:
            return func(*args, **kwargs)
        q, k, v, mask, dropout, causal, scale = _sdpa_arguments(*args, **kwargs)
        if mask is not None and mask.dtype == torch.bool:  # as the kernels take it: added to the scores
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        return flash_attention_cpu(q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]


def _sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple:
    return query, key, value, attn_mask, dropout_p, is_causal, scale
