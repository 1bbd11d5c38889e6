"""Engine benchmark: step time of every schedule, with and without 2BP, against one process.

    twobp-bench [--json PATH] [--repeats N] [--quick] [--timelines DIR]

Two gloo processes with one intra-op thread each run the workload (:mod:`.workload`). Every configuration
runs in the same process group, alternated (A, B, C, ..., A, B, C, ...), after two warm-up steps each; the
table shows medians. The single-process row is gradient accumulation of the same micro-batches on one
thread: a bubble-free 2-stage pipeline would take half of it ("ideal"). Costs per action are measured from
recorded steps and fed to :func:`lightning_twobp.schedules.simulate`, so each row also shows what the
simulator predicts.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass

import torch.distributed as dist

from lightning_twobp.bench.workload import WORLD, Workload, keep_freed_memory, loss_fn
from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.monitor import op_medians
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules import Costs, build_schedule, schedule_label, schedule_spec, simulate


@dataclass(frozen=True)
class Config:
    name: str
    split_backward: bool
    num_stages: int
    num_microbatches: int
    stages_per_rank: int = 1

    @property
    def label(self) -> str:
        return f"{schedule_label(self.name, self.split_backward)} S={self.num_stages} m={self.num_microbatches}"


def configs(m: int) -> list[Config]:
    out = []
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"):
        spec = schedule_spec(name)
        spr = spec.default_stages_per_rank
        out += [Config(name, split, WORLD * spr, m, spr) for split in ((True,) if spec.split_only else (False, True))]
    # The 2BP paper's 1F1B-1 (m = p) and 1F1B-2 (m = 2p) settings.
    for mm in (WORLD, 2 * WORLD):
        out += [Config("1f1b", False, WORLD, mm), Config("1f1b", True, WORLD, mm)]
    return out


def _measure_costs(records) -> dict:
    """Median duration of each compute kind per stage, from recorded ops (waits excluded), keyed "F0", "BW1", ..."""
    return {f"{k}{s}": v for (k, s), v in op_medians(records).items()}


def _bench(rank: int, world: int, wl: Workload, m: int, repeats: int) -> dict:
    keep_freed_memory()
    model = wl.model()
    ids, tgt = wl.data()
    runs = configs(m)
    execs = {}
    for c in runs:
        sched = build_schedule(
            c.name, c.num_stages, c.num_microbatches, stages_per_rank=c.stages_per_rank, split_backward=c.split_backward
        )
        parts = wl.stages(model, c.num_stages)
        mods = {s: parts[s] for s in sched.stages_of(rank)}
        execs[c] = PipelineExecutor(sched, mods, loss_fn=loss_fn, record=False)
    single = copy.deepcopy(model)

    def chunks(x, n):
        return list(x.chunk(n))

    def run(c: Config, record: bool = False):
        ex = execs[c]
        ex.record = record
        n = c.num_microbatches
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t = time.perf_counter()
        res = ex.step(chunks(ids, n) if 0 in ex.stages else None, chunks(tgt, n) if ex.last in ex.stages else None)
        dist.barrier()
        return time.perf_counter() - t, res

    def run_single(both: bool = False):
        """Gradient accumulation of the whole model on one thread. ``both``: every rank runs it at
        once, which shows what two busy cores cost each other (shared caches and memory bandwidth)."""
        dist.barrier()
        t = time.perf_counter()
        if rank == 0 or both:
            single.zero_grad(set_to_none=True)
            for x, y in zip(chunks(ids, m), chunks(tgt, m), strict=False):
                (loss_fn(single(x), y) / m).backward()
        dist.barrier()
        return time.perf_counter() - t

    for _ in range(2):  # warm-up: allocator, caches, the shape exchange
        for c in runs:
            run(c)
    run_single()
    run_single(both=True)
    times: dict[str, list[float]] = {c.label: [] for c in runs}
    times["single"] = []
    times["single_both"] = []
    for _ in range(repeats):
        for c in runs:
            times[c.label].append(run(c)[0])
        times["single"].append(run_single())
        times["single_both"].append(run_single(both=True))
    # Per-action costs for the simulator, from two recorded steps per configuration (recording adds
    # a saved-tensor hook, so these steps are not timed).
    measured, timelines = {}, {}
    for c in runs:
        first = run(c, record=True)[1].records
        last = run(c, record=True)[1].records
        measured[c.label] = _measure_costs(first + last)
        # boxes start once the inputs have arrived: time blocked on receives shows as idle
        timelines[c.label] = [(r.rank, r.op, r.start + r.wait, r.end) for r in last]
    return {"times": times, "costs": measured, "timelines": timelines}


def _predict(c: Config, costs: dict, comm: float) -> float | None:
    """The simulator's makespan for ``c`` from the per-stage costs measured in its own run."""
    sched = build_schedule(
        c.name, c.num_stages, c.num_microbatches, stages_per_rank=c.stages_per_rank, split_backward=c.split_backward
    )
    n = c.num_stages
    f = [costs.get(f"F{s}", 0.0) for s in range(n)]
    if c.split_backward:
        b = [costs.get(f"B{s}", 0.0) for s in range(n)]
        w = [costs.get(f"W{s}", 0.0) for s in range(n)]
    else:  # fused: BW is split evenly only for the simulator's bookkeeping (it charges b + w)
        b = [costs.get(f"BW{s}", 0.0) for s in range(n)]
        w = [0.0] * n
    return simulate(sched, Costs(f=f, b=b, w=w, comm=comm)).makespan


