"""``twobp-bench --memory-model``: the schedule model's peak bytes per rank against the executor's.

    twobp-bench --memory-model [--out DIR] [--quick] [--world P]

For the tiny LLaMa and the tiny BERT (:mod:`lightning_twobp.models`, 4 blocks x 128, batch 16 x 64
tokens, m = 8; on ``P`` > 2 ranks 2P blocks, so that a V has one a stage), every registered schedule
(with and without the split where both exist; 1F1B + 2BP also capped at ``max_pending_w`` = 0 and 1) is

* **predicted**: each layer (and the loss, on the last stage) runs once as a
  :class:`~lightning_twobp.engine.stage.Stage` on one micro-batch
  (:func:`~lightning_twobp.engine.footprint.measure_layer`: the bytes F saves, those B leaves for W, the
  output); :class:`~lightning_twobp.schedules.auto.Profile` cuts them into the stages the run uses, with
  each stage's weights, gradients and AdamW's two moments as fixed bytes, and
  :func:`~lightning_twobp.schedules.simulate` replays the schedule (``SimResult.peak_bytes``, each
  message between ranks placed by :class:`~lightning_twobp.schedules.MemoryCosts`: a received one held
  from its post to its last use);
* **measured**: the same schedule runs on 2 gloo ranks x 1 thread, a warm-up step and then one step
  whose every F, B, W and BW ends with a count of the distinct storages alive that the model is about:
  the parameters, their gradients and AdamW's state, the receive buffers posted and not yet read
  (``P2P.receive_buffers``; once read, a message is its stage's), every tensor autograd saved
  and has not let go of (:class:`~lightning_twobp.lightning.autoschedule.SavedBytes`) and what the
  stages hold for their micro-batches in flight
  (:func:`~lightning_twobp.engine.footprint.held_storages`). The peak is the largest count
  (:class:`~lightning_twobp.engine.footprint.StepMeter`).

Both sides count what a rank has sent and not let go of (``PipelineExecutor.outgoing``: gloo's send
works hold it until the schedule proves the receive posted, ``schedules.memory.send_releases``), the
step's 8-byte signature stage 0's rank sends the others among it (``schedules.memory.SIGNATURE_BYTES``).
Neither counts what lives inside one action only (a GEMM's temporaries, B's gradients before they
are handed on), nor an input gradient handed to a stage on the same rank.
"""

from __future__ import annotations

import copy
import csv
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_twobp.bench.paper import PaperModel
from lightning_twobp.bench.workload import WORLD, keep_freed_memory, stage_sizes
from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.engine.footprint import StepMeter, layer_cost, storage_key
from lightning_twobp.lightning.autoschedule import SavedBytes, timed_footprint
from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing
from lightning_twobp.partition import split_sequential
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules import Schedule, build_schedule, simulate
from lightning_twobp.schedules.auto import LayerCost, Profile
from lightning_twobp.schedules.placement import schedule_label
from lightning_twobp.schedules.spec import SCHEDULES, schedule_spec

__all__ = [
    "TOLERANCE",
    "Contender",
    "contenders",
    "layer_costs",
    "markdown",
    "models",
    "partitions",
    "predict",
    "profile",
    "run_memory_model",
    "write",
]

MiB = 2**20
TOLERANCE = 0.10  # the target: predicted within 10% of measured
ADAMW_COPIES = 4  # a weight, its gradient and AdamW's two moments, each the weight's size


def models(quick: bool = False, world: int = WORLD) -> list[PaperModel]:
    """The tiny LLaMa and BERT (``quick``: smaller still, for the test), with 4 blocks or, on more than
    2 ranks, one per stage of a V (2 x ``world``)."""
    d, t, b, v = (32, 16, 8, 64) if quick else (128, 64, 16, 256)
    n = max(4, 2 * world)
    kw = (("vocab_size", v), ("dim", d), ("n_layers", n), ("n_heads", 4), ("max_seq_len", t))
    return [PaperModel("llama", "Transformer-7b", kw, b, t, n), PaperModel("bert", "BERT-Large", kw, b, t, n)]


@dataclass(frozen=True)
class Contender:
    """One schedule of the table: ``name`` with or without the split, capped at ``max_pending_w``."""

    name: str
    split_backward: bool
    max_pending_w: int | None = None

    @property
    def stages_per_rank(self) -> int:
        return schedule_spec(self.name).default_stages_per_rank

    @property
    def label(self) -> str:
        cap = "" if self.max_pending_w is None else f", k={self.max_pending_w}"
        return schedule_label(self.name, self.split_backward) + cap


