"""``TwoBPStrategy(data_parallel="shard")``: each stage's parameters, gradients and optimizer state
sharded over its data-parallel replicas with FSDP2 (``torch.distributed.fsdp.fully_shard``), on the
``"dp"`` dimension of the run's ``("dp", "pp")`` mesh (issue 22).

FSDP2's own hooks reduce-scatter a module's gradients at the end of its backward. Under 2BP that
moment is after B, before W has produced any weight gradient, so they cannot do it here. Instead,
per stage and per step:

1. :meth:`ShardedStages.gather`, before the step's first action: ``unshard()`` all-gathers the
   parameters once; they stay gathered through the step's last W (FSDP's automatic gradient sync and
   its reshard after backward are off, and ``reshard_after_forward=False``, so no micro-batch gathers
   again). The stage's split backward then works on the gathered parameters exactly as on replicas.
2. Gradients accumulate unsharded over the step's micro-batches (B's early edges and W's).
3. :meth:`ShardedStages.reduce` is the executor's ``grad_reduce``: right after the stage's last W it
   starts one reduce-scatter per dtype over the replicas (SUM, then divided by ``dp``, as the
   replicated reduce does); at the step's end each shard's gradient becomes its DTensor parameter's
   ``.grad``, the gathered gradients are freed and ``reshard()`` frees the gathered parameters.

The optimizer (``configure_optimizers`` runs after setup) holds the DTensor shards, so its state is
sharded too.

Tied weights across stages (GPT-2's ``wte`` on the first stage, ``lm_head`` on the last) are sharded
like any weight: each holder's stage shards its copy on dim 0 over the same ``"dp"`` mesh, so replica
r of every holder holds the same rows, and :class:`~.grads.TiedParameters` sums the holders' shard
gradients within each replica (after the reduce-scatter), as it sums whole gradients when replicated.
:meth:`ShardedStages.resolve` points it at the DTensor shards.

A parameter used by two stages of one rank (the V schedules put the first and last stage on rank 0)
cannot be sharded as one: each stage's ``fully_shard`` group would make its own shard of it. So
before sharding, :func:`untie_within_rank` gives each later stage that uses it its own Parameter, a
clone of the same values, and the copies become a tie like one across ranks: both are sharded on dim
0 over the same mesh (replica r holds the same rows of each), and :class:`~.grads.TiedParameters`
gives both shards the sum of their gradients after the reduce-scatter (:attr:`ShardedStages.twins`);
the global norm counts the weight once. Equal values, equal gradients and the same optimizer update
keep the copies bitwise equal, step after step. The optimizer holds both copies, so that weight's
optimizer state (and its shard) is held twice on that rank; a checkpoint holds both names, as the
tied model's ``state_dict`` does. At the call's end each use gets the user's own Parameter back: the
model is tied again.

Only public FSDP2 calls are used: ``fully_shard``, ``unshard``, ``reshard``,
``set_requires_gradient_sync``, ``set_reshard_after_backward``, ``MixedPrecisionPolicy``.

Under ``precision="bf16-mixed"`` the shards (and the optimizer) stay fp32 and FSDP2 gathers them as
bf16 (``MixedPrecisionPolicy(param_dtype=bfloat16)``: half the all-gather's bytes and half the
gathered parameters' memory); the stage's gradients accumulate in bf16 over the micro-batches and
are cast to fp32 for the reduce-scatter (the policy's ``reduce_dtype`` stays unset: with it FSDP2's
post-backward hook would move the gradients aside after B, before W has added to them). Under
``"bf16-true"`` and ``"16-true"`` Lightning converts the model after it is cut and sharded, so the shards, their
gradients (reduced in that dtype, as the replicated all-reduce does) and the optimizer state are half
precision: half of fp32's bytes again. Under ``"16-mixed"`` the shards stay fp32 (no policy: autocast
computes in fp16) and the GradScaler's overflow check (torch's ``ShardedGradScaler``, one all-reduce over
the world, :func:`~.grads.overflow_agreeing_scaler`) reads each rank's DTensor gradient shards.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_twobp.lightning.failures import naming_lost
from lightning_twobp.lightning.shard_reads import answers_within_meshes, logged_whole

log = logging.getLogger(__name__)

__all__ = [
    "ShardedStages",
    "check_replicas",
    "check_stages",
    "mixed_precision",
    "replica_names",
    "sharded_static_bytes",
    "state_bytes",
    "untie_within_rank",
]

# the "-true" half precisions convert the model before it is cut and sharded: FSDP2 then shards half-precision
# parameters, whose gradients and optimizer state are half precision too (no policy needed)
_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-true", "16-mixed")


def mixed_precision(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for Lightning's ``precision``: bf16 gathered parameters under "bf16-mixed"."""
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16-mixed" else None


