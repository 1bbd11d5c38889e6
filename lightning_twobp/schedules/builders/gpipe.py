"""GPipe (Huang et al., 2019): every forward, then every backward.

With the split backward this is the 2BP paper's GPipe+2BP (Rae, Lee and Richings,
2024, §3): all F, all backward-p1 (B), then backward-p2 (W) of all micro-batches at
once, one W per local stage. The paper concatenates the micro-batches into one GEMM;
here each Linear's weight gradient accumulates in place micro-batch by micro-batch
(``addmm_``), the same FLOPs without the concatenation copy.  With several
stages per rank the stages are placed on the "loop" map (stage s on rank s % p).
"""

from __future__ import annotations

from ..ir import Action, Schedule
from ..spec import BuildRequest


def gpipe(req: BuildRequest) -> Schedule:
    """All F, then all B (or BW), then one batched W per local stage; any placement."""
    placement = req.stage_to_rank
    mbs = range(req.num_microbatches)
    backward = "B" if req.split_backward else "BW"
    rows = []
    for rank in range(req.num_ranks):
        local = [s for s in range(req.num_stages) if placement[s] == rank]
        row = [Action("F", s, m) for s in local for m in mbs]
        # Backward visits the local stages last-to-first: the gradient enters a rank
        # through its highest stage.
        row += [Action(backward, s, m) for s in reversed(local) for m in mbs]
        if req.split_backward:
            row += [Action("W", s, tuple(mbs)) for s in reversed(local)]
        rows.append(tuple(row))
    return Schedule(
        name=req.name,
        num_stages=req.num_stages,
        num_microbatches=req.num_microbatches,
        stage_to_rank=placement,
        actions=tuple(rows),
        split_backward=req.split_backward,
    )
