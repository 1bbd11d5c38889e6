"""The one door to torch's, Lightning's and torchmetrics' private names (autograd's graph has its own:
:mod:`lightning_twobp.engine.graph`). Every other module reaches them through here, and
``tests/test_private_apis.py`` fails on a private import or attribute anywhere else and checks that
each name below still exists in the installed releases, so an upgrade that renames one fails there,
by name, rather than somewhere inside a step.

Each entry says why nothing public does. Torch's ``_pytree`` is the exception in kind: it is what
torch.distributed.pipelining, torch.export and Lightning themselves use to walk nested batches, and
it is re-exported here so that the door stays the only import of it.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "collect_rng_states",
    "disabled_torch_function_impl",
    "dtensor_op_handlers",
    "efficient_attention",
    "flash_attention_cpu",
    "forward_hooks",
    "gloo_or_nccl_options",
    "layer_sync",
    "local_scalar_dense",
    "make_wrapper_subclass",
    "metric_finish_step",
    "metric_forward_cache",
    "metric_merge",
    "module_copy",
    "process_groups",
    "pytree",
    "saved_tensors_hooks_in_force",
    "set_rng_states",
    "skips_backward",
    "tensor_hooks",
    "tensor_version",
    "data_source",
    "unset_training_data",
    "without_distributed_sampler",
]

# ------------------------------------------------------------------ torch
# A wrapper tensor subclass (lightning/placeholders.py) dispatches plainly, as torch's own wrapper
# subclasses do; there is no public spelling of "no __torch_function__ override".
disabled_torch_function_impl = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(cls: type, *args: Any, **kwargs: Any) -> Any:
    """A tensor subclass instance with no storage of its own (lightning/placeholders.py's placeholders),
    as torch's own wrapper subclasses make theirs."""
    return torch.Tensor._make_wrapper_subclass(cls, *args, **kwargs)


# The op a tensor's value read (``.item()``, ``bool(t)``, ``int(t)``) dispatches to: twobp-plan's model runs
# on the meta device, which holds no values, and answers a mask check there as an ordinary batch would
# (meta_forward.py); the op has no public name.
local_scalar_dense = torch.ops.aten._local_scalar_dense.default


# The CPU flash and the memory-efficient attention kernels' ops: twobp-plan runs attention on meta through
# them, since on meta ``scaled_dot_product_attention`` takes its math path, which saves what no fused kernel
# keeps (meta_forward.py); the kernel ops have no public name.
flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
efficient_attention = torch.ops.aten._scaled_dot_product_efficient_attention.default


def tensor_version(t: torch.Tensor) -> int:
    """Autograd's count of in-place writes to ``t``: post-validation redoes a step only when the
    gradients it saw were not written since (engine/post_validation.py); a checkpointed block keeps a
    copy of each buffer its forward wrote, for B's recompute (lightning/checkpointing.py); B sees a ``.grad``
    written in place from inside a node's backward (engine/stage.py's ``_Hidden``)."""
    return t._version


def saved_tensors_hooks_in_force() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The (pack, unpack) pair of the innermost ``torch.autograd.graph.saved_tensors_hooks`` in force, or None.
    Autograd applies the innermost pair alone, so the executor's own pair (recording what a micro-batch saves
    for the monitor, engine/executor.py) hands each tensor on to this one: a user's ``save_on_cpu`` or a
    memory meter around the step would otherwise go unseen on the recorded steps. torch keeps the stack
    private."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def tensor_hooks(t: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """The gradient hooks (``t.register_hook``) and post-accumulate-grad hooks
    (``t.register_post_accumulate_grad_hook``) ``t`` holds: the split backward adds weight gradients into
    ``.grad`` itself, so a parameter's hooks are refused before any compute (lightning/checks.py), and
    torch lists them only in private attributes (None before the first hook)."""
    return list((t._backward_hooks or {}).values()), list((t._post_accumulate_grad_hooks or {}).values())


def forward_hooks(module: torch.nn.Module) -> int:
    """How many forward hooks and pre-hooks ``module`` itself holds: the ModuleList contract runs a block of
    another stage for its hooks' sake (lightning/modulelist_contract.py), and torch lists them only in
    private dicts."""
    return len(module._forward_hooks) + len(module._forward_pre_hooks)


def module_copy(module: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    """A copy of ``module``'s tree for one throwaway run: each module a new object over the same attributes (a
    LightningModule's trainer shared, not copied, nor cleared as pickling's ``__getstate__`` clears it), its
    parameters and buffers ``memo``'s stand-ins for them (meta tensors, for the call-order trace of
    lightning/call_order.py), its submodules copies (one per module, shared ones shared), and no forward hooks
    or pre-hooks (the user's would run on the stand-ins and count a call that is not one; a hook bound to a
    large object would drag it into a deep copy). torch keeps all of these in private dicts."""
    copies: dict[int, torch.nn.Module] = {}

    def copied(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) not in copies:
            twin = object.__new__(type(m))
            twin.__dict__.update(m.__dict__)
            copies[id(m)] = twin
            state = twin.__dict__
            # A method bound to the module in its own __dict__ (`m._pos_embed = types.MethodType(f, m)`, a
            # patched forward) would run on the original module's tensors: bound to the copy instead.
            for k, v in m.__dict__.items():
                if isinstance(v, types.MethodType) and v.__self__ is m:
                    state[k] = types.MethodType(v.__func__, twin)
            state["_parameters"] = {n: None if q is None else memo[id(q)] for n, q in m._parameters.items()}
            state["_buffers"] = {n: None if b is None else memo.get(id(b), b) for n, b in m._buffers.items()}
            state["_modules"] = {n: None if c is None else copied(c) for n, c in m._modules.items()}
            state["_forward_hooks"], state["_forward_pre_hooks"] = OrderedDict(), OrderedDict()
        return copies[id(m)]

    return copied(module)


def gloo_or_nccl_options(backend: str, timeout: timedelta) -> Any:
    """Backend options carrying ``timeout`` for a DeviceMesh's groups: ``init_device_mesh`` takes
    ``(backend, options)`` but the options classes take the timeout only privately."""
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return opts
    from torch._C._distributed_c10d import Backend

    return Backend.Options("gloo", timeout)


def process_groups() -> list[Any]:
    """Every process group this process holds a handle on, the default one included: a rank that fails in
    the middle of a run closes their connections (engine/failure.py's ``close_links``), and torch lists
    them only in its private registry (a group a rank is not a member of is not in it)."""
    import torch.distributed as dist

    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def dtensor_op_handlers() -> dict[Any, Callable[..., Any]]:
    """DTensor's table of ops it hands to a Python function instead of its sharding rules (op -> handler
    ``(op, args, kwargs)``), read on every DTensor op. torch's own ``loss_parallel`` adds its handlers to it
    the same way; there is no public registration (lightning/shard_reads.py)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