def sharded_static_bytes(
    params: int, weight: int, grad: int, optimizer: int, dp: int, precision: str, trained: int | None = None
) -> int:
    """A stage's peak bytes of parameters, gradients and optimizer state on one rank (``twobp-plan``):
    its ``1/dp`` share of each (rounded up), plus what a step holds in full from the first F to the
    last W: the gathered parameters and the unsharded gradients of the trained ones (``grad`` bytes, or
    ``trained`` parameters in bf16 under "bf16-mixed"; a frozen weight has none)."""
    shares = sum(-(-b // dp) for b in (weight, grad, optimizer))
    if precision == "bf16-mixed":  # gathered and accumulated in bf16
        return shares + 2 * (params + (params if trained is None else trained))
    return shares + weight + grad  # as stored: a frozen base of another dtype than its adapters counted exactly


def check_replicas(dp_degree: int, precision: str) -> None:
    """Refuse, before the model is cut, a layout or precision sharding does not support (yet)."""
    if precision not in _PRECISIONS:
        raise ValueError(
            f"data_parallel='shard' with precision={precision!r}: fp32 ('32-true'), 'bf16-mixed', 'bf16-true', "
            f"'16-true' and '16-mixed' are supported; use one of those or data_parallel='replicate'"
        )
    if dp_degree < 2:
        raise ValueError(
            f"data_parallel='shard' with {dp_degree} data-parallel replica: there is nothing to shard the stages "
            f"over; use data_parallel='replicate' (the default), or more devices than pipeline_degree "
            f"(devices x num_nodes = pipeline_degree x replicas, replicas >= 2)"
        )


def untie_within_rank(stages: dict[int, nn.Module]) -> list[list[tuple[int, str]]]:
    """Give each stage after the first of this rank that uses a parameter its own copy of it (a new
    Parameter of the same values, in all of that stage's uses), so that every stage's ``fully_shard``
    shards parameters of its own. Returns, per parameter so untied, its copies as ``(stage, name)`` in
    stage order, the stage that keeps the user's Parameter first. This changes attributes of the
    user's modules; :meth:`ShardedStages.unshard_for_good` puts the user's Parameter back in each use."""
    kept: dict[int, tuple[int, str]] = {}  # id(parameter) -> (the first stage using it, its name there)
    twins: dict[int, list[tuple[int, str]]] = {}
    for s in sorted(stages):
        copies: dict[int, nn.Parameter] = {}  # this stage's copy of each, one for all of its uses
        for name, q in list(stages[s].named_parameters(remove_duplicate=False)):
            first = kept.setdefault(id(q), (s, name))
            if first[0] == s:
                continue
            if id(q) not in copies:
                copies[id(q)] = nn.Parameter(q.detach().clone(), requires_grad=q.requires_grad)
                twins.setdefault(id(q), [first]).append((s, name))
            owner, _, leaf = name.rpartition(".")
            setattr(stages[s].get_submodule(owner), leaf, copies[id(q)])
    return list(twins.values())


def check_stages(stages: dict[int, nn.Module], name: Callable[[int, str], str] = lambda s, n: n) -> None:
    """Refuse, before any compute, stages sharding does not support (yet); each error says what to do.
    ``name(stage, parameter)``: a stage's parameter by its name in the model."""
    for s, module in stages.items():
        fsdp1 = next((n for n, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)), None)
        if fsdp1 is not None:
            raise ValueError(
                f"stage {s}: module {fsdp1 or '(the stage itself)'} is wrapped in FullyShardedDataParallel (FSDP1); "
                f"under data_parallel='shard' the strategy shards each stage itself with FSDP2's fully_shard, and "
                f"FSDP1's flat parameters cannot be cut into stages: pass the plain module (drop the wrapper)"
            )
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            raise ValueError(
                f"stage {s} already holds a fully_shard module: under data_parallel='shard' the strategy shards "
                f"each stage itself; do not call fully_shard in configure_model"
            )
        for n, q in module.named_parameters():
            if isinstance(q, DTensor):
                raise ValueError(
                    f"stage {s}: parameter {name(s, n)} is already a DTensor; under data_parallel='shard' the strategy "
                    f"shards the stages itself"
                )
            if q.dim() == 0:
                raise ValueError(
                    f"stage {s}: parameter {name(s, n)} is a scalar (0-dim); data_parallel='shard' shards dim 0 of "
                    f"every parameter: make it shape (1,) or use data_parallel='replicate'"
                )


def state_bytes(params: list[nn.Parameter], optimizers: list[Any]) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (local shards of DTensors)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(t: torch.Tensor) -> int:
        return local(t).numel() * t.element_size()

    opt = sum(
        nbytes(v) for o in optimizers for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )
    return {
        "params": sum(nbytes(q) for q in params),
        "grads": sum(nbytes(q.grad) for q in params if q.grad is not None),
        "optimizer": opt,
    }


def _whole(q: torch.Tensor) -> torch.Tensor:
    return (q.full_tensor() if isinstance(q, DTensor) else q).detach().clone()


def _grad(q: nn.Parameter) -> torch.Tensor:
    """``q``'s gradient, or zeros where this replica's micro-batches did not use it (another replica's may have)."""
    return q.grad if q.grad is not None else torch.zeros_like(q)


def replica_names(group: dist.ProcessGroup) -> str:
    """This rank's data-parallel peers, as ``global rank 2 (host a)``: one all-gather at setup, so that a
    lost replica can be named (gloo's error names an address and port)."""
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    return " or ".join(f"global rank {r} (host {h})" for r, h in zip(ranks, hosts, strict=True) if r != me)


class ShardedStages:
    """This rank's stage modules, each ``fully_shard``-ed over ``mesh`` (the ``"dp"`` dimension)."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        mesh: DeviceMesh,
        policy: MixedPrecisionPolicy | None,
        name: Callable[[int, str], str] = lambda s, n: f"stage {s}'s {n}",
        lightning_module: Any = None,
    ) -> None:
        """``name(stage, parameter)``: a stage's parameter by its name in the model, for messages; ``lightning_module``:
        the one of this call, whose ``self.log`` logs a DTensor value whole (:func:`.shard_reads.logged_whole`)."""
        self.mesh = mesh
        self.name = name
        self.group = mesh.get_group()
        self.dp = mesh.size()
        self.replicas = replica_names(self.group)
        self.modules: dict[int, Any] = {}
        self.sharded: dict[int, dict[str, nn.Parameter]] = {}  # stage -> name -> its DTensor parameter
        self.full: dict[int, dict[str, nn.Parameter]] = {}  # stage -> name -> gathered, during a step
        # stage -> name -> the user's Parameter, emptied during the call and given the trained weights
        # back at its end (the user's objects come back; a layer set aside here that shares one, the
        # tied head on the first pipeline rank, shares it again)
        self.originals: dict[int, dict[str, nn.Parameter]] = {s: dict(m.named_parameters()) for s, m in stages.items()}
        # (stage, name) of the copies of each parameter two stages of this rank use, and their shards
        self.twin_names = untie_within_rank(stages)
        for s, stage in stages.items():
            # the same module, now an FSDPModule
            module = fully_shard(
                stage, mesh=mesh, reshard_after_forward=False, mp_policy=policy or MixedPrecisionPolicy()
            )
            module.set_requires_gradient_sync(False)  # reduced after the stage's last W, not after B
            module.set_reshard_after_backward(False)  # held from the first F to the last W
            self.modules[s] = module
            self.sharded[s] = dict(stage.named_parameters())
        for named in self.originals.values():
            for q in named.values():
                # the shards hold the values now: no full copy stays behind; the shape stays (one zero,
                # expanded), for what reads it, the ModuleList contract's meta twins of a tied layer
                q.data = q.data.new_zeros(1).expand(q.shape)
        # Each is one parameter to :class:`~.grads.TiedParameters`: both shards get the sum of their
        # gradients (the same rows on each replica: the same shape, split alike on the same mesh)
        self.twins = [[self.sharded[s][n] for s, n in group] for group in self.twin_names]
        # torch.equal on the shards (BaseFinetuning's) and a number read from them (float(w.norm()) in a
        # callback) ask their replicas, not the world nor this rank alone, until the call's end
        self.within_meshes = ExitStack()
        self.within_meshes.enter_context(answers_within_meshes())
        if lightning_module is not None:  # and a value logged from them (a weight's norm in a hook), whole
            self.within_meshes.enter_context(logged_whole(lightning_module))

    def shards(self) -> dict[int, nn.Parameter]:
        """The user's Parameter (by id) -> its DTensor shard, the parameter the stage and the optimizer now
        hold (one two stages here use: the first stage's)."""
        shard: dict[int, nn.Parameter] = {}
        for s in sorted(self.originals):
            for n, q in self.originals[s].items():
                shard.setdefault(id(q), self.sharded[s][n])
        return shard

    def resolve(self, shared: list[Any]) -> list[Any]:
        """``shared`` (:class:`~.local_model.SharedParameter`) with this rank's copy of each replaced by
        its DTensor shard: the parameter the stage and the optimizer now hold."""
        shard = self.shards()
        return [sp if sp.param is None else dataclasses.replace(sp, param=shard[id(sp.param)]) for sp in shared]

    def gather(self, refresh: Callable[[int], None]) -> None:
        """All-gather every stage's parameters for one step; ``refresh(stage)`` after each (the
        executor's stage re-reads its module's parameters: the gathered ones)."""
        for s, module in self.modules.items():
            with self._naming_lost_replicas(f"the all-gather of stage {s}'s parameters"):
                module.unshard()
            self.full[s] = dict(module.named_parameters())
            refresh(s)

    def _naming_lost_replicas(self, what: str) -> AbstractContextManager[None]:
        """A collective over the replicas that fails on a lost connection or a timeout raises
        :class:`PeerLost` naming them (a whole node lost takes its replicas with it)."""
        return naming_lost(what, lambda: f"a data-parallel replica, {self.replicas},")

    def release(self) -> None:
        """Free the gathered parameters and gradients of every stage (after evaluation, or a failed step)."""
        for s, module in self.modules.items():
            for q in self.full.pop(s, {}).values():
                q.grad = None
            module.reshard()

    def reduce(self, stage: int, params: list[nn.Parameter]) -> Callable[[], None]:
        """The executor's ``grad_reduce`` (``params``: the gathered ones that require grad, alike on every
        replica): start the reduce-scatter of ``stage``'s gradients; the returned function sets the shards'
        gradients and reshards the stage at the step's end. A gradient this replica does not have adds zeros,
        and one no replica has leaves its shard's ``.grad`` None (a flag per parameter, summed over the
        replicas beside the reduce: see :class:`~.grads.ReplicaReduce`)."""
        wanted = {id(q) for q in params}
        names = [n for n, q in self.full[stage].items() if id(q) in wanted]
        if not names:
            return lambda: self.release_stage(stage)
        full = self.full[stage]
        present = torch.tensor(
            [full[n].grad is not None for n in names], dtype=torch.float32, device=full[names[0]].device
        )
        flags = dist.all_reduce(present, group=self.group, async_op=True)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in names:  # reduced in the sharded parameter's dtype (fp32 under "bf16-mixed")
            by_dtype.setdefault(self.sharded[stage][n].dtype, []).append(n)
        started = [self._start(stage, group) for group in by_dtype.values()]

        def finish() -> None:
            with self._naming_lost_replicas(f"the reduce-scatter of stage {stage}'s gradients"):
                assert flags is not None  # async_op=True returns the work
                flags.wait()
                unused = {n for n, used in zip(names, present.tolist(), strict=True) if not used}
                for work, out, group, rows in started:
                    work.wait()
                    self._set_grads(stage, group, out, rows, unused)
            self.release_stage(stage)

        return finish

    def release_stage(self, stage: int) -> None:
        for q in self.full.pop(stage, {}).values():
            q.grad = None
        self.modules[stage].reshard()

    def _start(self, stage: int, names: list[str]) -> tuple[Any, torch.Tensor, list[str], list[int]]:
        """One reduce-scatter of the gradients ``names``: each padded along dim 0 to ``dp`` equal chunks
        (FSDP2's ``torch.chunk`` layout: replica r holds rows ``r*c .. (r+1)*c - 1``, ``c = ceil(n/dp)``),
        laid out ``(dp, chunk)`` so that replica r's output is its chunk of every gradient."""
        dp, parts, rows = self.dp, [], []
        dtype = self.sharded[stage][names[0]].dtype
        for n in names:
            g = _grad(self.full[stage][n])
            c = -(-g.shape[0] // dp)
            padded = g.new_zeros((c * dp, *g.shape[1:]), dtype=dtype)
            padded[: g.shape[0]] = g
            parts.append(padded.reshape(dp, -1))
            rows.append(c)
        flat = torch.cat(parts, dim=1).reshape(-1).div_(dp)  # (dp * sum of chunks); the mean's division first,
        # as the replicated reduce and DDP divide: a SUM of fp16 gradients no larger than their mean
        out = flat.new_empty(flat.numel() // dp)
        work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
        return work, out, names, rows

    def _set_grads(self, stage: int, names: list[str], out: torch.Tensor, rows: list[int], unused: set[str]) -> None:
        offset = 0
        for n, c in zip(names, rows, strict=True):
            full, shard = self.full[stage][n], self.sharded[stage][n]
            assert isinstance(shard, DTensor)  # fully_shard made every parameter of the stage a DTensor
            size = c * math.prod(full.shape[1:])
            if n in unused:  # no replica's micro-batches used it: no gradient, as in one process
                shard.grad = None
                offset += size
                continue
            local = shard.to_local()
            part = out[offset : offset + size].view(c, *full.shape[1:])[: local.shape[0]]
            offset += size
            shard.grad = DTensor.from_local(
                part.clone(), self.mesh, shard.placements, run_check=False, shape=shard.shape, stride=shard.stride()
            )

    def unshard_for_good(self, failed: bool) -> None:
        """At the Trainer call's end: this rank's stages hold their full weights again in the user's own
        Parameters (one all-gather per parameter), so the model is an ordinary model afterwards and ties
        hold. The FSDP2 hooks sit on the stage containers only (ours, dropped with the pipeline), not on
        the user's layers. After a failure the shards stay: another replica may be gone, and the gather
        would wait for it."""
        self.within_meshes.close()
        if not self.modules:  # gathered back already (a refusal at setup, every rank together)
            return
        if failed:
            log.warning(
                "twobp: the Trainer call failed; under data_parallel='shard' this rank's stages keep their "
                "DTensor shards (gathering them would wait on replicas that may be gone), and the model's own "
                "Parameters of those stages hold no values; resume from a checkpoint"
            )
            return
        kept: dict[int, torch.Tensor] = {}  # id(the user's Parameter) -> its trained values
        for s in sorted(self.modules):
            module = self.modules[s]
            # every DTensor to its whole tensor in its own dtype (fp32 under "bf16-mixed", where unshard()
            # would gather bf16 copies)
            full = {n: _whole(q) for n, q in module.named_parameters()}
            for n, t in full.items():
                self._give_back(s, n, t, kept)
            names = {id(q): n for n, q in module.named_parameters()}
            for n, q in module.named_parameters(remove_duplicate=False):  # every use, tied ones too
                owner, _, leaf = n.rpartition(".")
                setattr(module.get_submodule(owner), leaf, self.originals[s][names[id(q)]])
        self.modules, self.sharded, self.full, self.originals = {}, {}, {}, {}

    def _give_back(self, stage: int, name: str, trained: torch.Tensor, kept: dict[int, torch.Tensor]) -> None:
        """The trained values into the user's Parameter, from the first stage that holds it: a later
        stage's copy (:func:`untie_within_rank`) is only compared, bitwise (equal gradients and updates
        keep it so, unless the optimizer treated the copies differently)."""
        original = self.originals[stage][name]
        first = kept.setdefault(id(original), trained)
        if first is trained:
            original.data = trained
        elif not torch.equal(first, trained):
            log.warning(
                "twobp: %s, stage %d's copy of a weight an earlier stage of this rank also uses, differs from "
                "that stage's after training (by up to %.3g); the earlier stage's values are kept. Give every "
                "use of a tied weight the same optimizer settings (param groups by name), or use "
                "data_parallel='replicate'",
                self.name(stage, name),
                stage,
                float((first.float() - trained.float()).abs().max()),
            )
