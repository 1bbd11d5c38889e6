"""Refusals before any compute that need no pipeline: options of the wrong type, a launch that cannot
start, optimizers the pipeline cannot step. Each error names the value and the fix
(docs/troubleshooting.md keeps a row per error)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_twobp.lightning.collectives import world_collective_optimizer
from lightning_twobp.lightning.optimizer_groups import OneProcess, moved_from_one_process
from lightning_twobp.options import check_flag
from lightning_twobp.private import tensor_hooks, tensor_version

# check_flag: lightning_twobp.options
__all__ = [
    "check_callbacks",
    "check_flag",
    "check_nodes",
    "check_parameter_hooks",
    "OutsideWrites",
    "check_sync_batchnorm",
    "checked_optimizers",
    "converted_in_place",
]

_LOOPBACK = ("", "127.0.0.1", "localhost", "::1")


def check_callbacks(callbacks: Sequence[Any]) -> None:
    """Lightning callbacks that act on the whole model as one process holds it, refused before any compute:

    - weight averaging (``StochasticWeightAveraging``, ``WeightAveraging`` and its ``EMAWeightAveraging``)
      deep-copies the whole LightningModule in its ``setup``, before the pipeline splits it, then pairs the
      copy's parameters with ``pl_module.parameters()``, which under the pipeline are this rank's only: a
      shape error at its first average, on one rank;
    - ``ModelPruning`` collects the modules to prune in its ``setup``, before the split: at the first
      epoch's end it pruned layers of other ranks, on the meta device (a torch error, after an epoch of
      training), and a global threshold would rank this rank's weights alone;
    - ``BackboneFinetuning`` sets the learning rate of ``optimizer.param_groups[-1]`` each epoch after the
      unfreezing, the group it added for the backbone; a rank that holds none of the backbone added none,
      and its last group is the head's: the head trained at the backbone's rate, silently. A subclass that
      overrides ``finetune_function`` (as the refusal says to) is the user's schedule, and accepted."""
    for cb in callbacks:
        reason = _unsupported(cb)
        if reason:
            raise ValueError(f"callbacks=[{type(cb).__name__}(...)] is not supported under strategy='twobp': {reason}")


def _unsupported(cb: Any) -> str | None:
    from lightning.pytorch.callbacks import BackboneFinetuning, ModelPruning, StochasticWeightAveraging

    averaging: tuple[type, ...] = (StochasticWeightAveraging,)
    try:
        from lightning.pytorch.callbacks import WeightAveraging  # Lightning >= 2.6

        averaging += (WeightAveraging,)
    except ImportError:  # pragma: no cover - older Lightning
        pass
    if isinstance(cb, averaging):
        return (
            "it averages a copy of the whole model, made before the pipeline splits it, against the parameters of "
            "this rank's stages alone. Average each rank's own parameters in a callback of yours "
            "(pl_module.parameters() after setup are this rank's; torch.optim.swa_utils.get_ema_multi_avg_fn does "
            "the update), or average after training, in one process, from a consolidated checkpoint "
            "(twobp-consolidate)"
        )
    if isinstance(cb, ModelPruning):
        return (
            "it collects the modules to prune before the pipeline splits the model, so it would prune layers that "
            "live on other ranks (and a global threshold would rank this rank's weights alone). Prune before fit "
            "(torch.nn.utils.prune on the model: the pruned model trains as in one process), or after training, in "
            "one process, from a consolidated checkpoint (twobp-consolidate)"
        )
    # a subclass with a finetune_function of its own is the fix this names: accepted
    if isinstance(cb, BackboneFinetuning) and type(cb).finetune_function is BackboneFinetuning.finetune_function:
        return (
            "after unfreezing it sets the learning rate of optimizer.param_groups[-1], taken to be the backbone's "
            "group; a pipeline rank that holds none of pl_module.backbone adds no group, and its last group is "
            "another's, which would train at the backbone's rate. Subclass it and, in finetune_function after the "
            "unfreezing epoch, set the rate of the groups that hold the backbone's parameters (found by id; none "
            "on a rank that holds none of them)"
        )
    return None


