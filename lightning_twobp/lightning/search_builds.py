"""``schedule="auto"``'s builds, and its fused variants, shared out over the ranks.

Every rank runs the same search on the same agreed profile, so that every rank makes the same choice
without one more message. Most of a search's time is its builds (the Zero Bubble families' greedy orders,
each scored in the simulator) and then each split candidate's order fused where its split loses
(docs/schedules.md, "The search's time"); each depends on its own arguments alone. So each rank makes a
share of them, one ``all_gather_object`` gives every rank all of them, and each rank then times and replays
them all itself: the same schedules, the same candidates, the same choice everywhere, in about 1/world of
their time. Every build at one (count, split, cap) is one rank's, so that ZB-H2 finds there the ZB-H1 build
it weighs (``schedules.memo``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_twobp.schedules import Schedule
from lightning_twobp.schedules.auto import Build, BuildAll, Candidate, FuseAll, fused_order

__all__ = ["build_across", "fuse_across"]

T = TypeVar("T")


def build_across(group: Any = None) -> BuildAll:
    """A ``build_all`` for :func:`~lightning_twobp.schedules.auto.search` that shares the builds out over
    ``group`` (default: every rank, each of which must run the same search); each in turn where there is
    no process group of two or more. A build that fails on its rank fails the search on every rank, named;
    ranks whose searches differ (a schedule registered on some ranks only) are refused before any is used."""

    def build_all(requests: Sequence[Build]) -> list[Schedule | None]:
        turns = _turns(requests)
        return _shared(requests, Build.run, turns.__getitem__, _named, group)

    return build_all


def fuse_across(group: Any = None) -> FuseAll:
    """A ``fuse_all`` for :func:`~lightning_twobp.schedules.auto.choose`, shared out as :func:`build_across`."""

    def fuse_all(candidates: Sequence[Candidate]) -> list[Schedule]:
        return _shared(candidates, fused_order, lambda i: i, lambda c: f"{c.label} fused where its split loses", group)

    return fuse_all


def _turns(requests: Sequence[Build]) -> list[int]:
    """Per request, the number of its (count, split, cap) setting in order: rank ``turn % world`` builds it."""
    settings: dict[tuple, int] = {}
    keys = [(b.num_microbatches, b.split_backward, b.max_pending_w) for b in requests]
    return [settings.setdefault(k, len(settings)) for k in keys]


def _named(b: Build) -> str:
    return f"{b.name} (m={b.num_microbatches}, split_backward={b.split_backward}, max_pending_w={b.max_pending_w})"


def _shared(
    items: Sequence[T], make: Callable[[T], Any], turn: Callable[[int], int], name: Callable[[T], str], group: Any
) -> list[Any]:
    """``[make(x) for x in items]``, item ``i`` made by rank ``turn(i) % world`` and gathered everywhere."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return [make(x) for x in items]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {i: _made(make, x) for i, x in enumerate(items) if turn(i) % world == rank}
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, (_digest(items, name), mine), group=group)
    if len({digest for digest, _ in parts}) > 1:
        raise RuntimeError(
            f"schedule='auto': the ranks searched different candidates ({len(items)} on rank {rank}); every rank "
            f"must register the same schedules and measure the same profile"
        )
    made = {i: x for _, part in parts for i, x in part.items()}
    failed = next((i for i in sorted(made) if isinstance(made[i], _Failed)), None)
    if failed is not None:
        raise RuntimeError(
            f"schedule='auto' could not make {name(items[failed])} on rank {turn(failed) % world}: {made[failed].why}"
        )
    return [made[i] for i in range(len(items))]


class _Failed:
    """What went wrong on the rank that made an item, sent to every rank (an exception may not pickle)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _made(make: Callable[[T], Any], x: T) -> Any:
    try:
        return make(x)
    except Exception as e:  # noqa: BLE001 - sent to every rank and raised there: none is left waiting in the gather
        return _Failed(f"{type(e).__name__}: {e}")


def _times(x: Any) -> Any:
    """The durations an item (a :class:`Build`, a :class:`Candidate`) was priced at."""
    return None if x.costs is None else x.costs.times


def _digest(items: Sequence[T], name: Callable[[T], str]) -> str:
    """The items, the same text on every rank that searches the same (Python's hash is per process)."""
    text = "\n".join(f"{name(x)} {_times(x)}" for x in items)
    return hashlib.sha256(text.encode()).hexdigest()
