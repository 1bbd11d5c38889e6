"""What user code reads from a sharded stage's parameters (``torch.equal``, a Python number, a logged value),
answered by the replicas that hold them, as one process answers it.

Under ``data_parallel="shard"`` a stage's parameters are DTensors on its data-parallel mesh (the replicas of
one pipeline rank), and user code compares them: Lightning's ``BaseFinetuning.unfreeze_and_add_param_group``
runs ``torch.equal(p, q)`` over every pair of the parameters it adds and the optimizer's. DTensor answers
``equal`` with an all-reduce over the *default* group, the whole world: its ops assume every rank runs the
same program (SPMD), and a pipeline's ranks do not. The ranks of other pipeline stages never make that call,
and the replicas waited in it for ever (a fine-tuning schedule that unfreezes a backbone hung at its epoch).

While a Trainer call holds sharded stages, :func:`answers_within_meshes` has DTensor hand ``aten.equal`` to
:func:`_equal`, which reduces over the tensors' own mesh: the ranks that hold them, every one of which makes
the same calls (replicas hold the same stages and parameters, and agree on each answer). torch's handler
table is reached through :func:`lightning_twobp.private.dtensor_op_handlers`, as torch's own
``loss_parallel`` extends it.

A Python number read from such a tensor (``float(w.norm())``, ``w.sum().item()``, ``int(torch.count_nonzero(w))``,
``float(w.max())`` in a callback) is one process's too, where DTensor reads it from this rank's piece alone:
a reduction over a shard is a partial result (a sum, a norm, a max of this replica's rows), and DTensor
answers ``aten._local_scalar_dense`` locally, whatever the placement. One process's ``float(w.norm())`` of a
16 x 6 weight read 2.350; each of its two replicas read 1.633 and 1.689, silently. :func:`_scalar` makes the
tensor whole over its mesh first, as ``equal`` does: every replica of a stage makes the same calls, but a read
in code that runs on one rank alone (``if trainer.is_global_zero``) would wait for the others; read
``w.to_local()`` there, this rank's piece.

A value logged from such a tensor outside the training step (``self.log("w_norm", self.layer.weight.norm())``
in ``on_train_epoch_end``) was stored as a DTensor by Lightning, whose later arithmetic on it (the progress
bar's read on global rank 0 only, the epoch's reduce) ran collectives over the replicas that the others never
joined: every rank hung at the epoch's end. :class:`_WholeLog` logs its whole tensor instead (one gather over
the replicas, which make the same ``self.log`` calls), the value one process logs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor, Partial, Replicate

from lightning_twobp.lightning.step import shadowed
from lightning_twobp.private import dtensor_op_handlers, local_scalar_dense

__all__ = ["answers_within_meshes", "logged_whole"]

_EQUAL = torch.ops.aten.equal.default
_SCALAR = local_scalar_dense  # .item(), float(), int(), bool() of a one-element tensor
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


def _scalar(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The Python number of a one-element DTensor: made whole over its mesh first (a partial sum or norm
    reduced, a shard gathered), so every holder reads the value one process reads."""
    t = args[0]
    mesh = t.device_mesh
    if mesh.get_coordinate() is not None and not all(isinstance(p, Replicate) for p in t.placements):
        t = t.redistribute(mesh, [Replicate()] * mesh.ndim)
    return op(t.to_local())


_HANDLERS = {_EQUAL: _equal, _SCALAR: _scalar}


@contextmanager
def answers_within_meshes() -> Iterator[None]:
    """``aten.equal`` and the Python number of a DTensor reduced over its own mesh, not the world (equal) nor
    this rank alone (a number), while the context is open; the table is left as it was found when the last
    holder closes."""
    global _held
    handlers = dtensor_op_handlers()
    before = {op: handlers.get(op) for op in _HANDLERS}
    handlers.update(_HANDLERS)
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if _held == 0:
            for op, ours in _HANDLERS.items():
                previous = before[op]
                if previous is None or previous is ours:
                    handlers.pop(op, None)
                else:
                    handlers[op] = previous


class _WholeLog:
    """``module.log`` with each DTensor in the value made whole first (an object, not a closure: a module
    pickled during the call stays picklable)."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.log(name, apply_to_collection(value, DTensor, lambda t: t.full_tensor()), *args, **kwargs)


def logged_whole(module: Any) -> AbstractContextManager[None]:
    """While open, ``module.log`` (and ``log_dict``, which calls it) logs a DTensor's whole tensor: an instance
    attribute shadowing the method (:func:`.step.shadowed`, as the training step's own shadow of it)."""
    return shadowed([(module, "log", _WholeLog(module.log))])