def check_sync_batchnorm(layer_sync: Any, module: nn.Module) -> None:
    """``Trainer(sync_batchnorm=True)`` was ignored: Lightning's DDP converts the model in its own setup, which
    this strategy replaces, so every replica normalised alone while the user asked for synchronised
    statistics. A model converted by hand (``nn.SyncBatchNorm``) gathers each forward's statistics over the
    whole world, whose ranks hold other stages and run other layers at other times. Refused before any compute."""
    synced = [name or type(module).__name__ for name, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if layer_sync is None and not synced:
        return
    if layer_sync is not None:
        from lightning.pytorch.plugins import TorchSyncBatchNorm  # what sync_batchnorm=True gives

        what = (
            "Trainer(sync_batchnorm=True)"
            if isinstance(layer_sync, TorchSyncBatchNorm)
            else f"plugins=[{type(layer_sync).__name__}(...)]"
        )
    else:
        what = f"nn.SyncBatchNorm ({', '.join(synced[:3])}{', ...' if len(synced) > 3 else ''})"
    raise ValueError(
        f"{what} is not supported under strategy='twobp': SyncBatchNorm gathers a forward's batch statistics from "
        f"every rank of its process group at once, but a pipeline runs each stage's micro-batches on its own ranks "
        f"at its own times (torch's default group, the world, holds every stage). BatchNorm here normalises each "
        f"micro-batch on its own, as gradient accumulation does: drop sync_batchnorm=True (and "
        f"nn.SyncBatchNorm.convert_sync_batchnorm), or use GroupNorm for statistics that do not depend on the "
        f"micro-batch"
    )


def converted_in_place(plugin: Any, module: nn.Module) -> None:
    """``plugin.convert_module(module)``, refused where it replaced layers rather than casting them.

    The strategy builds the pipeline before the precision plugin converts the model (the stages hold the
    layers then), so a plugin that swaps layers for others (Lightning's ``TransformerEnginePrecision`` and
    ``BitsandbytesPrecision`` replace each ``nn.Linear``) left the pipeline training the old layers while the
    optimizer took the new ones' parameters: every step silently wrong. A cast (``"bf16-true"``) keeps each
    Parameter object, changing its data in place."""
    before = {id(q) for q in module.parameters()}
    plugin.convert_module(module)
    if {id(q) for q in module.parameters()} != before:
        raise ValueError(
            f"{type(plugin).__name__} replaced layers of the model as it converted it, which strategy='twobp' does "
            f"not support: the pipeline is built before the conversion and would train the layers it took, not the "
            f"new ones the optimizer holds. Build the model with the layers you want (replace them before fit) and "
            f"use a precision that casts, e.g. precision='bf16-true' or 'bf16-mixed'"
        )


def check_parameter_hooks(lm: nn.Module, stages: Mapping[int, nn.Module], when: str) -> None:
    """A gradient hook (``p.register_hook``) or a post-accumulate-grad hook on a parameter of this rank's
    stages, refused on every rank together (a collective over the world: every rank calls this at the same
    point, at setup and before the first training step's first forward).

    One process runs such a hook once per backward on the parameter's whole gradient. The pipeline computes
    each gradient per micro-batch, and its split backward adds the weight gradients into ``.grad`` itself
    (``Stage._accumulate``), so the hooks ran on parts or not at all: a clamp hook was ignored (every
    parameter 0.03-0.12 off one process after an epoch), a post-accumulate hook ran 0 to 24 times where one
    process ran it 36. Run per part, a nonlinear hook (a clamp) of each part summed is not the hook of the
    sum, so there is no exact way to run them. The strategy registers none on parameters (``Stage``'s
    ``_Hidden`` compares ``.grad`` before and after B); nor does FSDP2's ``fully_shard``."""
    names = {id(q): n for n, q in lm.named_parameters()}
    problem = None
    for s in sorted(stages):
        for local, q in stages[s].named_parameters():
            grad, post = tensor_hooks(q)
            if grad or post:
                problem = _hook_refusal(f"{names.get(id(q), local)} (pipeline stage {s})", grad, when)
                break
        if problem:
            break
    others = [p for p in _everyone(problem) if p]
    if problem or others:
        raise ValueError(problem or others[0])


def _hook_refusal(name: str, grad: list[Any], when: str) -> str:
    if any(_owner(h).startswith("wandb") for h in grad):  # read-only logging hooks, on every parameter
        kind = "a gradient hook of wandb's (WandbLogger.watch / wandb.watch with log='gradients' or 'all')"
        fix = (
            "Watch with log='parameters' (or log=None), or log gradient statistics yourself in "
            "on_before_optimizer_step, where each rank's p.grad holds the whole gradient of the step"
        )
    elif grad:
        kind = "a gradient hook (Tensor.register_hook)"
        fix = (
            "For a per-element clamp use Trainer(gradient_clip_val=c, gradient_clip_algorithm='value'), or "
            "clamp p.grad in on_before_optimizer_step (p.grad.clamp_(-c, c)): both see each parameter's whole "
            "gradient of the step, as one process's hook does, and match one process"
        )
    else:
        kind = "a post-accumulate-grad hook (Tensor.register_post_accumulate_grad_hook)"
        fix = (
            "An optimizer stepped in the hook (torch's optimizer-in-backward) would step on parts: let Lightning "
            "step the optimizer (return it from configure_optimizers), and do other per-parameter work on p.grad "
            "in on_before_optimizer_step, where it holds the whole gradient of the step"
        )
    return (
        f"{name} has {kind}, found {when}, which strategy='twobp' cannot run as one process does: the pipeline "
        f"computes each parameter's gradient per micro-batch (and 2BP's split adds the weight gradients into .grad "
        f"itself, in two halves: B and W), so the hook would see parts of the gradient, or not run at all, and a "
        f"clamp of each part summed is not the clamp of the sum. {fix}"
    )


def _owner(hook: Any) -> str:
    """The module that defined ``hook`` (a function, a ``functools.partial`` of one, or a callable object)."""
    fn = getattr(hook, "func", hook)
    return str(getattr(fn, "__module__", None) or getattr(type(fn), "__module__", ""))


class OutsideWrites:
    """The LightningModule's parameters outside this rank's stages, from the call's first training batch on
    (or a checkpoint's load): one written during training (an EMA teacher's ``mul_().add_()``, a momentum
    encoder's ``p.data = tau * p.data + ...``, ``torch.optim.swa_utils.AveragedModel.update_parameters``) is
    refused before the next step and at the end of training, on every rank that wrote it.

    Each rank holds only its own stages' weights of the pipelined layers, and only the last stage's rank runs
    the step past the pipelined call, so such a copy holds other values on every rank and none of them is one
    process's: a trial's EMA teacher by ``zip(teacher.parameters(), self.layers.parameters())`` paired the
    teacher's first layers with the last stage's (0.23 off one process after an epoch, silently, where the
    layers' shapes repeat; a torch shape error where they do not); by name, each rank's copy kept the other
    stages' layers as they started. Nothing else writes those parameters: the optimizer skips a parameter
    without a gradient, and no parameter outside the stages gets one (the stages' graphs refuse them).

    Each check compares the version counters and storages (an in-place write, a ``.data =`` rebind); the first
    :attr:`VALUE_CHECKS` and the one at the end of training compare values too (a write into ``.data`` moves
    no version counter), one norm per parameter and one host sync, not at every step."""

    VALUE_CHECKS = 2

    def __init__(self, lm: nn.Module, stages: Mapping[int, nn.Module]) -> None:
        inside = {id(q) for stage in stages.values() for q in stage.parameters()}
        self.watched = [(n, q) for n, q in lm.named_parameters() if id(q) not in inside]
        self._marks = self._mark()
        self._values = self._norms()
        self._value_checks = self.VALUE_CHECKS

    def _mark(self) -> list[tuple[int, int]]:
        return [(tensor_version(q), q.data_ptr()) for _, q in self.watched]

    def _norms(self) -> list[float]:
        if not self.watched:
            return []
        with torch.no_grad():
            return torch.stack(
                [torch.linalg.vector_norm(q.detach(), dtype=torch.float32) for _, q in self.watched]
            ).tolist()

    def check(self, when: str, values: bool = False) -> None:
        """Refuse a write since the start (``when``: where it is seen); ``values``: compare values too."""
        problem = self.problem(when, values)
        if problem:
            raise ValueError(problem)

    def check_everywhere(self, when: str) -> None:
        """At the end of training, on every rank at once (a collective over the world): values compared, and
        every rank refuses where one saw a write, as none of them trains again to be stopped at a next step."""
        problem = self.problem(when, values=True)
        others = [p for p in _everyone(problem) if p]
        if problem or others:
            raise ValueError(problem or others[0])

    def problem(self, when: str, values: bool = False) -> str | None:
        changed = [n for (n, _), was, now in zip(self.watched, self._marks, self._mark(), strict=True) if was != now]
        if not changed and self.watched and (values or self._value_checks > 0):
            self._value_checks -= 1
            pairs = zip(self.watched, self._values, self._norms(), strict=True)
            changed = [n for (n, _), was, now in pairs if was != now and not (math.isnan(was) and math.isnan(now))]
        if not changed:
            return None
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        return (
            f"{shown} (outside the pipelined layers) changed during training (seen {when}): under "
            f"strategy='twobp' each rank holds only its own stages' weights of the pipelined layers and only the "
            f"last stage's rank runs the step past the pipelined call, so a copy outside the pipeline updated from "
            f"them (an EMA teacher, a momentum encoder, AveragedModel) would hold other values on every rank, none "
            f"of them one process's. Such a copy is not supported yet: keep it frozen (a fixed reference model is "
            f"fine) or train it without the pipeline; a value that depends on nothing the pipeline holds (a "
            f"schedule) can be a buffer (register_buffer), which this check leaves alone"
        )


def check_nodes(num_nodes: int, devices: int, environment: Any) -> None:
    """``num_nodes > 1`` while Lightning launches the processes on this machine and nothing says which node
    this is: the ranks started here would wait for the other nodes' ranks, which nobody starts (a hang
    until the process group's timeout). Refused before anything is launched."""
    if num_nodes <= 1 or environment is None or environment.creates_processes_externally:
        return
    if os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK"):
        return  # a multi-node run started by hand on each node
    address = os.environ.get("MASTER_ADDR", "")
    if address not in _LOOPBACK:
        return
    raise ValueError(
        f"Trainer(num_nodes={num_nodes}, devices={devices}) on one machine: Lightning starts {devices} process(es) "
        f"here and they would wait for {(num_nodes - 1) * devices} more from {num_nodes - 1} other node(s) that "
        f"nothing starts (NODE_RANK is not set, MASTER_ADDR={address or 'unset'}). On one machine use num_nodes=1 "
        f"with devices={num_nodes * devices}; across machines run the same command on each node with "
        f"NODE_RANK=0..{num_nodes - 1} and MASTER_ADDR=<node 0's address>, or launch with torchrun or srun"
    )


def checked_optimizers(
    setup: Callable[[], None],
    module: nn.Module,
    optimizers: Callable[[], list[Any]],
    pp_rank: int,
    stages: Sequence[int],
    pipeline_degree: int = 2,
    one_process: OneProcess | None = None,
) -> None:
    """Run ``setup`` (Lightning's ``configure_optimizers``) and check what it built, on every rank together:
    a failure on one rank (torch's "empty parameter list" where an optimizer covers other stages' layers
    only) is raised on every rank at once, not left for the others to wait on at the first step. An
    optimizer whose step reads all of its parameters at once (LBFGS) is refused when the model is split, and
    one that steps a parameter otherwise than ``one_process``'s places (:mod:`.optimizer_groups`)."""
    error: Exception | None = None
    try:
        setup()
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised again
        error = e
    if error is None:
        problem = (
            _outside(module, optimizers(), pp_rank)
            or _whole_model_step(optimizers(), pipeline_degree)
            or _zero_over_stages(optimizers(), pp_rank, pipeline_degree)
            or world_collective_optimizer(optimizers(), pipeline_degree)
            or moved_from_one_process(one_process, module, optimizers(), pp_rank)
        )
    elif isinstance(error, ValueError) and "empty parameter list" in str(error):
        problem = (
            f"configure_optimizers on pipeline rank {pp_rank} (stages {list(stages)}) gave an optimizer an empty "
            f"parameter list ({error}): under strategy='twobp' each rank holds only its own stages' parameters, so "
            f"an optimizer over some layers only (e.g. self.layers[:3].parameters()) has none on the ranks that "
            f"hold none of them; build every optimizer from self.parameters() (param groups by name for different "
            f"settings), and leave layers untrained with requires_grad_(False) instead of leaving them out (an "
            f"optimizer over the parameters that require grad has none on a rank whose layers are all frozen)"
        )
    elif isinstance(error, ValueError) and "more than one parameter group" in str(error) and pipeline_degree > 1:
        problem = (
            f"configure_optimizers on pipeline rank {pp_rank} (stages {list(stages)}) put a parameter in two param "
            f"groups ({error}). Where it runs in one process without this error, the parameter is a tied weight "
            f"(lm_head's and wte's): one process lists it under its first name only (self.named_parameters()), and "
            f"this rank holds a copy listed under each of its names (lm_head.weight, and wte.parameters() through "
            f"the placeholder of wte's stage). Choose its group by one name or one module"
        )
    else:
        problem = f"configure_optimizers failed on pipeline rank {pp_rank}: {type(error).__name__}: {error}"
    others = [p for p in _everyone(problem) if p and p != problem]
    if error is not None:
        assert problem is not None  # both branches above describe the error
        if problem.startswith("configure_optimizers on"):
            raise ValueError(problem) from error
        raise error
    if problem:
        raise ValueError(problem)
    if others:
        raise RuntimeError(f"twobp: stopped before the first step because {others[0]}")


def _outside(module: nn.Module, optimizers: list[Any], pp_rank: int) -> str | None:
    mine = {id(q) for q in module.parameters()}
    stray = [q for opt in optimizers for group in opt.param_groups for q in group["params"] if id(q) not in mine]
    if not stray:
        return None
    shapes = ", ".join(str(tuple(q.shape)) for q in stray[:4]) + (" ..." if len(stray) > 4 else "")
    return (
        f"an optimizer of configure_optimizers on pipeline rank {pp_rank} holds {len(stray)} tensor(s) that are not "
        f"parameters of the LightningModule (shapes {shapes}): under strategy='twobp' the pipeline computes the "
        f"gradients of the module's parameters only, and checkpoints key optimizer state by parameter name; "
        f"register it in the module (self.scale = nn.Parameter(...)) or leave it out of the optimizer. "
        f"configure_optimizers runs more than once at setup (once more on the whole model, to compare its param "
        f"groups with this rank's): an optimizer kept from an earlier call holds other ranks' parameters, so "
        f"build a new one in each call"
    )


def _whole_model_step(optimizers: list[Any], pipeline_degree: int) -> str | None:
    """torch's LBFGS computes its direction, step size and stopping tests from dot products and norms over
    all of its parameters; on a rank holding some stages only, each rank would take another step than one
    process (found by a trial: every parameter off by up to 5.9 after 3 steps, silently)."""
    lbfgs = [opt for opt in optimizers if isinstance(opt, torch.optim.LBFGS)]
    if not lbfgs or pipeline_degree == 1:
        return None
    return (
        f"{type(lbfgs[0]).__name__} is not supported under strategy='twobp' with pipeline_degree="
        f"{pipeline_degree}: its step takes dot products and norms over all of its parameters (the search "
        f"direction, the step size, the line search and the stopping tests), but each rank's optimizer holds "
        f"only its own stages' parameters, so every rank would step differently from one process. Use an "
        f"optimizer whose update is per parameter (SGD, Adam, AdamW, ...; a closure that Lightning's "
        f"optimizer_step calls several times is fine), or train with LBFGS in one process"
    )


def _zero_over_stages(optimizers: list[Any], pp_rank: int, pipeline_degree: int) -> str | None:
    """torch's ZeroRedundancyOptimizer shards its parameter list over its process group (the world by default)
    and broadcasts each shard from the rank that updated it into the same place of every rank's list; ranks
    holding other stages hold other parameters, so each rank's weights were overwritten by another stage's
    (found by a trial: 0.48 off one process after 6 steps, silently, where the stages' shapes agree; gloo's
    size mismatch abort where they do not). Global rank g is pipeline rank g % pipeline_degree
    (:meth:`.layout.Layout.global_rank_of`)."""
    # not imported here: torch.distributed.optim scripts its functional optimizers on import (66 warnings of
    # torch.jit's deprecation); an optimizer of that class exists only where the user imported its module
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    for opt in optimizers:
        if zero is None or not isinstance(opt, zero.ZeroRedundancyOptimizer) or pipeline_degree == 1:
            continue
        ranks = dist.get_process_group_ranks(opt.process_group)
        others = [g for g in ranks if g % pipeline_degree != pp_rank]
        if others:
            return (
                f"ZeroRedundancyOptimizer over global ranks {ranks} under strategy='twobp': global rank(s) {others} "
                f"hold other pipeline stages (other parameters), and ZeRO broadcasts each shard it updates into the "
                f"same place of every rank's parameter list, so each stage's weights would be overwritten by "
                f"another's. Shard over the data-parallel replicas of this stage: "
                f"ZeroRedundancyOptimizer(..., process_group=self.trainer.strategy.group('dp')), or use "
                f"TwoBPStrategy(data_parallel='shard')"
            )
    return None


def _everyone(problem: str | None) -> list[str | None]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [problem]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, problem)
    return every


