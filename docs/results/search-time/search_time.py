"""Seconds ``schedule="auto"``'s search takes (``search`` then ``choose``) at p = 2, 4 and 8, on one thread.

The layers are the budget bench's tiny LLaMa measured once (``bench.budget.workload_profile``: F, B, W, the
fused BW and the bytes of every layer at m = 8 and 16), its blocks repeated to 4p so that every family has
a partition at p ranks, at m = p, 2p and 4p with caps 0..2p (what the strategy searches for a batch those
counts divide). Run from the repository root: ``PYTHONPATH=. python docs/results/search-time/search_time.py``;
with ``--ranks N`` the same search runs in N gloo processes (one thread each) that share its builds and
fused variants out as the strategy does (``lightning/search_builds.py``), rank 0's seconds printed, beside
the one-process search on the same profile.
"""

import dataclasses
import sys
import time

import torch

from lightning_twobp.bench.budget import workload_profile
from lightning_twobp.bench.peer import Workload
from lightning_twobp.processes import run_distributed
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


def timed(profile: Profile, build_all=None, fuse_all=None) -> tuple[float, float, int, str]:
    """Seconds of ``search`` and of ``choose`` on ``profile``, the candidates and the fastest."""
    start = time.perf_counter()
    shared = {} if build_all is None else {"build_all": build_all}  # the code before it had no such argument
    candidates = search(profile, max_caps=2 * profile.num_ranks, **shared)
    searched = time.perf_counter()
    best = choose(candidates, float("inf"), **({} if fuse_all is None else {"fuse_all": fuse_all})).best
    return searched - start, time.perf_counter() - searched, len(candidates), best.label


def _shared(rank: int, world: int, profile: Profile) -> tuple[float, float, int, str]:
    from lightning_twobp.lightning.search_builds import build_across, fuse_across  # not in the code before it

    return timed(profile, build_across(), fuse_across())


if __name__ == "__main__":
    torch.set_num_threads(1)
    ranks = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 1
    measured = workload_profile(Workload(), (8, 16))
    for p in (2, 4, 8):
        profile = profile_at(p, measured)
        runs = [("one process", timed(profile))]
        if ranks > 1:
            runs.append((f"{ranks} ranks", run_distributed(_shared, ranks, profile, timeout=600)[0]))
        for how, (s, c, n, label) in runs:
            took = f"search {s:.1f} s, choose {c:.1f} s, total {s + c:.1f} s"
            print(f"p={p}, {how}: {n} candidates, {took}; fastest {label}", flush=True)