def contenders(names: Any = None) -> list[Contender]:
    """Every registered schedule (or ``names``), fused and split where both exist, 1F1B + 2BP capped."""
    out = []
    for name in SCHEDULES if names is None else names:
        splits = (True,) if schedule_spec(name).split_only else (False, True)
        out += [Contender(name, split) for split in splits]
        if name == "1f1b":
            out += [Contender(name, True, k) for k in (0, 1)]
    return out


class _Loss(nn.Module):
    """The last stage's loss on one micro-batch's targets, as a layer of its own (it saves tensors too)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], target: torch.Tensor) -> None:
        super().__init__()
        self.loss_fn, self.target = loss_fn, target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(x, self.target)


def _sizes(pm: PaperModel, num_stages: int) -> list[int]:
    """The cut the run uses (:func:`stage_sizes`), the loss joining the last stage in the profile."""
    sizes = stage_sizes(pm.blocks, num_stages)
    sizes[-1] += 1
    return sizes


def layer_costs(
    pm: PaperModel,
    size: int,
    repeats: int = 1,
    clock: Callable[[], float] | None = None,
    checkpointing: str | None = None,
) -> tuple[LayerCost, ...]:
    """Every layer of ``pm`` and its loss on one micro-batch of ``size`` samples, one after the other on
    this process's thread: the bytes (the module docstring), the median F, B, W and fused BW seconds of
    ``repeats`` runs after a warm-up by ``clock`` (default: wall time; BW lets the search price the
    split), and as fixed bytes its weights, gradients and AdamW's moments. ``checkpointing`` ("full" or
    "selective"): every layer but the loss measured checkpointed, as the strategy wraps it."""
    layers, loss_fn = pm.build()
    x, y = pm.data()
    t: torch.Tensor = x[:size]
    rows: list[LayerCost] = []
    for i, layer in enumerate([*layers, _Loss(loss_fn, y[:size])]):
        wrapped = checkpointing is not None and i < len(layers)
        undo = apply_activation_checkpointing([(0, layer)], checkpointing) if wrapped else (lambda: None)
        try:
            fp = timed_footprint(layer, t, t.is_floating_point() and i > 0, t.device, repeats, clock)
        finally:
            undo()
        fixed = ADAMW_COPIES * sum(q.numel() * q.element_size() for q in layer.parameters())
        rows.append(layer_cost(fp, fixed))
        layer.zero_grad(set_to_none=True)
        assert fp.output is not None  # measure_layer returns F's output
        t = fp.output
    return tuple(rows)


def partitions(pm: PaperModel, num_ranks: int) -> dict[int, list[int]]:
    """Layers per stage, one and two stages per rank, as the runs cut them (:func:`_sizes`)."""
    return {v: _sizes(pm, num_ranks * v) for v in (1, 2) if num_ranks * v <= pm.blocks}


def profile(pm: PaperModel, m: int, world: int = WORLD) -> Profile:
    """``pm`` at ``m`` micro-batches on ``world`` ranks: :func:`layer_costs` cut as the run cuts it."""
    return Profile(world, {m: layer_costs(pm, pm.batch // m)}, partitions(pm, world))


def predict(prof: Profile, c: Contender, m: int) -> tuple[Schedule, tuple[float, ...]]:
    """The schedule built at the profile's costs, and its replayed peak bytes per rank."""
    v = c.stages_per_rank
    costs = prof.costs(m, v)
    schedule = build_schedule(
        c.name,
        prof.num_ranks * v,
        m,
        stages_per_rank=v,
        split_backward=c.split_backward,
        costs=costs,
        max_pending_w=c.max_pending_w,
    )
    return schedule, simulate(schedule, costs).peak_bytes