# ------------------------------------------------------------------ Lightning
def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """Lightning's own collection of torch, CUDA, NumPy and Python random states (what its checkpoints
    and ``isolate_rng`` use), so a checkpoint holds exactly what one process's would."""
    from lightning.fabric.utilities.seed import _collect_rng_states

    return _collect_rng_states(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    from lightning.fabric.utilities.seed import _set_rng_states

    _set_rng_states(states)


def data_source(loop: Any) -> Any:
    """A Trainer loop's handle on its data (2.x), or None: read before the loop sets its data up, whose iterator
    then reads the first batch ahead (the call-order trace must not take a stream's first batch that way), and
    before Lightning loads the data (the fit loop's: a batch size that cannot split is refused before the
    sanity check runs)."""
    return getattr(loop, "_data_source", None)


def skips_backward(trainer: Any) -> bool:
    """Whether Lightning's fit loop runs its training steps without backward nor ``zero_grad`` (the
    ``StochasticWeightAveraging`` callback's batch-norm epoch sets it): then nothing drops the gradients
    after a step. Lightning's own callback sets this flag; nothing public reads it."""
    return bool(getattr(trainer.fit_loop, "_skip_backward", False))


def unset_training_data(trainer: Any) -> None:
    """Undo the fit loop's ``setup_data``, run early to read the first batch (``profile.first_batch``) or by
    the user's code reading ``trainer.estimated_stepping_batches`` (``checkpoint_hooks.load``), so that the
    loop sets its data up again itself where it would have: after a checkpoint's loader state is restored
    (Lightning loads it there only: a stateful loader resumed at batch 0 otherwise) and outside the random
    state the profiling forks. There is no public way to make the loop set its data up again."""
    loop = trainer.fit_loop
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
    loop._data_fetcher = loop._combined_loader = None


def layer_sync(strategy: Any) -> Any:
    """The layer conversion ``Trainer(sync_batchnorm=True)`` (or a ``LayerSync`` plugin) handed the strategy,
    or None: Lightning's DDP applies it in its own ``setup``; nothing public says whether it was asked for."""
    return getattr(strategy, "_layer_sync", None)


def without_distributed_sampler(trainer: Any) -> Callable[[], None] | None:
    """Switch Lightning's distributed-sampler injection off for this Trainer call; returns the undo, or
    None where this Lightning keeps the switch elsewhere. There is no public setter after the Trainer
    is built."""
    connector = getattr(trainer, "_accelerator_connector", None)
    if connector is None or not hasattr(connector, "use_distributed_sampler"):
        return None
    before = connector.use_distributed_sampler
    connector.use_distributed_sampler = False

    def undo() -> None:
        connector.use_distributed_sampler = before

    return undo


# ------------------------------------------------------------------ torchmetrics
# torchmetrics has no public way to set the value Lightning logs at a step nor the update count, and
# its public merge_state refuses metrics whose update needs the full state (merging by the states'
# reductions is what its own DDP sync does for every metric): lightning/metrics.py.
def metric_finish_step(metric: Any, count: int, value: Any) -> None:
    """After a step: its update count, and ``value`` where Lightning reads the step's value of a logged Metric;
    no cached ``compute()`` (the state changed, as ``update`` drops it)."""
    metric._update_count = count
    metric._forward_cache = value
    metric._computed = None


def metric_forward_cache(metric: Any) -> Any:
    return getattr(metric, "_forward_cache", None)


def metric_merge(metric: Any, state: dict[str, Any]) -> None:
    """``state`` (from before the step) merged into the metric's (the step's), before it: ``pre + step``."""
    with torch.no_grad():
        metric._reduce_states(state)


# Names checked by tests/test_private_apis.py: (owner, attribute) that must exist.
GUARDED: tuple[tuple[str, str], ...] = (
    ("torch._C", "_disabled_torch_function_impl"),
    ("torch._C._autograd", "_top_saved_tensors_default_hooks"),
    ("torch.Tensor", "_version"),
    ("torch.Tensor", "_backward_hooks"),
    ("torch.Tensor", "_post_accumulate_grad_hooks"),
    ("torch.Tensor", "_make_wrapper_subclass"),
    ("torch._C._distributed_c10d.Backend", "Options"),
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed.tensor.DTensor", "_op_dispatcher"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.ops.aten", "_local_scalar_dense"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("torch.ops.aten", "_scaled_dot_product_efficient_attention"),
    ("lightning.fabric.utilities.seed", "_collect_rng_states"),
    ("lightning.fabric.utilities.seed", "_set_rng_states"),
    ("lightning.pytorch.plugins.precision.Precision", "_after_closure"),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "_skip_backward"),
    ("torch.amp.GradScaler", "_check_inf_per_device"),
    ("torchmetrics.Metric", "_reduce_states"),
)
