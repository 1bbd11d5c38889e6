"""``twobp-bench --memory-model --simulate``: ``--budget``'s table on paper, at p = 4 and 8, for the 2BP
paper's four models, from their layers' measured costs.

    twobp-bench --memory-model --simulate [--quick]

The 2BP paper's four model families as ``--paper`` builds them (:func:`lightning_twobp.bench.paper.models`),
with 16 blocks each (ResNet-50's layout has 16; the transformers and Mamba are given 16 so that a V
cuts p = 8 ranks into 16 stages), a global batch of 64. Every layer and the loss is measured once, in
this one process on one thread (:func:`lightning_twobp.bench.memory_model.layer_costs`: F, B, W and
the fused BW in the thread's CPU seconds, median of 3 after a warm-up, so that other processes on the machine do
not count; and the bytes F saves, B leaves for W, and the output), at the micro-batch sizes of m = p,
2p and 4p. Then, for p = 4 and 8 (comm = 0: one process cannot time a
link):

* **ours**: :func:`lightning_twobp.schedules.auto.search` over every registered schedule, fused and
  split, m in {p, 2p, 4p}, caps 0..2p, the step time the steady-state period for the schedules whose
  steps overlap (the strategy's post-validation) and the makespan otherwise;
* **torch's orders**: fused 1F1B and GPipe (ours, the same order), and torch's own action lists
  (:func:`lightning_twobp.bench.torch_orders.torch_order`) of ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble`` (ZB1P) and ``ScheduleZBVZeroBubble``, each at every m torch
  takes, timed one step at a time (torch's runtime does not overlap steps). Its split keeps a
  micro-batch's whole autograd graph until W, so those hold their activation from F until W: the
  replay is given that (``LayerCost.graph_kept``).

Both sides again with every block checkpointed "full" (each layer measured wrapped as the strategy wraps
it): ours under every schedule; torch's fused 1F1B and GPipe (:func:`_ac_rows`: its split orders are not
priced with checkpointing). Each checkpointed peak includes B's recompute of one block.

At 0.5x, 1x, 1.5x and 2x fused 1F1B's predicted peak (m = 2p), each side's fastest predicted step
whose predicted peak (the fullest rank's) fits. Figures on paper: the memory model is the one
``--memory-model`` checks against the executor (within 10% on 2 ranks); the times are one thread's.
"""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_twobp.bench.budget import BUDGETS
from lightning_twobp.bench.memory_model import layer_costs, partitions
from lightning_twobp.bench.paper import PaperModel
from lightning_twobp.bench.paper import models as paper_models
from lightning_twobp.bench.peer import torch_pipelining_available
from lightning_twobp.bench.report import write_json
from lightning_twobp.schedules import build_schedule, simulate
from lightning_twobp.schedules.auto import Profile, fused_1f1b_peak, search, with_recompute

__all__ = ["DEGREES", "markdown", "models", "run_budget_sim", "torch_rows", "write"]

DEGREES = (4, 8)
BATCH = 64
MiB = 2**20
# torch class -> (its label, stages per rank); fused 1F1B and GPipe are ours, the same orders
_TORCH = {
    "ScheduleInterleaved1F1B": ("torch Interleaved1F1B", 2),
    "ScheduleInterleavedZeroBubble": ("torch ZB1P", 1),
    "ScheduleZBVZeroBubble": ("torch ZBV", 2),
}


def models(quick: bool = False, names: Sequence[str] | None = None) -> list[PaperModel]:
    """The four paper models (or those ``names``: llama, bert, mamba, resnet) with 16 blocks and a batch
    of :data:`BATCH` (``quick``: 8 blocks, a batch of 16, p = 4 only: a check of the harness)."""
    out = []
    blocks, batch = (8, 16) if quick else (16, BATCH)
    for pm in paper_models(quick):
        if names is not None and pm.name not in names:
            continue
        kw = dict(pm.kwargs)
        if "n_layers" in kw:
            kw["n_layers"] = blocks
        out.append(dataclasses.replace(pm, kwargs=tuple(kw.items()), batch=batch, blocks=max(blocks, pm.blocks)))
    return out