def grad_scalars(layers: Any) -> set[int]:
    """The ids of the scalars requiring grad that ``layers`` and their submodules hold as plain attributes."""
    return {id(t) for *_, t in _attribute_tensors(layers)}


def _attribute_tensors(layers: Any) -> Iterator[tuple[int, str, str, torch.Tensor]]:
    """(layer index, submodule path in it, attribute, tensor) for every scalar tensor with a ``grad_fn`` held in
    a module's own ``__dict__`` (not a parameter or buffer: those are in ``_parameters`` / ``_buffers``),
    directly or in a list, tuple or dict. Scalars only: a loss is one, while the weights that torch's hook-based
    ``weight_norm``, ``spectral_norm`` and ``prune`` set as attributes before each forward are not, nor is an
    activation kept for a look."""
    for k, layer in enumerate(layers):
        for sub, module in layer.named_modules():
            for attr, value in vars(module).items():
                if attr in ("_parameters", "_buffers", "_modules"):
                    continue
                values = (
                    value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
                )
                for t in values:
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.dim() == 0:
                        yield k, sub, attr, t


CARRY_AUX = (
    "Carry it through the pipeline instead: have the layer return (hidden, aux) and each later layer pass the running "
    "sum on (a tuple of tensors travels between stages), then `out, aux = self.layers(x)` in training_step; or put "
    "the layers that store it on the last stage (balance=[...])"
)
LOOP_AUX = (
    "A block passes one hidden state on under the ModuleList contract, so such a loss cannot travel with it: put "
    "those blocks on the last stage (balance=[...]), or train without it (as Hugging Face's router loss, "
    "output_router_logits=False), or use one nn.Sequential whose layers return (hidden, aux)"
)


