"""``torch.equal`` on a sharded stage's parameters, answered by the replicas that hold them.

Under ``data_parallel="shard"`` a stage's parameters are DTensors on its data-parallel mesh (the replicas of
one pipeline rank), and user code compares them: Lightning's ``BaseFinetuning.unfreeze_and_add_param_group``
runs ``torch.equal(p, q)`` over every pair of the parameters it adds and the optimizer's. DTensor answers
``equal`` with an all-reduce over the *default* group, the whole world: its ops assume every rank runs the
same program (SPMD), and a pipeline's ranks do not. The ranks of other pipeline stages never make that call,
and the replicas waited in it for ever (a fine-tuning schedule that unfreezes a backbone hung at its epoch).

While a Trainer call holds sharded stages, :func:`equal_within_meshes` has DTensor hand ``aten.equal`` to
:func:`_equal`, which reduces over the tensors' own mesh: the ranks that hold them, every one of which makes
the same calls (replicas hold the same stages and parameters, and agree on each answer). torch's handler
table is reached through :func:`lightning_twobp.private.dtensor_op_handlers`, as torch's own
``loss_parallel`` extends it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from lightning_twobp.private import dtensor_op_handlers

__all__ = ["equal_within_meshes"]

_EQUAL = torch.ops.aten.equal.default
_held = 0  # Trainer calls holding the handler (one pipeline a process; counted so nesting cannot drop it)


def _equal(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``torch.equal(a, b)`` for DTensors on one mesh: both laid out alike (a partial sum made whole first),
    each rank's pieces compared, the answers reduced over the mesh's groups only."""
    a, b = args[0], args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise RuntimeError(f"torch.equal got a DTensor and a {type(b if isinstance(a, DTensor) else a).__name__}")
    mesh = a.device_mesh
    if b.device_mesh != mesh:
        raise RuntimeError("torch.equal got DTensors on two device meshes: compare their full_tensor()s")
    if mesh.get_coordinate() is None:  # not one of the holders: torch's answer for a rank outside the mesh
        return True
    if a.shape != b.shape:  # a global fact, alike on every holder: no reduce needed (dtypes may differ, as in torch)
        return False
    if a.ndim == 0 or any(isinstance(p, Partial) for p in (*a.placements, *b.placements)):
        a = a.redistribute(mesh, [Replicate()] * mesh.ndim)
    if b.placements != a.placements:
        b = b.redistribute(mesh, a.placements)
    same = torch.tensor(int(torch.equal(a.to_local(), b.to_local())), device=mesh.device_type)
    for dim in range(mesh.ndim):
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    return bool(same.item())


@contextmanager
def equal_within_meshes() -> Iterator[None]:
    """``aten.equal`` on DTensors reduced over their own mesh, not the world, while the context is open; the
    table is left as it was found when the last holder closes."""
    global _held
    handlers = dtensor_op_handlers()
    before = handlers.get(_EQUAL)
    handlers[_EQUAL] = _equal
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if _held == 0:
            if before is None or before is _equal:
                handlers.pop(_EQUAL, None)
            else:
                handlers[_EQUAL] = before
