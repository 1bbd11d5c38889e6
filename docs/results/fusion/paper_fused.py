"""The 2BP paper's RQ1 on the Zero Bubble rows, with each schedule also fused where its split loses.

For each of `twobp-bench --paper`'s four models at p = 2, m = 4 (its 1F1B-2 / ZB rows): fused 1F1B-2
(the baseline), ZB-H1, ZB-H2 and ZB-V as the paper bench builds them (at unit costs), the same families
built at the layers' profiled costs ("at costs"), and those fused where the split loses
(schedules.fusion: what schedule="auto" weighs for them), on the same stage modules in one 2-rank gloo
group, one thread per rank, taking turns with the order rotated every round. Each row's gradients are
checked against one process first. Prints one line per model and row: the median step time, RQ1 (the
median over rounds of the baseline's time over the row's) and, for the fused rows, how many of the
backwards were fused and the simulated gain.

    PYTHONPATH=. python docs/results/fusion/paper_fused.py [ROUNDS]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch.distributed as dist

from lightning_twobp.bench import paper as P
from lightning_twobp.bench.peer import grad_error
from lightning_twobp.bench.workload import keep_freed_memory, stage_sizes
from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.partition import split_sequential
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules import Schedule, build_schedule, schedule_spec, simulate
from lightning_twobp.schedules.fusion import fuse_where_split_loses, num_fused

M, FAMILIES = 4, ("zb-h1", "zb-h2", "zb-v")


def schedules(pm: P.PaperModel, layers: P.LayerCosts) -> dict[str, tuple[Schedule, str]]:
    out = {"1F1B-2": (build_schedule("1f1b", 2, M, split_backward=False), "")}
    for name in FAMILIES:
        spec = schedule_spec(name)
        v = spec.default_stages_per_rank
        out[name] = (build_schedule(name, 2 * v, M, stages_per_rank=v), "")
        costs = layers.stage_costs(stage_sizes(pm.blocks, 2 * v), split=True)
        it = 2 if spec.overlaps else 1
        read = (lambda sim: sim.period) if spec.overlaps else (lambda sim: sim.makespan)
        split = build_schedule(name, 2 * v, M, stages_per_rank=v, costs=costs)
        out[f"{name} at costs"] = (split, "")
        fused = fuse_where_split_loses(split, costs, read, it)
        gain = read(simulate(split, costs, iterations=it)) / read(simulate(fused, costs, iterations=it))
        total = fused.num_stages * M
        out[f"{name} fused"] = (fused, f"{num_fused(fused)} of {total} fused, simulated {gain:.3f}x its split")
    return out


def worker(rank: int, world: int, rounds: int) -> dict:
    keep_freed_memory()  # as the paper bench runs
    out = {}
    for pm in P.models():
        layers, loss_fn = pm.build()
        x, y = pm.data()
        profile = [P._profile(copy.deepcopy(layers), x[: pm.batch // M], reps=3) if rank == 0 else None]
        dist.broadcast_object_list(profile, src=0)  # every rank builds the same orders from rank 0's costs
        rows = schedules(pm, profile[0])
        ref = P._reference(layers, loss_fn, x, y, M)
        runners = {}
        for label, (sched, _) in rows.items():
            parts = split_sequential(copy.deepcopy(layers), stage_sizes(pm.blocks, sched.num_stages))
            mods = {s: parts[s] for s in sched.stages_of(rank)}
            ex = PipelineExecutor(sched, mods, loss_fn=loss_fn)
            inputs = list(x.chunk(M)) if 0 in mods else None
            targets = list(y.chunk(M)) if sched.num_stages - 1 in mods else None
            params = {k: q for mod in mods.values() for k, q in mod.named_parameters()}
            runners[label] = (lambda ex=ex, i=inputs, t=targets: ex.step(i, t), params)
        worst = 0.0
        for label, (step, params) in runners.items():
            for q in params.values():
                q.grad = None
            step()
            err, bad = grad_error(params, ref)
            assert not bad, (pm.name, label, bad[:3])
            worst = max(worst, err)
        times: dict[str, list[float]] = {label: [] for label in runners}
        labels = list(runners)
        for i in range(rounds):
            k = i % len(labels)
            for label in labels[k:] + labels[:k]:
                step, params = runners[label]
                for q in params.values():
                    q.grad = None
                dist.barrier()
                t = time.perf_counter()
                step()
                dist.barrier()
                times[label].append(time.perf_counter() - t)
        out[pm.name] = {"times": times, "notes": {k: v[1] for k, v in rows.items()}, "worst": worst}
    return out


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    per_rank = run_distributed(worker, 2, rounds, timeout=3000)
    for model, r in per_rank[0].items():
        base = r["times"]["1F1B-2"]
        worst = max(rank[model]["worst"] for rank in per_rank)
        print(f"{model}: gradients within rtol 1e-5 of one process on both ranks (largest difference {worst:.2g})")
        for label, ts in r["times"].items():
            rq1 = statistics.median(b / t for b, t in zip(base, ts, strict=True))
            note = r["notes"][label]
            print(f"  {label:14s} {statistics.median(ts) * 1e3:7.1f} ms  RQ1 {rq1:.3f}  {note}")