def _fixed(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> dict[int, int]:
    tensors = [*params, *(q.grad for q in params if q.grad is not None)]
    tensors += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return {storage_key(t): t.untyped_storage().nbytes() for t in tensors}


def _measure(rank: int, pm: PaperModel, schedule: Schedule, m: int) -> int:
    """One contender on this rank: a warm-up step, then the measured one (the module docstring)."""
    layers, loss_fn = pm.build()
    x, y = pm.data()
    parts = split_sequential(copy.deepcopy(layers), stage_sizes(pm.blocks, schedule.num_stages))
    mods = {s: parts[s] for s in schedule.stages_of(rank)}
    meter = StepMeter()
    ex = PipelineExecutor(schedule, mods, loss_fn=loss_fn, around=meter.around)
    meter.executor = ex
    params = [q for mod in mods.values() for q in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    inputs = list(x.chunk(m)) if 0 in mods else None
    targets = list(y.chunk(m)) if schedule.num_stages - 1 in mods else None
    ex.step(inputs, targets)  # the warm-up: from here on the gradients and AdamW's state exist
    opt.step()
    opt.zero_grad(set_to_none=False)
    meter.fixed = _fixed(params, opt)
    with SavedBytes(exclude=params) as saved:
        meter.saved = saved
        ex.step(inputs, targets)
    meter.saved = None
    return meter.peak


def _worker(rank: int, world: int, jobs: list[tuple[PaperModel, str, Schedule]], m: int) -> dict[str, int]:
    keep_freed_memory()
    return {f"{pm.name} {label}": _measure(rank, pm, schedule, m) for pm, label, schedule in jobs}


def run_memory_model(
    quick: bool = False, m: int = 8, names: Any = None, timeout: float = 1800.0, world: int = WORLD
) -> dict:
    """Predicted and measured peak bytes per rank for every model x contender (see the module docstring)."""
    jobs, predicted = [], {}
    for pm in models(quick, world):
        prof = profile(pm, m, world)
        for c in contenders(names):
            schedule, peaks = predict(prof, c, m)
            jobs.append((pm, c.label, schedule))
            predicted[f"{pm.name} {c.label}"] = peaks
    measured = run_distributed(_worker, world, jobs, m, timeout=timeout)
    rows = []
    for pm, label, _ in jobs:
        key = f"{pm.name} {label}"
        for r in range(world):
            p, got = predicted[key][r], measured[r][key]
            rows.append(dict(model=pm.name, schedule=label, rank=r, predicted=p, measured=got, ratio=p / got))
    shape = [
        dict(name=pm.name, kwargs=dict(pm.kwargs), batch=pm.batch, blocks=pm.blocks) for pm in models(quick, world)
    ]
    return {"models": shape, "world": world, "microbatches": m, "rows": rows}


def markdown(result: dict) -> str:
    out = io.StringIO()
    w = out.write
    for pm in result["models"]:
        kw = pm["kwargs"]
        w(
            f"- {pm['name']}: {pm['blocks']} blocks x {kw['dim']}, {kw['n_heads']} heads, vocabulary "
            f"{kw['vocab_size']}, batch {pm['batch']} x {kw['max_seq_len']} tokens\n"
        )
    w(
        f"\n{result['world']} gloo ranks x 1 thread, m = {result['microbatches']}, AdamW; MiB per rank, predicted "
        f"(profile + simulate) / measured (live storages at every action's end) / ratio\n\n"
    )
    world = range(result["world"])
    w("| model | schedule | " + " | ".join(f"rank {r} predicted | measured | ratio" for r in world) + " |\n")
    w("|---|---|" + "---:|---:|---:|" * len(world) + "\n")
    by: dict[tuple[str, str], list[dict]] = {}
    for r in result["rows"]:
        by.setdefault((r["model"], r["schedule"]), []).append(r)
    for (model, label), ranks in by.items():
        cells = [f"{r['predicted'] / MiB:.2f} | {r['measured'] / MiB:.2f} | {r['ratio']:.3f}" for r in ranks]
        w(f"| {model} | {label} | " + " | ".join(cells) + " |\n")
    worst = max(result["rows"], key=lambda r: abs(r["ratio"] - 1))
    w(f"\nworst: {worst['model']} {worst['schedule']} rank {worst['rank']}, ratio {worst['ratio']:.3f}\n")
    return out.getvalue()


def write(result: dict, folder: str | Path) -> list[Path]:
    """``memory-model.md``, ``.csv`` and ``.json`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"memory-model.{ext}" for ext in ("md", "csv", "json")]
    paths[0].write_text(markdown(result))
    with paths[1].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["model", "schedule", "rank", "predicted", "measured", "ratio"])
        writer.writeheader()
        writer.writerows(result["rows"])
    paths[2].write_text(json.dumps(result, indent=1, default=str))
    return paths
