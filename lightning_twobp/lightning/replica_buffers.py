"""Buffers follow data-parallel replica 0, as under DDP's ``broadcast_buffers=True`` (Lightning's default).

A training batch norm updates its running statistics from the micro-batches its replica reads, so
replicas drift apart: each evaluated its shard of a validation set with statistics of its own, and a
checkpoint (replica 0's copy) resumed every replica with replica 0's, so a run's validation read
differently once resumed. DDP broadcasts the module's buffers from rank 0 before each forward; here,
before each pipelined step (training, validation, test, predict), each rank broadcasts its model's
buffers from the rank of replica 0 that holds the same stages: one flat broadcast per dtype.

The ranks of a data-parallel group hold the same stages, so they list the same buffers in the same
order. A buffer off the step's device (a CPU table under NCCL) is left as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ReplicaBuffers"]


class ReplicaBuffers:
    """``sync()``: ``module``'s buffers on ``device`` become those of global rank ``src`` over ``group``."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, src: int, device: torch.device) -> None:
        self.module, self.group, self.src, self.device = module, group, src, device

    def sync(self) -> None:
        # read at every step: a module may rebind a buffer (``self.buf = new``) rather than write into it
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.module.buffers():
            if b.device == self.device and b.numel() and not b.is_meta:
                by_dtype.setdefault(b.dtype, []).append(b)
        for bufs in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in bufs])
            dist.broadcast(flat, src=self.src, group=self.group)
            with torch.no_grad():
                for b, part in zip(bufs, flat.split([b.numel() for b in bufs]), strict=True):
                    b.copy_(part.view_as(b))
