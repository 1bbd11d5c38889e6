"""The 2BP paper's three research questions (Rae, Lee, Richings 2024, arXiv 2405.18047) on this machine.

    twobp-bench --paper [--out DIR] [--quick] [--repeats N]

* **RQ1 throughput.** The paper's four model families (LLaMa-like transformer, BERT, Mamba, ResNet),
  tiny enough for one CPU thread, each cut into stages of ``model.layers`` by the workload's rule (the
  blocks evenly, the embedding or stem joining the first stage, the head the last). Every model runs
  GPipe (m = 2p), 1F1B-1 (m = p) and 1F1B-2 (m = 2p), each with and without 2BP, then ZB-H1, ZB-H2
  and ZB-V (m = 2p, 2 stages per rank); torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B
  run on deep copies of the same stage modules where they have a counterpart. The ratio is the
  median over rounds of time(without 2BP) / time(with 2BP) in the same round; for the Zero Bubble
  rows (2BP by definition) the baseline is fused 1F1B-2, the same m.
* **RQ2 peak memory.** On CPU, the bytes the schedule holds: each micro-batch's forward saves
  ``StepResult.held_bytes[(stage, mb)]`` (the executor's record of autograd's saved storages, weights
  excluded); :func:`peak_held_bytes` replays each rank's action list and holds a micro-batch's bytes
  from its F until its last backward (W, or BW). The first stage takes no input gradient, so its B
  runs the whole backward and frees the graph there (W is empty), which the replay follows. Not
  counted: the output gradients a deferred W keeps after B (2BP's "intermediate derivatives"), so
  the 2BP figures are a lower bound. On CUDA, ``torch.cuda.max_memory_allocated`` per rank over the
  recorded steps (the path is written for ranks with one GPU each; this project's CPU runs do not take it).
* **RQ3 scaling.** Pipeline degree p = 2, 4, 8 by :func:`~lightning_twobp.schedules.simulate`: a
  one-thread profile of every layer (F, B, W and fused BW at the row's micro-batch size) gives the
  shape, cut into p (2p for ZB-V) stages by the same rule; one factor per kind rescales it to the F,
  B, W (or BW) seconds measured in the 2-rank run, so p = 2 reproduces the measured totals. The real
  p = 2 row is RQ1's; this machine has no more ranks. Communication is not modelled (comm = 0), so the
  simulation does not show the paper's "gains shrink with more GPUs" from communication, only from
  the bubble.

Every row's gradients (ours and torch's) are checked once against a single process accumulating the
same micro-batches (fp32, rtol 1e-5, atol 1e-7, the peer benchmark's check); a mismatch fails the
run. All rows of all models take turns within one 2-rank gloo process group (1 thread per rank), the
order rotated every round.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_twobp.bench.peer import grad_error, grad_failures, torch_pipelining_available, what_ran
from lightning_twobp.bench.progress import say
from lightning_twobp.bench.workload import WORLD, grad_of, keep_freed_memory, stage_sizes
from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.engine.stage import Stage
from lightning_twobp.monitor import measured_costs
from lightning_twobp.partition import split_sequential
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules import Costs, Schedule, build_schedule, default_stages_per_rank, replay_memory, simulate

__all__ = [
    "LayerCosts",
    "PaperModel",
    "Row",
    "markdown",
    "models",
    "peak_held_bytes",
    "rows",
    "run_paper",
    "scaling",
    "summary",
    "write",
]

DEGREES = (2, 4, 8)
# What the paper reports that we could find: its abstract gives the one headline figure (no schedule
# named there); per-model, per-schedule figures were not in the sources this harness was written from.
PAPER_RATIO = {"llama": "up to 1.70 (7B, p = 4)"}


# ---------------------------------------------------------------------------------------------- what runs
@dataclass(frozen=True)
class PaperModel:
    """One of the paper's four model families at a CPU size: ``cls`` from :mod:`lightning_twobp.models`
    built with ``kwargs``, trained on ``batch`` samples of ``size`` tokens (or pixels a side)."""

    name: str  # llama | bert | mamba | resnet
    paper: str  # the paper's model
    kwargs: tuple[tuple[str, Any], ...]
    batch: int
    size: int
    blocks: int  # layers between the embedding / stem and the head

    def build(self) -> tuple[nn.Sequential, Callable[[Any, Any], torch.Tensor]]:
        """The seed-0 layers and the model's own loss, the same on every rank."""
        from lightning_twobp import models as zoo

        cls = {"llama": zoo.LlamaLM, "bert": zoo.BertMLM, "mamba": zoo.MambaLM, "resnet": zoo.ResNetClassifier}[
            self.name
        ]
        module = cls(**dict(self.kwargs), seed=0)
        return module.layers, lambda out, target: module.compute_loss(out, (None, target))

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1)
        kw = dict(self.kwargs)
        if self.name == "resnet":
            x = torch.randn(self.batch, 3, self.size, self.size, generator=gen)
            return x, torch.randint(0, kw["num_classes"], (self.batch,), generator=gen)
        ids = torch.randint(0, kw["vocab_size"], (self.batch, self.size), generator=gen)
        if self.name == "bert":  # every token is a prediction target (no -100): each micro-batch has a loss
            return ids, torch.randint(0, kw["vocab_size"], (self.batch, self.size), generator=gen)
        return ids, torch.roll(ids, -1, dims=1)


