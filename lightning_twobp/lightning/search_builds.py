"""``schedule="auto"``'s builds shared out over the ranks.

Every rank runs the same search on the same agreed profile, so that every rank makes the same choice
without one more message. Most of a search's time is its builds (the Zero Bubble families' greedy orders,
each scored in the simulator: about 30 s of a p = 8 search on one thread, docs/schedules.md), and each
build depends on its arguments alone. So rank r builds every world-th one, one ``all_gather_object`` gives
every rank all of them, and each rank then times and replays them all itself (the rest of the search):
the same schedules, the same candidates, the same choice everywhere, in about 1/world of the builds' time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from lightning_twobp.schedules import Schedule
from lightning_twobp.schedules.auto import Build, BuildAll

__all__ = ["build_across"]


def build_across(group: Any = None) -> BuildAll:
    """A ``build_all`` for :func:`~lightning_twobp.schedules.auto.search` that shares the builds out over
    ``group`` (default: every rank, each of which must run the same search); each in turn where there is
    no process group of two or more. A build that fails on its rank fails the search on every rank, named."""

    def build_all(requests: Sequence[Build]) -> list[Schedule | None]:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
            return [b.run() for b in requests]
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        mine = {i: _built(requests[i]) for i in range(rank, len(requests), world)}
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, mine, group=group)
        made = {i: x for part in parts for i, x in part.items()}
        failed = next((i for i in sorted(made) if isinstance(made[i], str)), None)
        if failed is not None:
            b = requests[failed]
            raise RuntimeError(
                f"schedule='auto' could not build {b.name} (m={b.num_microbatches}, split_backward="
                f"{b.split_backward}, max_pending_w={b.max_pending_w}) on rank {failed % world}: {made[failed]}"
            )
        return [made[i] for i in range(len(requests))]

    return build_all


def _built(b: Build) -> Schedule | None | str:
    """``b``'s schedule (None: refused), or what went wrong, as text."""
    try:
        return b.run()
    except Exception as e:  # noqa: BLE001 - sent to every rank and raised there: none is left waiting in the gather
        return f"{type(e).__name__}: {e}"
