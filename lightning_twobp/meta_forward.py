"""What the meta device does differently from a device, put right for ``twobp-plan``'s forwards.

* **Attention saves what the fused kernels save** (:func:`attention_fused`). On meta,
  ``scaled_dot_product_attention`` takes its math path and saves every head's T x T probabilities (and a
  boolean mask), which the flash and memory-efficient kernels on a GPU, and the flash kernel on a CPU, do
  not keep: they save the output and a log-sum-exp per row. Each block's attention is routed to the CPU
  flash kernel's op, whose meta form saves what those do; a value head narrower than the query's (DeepSeek's
  MLA), which flash does not take, to the memory-efficient kernel's, as a GPU runs it. Entered in each
  block's own forward, so a checkpointed block's recompute (inside the backward, where a mode entered
  around the plan's calls is not active) runs it too.
* **A value read in Hugging Face's mask code is answered as an unpadded batch answers it**
  (:class:`OrdinaryBatch`). The meta device holds no values, and the mask code asks whether the batch is
  packed (``(...).all()``) or, given a mask, whether it pads (``fast_all``: ``sum() == numel()``): every
  such check of all entries is answered true, of any entry false (no padding, one sequence per row). A value
  read anywhere else (a length, a maximum, ``mask.any()`` meaning "this feature is present") is refused,
  naming where: no answer would be right in general.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_twobp.private import TorchDispatchMode, efficient_attention, flash_attention_cpu, local_scalar_dense

__all__ = ["OrdinaryBatch", "attention_fused", "forwards_wrapped"]

_MISSING = object()
# The modules whose checks are answered, and each check's answer for an unpadded batch of one sequence per row
_MASK_CODE = ("transformers.masking_utils", "transformers.modeling_attn_mask_utils")
_ORDINARY = {"all": True, "eq": True, "any": False}  # eq: fast_all's sum() == numel()
_OURS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))


class OrdinaryBatch(TorchDispatchMode):
    """A value read on meta inside Hugging Face's mask code answered (see the module docstring), each check's
    place counted in ``answered`` (``"masking_utils.py:761"``); any other refused, or with ``zero_otherwise``
    answered as zero (False): for a run that wants the order of the module calls and not the values
    (:mod:`lightning_twobp.lightning.call_order`), past a check such as ``pad_token_id in input_ids``."""

    def __init__(self, model: str, answered: dict[str, int], strict: bool = True, zero_otherwise: bool = False) -> None:
        super().__init__()
        self._model, self.answered, self._strict, self._zero = model, answered, strict, zero_otherwise
        self._checks: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # a check's result -> its op

    def valueless(self, t: torch.Tensor) -> bool:
        """Whether ``t`` holds no values (here: is on meta)."""
        return t.is_meta

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is local_scalar_dense and self.valueless(args[0]):
            answer = self._answer(self._checks.get(args[0]))
            if answer is not None:
                return answer
            if self._zero:
                return torch.zeros((), dtype=args[0].dtype).item()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _ORDINARY and isinstance(out, torch.Tensor) and self.valueless(out) and out.numel() == 1:
            self._checks[out] = name
        return out

    def _answer(self, check: str | None) -> bool | None:
        """The answer, or (not ``strict``) None where there is none: the read then goes on as it would."""
        mask_code, reader = _readers()
        if (check is None or mask_code is None) and not self._strict:
            return None
        if check is None or mask_code is None:
            raise ValueError(
                f"twobp-plan builds {self._model} on the meta device, which holds shapes but no values, and its "
                f"forward reads a value at {reader} (Tensor.item(), or a Python bool, int or float of a tensor; only "
                f"Hugging Face's mask checks are answered, as an unpadded batch answers them): it cannot be planned "
                f"there. Train it with schedule='auto' and a memory_limit instead, which measures each layer on the "
                f"device before the cut"
            )
        self.answered[mask_code] = self.answered.get(mask_code, 0) + 1
        return _ORDINARY[check]


def _readers() -> tuple[str | None, str]:
    """Where a value is being read: the Hugging Face mask code's line on the stack (or None), and the first
    line outside torch and this package."""
    mask_code, reader = None, "an unknown place"
    frame = inspect.currentframe()
    while frame is not None:
        module, where = frame.f_globals.get("__name__", ""), frame.f_code.co_filename
        line = f"{os.path.basename(where)}:{frame.f_lineno}"
        if mask_code is None and module.startswith(_MASK_CODE):
            mask_code = line
        if reader == "an unknown place" and not where.startswith(_OURS):
            reader = f"{where}:{frame.f_lineno}"
        frame = frame.f_back
    return mask_code, reader


def attention_fused(blocks: list[nn.Module]) -> AbstractContextManager[None]:
    """Each of ``blocks`` runs its forward under :class:`_FusedAttention` while open."""
    return forwards_wrapped(blocks, _fused)


@contextmanager
def forwards_wrapped(
    blocks: list[nn.Module], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Each of ``blocks``' forward as ``wrap`` makes it while open: an instance ``forward``, which the ModuleList
    contract's block calls and the activation checkpointing wrap in turn, and which a block's own instance
    forward (a hook's) is wrapped in and put back after."""
    installed: list[tuple[nn.Module, Any]] = []
    try:
        for block in blocks:
            installed.append((block, block.__dict__.get("forward", _MISSING)))
            block.__dict__["forward"] = wrap(block.forward)
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
    """``F.scaled_dot_product_attention`` of meta tensors as a fused kernel (see the module docstring): its
    output, with that kernel's saved tensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, mask, dropout, causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        # Not meta, or not 4-D (the fused kernels take batch x heads x tokens x dim only: every device runs the
        # math path): as it comes
        if not q.is_meta or q.dim() != 4:
            return func(*args, **kwargs)
        if mask is not None and mask.dtype == torch.bool:  # as the kernels take it: added to the scores
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        if v.shape[-1] == q.shape[-1]:  # flash takes grouped-query heads as they come
            return flash_attention_cpu(q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]
        if gqa and k.shape[-3] != q.shape[-3]:  # the memory-efficient kernel takes them repeated
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        return efficient_attention(q, k, v, mask, True, dropout, causal, scale=scale)[0]


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
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
