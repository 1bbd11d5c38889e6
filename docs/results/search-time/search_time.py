"""Seconds ``schedule="auto"``'s search takes (``search`` then ``choose``) at p = 2, 4 and 8, on one thread.

The layers are the budget bench's tiny LLaMa measured once (``bench.budget.workload_profile``: F, B, W, the
fused BW and the bytes of every layer at m = 8 and 16), its blocks repeated to 4p so that every family has
a partition at p ranks, at m = p, 2p and 4p with caps 0..2p (what the strategy searches for a batch those
counts divide). Run from the repository root: ``PYTHONPATH=. python docs/results/search-time/search_time.py``.
"""

import dataclasses
import time

import torch

from lightning_twobp.bench.budget import workload_profile
from lightning_twobp.bench.peer import Workload
from lightning_twobp.schedules.auto import Profile, choose, search


def profile_at(p: int, measured: Profile) -> Profile:
    """``measured``'s first layer, its blocks repeated to ``4 p``, its last layer; each count of p, 2p, 4p at
    the measured size nearest below (m = 8 or 16)."""

    def layers(m: int) -> tuple:
        row = measured.layers[8 if m <= 8 else 16]
        blocks = [row[1 + i % (len(row) - 2)] for i in range(4 * p)]
        return (row[0], *blocks, row[-1])

    counts = (p, 2 * p, 4 * p)
    by_m = {m: layers(m) for m in counts}
    n = len(by_m[p])

    def even(stages: int) -> tuple[int, ...]:
        q, r = divmod(n, stages)
        return tuple(q + (i < r) for i in range(stages))

    return dataclasses.replace(measured, num_ranks=p, layers=by_m, partitions={1: even(p), 2: even(2 * p)})


if __name__ == "__main__":
    torch.set_num_threads(1)
    measured = workload_profile(Workload(), (8, 16))
    for p in (2, 4, 8):
        profile = profile_at(p, measured)
        start = time.perf_counter()
        candidates = search(profile, max_caps=2 * p)
        searched = time.perf_counter()
        best = choose(candidates, float("inf")).best
        done = time.perf_counter()
        print(
            f"p={p}: {len(candidates)} candidates, search {searched - start:.1f} s, choose {done - searched:.1f} s, "
            f"total {done - start:.1f} s; fastest {best.label}",
            flush=True,
        )