def _row(label: str, m: int, step: float, peaks: Sequence[float]) -> dict:
    return dict(label=label, m=m, step_s=step, peak=max(peaks), peak_per_rank=list(peaks))


def torch_rows(profile: Profile, counts: Sequence[int]) -> list[dict]:
    """torch's orders at ``counts`` micro-batches, timed one step at a time (the module docstring)."""
    from lightning_twobp.bench.torch_orders import torch_order

    p = profile.num_ranks
    kept = Profile(
        p,
        {m: tuple(dataclasses.replace(c, graph_kept=True) for c in rows) for m, rows in profile.layers.items()},
        profile.partitions,
        profile.comm,
    )
    out = []
    for m in counts:
        for name, label in (("1f1b", "torch 1F1B"), ("gpipe", "torch GPipe")):
            costs = profile.costs(m, 1)
            sim = simulate(build_schedule(name, p, m, split_backward=False), costs)
            out.append(_row(f"{label} (m={m})", m, sim.makespan, sim.peak_bytes))
        for cls, (label, v) in _TORCH.items():
            if v not in profile.partitions:
                continue
            try:
                schedule = torch_order(cls, p, m, v)
            except ValueError:  # torch refuses this m
                continue
            costs = (kept if schedule.split_backward else profile).costs(m, v)
            sim = simulate(schedule, costs)
            out.append(_row(f"{label} (m={m})", m, sim.makespan, sim.peak_bytes))
    return out


def _fastest(rows: Sequence[dict], limit: float) -> dict | None:
    fits = [r for r in rows if r["peak"] <= limit]
    return min(fits, key=lambda r: (r["step_s"], r["peak"])) if fits else None