def models(quick: bool = False) -> list[PaperModel]:
    """8 blocks each (16 for ResNet-50's layout), so that RQ3 can cut p = 8 stages; sized so that one
    pipelined step takes about 0.5 s on one thread per rank (a few ms with ``quick``)."""
    d, t, b = (16, 8, 4) if quick else (256, 64, 16)
    lm = (("vocab_size", 128 if quick else 1024), ("dim", d), ("n_layers", 8))
    heads = (("n_heads", 2 if quick else 4), ("max_seq_len", t))
    mamba = (("vocab_size", 128 if quick else 1024), ("dim", 8 if quick else 128), ("n_layers", 8), ("max_seq_len", t))
    # BatchNorm needs 2 or more values per channel: at least 2 images per micro-batch at 1x1 (layer 4)
    px = 32 if quick else 64
    resnet = (("depth", 50), ("num_classes", 10), ("width", 4 if quick else 16), ("image_size", px))
    return [
        PaperModel("llama", "Transformer-7b", lm + heads, b, t, 8),
        PaperModel("bert", "BERT-Large", lm + heads, b, t, 8),
        PaperModel("mamba", "Mamba-1.4B", mamba, 4 if quick else 8, t, 8),
        PaperModel("resnet", "ResNet-152", resnet, 8 if quick else 16, px, 16),
    ]


@dataclass(frozen=True)
class Row:
    """One pipeline of RQ1: ``schedule`` is ours, or torch's class for ``side="torch"``; ``m = mult * p``."""

    label: str
    schedule: str
    split_backward: bool
    mult: int
    side: str = "ours"
    baseline: str | None = None  # label of the row without 2BP this one is compared with
    counterpart: str | None = None  # torch's row with the same order

    @property
    def stages_per_rank(self) -> int:
        return default_stages_per_rank(self.schedule) if self.side == "ours" else 1

    def num_stages(self, p: int = WORLD) -> int:
        return p * self.stages_per_rank

    def m(self, p: int = WORLD) -> int:
        return self.mult * p


def rows(with_torch: bool = True) -> list[Row]:
    out = []
    for label, name, mult, _theirs in (
        ("GPipe", "gpipe", 2, "ScheduleGPipe"),
        ("1F1B-1", "1f1b", 1, "Schedule1F1B"),
        ("1F1B-2", "1f1b", 2, "Schedule1F1B"),
    ):
        counterpart = f"torch {label}" if with_torch else None
        out.append(Row(label, name, False, mult, counterpart=counterpart))
        out.append(Row(f"{label}+2BP", name, True, mult, baseline=label))
    out += [
        Row(lab, name, True, 2, baseline="1F1B-2")
        for lab, name in (("ZB-H1", "zb-h1"), ("ZB-H2", "zb-h2"), ("ZB-V", "zb-v"))
    ]
    if with_torch:
        out += [
            Row("torch GPipe", "ScheduleGPipe", False, 2, "torch"),
            Row("torch 1F1B-1", "Schedule1F1B", False, 1, "torch"),
            Row("torch 1F1B-2", "Schedule1F1B", False, 2, "torch"),
        ]
    return out


def _schedule(r: Row, p: int = WORLD) -> Schedule:
    return build_schedule(
        r.schedule, r.num_stages(p), r.m(p), stages_per_rank=r.stages_per_rank, split_backward=r.split_backward
    )


# ---------------------------------------------------------------------------------------------- RQ2: replay
def peak_held_bytes(
    schedule: Schedule, held: dict[tuple[int, int], int], frees_at_b: Sequence[int] = (0,)
) -> tuple[tuple[float, ...], dict[int, float]]:
    """Peak bytes held per rank and per stage over one step, replaying each rank's action list.

    ``held[(stage, mb)]`` is what micro-batch ``mb``'s F saves on ``stage``; it is held until the
    micro-batch's last backward action on that stage (its W, or BW), or until its B on the stages in
    ``frees_at_b`` (a stage whose input takes no gradient runs its whole backward in B)."""
    after_b = {k: 0 if k[0] in frees_at_b else v for k, v in held.items()}
    peaks = replay_memory(schedule, held, after_b)
    return peaks.per_rank, dict(enumerate(peaks.per_stage))