def _graph_of(out: Any) -> set[Any]:
    """The autograd nodes the tensors in ``out`` (a tensor or a tuple, list or dict of them) depend on."""
    values = out.values() if isinstance(out, dict) else out if isinstance(out, list | tuple) else [out]
    todo: list[Any] = [t.grad_fn for t in values if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return seen


def stored_for_loss(
    layers: Any, name_of: Callable[[int, str], str], before: set[int], fix: str, out: Any = None
) -> None:
    """Refuse a scalar that a layer of a stage other than the last stored on a module in its training forward
    and that requires grad: an auxiliary loss kept on the module (``self.aux = ...``: a Switch MoE's
    load-balancing loss, a VQ-VAE's commitment loss, a Bayesian layer's KL) for ``training_step`` to add.
    The step's code after the pipelined call runs on the last stage, where this layer is a placeholder:
    ``hasattr(layer, 'aux')`` was False there, so the term was left out of the loss, silently (every
    parameter 3e-4 to 3e-3 off one process after 4 steps in a trial; the logged ``aux`` 1.2 off; a
    ModuleList's blocks alike). ``name_of(k, sub)``: the model's name of submodule ``sub`` of layer ``k``;
    ``before``: the ids :func:`grad_scalars` found before the forward; ``fix`` ends the message. A scalar the
    stage's output ``out`` depends on is carried (a loss passed on with the hidden state, as the fix says, which
    a library layer may keep on itself too: DeepSpeed's ``MOELayer.l_aux``) or used (a gate
    ``self.alpha = sigmoid(...)``), not left behind: not refused."""
    graph: set[Any] | None = None
    for k, sub, attr, t in _attribute_tensors(layers):
        if id(t) not in before:
            graph = _graph_of(out) if graph is None else graph
            if t.grad_fn in graph:
                continue
            name = name_of(k, sub)
            raise RuntimeError(
                f"{name} stored a scalar that requires grad on itself in its training forward ({name}.{attr}; "
                f"an auxiliary loss kept on the module?), on a pipeline stage other than the last: under "
                f"strategy='twobp' training_step's code after the call of the pipelined layers runs on the last stage "
                f"only, where {name} is a placeholder without it, so a loss term read from it there would be "
                f"missing (or, with hasattr or getattr(..., 0), left out silently). {fix}; `.detach()` it if it is "
                f"only kept for a look"
            )
