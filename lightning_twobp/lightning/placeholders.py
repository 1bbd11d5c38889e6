"""Values that live on another pipeline stage: shapes without data, and an error when they are used.

Under the ModuleList contract every stage runs the model's own ``forward`` on its micro-batch
(:mod:`lightning_twobp.lightning.modulelist_contract`). What a stage does not hold (the embedding on a later stage,
the blocks of other stages) is not computed there: it yields an :class:`Elsewhere` tensor, which has
the shape, dtype and device of the real value but no data (it computes on the ``meta`` device, so it
costs no memory and no FLOPs). Code that only asks for shapes and dtypes (building an attention mask
from ``inputs_embeds``, rotary embeddings from ``hidden_states.dtype``) runs unchanged, and every
value derived from one is again an ``Elsewhere``. Reading one raises :class:`ElsewhereError`:

* on the host (``bool``, ``.item()``, ``.tolist()``): control flow that depends on the data;
* in place into a real tensor (``mask.masked_fill_(elsewhere > 0, ...)``);
* and, checked by the contract, when one reaches a block this stage runs or the model's output.

So a result can never silently depend on a value a stage does not have.

``torch.Tensor._make_wrapper_subclass`` and ``torch._C._disabled_torch_function_impl`` are how torch's
own wrapper subclasses (DTensor, FakeTensor) are written; they are used here only, and
``tests/test_modulelist.py::test_elsewhere_tensors_compute_shapes_and_refuse_reads`` fails when a torch
version changes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_twobp.meta_forward import OrdinaryBatch
from lightning_twobp.private import disabled_torch_function_impl, make_wrapper_subclass, pytree

__all__ = ["Elsewhere", "ElsewhereError", "ElsewhereWrite", "StandIn", "elsewhere", "find_elsewhere"]

_aten = torch.ops.aten
_HOST_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default}
_WRITES: dict[Any, list[int]] = {}  # op -> indices of the arguments it writes to


class ElsewhereError(RuntimeError):
    """A value computed on another pipeline stage was used on this one."""


class ElsewhereWrite(ElsewhereError):
    """A value computed on another pipeline stage was written into a tensor this stage holds."""


class Elsewhere(torch.Tensor):
    """A tensor whose value is on another stage (see the module docstring). ``where`` says which
    module or block produced it and where that runs."""

    # plain dispatch, as wrapper subclasses do (torch's stubs type the attribute as a 4-argument classmethod)
    __torch_function__ = disabled_torch_function_impl  # type: ignore[assignment]

    _meta: torch.Tensor
    where: str  # type: ignore[assignment]  # shadows Tensor.where on purpose: an Elsewhere's origin
    received: bool = False  # this stage received its value (ModuleListContract._received): no writes into it

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device, where: str) -> Elsewhere:
        t = make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=device,
            requires_grad=False,
        )
        t._meta = meta
        t.where = where
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's is unannotated
        return f"Elsewhere(shape={tuple(self.shape)}, dtype={self.dtype}, from {self.where})"

    # torch's stubs type Tensor's as the disabled implementation (a function), not the classmethod torch documents
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        flat, spec = pytree.tree_flatten((args, kwargs))
        first = next(x for x in flat if isinstance(x, Elsewhere))
        if func in _HOST_READS:
            raise ElsewhereError(
                f"a value computed by {first.where} was read on the host (Python control flow on it: `if`, "
                f"bool(), .item(), .tolist()). Under strategy='twobp' this stage does not have it: control flow "
                f"between the pipelined blocks that depends on the data is not supported, nor values collected "
                f"from the blocks of every stage (a forward hook that gathers each block's router logits for an "
                f"auxiliary loss, per-block outputs): only the last stage's output reaches the loss"
            )
        for i in _written(func):
            if i < len(args) and getattr(args[i], "received", False):
                raise ElsewhereWrite(
                    f"{func} changes in place a value computed by {first.where}, which this pipeline stage received "
                    f"from the previous one: under strategy='twobp' the stage's blocks get the received value, which "
                    f"a change made to it between blocks would not reach; make the change out of place inside a block "
                    f"or module (`mem = mem * 0.5`, returned by it)"
                )
            if i < len(args) and isinstance(args[i], torch.Tensor) and not isinstance(args[i], Elsewhere):
                raise ElsewhereWrite(
                    f"{func} writes a value computed by {first.where} into a tensor this stage holds; under "
                    f"strategy='twobp' this stage does not have that value"
                )
        device = first.device
        meta = []
        for x in flat:
            if isinstance(x, Elsewhere):
                x = x._meta
            elif isinstance(x, torch.Tensor):
                x = x.detach().to("meta")
            meta.append(x)
        a, k = pytree.tree_unflatten(meta, spec)
        if k.get("device") is not None:  # factory and copy ops: the result lives where they say
            device = torch.device(k["device"])
            k["device"] = torch.device("meta")
        out = func(*a, **k)
        out = pytree.tree_map(lambda x: Elsewhere(x, device, first.where) if isinstance(x, torch.Tensor) else x, out)
        if func.is_view and getattr(args[0], "received", False):  # a view of a received value: written, refused
            for x in pytree.tree_leaves(out):
                x.received = True
        return out


class StandIn(OrdinaryBatch):
    """While a module of another stage stands in by its meta twin (an encoder on a decoder's later stage): a
    tensor the twin made from its own meta weights moved to a device (BART's positions, ``embed_pos.to(
    inputs_embeds.device)``) becomes an :class:`Elsewhere` there, and a value Hugging Face's mask code reads
    (T5's and BART's encoders: "does the mask pad?") is answered as an unpadded batch answers it. Only the
    twin's output's structure and shapes are used (the stage receives the real output, or refuses it), and
    the mask code's answers choose the mask's form, not the output's shape. Any other read is refused as an
    Elsewhere's is, and a write of a meta value into a real tensor fails as it did (a real output would be
    left unwritten, and wrong, otherwise)."""

    def __init__(self, where: str) -> None:
        super().__init__(where, {}, strict=False)
        self._where = where

    def valueless(self, t: torch.Tensor) -> bool:
        return t.is_meta or isinstance(t, Elsewhere)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._to_copy.default and args[0].is_meta and kwargs.get("device") is not None:
            device = torch.device(kwargs["device"])
            if device.type != "meta":
                return Elsewhere(func(*args, **{**kwargs, "device": torch.device("meta")}), device, self._where)
        flat, spec = pytree.tree_flatten((args, kwargs))
        real = [x for x in flat if isinstance(x, torch.Tensor) and not x.is_meta and not isinstance(x, Elsewhere)]
        writes_real = any(i < len(args) and any(args[i] is r for r in real) for i in _written(func))
        if real and not writes_real and any(isinstance(x, torch.Tensor) and x.is_meta for x in flat):
            # a tensor the twin made on the stage's device (T5's relative positions: an arange on its input's
            # device) meeting one of its meta weights: on meta, the result an Elsewhere on that device
            a, k = pytree.tree_unflatten([x.to("meta") if any(x is r for r in real) else x for x in flat], spec)
            out = func(*a, **k)
            return pytree.tree_map(
                lambda x: Elsewhere(x, real[0].device, self._where) if isinstance(x, torch.Tensor) else x, out
            )
        return super().__torch_dispatch__(func, types, args, kwargs)


def _written(func: Any) -> list[int]:
    if func not in _WRITES:
        _WRITES[func] = [
            i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        ]
    return _WRITES[func]


def elsewhere(t: torch.Tensor, where: str) -> Elsewhere:
    """An :class:`Elsewhere` standing for ``t`` (its shape, dtype and device, not its data)."""
    if isinstance(t, Elsewhere):
        return t
    return Elsewhere(torch.empty_like(t, device="meta"), t.device, where)


def find_elsewhere(obj: Any, depth: int = 6) -> Elsewhere | None:
    """The first :class:`Elsewhere` in ``obj``, looking into tuples, lists and dicts (Hugging Face's
    ``ModelOutput`` is a dict) ``depth`` levels down."""
    if isinstance(obj, Elsewhere):
        return obj
    if depth == 0 or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
        return None
    items: Iterable[Any]
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (tuple, list)):
        items = obj
    else:
        return None
    for x in items:
        found = find_elsewhere(x, depth - 1)
        if found is not None:
            return found
    return None
