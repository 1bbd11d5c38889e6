"""Buffers follow data-parallel replica 0, as under DDP's ``broadcast_buffers=True`` (Lightning's default).

A training batch norm updates its running statistics from the micro-batches its replica reads, so
replicas drift apart: each evaluated its shard of a validation set with statistics of its own, and a
checkpoint (replica 0's copy) resumed every replica with replica 0's, so a run's validation read
differently once resumed. DDP broadcasts the module's buffers from rank 0 before each forward; here,
before each training step and at an evaluation's start, each rank broadcasts its model's buffers from
the rank of replica 0 that holds the same stages.

The buffers travel as their bytes, in one flat broadcast: gloo broadcasts no int16, and a byte is a byte
to every backend. The ranks of a data-parallel group hold the same stages, so they list the same buffers
in the same order; a buffer whose size follows the data a replica read (a cache that grows) would make
the broadcasts disagree, a gloo abort or an NCCL hang: each sync first gathers every replica's count and
bytes and refuses a difference, naming it. A buffer off the step's device (a CPU table under NCCL) is left
as it is.
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
        self._shapes: dict[str, tuple[int, ...]] = {}  # each buffer's at the last sync: a change is named

    def sync(self) -> None:
        # read at every step: a module may rebind a buffer (``self.buf = new``) rather than write into it
        named = [(n, b) for n, b in self.module.named_buffers() if b.device == self.device and b.numel()]
        self._check_alike(named)
        if not named:
            return
        # the widest elements first: each buffer's bytes then start at a multiple of its element size, where a
        # view of them as its dtype may start (no copy of the slice)
        named.sort(key=lambda nb: -nb[1].element_size())
        flat = torch.cat([_bytes(b) for _, b in named])
        dist.broadcast(flat, src=self.src, group=self.group)
        if dist.get_rank() == self.src:  # its own buffers were sent: nothing to copy back
            return
        offset = 0
        with torch.no_grad():
            for _, b in named:
                size = b.numel() * b.element_size()
                b.copy_(flat[offset : offset + size].view(b.dtype).view(b.shape))
                offset += size

    def _check_alike(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Every replica's buffers: the same count and bytes, else a refusal on every rank naming the sizes."""
        mine = torch.tensor([len(named), sum(b.numel() * b.element_size() for _, b in named)], device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        seen = [tuple(t.tolist()) for t in every]
        previous, self._shapes = self._shapes, {n: tuple(b.shape) for n, b in named}
        if len(set(seen)) > 1:
            self._shapes = previous  # named against the last sync that agreed
            ranks = dist.get_process_group_ranks(self.group)
            listed = ", ".join(
                f"global rank {r}: {c} buffers, {n} bytes" for r, (c, n) in zip(ranks, seen, strict=True)
            )
            changed = [
                f"{n} {self._shapes[n]} -> {tuple(b.shape)}"
                for n, b in named
                if self._shapes.get(n, tuple(b.shape)) != tuple(b.shape)
            ]
            here = f"changed here since the last step: {', '.join(changed)}" if changed else "none changed here"
            raise RuntimeError(
                f"the data-parallel replicas hold different buffers ({listed}; {here}): under "
                f"strategy='twobp' every replica takes replica 0's buffers before each step, as DDP's "
                f"broadcast_buffers does, which needs them alike. A buffer whose size follows the data a replica "
                f"read (a cache that grows with the sequence length) differs: make it a plain attribute, not a "
                f"registered buffer, or keep its size fixed (allocate it at the largest size)"
            )


def _bytes(b: torch.Tensor) -> torch.Tensor:
    """``b``'s elements as bytes, flat."""
    return b.detach().contiguous().reshape(-1).view(torch.uint8)
