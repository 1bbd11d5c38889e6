"""twobp-plan with activation checkpointing: what it plans on meta is what the executor holds.

The measured side runs the plan's cut of the tiny LLaMa (``conf/model/tiny-llama.yaml``) with every
layer checkpointed as the strategy checkpoints it, one warm-up step and then one measured step. It
counts, as ``twobp-bench --memory-model`` does, the distinct storages the stages hold for their
micro-batches in flight and those autograd saved, at every action's end; and, around each B and BW, the
most the CPU allocator held beyond the start of that action (the profiler's allocation events: B's
recompute lives only inside the action)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.engine.footprint import held_storages
from lightning_twobp.lightning.autoschedule import SavedBytes
from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing
from lightning_twobp.models import LlamaLM
from lightning_twobp.partition import split_sequential
from lightning_twobp.plan import format_plan, plan_recipe
from lightning_twobp.schedules import build_schedule

TINY = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=64)  # conf/model/tiny-llama.yaml
BATCH, M = 16, 4  # conf/data/counting.yaml, the cpu-tiny-llama recipe's m
PLANNED = ["trainer.devices=2", "schedule=1f1b", f"strategy.num_microbatches={M}"]


def _ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def allocated_bytes(prof: torch.profiler.profile) -> tuple[int, int]:
    """The most the allocator held at once during ``prof`` and what it held at the end, beyond what it
    held when it started (also read by tests/test_recompute.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    now = peak = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        now += e["args"]["Bytes"]
        peak = max(peak, now)
    return peak, now


class _Meter:
    """Per rank: the most held at an action's end, and during a B or BW (see the module docstring)."""

    def __init__(self, row: tuple) -> None:
        self.row, self.i = row, 0
        self.saved: SavedBytes | None = None
        self.executor: PipelineExecutor | None = None
        self.boundary = self.during = self.recompute = 0

    def live(self) -> int:
        assert self.executor is not None and self.saved is not None
        return sum({**held_storages(self.executor.stages), **self.saved.live}.values())

    @contextmanager
    def around(self, stage: int) -> Iterator[None]:
        kind = self.row[self.i % len(self.row)].kind
        self.i += 1
        if self.saved is None:
            yield
            return
        before = self.live()
        if kind in ("B", "BW"):
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
                yield
            extra, _ = allocated_bytes(prof)
            self.during, self.recompute = max(self.during, before + extra), max(self.recompute, extra)
        else:
            yield
        self.boundary = max(self.boundary, self.live())


def _measure(rank: int, world: int, sizes: list[int], split: bool, ac: str | int | None) -> dict[str, int]:
    torch.manual_seed(0)
    lm = LlamaLM(**TINY)
    apply_activation_checkpointing(list(enumerate(lm.layers)), ac)
    parts = split_sequential(lm.layers, sizes)
    schedule = build_schedule("1f1b", world, M, split_backward=split)
    meter = _Meter(schedule.actions[rank])
    ex = PipelineExecutor(schedule, {rank: parts[rank]}, loss_fn=_ce, around=meter.around)
    meter.executor = ex
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, TINY["max_seq_len"]))
    inputs = list(ids.chunk(M)) if rank == 0 else None
    targets = list(ids.roll(-1, 1).chunk(M)) if rank == world - 1 else None
    ex.step(inputs, targets)  # the warm-up: receive buffers and gradients exist from here on
    params = list(parts[rank].parameters())
    with SavedBytes(exclude=params) as saved:
        meter.saved = saved
        ex.step(inputs, targets)
    meter.saved = None
    return {"boundary": meter.boundary, "during": meter.during, "recompute": meter.recompute}


def test_checkpointed_stage_saves_only_its_layers_inputs():
    """One stage holding the whole tiny LLaMa, every layer checkpointed: the bytes a real F saves
    (the executor's record) against the plan's M_act."""
    planned = plan_recipe(
        ["trainer.devices=1", f"strategy.num_microbatches={M}", "strategy.activation_checkpointing=full"]
    )
    plain = plan_recipe(["trainer.devices=1", f"strategy.num_microbatches={M}"])
    (stage,) = planned.stages
    lm = LlamaLM(**TINY)
    apply_activation_checkpointing(list(enumerate(lm.layers)), "full")
    ex = PipelineExecutor(build_schedule("1f1b", 1, M), {0: lm.layers}, loss_fn=_ce, record=True)
    ids = torch.randint(0, 256, (BATCH, 64))
    measured = ex.step(list(ids.chunk(M)), list(ids.roll(-1, 1).chunk(M))).held_bytes[(0, 0)]
    assert stage.checkpointed == len(lm.layers)
    assert stage.activation_bytes == pytest.approx(measured, rel=0.10), (stage.activation_bytes, measured)
    assert stage.activation_bytes < plain.stages[0].activation_bytes / 2
    # the first stage's B is a plain backward: one layer's recompute at a time, on top of the saved inputs
    assert 0 < stage.recompute_bytes < plain.stages[0].activation_bytes


