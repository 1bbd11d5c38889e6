"""``schedule="auto"``'s builds and fused variants shared out over the ranks (lightning/search_builds.py):
every rank gets the candidates one process's search makes, having built about 1/world of them; a build
that fails on one rank fails the search on every rank, named, with none left waiting; and a limit given as a
fraction of the device is read against one device size everywhere."""

from __future__ import annotations

import pytest
import torch

from lightning_twobp.lightning.search_builds import _turns, build_across, fuse_across
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules.auto import Build, LayerCost, Profile, builds, choose, search

WORLD = 3


def _profile() -> Profile:
    """Four ranks' pipeline (more than the processes: the search's p is the profile's), m = 4 and 8."""
    per_m = {
        m: LayerCost(f=8 / m, b=8 / m, w=6 / m, bw=13 / m, activation=800 / m, held=320 / m, fixed=1000) for m in (4, 8)
    }
    return Profile(4, {m: (c,) * 8 for m, c in per_m.items()}, {1: (2, 2, 2, 2), 2: (1,) * 8})


def _snapshot(candidates) -> list:
    return [(c.label, c.step_time, c.peak_bytes, c.schedule) for c in candidates]


def _shared(rank: int, world: int) -> dict:
    made = []
    run = Build.run

    def counted(self):
        made.append(self)
        return run(self)

    Build.run = counted  # type: ignore[method-assign]
    try:
        candidates = search(_profile(), max_caps=3, build_all=build_across())
        shared = _snapshot(candidates)
        built = len(made)
        fused = _snapshot(choose(candidates, float("inf"), fuse_all=fuse_across()).considered)

        def broken(self):
            if self == builds(_profile(), max_caps=3)[5]:
                raise RuntimeError("a builder bug")
            return run(self)

        Build.run = broken if rank == _turns(builds(_profile(), max_caps=3))[5] % world else run  # type: ignore[method-assign]
        try:
            search(_profile(), max_caps=3, build_all=build_across())
            failure = None
        except RuntimeError as e:
            failure = str(e)
    finally:
        Build.run = run  # type: ignore[method-assign]
    try:  # rank 1 searches fewer caps (a schedule registered on some ranks only would do the same)
        search(_profile(), max_caps=2 if rank == 1 else 3, build_all=build_across())
        differ = None
    except RuntimeError as e:
        differ = str(e)
    return {
        "candidates": shared,
        "built": built,
        "failure": failure,
        "differ": differ,
        "fused": fused,
        "devices": _devices(rank),
    }


def _devices(rank: int) -> list:
    """The device size a fraction ``memory_limit`` is read against, on ranks whose devices differ, then on ranks
    of which one cannot tell: one number on every rank (the smallest), or None on every rank."""
    from lightning_twobp.lightning import autoschedule

    real = autoschedule.device_bytes
    try:
        autoschedule.device_bytes = lambda device: 1000.0 * (rank + 1)
        sizes = [autoschedule.smallest_device(torch.device("cpu"))]
        autoschedule.device_bytes = lambda device: None if rank == 2 else 1000.0
        return [*sizes, autoschedule.smallest_device(torch.device("cpu"))]
    finally:
        autoschedule.device_bytes = real


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_every_rank_gets_the_one_process_candidates_having_built_a_share():
    alone = _snapshot(search(_profile(), max_caps=3))
    total = len(builds(_profile(), max_caps=3))
    ranks = run_distributed(_shared, WORLD, timeout=180)
    with_fused = _snapshot(choose(search(_profile(), max_caps=3), float("inf")).considered)
    assert any("fused where the split loses" in c[0] for c in with_fused)
    for r in ranks:
        assert r["candidates"] == alone  # labels, times, peaks and orders, to the bit
        assert r["fused"] == with_fused  # and the variants fused where the split loses, made a share per rank
    owner = [t % WORLD for t in _turns(builds(_profile(), max_caps=3))]
    assert [r["built"] for r in ranks] == [owner.count(k) for k in range(WORLD)]
    assert all(0 < r["built"] < total for r in ranks)
    fifth = builds(_profile(), max_caps=3)[5]
    for r in ranks:  # every rank names the build, its rank and the error; none hangs in the gather
        assert r["failure"] == (
            f"schedule='auto' could not make {fifth.name} (m={fifth.num_microbatches}, split_backward="
            f"{fifth.split_backward}, max_pending_w={fifth.max_pending_w}) on rank {owner[5]}: "
            "RuntimeError: a builder bug"
        )
        assert r["differ"] is not None and r["differ"].startswith("schedule='auto': the ranks searched different"), r
        assert r["devices"] == [1000.0, None]


def test_one_process_builds_each_in_turn():
    assert _snapshot(search(_profile(), max_caps=3, build_all=build_across())) == _snapshot(
        search(_profile(), max_caps=3)
    )