# ---------------------------------------------------------------------------------------------- RQ3: scaling
@dataclass(frozen=True)
class LayerCosts:
    """Seconds per micro-batch of every layer of ``model.layers``: F, B, W and the fused BW."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    bw: tuple[float, ...]

    def stage_costs(self, sizes: Sequence[int], split: bool) -> Costs:
        """Per-stage costs of the cut ``sizes``. Fused: B is the BW (W zero), as measured_costs has it.
        Split: the first stage's B is its whole backward and its W zero, as the engine runs it. ``bw``: the
        stages' fused backward, which prices a BW written into a split order (schedules.fusion)."""
        f, b, w, bw, start = [], [], [], [], 0
        for s, n in enumerate(sizes):
            sl = slice(start, start + n)
            start += n
            f.append(sum(self.f[sl]))
            bw.append(sum(self.bw[sl]))
            whole = not split or s == 0
            b.append(bw[-1] if whole else sum(self.b[sl]))
            w.append(0.0 if whole else sum(self.w[sl]))
        return Costs(f=f, b=b, w=w, bw=bw)


def _calibration(measured: Costs, predicted: Costs) -> tuple[float, float, float]:
    """One factor per kind (F, B, W) that turns the profile's totals into the 2-rank run's."""

    def ratio(a: Any, b: Any) -> float:
        return sum(a) / sum(b) if sum(b) > 0 else 1.0

    return ratio(measured.f, predicted.f), ratio(measured.b, predicted.b), ratio(measured.w, predicted.w)


def scaling(
    layers: LayerCosts,
    r: Row,
    blocks: int,
    mb_size: int,
    alpha: tuple[float, float, float] = (1.0, 1.0, 1.0),
    degrees: Sequence[int] = DEGREES,
) -> list[dict]:
    """Simulated step of row ``r`` at each pipeline degree p, m = r.mult * p micro-batches of ``mb_size``
    samples; ``alpha`` rescales F, B, W. Degrees whose stages outnumber the blocks are left out."""
    out = []
    for p in degrees:
        n = r.num_stages(p)
        if n > blocks:
            continue
        c = layers.stage_costs(stage_sizes(blocks, n), r.split_backward)
        f, b, w = c.f, c.b, c.w
        assert isinstance(f, tuple) and isinstance(b, tuple) and isinstance(w, tuple)  # per-stage costs
        c = Costs(f=[alpha[0] * x for x in f], b=[alpha[1] * x for x in b], w=[alpha[2] * x for x in w])
        sim = simulate(_schedule(r, p), c)
        m = r.m(p)
        out.append(
            dict(
                p=p,
                m=m,
                makespan_s=sim.makespan,
                bubble=sim.bubble_fraction,
                samples_per_s=m * mb_size / sim.makespan if sim.makespan > 0 else float("nan"),
            )
        )
    return out