def _draw_timelines(per_rank: list[dict], folder: str) -> None:
    """One picture per configuration: every rank's ops in its last recorded step (seconds)."""
    from pathlib import Path

    from lightning_twobp.viz import plot_timeline

    Path(folder).mkdir(parents=True, exist_ok=True)
    for label in per_rank[0]["timelines"]:
        ops = [op for out in per_rank for op in out["timelines"][label]]
        slug = label.replace("+2BP", "-2bp").replace(" S=", "-s").replace(" m=", "-m")
        path = Path(folder) / f"measured-{slug}.png"
        plot_timeline(ops, num_ranks=WORLD, title=f"measured: {label}", unit="s", path=path)
        print(f"wrote {path}")


def run_engine(wl: Workload = Workload(), m: int = 8, repeats: int = 5, timelines: str | None = None) -> dict:
    """Run the engine benchmark; returns what ``--json`` writes (and prints the table)."""
    start = time.perf_counter()
    per_rank = run_distributed(_bench, WORLD, wl, m, repeats, timeout=3600)
    out = per_rank[0]  # step times are the same on every rank (barrier to barrier)
    for other in per_rank[1:]:  # each rank measured the costs of its own stages
        for label, cst in other["costs"].items():
            out["costs"][label].update(cst)
    times = {k: statistics.median(v) for k, v in out["times"].items()}
    single = times["single"]
    ideal = single / WORLD
    ideal_busy = times["single_both"] / WORLD
    rows = []
    for c in configs(m):
        t = times[c.label]
        rows.append(
            dict(
                name=c.name,
                split_backward=c.split_backward,
                num_stages=c.num_stages,
                num_microbatches=c.num_microbatches,
                median_step_s=t,
                samples_per_s=wl.batch / t,
                ideal_over_step=ideal / t if c.num_microbatches == m else None,
                busy_ideal_over_step=ideal_busy / t if c.num_microbatches == m else None,
                simulated_step_s=_predict(c, out["costs"][c.label], comm=0.0),
                all_steps_s=out["times"][c.label],
            )
        )
    print(
        f"\ntiny LLaMa {wl.layers} x {wl.dim}, batch {wl.batch} x {wl.seq} tokens, {WORLD} ranks x 1 thread, "
        f"median of {repeats} alternated steps ({time.perf_counter() - start:.0f} s in all)"
    )
    print(
        f"single process, 1 thread, grad accumulation over m={m}: {single:.3f} s/step; "
        f"ideal bubble-free 2-stage: {ideal:.3f} s"
    )
    print(
        f"the same on both cores at once: {times['single_both']:.3f} s/step (two busy cores slow each other "
        f"by {times['single_both'] / single - 1:+.1%}); with that, a bubble-free 2-stage step: {ideal_busy:.3f} s"
    )
    hdr = (
        f"{'schedule':<20}{'2BP':>5}{'S':>3}{'m':>4}{'step s':>9}{'samples/s':>11}{'ideal/step':>12}"
        f"{'busy-ideal/step':>17}{'simulated s':>13}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        eff = "" if r["ideal_over_step"] is None else f"{r['ideal_over_step']:.3f}"
        eff2 = "" if r["busy_ideal_over_step"] is None else f"{r['busy_ideal_over_step']:.3f}"
        print(
            f"{r['name']:<20}{'yes' if r['split_backward'] else 'no':>5}{r['num_stages']:>3}{r['num_microbatches']:>4}"
            f"{r['median_step_s']:>9.3f}{r['samples_per_s']:>11.2f}{eff:>12}{eff2:>17}{r['simulated_step_s']:>13.3f}"
        )
    if timelines:
        _draw_timelines(per_rank, timelines)
    return dict(
        model=asdict(wl.config),
        batch=wl.batch,
        seq=wl.seq,
        world=WORLD,
        repeats=repeats,
        single_process_step_s=single,
        ideal_step_s=ideal,
        single_process_both_cores_step_s=times["single_both"],
        busy_ideal_step_s=ideal_busy,
        configs=rows,
        measured_costs=out["costs"],
    )