def _ac_rows(plain: Profile, by_size_ac: dict[int, Any], batch: int, with_torch: bool) -> tuple[list, list]:
    """Every block checkpointed "full": ours, every schedule (B recomputes each block once, W uses what B
    recomputed); torch's, its fused 1F1B and GPipe (the same orders as ours, recomputing once in the fused
    backward). torch's split orders with checkpointing are left out: their W re-enters the graph and
    recomputes again (11 forwards per block per micro-batch measured, ``--peer --activation-checkpointing``),
    which this model of one recompute does not price. Each checkpointed peak adds B's recompute of one
    block (:func:`~lightning_twobp.schedules.auto.with_recompute`), for both sides."""
    layers = {m: by_size_ac[batch // m] for m in plain.layers}
    ac = with_recompute(Profile(plain.num_ranks, layers, plain.partitions, checkpointing="full"), plain)
    p = plain.num_ranks
    ours = [_row(c.label, c.num_microbatches, c.step_time, c.peak_bytes) for c in search(ac, max_caps=2 * p)]
    fused = search(ac, families=("1f1b", "gpipe"), split_backward=False) if with_torch else ()
    names = {"1f1b": "torch 1F1B +AC", "gpipe": "torch GPipe +AC"}
    theirs = [
        _row(f"{names[c.name]} (m={c.num_microbatches})", c.num_microbatches, c.step_time, c.peak_bytes) for c in fused
    ]
    return ours, theirs


def _tables(
    pm: PaperModel, by_size: dict[int, Any], p: int, with_torch: bool, by_size_ac: dict[int, Any] | None = None
) -> dict:
    counts = [m for m in (p, 2 * p, 4 * p) if pm.batch % m == 0 and pm.batch // m in by_size]
    profile = Profile(p, {m: by_size[pm.batch // m] for m in counts}, partitions(pm, p))
    ours = [_row(c.label, c.num_microbatches, c.step_time, c.peak_bytes) for c in search(profile, max_caps=2 * p)]
    theirs = torch_rows(profile, counts) if with_torch else []
    if by_size_ac is not None:
        ours_ac, theirs_ac = _ac_rows(profile, by_size_ac, pm.batch, with_torch)
        ours, theirs = ours + ours_ac, theirs + theirs_ac
    base = fused_1f1b_peak(profile)
    assert base is not None  # p ranks always take one stage per rank
    budgets = []
    for x in BUDGETS:
        budgets.append(
            dict(times_1f1b=x, limit=x * base, ours=_fastest(ours, x * base), torch=_fastest(theirs, x * base))
        )
    return dict(
        model=pm.name,
        p=p,
        microbatches=counts,
        fused_1f1b_peak=base,
        budgets=budgets,
        considered=len(ours),
        ours_rows=ours,  # every candidate weighed, so that a reader can check each pick
        torch_rows=theirs,
    )


def run_budget_sim(
    quick: bool = False,
    degrees: Sequence[int] = DEGREES,
    names: Sequence[str] | None = None,
    checkpointing: bool = True,
) -> dict:
    """Measure every model's layers (or those ``names``) once, plain and (``checkpointing``) every block
    checkpointed "full", then each degree's budget table (see the module docstring)."""
    import torch

    torch.set_num_threads(1)  # one thread, as every rank of the benchmarks runs
    degrees = (4,) if quick else tuple(degrees)
    with_torch = torch_pipelining_available()
    tables = []
    chosen = models(quick, names)
    if not chosen:
        raise ValueError(f"no paper model is named in {names}: choose among llama, bert, mamba, resnet")
    for pm in chosen:
        # two samples a micro-batch at least: ResNet's BatchNorm needs 2 values per channel at 1 x 1
        sizes = sorted({pm.batch // m for p in degrees for m in (p, 2 * p, 4 * p) if pm.batch // m >= 2})
        # this thread's CPU time: what other processes on the machine take does not count
        by_size = {s: layer_costs(pm, s, repeats=3, clock=time.thread_time) for s in sizes}
        by_size_ac = (
            {s: layer_costs(pm, s, repeats=3, clock=time.thread_time, checkpointing="full") for s in sizes}
            if checkpointing
            else None
        )
        tables += [_tables(pm, by_size, p, with_torch, by_size_ac) for p in degrees]
    return {"batch": chosen[0].batch, "degrees": list(degrees), "tables": tables, "torch": with_torch}


def _cell(r: dict | None) -> str:
    if r is None:
        return "none fits | | "
    return f"{r['label']} | {1e3 * r['step_s']:.1f} | {r['peak'] / MiB:.1f}"


def markdown(result: dict) -> str:
    out = io.StringIO()
    w = out.write
    for t in result["tables"]:
        w(
            f"\n**{t['model']}, p = {t['p']}** (m in {t['microbatches']}; fused 1F1B's predicted peak at m = "
            f"{2 * t['p']}: {t['fused_1f1b_peak'] / MiB:.1f} MiB; {t['considered']} of ours weighed)\n\n"
        )
        w(
            "| budget | MiB | ours: fastest that fits | ms/step | peak MiB | torch's orders: fastest that fits | "
            "ms/step | peak MiB | ours / torch |\n|---|---:|---|---:|---:|---|---:|---:|---:|\n"
        )
        for b in t["budgets"]:
            ours, theirs = b["ours"], b["torch"]
            ratio = f"{theirs['step_s'] / ours['step_s']:.2f}x" if ours and theirs else ""
            w(f"| {b['times_1f1b']:g}x | {b['limit'] / MiB:.1f} | {_cell(ours)} | {_cell(theirs)} | {ratio} |\n")
    return out.getvalue()


def write(result: dict, folder: str | Path) -> list[Path]:
    """``budget-sim.json`` and ``budget-sim.md`` into ``folder``."""
    md, js = Path(folder) / "budget-sim.md", Path(folder) / "budget-sim.json"
    write_json(result, js)  # makes the folder
    md.write_text(markdown(result))
    return [md]