def test_selective_plan_keeps_the_products_between_full_and_none():
    """``activation_checkpointing=selective`` is planned as selective (was planned as "full"): F keeps
    each layer's input and its matrix products' outputs, more than "full" and less than no checkpointing;
    the note says so."""
    base = ["trainer.devices=1", f"strategy.num_microbatches={M}"]
    act = {
        ac: plan_recipe([*base, f"strategy.activation_checkpointing={ac}"]).stages[0].activation_bytes
        for ac in ("full", "selective", "null")
    }
    assert act["full"] < act["selective"] < act["null"], act
    notes = plan_recipe([*base, "strategy.activation_checkpointing=selective"]).notes
    assert any("matrix products' outputs until B" in n for n in notes), notes


def _measure_with_and_without(rank: int, world: int, sizes: list[int], split: bool, ac: str | int) -> tuple:
    return _measure(rank, world, sizes, split, ac), _measure(rank, world, sizes, split, None)


@pytest.mark.dist
@pytest.mark.parametrize(("ac", "split"), [("full", True), ("full", False), (2, True)])
def test_checkpointed_plan_against_the_executor(ac, split):
    """2 ranks, 1F1B with and without 2BP, every layer or every other one checkpointed.

    At actions' ends (what ``twobp-bench --memory-model`` checks) each rank's planned activation peak
    is within 10% of the measured one. Inside B (or BW) the allocator's peak rises above what the rank
    held before it by the recompute and by the backward's own working set (its gradients in flight),
    which the plan does not count, with or without checkpointing: measured in the same launch without
    checkpointing, that working set brackets the planned recompute. B recomputes one layer at a time,
    under the split on top of the operands and gradients it has made for W of the layers after it.
    (The stage's output sent to the other rank is dropped once sent: not held to B.)"""
    from lightning_twobp.processes import run_distributed

    flag = [] if split else ["strategy.split_backward=false"]
    pl = plan_recipe([*PLANNED, *flag, f"strategy.activation_checkpointing={ac}"])
    sizes = [sp.layers[1] - sp.layers[0] + 1 for sp in pl.stages]
    measured = run_distributed(_measure_with_and_without, 2, sizes, split, ac, timeout=240)
    for rp, (got, off) in zip(pl.ranks, measured, strict=True):
        planned = rp.split if split else rp.fused
        boundary = planned["activation_bytes"] - planned["recompute_bytes"]
        assert boundary == pytest.approx(got["boundary"], rel=0.10), (rp.rank, boundary, got)
        (sp,) = (pl.stages[s] for s in rp.stages)
        recompute = sp.recompute_bytes if split else sp.recompute_fused_bytes
        assert recompute <= got["recompute"] <= recompute + off["recompute"], (rp.rank, recompute, got, off)


def test_the_70b_recipe_fits_80_gb_only_with_checkpointing():
    """``twobp-plan recipe=llama70b-64gpu``: pp 8 x dp 8 sharded fits 80 GiB x headroom on every rank;
    the same run without activation checkpointing does not."""
    p = plan_recipe(["recipe=llama70b-64gpu"])
    assert 6.8e10 < p.params < 7.0e10 and (p.pipeline_degree, p.data_parallel) == (8, 8)
    assert p.activation_checkpointing == "full" and all(sp.checkpointed for sp in p.stages)
    assert all(r.fits for r in p.ranks) and p.gpu_memory_gib == 80, format_plan(p)
    off = plan_recipe(["recipe=llama70b-64gpu", "strategy.activation_checkpointing=null"])
    assert not all(r.fits for r in off.ranks)
    assert max(r.split["total_bytes"] for r in off.ranks) > 1.3 * max(r.split["total_bytes"] for r in p.ranks)