@torch.no_grad()
def inputs_of(layers: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for layer in layers:
        out.append(x)
        x = layer(x)
    return out


def _profile(layers: nn.Sequential, x: torch.Tensor, reps: int) -> LayerCosts:
    """Median F, B, W and BW seconds of every layer alone on one micro-batch ``x`` (after one warm-up),
    on the device of ``x``."""
    cols: dict[str, list[float]] = {k: [] for k in ("f", "b", "w", "bw")}
    layers = layers.to(x.device)

    def now() -> float:
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        return time.perf_counter()

    for layer, inp in zip(layers, inputs_of(copy.deepcopy(layers), x), strict=False):
        st = Stage(layer)
        inp = inp.detach().requires_grad_(inp.is_floating_point() and layer is not layers[0])
        samples: dict[str, list[float]] = {k: [] for k in cols}
        for rep in range(reps + 1):
            t0 = now()
            y = st.forward(0, inp)
            t1 = now()
            g = torch.ones_like(y)
            st.backward_input(0, g)
            t2 = now()
            st.backward_weight(0)
            t3 = now()
            st.forward(0, inp)
            t4 = now()
            st.backward(0, g)
            t5 = now()
            if rep:
                for k, v in zip(cols, (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=False):
                    samples[k].append(v)
        layer.zero_grad(set_to_none=True)
        for k in cols:
            cols[k].append(statistics.median(samples[k]))
    return LayerCosts(**{k: tuple(v) for k, v in cols.items()})


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class _Runner:
    key: str  # "<model> <row label>"
    model: PaperModel
    row: Row
    step: Callable[[], Any]
    params: dict[str, nn.Parameter]
    executor: PipelineExecutor | None = None
    result: dict = field(default_factory=dict)

    def zero(self) -> None:
        for q in self.params.values():
            q.grad = None


def _reference(
    layers: nn.Sequential, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, m: int
) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(layers)
    for a, b in zip(x.chunk(m), y.chunk(m), strict=False):
        (loss_fn(ref(a), b) / m).backward()
    return {n: grad_of(q).detach().clone() for n, q in ref.named_parameters()}


def _build(
    pm: PaperModel,
    r: Row,
    layers: nn.Sequential,
    loss_fn: Callable,
    x: torch.Tensor,
    y: torch.Tensor,
    rank: int,
    device: torch.device,
) -> _Runner:
    n, m = r.num_stages(), r.m()
    parts = split_sequential(copy.deepcopy(layers).to(device), stage_sizes(pm.blocks, n))
    x, y = x.to(device), y.to(device)
    key = f"{pm.name} {r.label}"
    if r.side == "ours":
        sched = _schedule(r)
        mods = {s: parts[s] for s in sched.stages_of(rank)}
        ex = PipelineExecutor(sched, mods, loss_fn=loss_fn)
        inputs = list(x.chunk(m)) if 0 in mods else None
        targets = list(y.chunk(m)) if n - 1 in mods else None
        params = {k: q for mod in mods.values() for k, q in mod.named_parameters()}
        return _Runner(key, pm, r, lambda: ex.step(inputs, targets), params, ex)

    import torch.distributed.pipelining as pp

    stage = pp.PipelineStage(parts[rank], rank, n, device)
    sched = getattr(pp, r.schedule)(stage, n_microbatches=m, loss_fn=loss_fn)
    args = (x,) if rank == 0 else ()
    kwargs: dict[str, Any] = {"target": y, "losses": []} if rank == n - 1 else {}

    def step() -> None:
        if "losses" in kwargs:
            kwargs["losses"].clear()
        sched.step(*args, **kwargs)

    return _Runner(key, pm, r, step, dict(parts[rank].named_parameters()))


def _timed(r: _Runner, device: torch.device) -> float:
    r.zero()
    dist.barrier()
    t = time.perf_counter()
    r.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter() - t


def _worker(rank: int, world: int, quick: bool, repeats: int, with_torch: bool) -> dict:
    keep_freed_memory()
    # CUDA: one GPU per rank where the host has them, on NCCL (run_distributed(backend=)), RQ2 then reading
    # max_memory_allocated. Written for a multi-GPU host and not run by this project's tests or docs: their
    # machine has no GPU.
    device = torch.device(f"cuda:{rank}") if dist.get_backend() == "nccl" else torch.device("cpu")
    runners, refs, profiles = [], {}, {}
    tell = say if rank == 0 else lambda what: None
    for pm in models(quick):
        tell(f"--paper: {pm.name}: one-process references, layer profiles and {len(rows(with_torch))} pipelines")
        layers, loss_fn = pm.build()
        x, y = pm.data()
        for m in (WORLD, 2 * WORLD):
            refs[(pm.name, m)] = {k: g.to(device) for k, g in _reference(layers, loss_fn, x, y, m).items()}
            if rank == 0:  # rank 1 waits at the next barrier: the profile runs on a quiet core
                profiles[(pm.name, m)] = _profile(
                    copy.deepcopy(layers), x[: pm.batch // m].to(device), reps=1 if quick else 3
                )
        runners += [_build(pm, r, layers, loss_fn, x, y, rank, device) for r in rows(with_torch)]
    dist.barrier()

    checks = {}
    for r in runners:  # one step each from the seed weights: warm-up and the gradient check
        _timed(r, device)
        checks[r.key] = grad_error(r.params, refs[(r.model.name, r.row.m())])

    times: dict[str, list[float]] = {r.key: [] for r in runners}
    for i in range(repeats):
        tell(f"--paper: gradients checked; timing round {i + 1} of {repeats} ({len(runners)} pipelines)")
        k = i * len(runners) // max(1, repeats)
        for r in runners[k:] + runners[:k]:
            times[r.key].append(_timed(r, device))

    # Two recorded steps per row of ours (recording adds a saved-tensor hook: not timed): the per-op
    # costs for RQ3 (medians over both) and the bytes each micro-batch holds for RQ2; on CUDA, the
    # peak allocated.
    tell("--paper: recording two steps per pipeline (memory, per-op costs)")
    records: dict[str, list[tuple[str, float, float, float]]] = {}
    held: dict[str, dict[tuple[int, int], int]] = {}
    cuda_peak: dict[str, int] = {}
    for r in runners:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        if r.executor is not None:
            r.executor.record = True
            records[r.key] = []
            for _ in range(2):
                r.zero()
                dist.barrier()
                res = r.step()
                assert res is not None  # ours: the executor's result
                records[r.key] += [(x.op, x.start, x.end, x.wait) for x in res.records]
            r.executor.record = False
            held[r.key] = dict(res.held_bytes)
        else:
            _timed(r, device)
        if device.type == "cuda":
            cuda_peak[r.key] = torch.cuda.max_memory_allocated(device) - base
        dist.barrier()
    return dict(
        times=times,
        checks=checks,
        records=records,
        held=held,
        cuda_peak=cuda_peak,
        profiles=profiles,
        device=str(device),
    )


@dataclass(frozen=True)
class _Rec:
    op: str
    start: float
    end: float
    wait: float


def _median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den, strict=False))


def run_paper(quick: bool = False, repeats: int = 5, timeout: float = 3600.0) -> dict:
    """Run RQ1-RQ3 (the ranks are stopped after ``timeout`` seconds); returns what ``paper.json`` holds
    (:func:`markdown` writes its tables). Raises AssertionError when a row's gradients differ from one
    process."""
    start = time.perf_counter()
    with_torch = torch_pipelining_available()
    # one GPU per rank where the host has them, over NCCL (gloo has no GPU sends); else CPU processes on gloo
    backend = "nccl" if torch.cuda.device_count() >= WORLD else "gloo"
    per_rank = run_distributed(_worker, WORLD, quick, repeats, with_torch, timeout=timeout, backend=backend)
    failures: list[str] = []
    rq1, rq2, rq3 = [], [], []
    for pm in models(quick):
        for r in rows(with_torch):
            failures += grad_failures(per_rank, f"{pm.name} {r.label}", 4)
            rq1.append(_throughput(pm, r, per_rank))
            if r.side == "ours":
                rq2.append(_memory(pm, r, per_rank))
                rq3.append(_scaling(pm, r, per_rank))
    if failures:
        raise AssertionError("gradients differ from one process:\n" + "\n".join(failures))
    _add_memory_ratios(rq2)
    _add_scaling_ratios(rq3)
    return dict(
        quick=quick,
        repeats=repeats,
        world=WORLD,
        device=per_rank[0]["device"],
        torch_version=torch.__version__,
        torch_pipelining=with_torch,
        seconds=time.perf_counter() - start,
        models=[
            dict(name=pm.name, paper=pm.paper, kwargs=dict(pm.kwargs), batch=pm.batch, size=pm.size)
            for pm in models(quick)
        ],
        split_over_fused=_split_prices(per_rank[0]["profiles"], quick),
        rq1=rq1,
        rq2=rq2,
        rq3=rq3,
    )


def _step_s(per_rank: list[dict], key: str) -> float:
    """Row ``key``'s median step time, barrier to barrier: the same on every rank."""
    return statistics.median(per_rank[0]["times"][key])


def _throughput(pm: PaperModel, r: Row, per_rank: list[dict]) -> dict:
    """RQ1's row: the step time, and its ratio to the row's baseline and to torch's counterpart."""
    times = per_rank[0]["times"]
    key = f"{pm.name} {r.label}"
    t = _step_s(per_rank, key)
    return dict(
        model=pm.name,
        paper_model=pm.paper,
        row=r.label,
        **what_ran(r),
        num_stages=r.num_stages(),
        m=r.m(),
        step_s=t,
        samples_per_s=pm.batch / t,
        baseline=r.baseline,
        ratio=_median_ratio(times[f"{pm.name} {r.baseline}"], times[key]) if r.baseline else None,
        paper_ratio=PAPER_RATIO.get(pm.name) if r.label.endswith("+2BP") else None,
        vs_torch=_median_ratio(times[f"{pm.name} {r.counterpart}"], times[key]) if r.counterpart else None,
        max_grad_diff=max(out["checks"][key][0] for out in per_rank),
        samples=times[key],
    )


def _which(pm: PaperModel, r: Row) -> dict[str, Any]:
    """An RQ2 or RQ3 row's model, row and the baseline it is compared with."""
    return dict(model=pm.name, row=r.label, baseline=r.baseline)


def _memory(pm: PaperModel, r: Row, per_rank: list[dict]) -> dict:
    """RQ2's row (ours only): the peak bytes each rank and stage held, replayed from the measured
    per-micro-batch bytes, and CUDA's own peak when on GPUs."""
    key = f"{pm.name} {r.label}"
    held = {k: v for out in per_rank for k, v in out["held"][key].items()}
    ranks, stages = peak_held_bytes(_schedule(r), held)
    cuda = [out["cuda_peak"].get(key) for out in per_rank]
    return dict(
        **_which(pm, r),
        peak_held_bytes=list(ranks),
        peak_held_bytes_per_stage={str(s): v for s, v in stages.items()},
        cuda_max_allocated_bytes=cuda if all(c is not None for c in cuda) else None,
    )


def _scaling(pm: PaperModel, r: Row, per_rank: list[dict]) -> dict:
    """RQ3's row (ours only): the layers' profiled costs, calibrated to the measured step, simulated
    over more stages."""
    key = f"{pm.name} {r.label}"
    t = _step_s(per_rank, key)
    recs = [_Rec(*x) for out in per_rank for x in out["records"][key]]
    measured = measured_costs(recs, r.num_stages())
    layer_costs = per_rank[0]["profiles"][(pm.name, r.m())]
    predicted = layer_costs.stage_costs(stage_sizes(pm.blocks, r.num_stages()), r.split_backward)
    alpha = _calibration(measured, predicted)
    return dict(
        **_which(pm, r),
        measured_step_s=t,
        measured_samples_per_s=pm.batch / t,
        alpha=list(alpha),
        simulated=scaling(layer_costs, r, pm.blocks, pm.batch // r.m(), alpha),
    )


def _split_prices(profiles: dict, quick: bool) -> dict[str, float]:
    """The split's own price on each model: (B + W) / BW of its layers alone at 1F1B-2's micro-batch,
    the first layer left out (its input takes no gradient, so its B is the whole backward)."""
    split = {}
    for pm in models(quick):
        c = profiles[(pm.name, 2 * WORLD)]
        split[pm.name] = (sum(c.b[1:]) + sum(c.w[1:])) / sum(c.bw[1:])
    return split


def _add_memory_ratios(rq2: list[dict]) -> None:
    by = {(r["model"], r["row"]): r for r in rq2}
    for r in rq2:
        base = by.get((r["model"], r["baseline"]))
        if base is None:
            r["ratio_per_rank"], r["ratio"] = None, None
            continue
        r["ratio_per_rank"] = [
            a / b if b else float("nan") for a, b in zip(r["peak_held_bytes"], base["peak_held_bytes"], strict=False)
        ]
        r["ratio"] = max(r["ratio_per_rank"])  # the rank whose peak grows the most


def _add_scaling_ratios(rq3: list[dict]) -> None:
    by = {(r["model"], r["row"]): r for r in rq3}
    for r in rq3:
        base = by.get((r["model"], r["baseline"]))
        if base is None:
            continue
        theirs = {s["p"]: s["samples_per_s"] for s in base["simulated"]}
        for s in r["simulated"]:
            s["ratio"] = s["samples_per_s"] / theirs[s["p"]] if s["p"] in theirs else None


# ---------------------------------------------------------------------------------------------- output
def _f(x: float | None, fmt: str = ".3f") -> str:
    return "" if x is None else format(x, fmt)


_SPLIT_ROWS = ("GPipe+2BP", "1F1B-1+2BP", "1F1B-2+2BP", "ZB-H1", "ZB-H2", "ZB-V")


def summary(result: dict) -> str:
    """One line per model and question: RQ1's and RQ2's ratios, RQ3's simulated ratios per p."""
    out = io.StringIO()
    w = out.write
    names = [m["name"] for m in result["models"]]
    rq1 = {(r["model"], r["row"]): r for r in result["rq1"]}
    torch_cols = [k for k in ("GPipe", "1F1B-1", "1F1B-2") if rq1[(names[0], k)]["vs_torch"] is not None]
    w(
        "RQ1, throughput with 2BP / without (Zero Bubble rows: over fused 1F1B-2); (B + W) / BW of the layers "
        "alone; ours fused / torch's same order:\n\n"
    )
    w(
        "| model | "
        + " | ".join(_SPLIT_ROWS)
        + " | (B + W) / BW | "
        + " | ".join(f"{k} / torch" for k in torch_cols)
        + " |\n|---|"
        + "---:|" * (len(_SPLIT_ROWS) + 1 + len(torch_cols))
        + "\n"
    )
    for n in names:
        cells = [f"{rq1[(n, k)]['ratio']:.3f}" for k in _SPLIT_ROWS] + [f"{result['split_over_fused'][n]:.3f}"]
        cells += [f"{rq1[(n, k)]['vs_torch']:.3f}" for k in torch_cols]
        w(f"| {n} | " + " | ".join(cells) + " |\n")
    rq2 = {(r["model"], r["row"]): r for r in result["rq2"]}
    w("\nRQ2, peak held bytes with 2BP / without, rank 0 / rank 1 (first column: fused 1F1B-2's peaks in MB):\n\n")
    w("| model | 1F1B-2 MB | " + " | ".join(_SPLIT_ROWS) + " |\n|---|---:|" + "---:|" * len(_SPLIT_ROWS) + "\n")
    for n in names:
        base = " / ".join(f"{b / 1e6:.1f}" for b in rq2[(n, "1F1B-2")]["peak_held_bytes"])
        cells = [" / ".join(f"{x:.2f}" for x in rq2[(n, k)]["ratio_per_rank"]) for k in _SPLIT_ROWS]
        w(f"| {n} | {base} | " + " | ".join(cells) + " |\n")
    rq3 = {(r["model"], r["row"]): {s["p"]: s for s in r["simulated"]} for r in result["rq3"]}
    degrees = sorted({p for sims in rq3.values() for p in sims})
    w("\nRQ3, simulated throughput with 2BP / without at pipeline degree p (empty: more stages than blocks):\n\n")
    w("| model | p | " + " | ".join(_SPLIT_ROWS) + " |\n|---|---:|" + "---:|" * len(_SPLIT_ROWS) + "\n")
    for n in names:
        for p in degrees:
            cells = [f"{rq3[(n, k)][p]['ratio']:.2f}" if p in rq3[(n, k)] else "" for k in _SPLIT_ROWS]
            w(f"| {n} | {p} | " + " | ".join(cells) + " |\n")
    return out.getvalue()


def _heading(result: dict) -> str:
    backend = "NCCL" if str(result["device"]).startswith("cuda") else "gloo"
    return (
        f"{result['world']} {backend} ranks x 1 thread on {result['device']}, torch {result['torch_version']}, "
        f"median of {result['repeats']} alternated rounds ({result['seconds']:.0f} s in all)"
        f"{' (--quick)' if result['quick'] else ''}\n\n"
    )


def markdown(result: dict) -> str:
    out = io.StringIO()
    w = out.write
    w(_heading(result))
    w(
        "Models: "
        + "; ".join(
            f"{m['name']} ({m['paper']}): {m['kwargs']}, batch {m['batch']} x {m['size']}" for m in result["models"]
        )
        + "\n\n"
    )
    w("### Summary\n\n" + summary(result) + "\n")
    w(
        "### RQ1: throughput\n\n2BP / no-2BP is the median over rounds of time(baseline) / time(row), the baseline "
        "being the same schedule without 2BP (fused 1F1B-2 for the Zero Bubble rows). The paper's column holds "
        "what we found of its figures: its abstract's headline only.\n\n"
    )
    w(
        "| model | row | S | m | s/step | samples/s | 2BP / no-2BP | paper | ours / torch (same order) | max grad "
        "diff |\n"
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|\n"
    )
    for r in result["rq1"]:
        ratio = f"**{r['ratio']:.3f}** (vs {r['baseline']})" if r["ratio"] is not None else ""
        w(
            f"| {r['model']} | {r['row']} | {r['num_stages']} | {r['m']} | {r['step_s']:.4f} | "
            f"{r['samples_per_s']:.1f} | "
            f"{ratio} | {r['paper_ratio'] or ''} | {_f(r['vs_torch'])} | {r['max_grad_diff']:.1e} |\n"
        )
    if not result["torch_pipelining"]:
        w("\ntorch.distributed.pipelining is not importable in this torch build: no torch rows.\n")
    cuda = any(r["cuda_max_allocated_bytes"] for r in result["rq2"])
    w(
        "\n### RQ2: peak memory\n\nPeak bytes the schedule holds per rank (saved activations from F until W/BW, "
        "replayed over the action order; the deferred W's output gradients not counted), in MB, and each rank's "
        "ratio to the baseline's" + (" ; CUDA max_memory_allocated per rank" if cuda else "") + ".\n\n"
    )
    w(
        "| model | row | rank 0 MB | rank 1 MB | 2BP / no-2BP (rank 0 / rank 1) |"
        + (" CUDA MB per rank |" if cuda else "")
        + "\n|---|---|---:|---:|---:|"
        + ("---|" if cuda else "")
        + "\n"
    )
    for r in result["rq2"]:
        mb = [f"{b / 1e6:.2f}" for b in r["peak_held_bytes"]]
        extra = (
            (" " + " / ".join(f"{c / 1e6:.1f}" for c in r["cuda_max_allocated_bytes"]) + " |")
            if cuda and r["cuda_max_allocated_bytes"]
            else (" |" if cuda else "")
        )
        ratio = " / ".join(f"{x:.2f}" for x in r["ratio_per_rank"]) + f" (vs {r['baseline']})" if r["ratio"] else ""
        w(f"| {r['model']} | {r['row']} | {mb[0]} | {mb[1]} | {ratio} |{extra}\n")
    degrees = sorted({s["p"] for r in result["rq3"] for s in r["simulated"]})
    w(
        "\n### RQ3: scaling (simulated)\n\nSamples/s simulated at pipeline degree p (m = p or 2p micro-batches of "
        "the measured size), from per-layer profiles rescaled to the 2-rank run's measured costs, no "
        "communication cost; in brackets the ratio to the baseline at the same p. `measured` is RQ1's 2-rank row.\n\n"
    )
    w(
        "| model | row | measured p=2 | "
        + " | ".join(f"p={p}" for p in degrees)
        + " |\n|---|---|---:|"
        + "---:|" * len(degrees)
        + "\n"
    )
    for r in result["rq3"]:
        sim = {s["p"]: s for s in r["simulated"]}
        cells = [
            f"{sim[p]['samples_per_s']:.1f}" + (f" ({sim[p]['ratio']:.2f})" if sim[p].get("ratio") else "")
            if p in sim
            else ""
            for p in degrees
        ]
        w(f"| {r['model']} | {r['row']} | {r['measured_samples_per_s']:.1f} | " + " | ".join(cells) + " |\n")
    return out.getvalue()


def _plots(result: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m["name"] for m in result["models"]]
    paths = []
    for rq, key, title in (
        ("rq1", "ratio", "RQ1: throughput, 2BP / no-2BP"),
        ("rq2", "ratio", "RQ2: peak held bytes, 2BP / no-2BP (the rank that grows most)"),
    ):
        data = [r for r in result[rq] if r.get(key) is not None]
        labels = list(dict.fromkeys(r["row"] for r in data))
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / max(1, len(labels))
        for i, lab in enumerate(labels):
            vals = [next((r[key] for r in data if r["model"] == n and r["row"] == lab), 0.0) for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=lab)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=3)
        path = folder / f"paper-{rq}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    # RQ3: one column per model; samples/s on top, the ratio to the row's baseline below. One colour per
    # schedule family, solid without 2BP, dashed with it.
    families = list(dict.fromkeys(r["row"].removesuffix("+2BP") for r in result["rq3"]))
    colour = {f: f"C{i}" for i, f in enumerate(families)}
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 6), squeeze=False, sharex=True)
    for col, n in enumerate(names):
        for r in (r for r in result["rq3"] if r["model"] == n):
            ps = [s["p"] for s in r["simulated"]]
            style = dict(
                marker="o",
                color=colour[r["row"].removesuffix("+2BP")],
                label=r["row"],
                linestyle="-" if r["baseline"] is None else "--",
            )
            axes[0][col].plot(ps, [s["samples_per_s"] for s in r["simulated"]], **style)
            if r["baseline"] is not None:
                axes[1][col].plot(ps, [s["ratio"] for s in r["simulated"]], **style)
        axes[0][col].set_title(f"RQ3 {n}: simulated samples/s")
        axes[1][col].set_title("vs its baseline (no 2BP)")
        axes[1][col].axhline(1.0, color="black", linewidth=0.8)
        axes[1][col].set_xlabel("pipeline degree p")
    axes[0][0].legend(fontsize=6)
    path = folder / "paper-rq3.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return paths + [path]


def write(result: dict, folder: str | Path) -> list[Path]:
    """``paper.md``, ``paper-rq{1,2,3}.csv``, ``paper.json`` and ``paper-rq{1,2,3}.png`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "paper.md", folder / "paper.json"]
    paths[0].write_text(markdown(result))
    paths[1].write_text(json.dumps(result, indent=1))
    flat = {
        "rq1": result["rq1"],
        "rq2": result["rq2"],
        "rq3": [dict(model=r["model"], row=r["row"], **s) for r in result["rq3"] for s in r["simulated"]],
    }
    for name, table in flat.items():
        path = folder / f"paper-{name}.csv"
        cols = [k for k in table[0] if k not in ("samples", "peak_held_bytes_per_stage")]
        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(table)
        paths.append(path)
    return paths + _plots(result, folder)
