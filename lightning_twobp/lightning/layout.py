"""Where ranks, stages and micro-batches go: the defaults, the process mesh, the schedule's label.

The defaults (``default_num_microbatches``, ``default_stages_per_rank``) and ``schedule_label`` are
:mod:`lightning_twobp.schedules.placement`'s, re-exported here for the strategy and ``twobp-plan``.

Ranks form a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` with named dimensions
``("dp", "pp")``: global rank ``d * p + r`` is pipeline rank ``r`` of data-parallel replica ``d``, so a
pipeline is ``p`` consecutive ranks (on one node when ``p`` divides the GPUs per node: its
point-to-point traffic stays on the fast links) and a data-parallel group holds one stage's replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_twobp.private import gloo_or_nccl_options
from lightning_twobp.schedules import default_num_microbatches, default_stages_per_rank, schedule_label

_IO_TIMEOUT = timedelta(minutes=30)  # at least this for checkpoint collectives

__all__ = [
    "MeshLayout",
    "SideGroups",
    "check_degree",
    "default_num_microbatches",
    "default_stages_per_rank",
    "schedule_label",
]


def check_degree(world_size: int, pipeline_degree: int) -> None:
    """Raise ``ValueError`` when the world does not split into whole pipelines."""
    if pipeline_degree < 1 or world_size % pipeline_degree:
        raise ValueError(
            f"{world_size} devices cannot be split into pipelines of {pipeline_degree}: devices x num_nodes "
            f"must be a multiple of pipeline_degree (use one of "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]})"
        )


@dataclass(frozen=True)
class SideGroups:
    """The process groups beside the mesh's. On NCCL every group runs its operations in order on one
    stream of its own, so a message that waits on a peer holds back whatever was posted after it in its
    group: the schedule's sends and receives travel alone on the mesh's ``"pp"`` group, and what passes
    between steps gets a group of its own (None where there is no process group; all but ``io`` None with
    one pipeline rank).

    - ``io``: checkpoint I/O's, the world with at least 30 minutes (writing, hashing and verifying a large
      checkpoint may take longer than a hung rank should).
    - ``logs``: this pipeline's loss and logs (NCCL matches messages between two ranks in posting order,
      ignoring tags, so they must never mix with the schedule's).
    - ``checks``: this pipeline's post-validation reduce (``engine.post_validation``), posted at a step's
      end and read a step later. On the ``"pp"`` group it held the next step's sends back until the last
      pipeline rank had posted it: a flush at every step boundary, on a GPU only.
    - ``shapes``: stage 0's input signature, sent at each step's start (``engine.p2p.P2P``); on the
      ``"pp"`` group its send held stage 0's first activations back until every peer had posted its
      receive.
    """

    io: dist.ProcessGroup | None
    logs: dist.ProcessGroup | None
    checks: dist.ProcessGroup | None
    shapes: dist.ProcessGroup | None


@dataclass(frozen=True)
class MeshLayout:
    """This rank's place in the ``("dp", "pp")`` mesh."""

    world_size: int
    pipeline_degree: int
    global_rank: int

    def __post_init__(self) -> None:
        check_degree(self.world_size, self.pipeline_degree)

    @property
    def dp_degree(self) -> int:
        return self.world_size // self.pipeline_degree

    @property
    def pp_rank(self) -> int:
        return self.global_rank % self.pipeline_degree

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.pipeline_degree

    def global_rank_of(self, pp_rank: int, dp_rank: int | None = None) -> int:
        """Global rank of pipeline rank ``pp_rank`` in replica ``dp_rank`` (default: this rank's)."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return d * self.pipeline_degree + pp_rank

    def side_groups(self, timeout: timedelta) -> SideGroups:
        """The groups beside the mesh (:class:`SideGroups`), every rank creating every group in one order."""
        if not dist.is_initialized():
            return SideGroups(None, None, None, None)
        io = dist.new_group(timeout=max(timeout, _IO_TIMEOUT))
        mine: list[dist.ProcessGroup | None] = [None, None, None]
        if self.pipeline_degree > 1:
            for d in range(self.dp_degree):
                ranks = [self.global_rank_of(r, d) for r in range(self.pipeline_degree)]
                made = [dist.new_group(ranks, timeout=timeout) for _ in mine]
                if d == self.dp_rank:
                    mine = list(made)
        return SideGroups(io, *mine)

    def init_mesh(self, device: torch.device, timeout: timedelta | None = None) -> DeviceMesh | None:
        """The ``("dp", "pp")`` device mesh over the world; ``None`` without a process group. Its
        groups get ``timeout`` (torch's ``new_group`` would give them its own default, 30 minutes
        for gloo, not the world's)."""
        if not dist.is_initialized():
            return None
        override: dict[int | str, Any] | None = None  # per dimension: (backend, options), as torch takes it
        if group_options(dist.get_backend(), timeout) is not None:
            # one options object per dimension: NCCL's split writes the new group's ranks into the options
            # it is given and keeps them (torch's own split_group copies them for this reason)
            override = {dim: group_options(dist.get_backend(), timeout) for dim in ("dp", "pp")}
        return init_device_mesh(
            device.type, (self.dp_degree, self.pipeline_degree), mesh_dim_names=("dp", "pp"), backend_override=override
        )


def group_options(backend: str, timeout: timedelta | None) -> tuple[str, Any] | None:
    """``(backend, options)`` carrying ``timeout`` for a DeviceMesh's groups (gloo, NCCL), or ``None``
    (no timeout given, or a backend whose options we do not know: torch's defaults then)."""
    if timeout is None or backend not in ("nccl", "gloo"):
        return None
    return backend, gloo_or_nccl_options(backend, timeout)
