"""Engine benchmark: step time of every schedule, with and without 2BP, against one process.

    python -m lightning_twobp.bench [--json PATH] [--repeats N] [--quick]
    python -m lightning_twobp.bench --trainer    # the same steps through Trainer vs the bare engine

Two gloo processes with one intra-op thread each run the tiny LLaMa-like model (8 blocks x 512, 8 heads,
vocab 1024) on a batch of 32 x 128 tokens. Every configuration runs in the same process group, alternated
(A, B, C, ..., A, B, C, ...), after one warm-up step each; the table shows medians. The single-process
row is gradient accumulation of the same micro-batches on one thread: a bubble-free 2-stage pipeline
would take half of it ("ideal"). Costs per action are measured from recorded steps and fed to
:func:`lightning_twobp.schedules.simulate`, so each row also shows what the simulator predicts.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.models.llama import LlamaConfig, build_llama
from lightning_twobp.partition import even_sizes, split_sequential
from lightning_twobp.schedules import Action, Costs, build_schedule, simulate
from lightning_twobp.testing import run_distributed

WORLD = 2


def _keep_freed_memory() -> None:
    """Stop glibc from handing large freed blocks back to the OS after every step.

    By default a freed block above the mmap threshold is unmapped and the next allocation faults in
    fresh zeroed pages. The split backward holds more at once, so it would pay that more often than
    the fused one. GPU runs use the CUDA caching allocator, which keeps memory; this makes the CPU
    stand-in behave alike for every configuration (fused and split alike).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)
    libc.mallopt(m_trim_threshold, 1 << 30)


@dataclass(frozen=True)
class Config:
    name: str
    split_backward: bool
    num_stages: int
    num_microbatches: int
    stages_per_rank: int = 1

    @property
    def label(self) -> str:
        tag = "+2BP" if self.split_backward and not self.name.startswith("zb") else ""
        return f"{self.name}{tag} S={self.num_stages} m={self.num_microbatches}"


def configs(m: int) -> list[Config]:
    out = []
    for name, spr in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        for split in (False, True):
            out.append(Config(name, split, WORLD * spr, m, spr))
    out += [Config("zb-h1", True, WORLD, m), Config("zb-h2", True, WORLD, m), Config("zb-v", True, 2 * WORLD, m, 2)]
    # The 2BP paper's 1F1B-1 (m = p) and 1F1B-2 (m = 2p) settings.
    for mm in (WORLD, 2 * WORLD):
        out += [Config("1f1b", False, WORLD, mm), Config("1f1b", True, WORLD, mm)]
    return out


def stage_sizes(num_blocks: int, num_stages: int) -> list[int]:
    """Layers per stage for embedding + blocks + head: the blocks evenly over the stages, the
    embedding joining the first stage and the head the last. Even layer counts would instead give
    the V's rank 1 five blocks and rank 0 three (the embedding is nearly free)."""
    sizes = even_sizes(num_blocks, num_stages)
    sizes[0] += 1
    sizes[-1] += 1
    return sizes


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _measure_costs(records) -> dict:
    """Median duration of each compute kind per stage, from recorded ops (waits excluded)."""
    per: dict[tuple[str, int], list[float]] = {}
    for r in records:
        kind_stage = _parse(r.op)
        if kind_stage is None:
            continue
        kind, stage, n = kind_stage
        per.setdefault((kind, stage), []).append((r.end - r.start - r.wait) / n)
    return {f"{k}{s}": statistics.median(v) for (k, s), v in per.items()}


def _parse(op: str):
    try:
        a = Action.parse(op)
    except ValueError:
        return None
    return a.kind, a.stage, len(a.microbatches) if a.kind == "W" else 1


def _bench(rank: int, world: int, batch: int, seq: int, m: int, repeats: int, layers: int) -> dict:
    _keep_freed_memory()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, dim=512, n_layers=layers, n_heads=8, max_seq_len=seq)
    model = build_llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    tgt = torch.roll(ids, -1, dims=1)
    runs = configs(m)
    execs = {}
    for c in runs:
        sched = build_schedule(c.name, c.num_stages, c.num_microbatches, stages_per_rank=c.stages_per_rank, split_backward=c.split_backward)
        parts = split_sequential(model, stage_sizes(layers, c.num_stages))
        mods = {s: parts[s] for s in sched.stages_of(rank)}
        execs[c] = PipelineExecutor(sched, mods, loss_fn=_loss, record=False)
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
            for x, y in zip(chunks(ids, m), chunks(tgt, m)):
                (_loss(single(x), y) / m).backward()
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
    sched = build_schedule(c.name, c.num_stages, c.num_microbatches, stages_per_rank=c.stages_per_rank, split_backward=c.split_backward)
    n = c.num_stages
    f = [costs.get(f"F{s}", 0.0) for s in range(n)]
    if c.split_backward:
        b = [costs.get(f"B{s}", 0.0) for s in range(n)]
        w = [costs.get(f"W{s}", 0.0) for s in range(n)]
    else:  # fused: BW is split evenly only for the simulator's bookkeeping (it charges b + w)
        b = [costs.get(f"BW{s}", 0.0) for s in range(n)]
        w = [0.0] * n
    return simulate(sched, Costs(f=f, b=b, w=w, comm=comm)).makespan


def bench_split(tokens: int = 512, repeats: int = 21, seq: int = 128) -> dict:
    """(B + W) / BW on one block of the tiny LLaMa (hidden 512, 8 heads), one thread, alternated.

    BW is plain ``loss.backward()``-style autograd (``out.backward(grad)``) on the block; B + W is
    :class:`Stage`'s split. Each pair starts from ``.grad = None``, so both pay the first
    accumulation. Medians over ``repeats`` pairs after 3 warm-up pairs.
    """
    from lightning_twobp.engine import Stage
    from lightning_twobp.models.llama import Block

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        seq = min(seq, tokens)
        block = Block(LlamaConfig(dim=512, n_heads=8, max_seq_len=seq))
        x = torch.randn(tokens // seq, seq, 512)
        g = torch.randn_like(x)
        stage = Stage(block)
        fused, b, w = [], [], []
        for i in range(repeats + 3):
            block.zero_grad(set_to_none=True)
            out = block(x.requires_grad_())
            t0 = time.perf_counter()
            out.backward(g)
            t1 = time.perf_counter()
            del out
            x.grad = None
            block.zero_grad(set_to_none=True)
            stage.forward(0, x)
            t2 = time.perf_counter()
            stage.backward_input(0, g)
            t3 = time.perf_counter()
            stage.backward_weight(0)
            t4 = time.perf_counter()
            if i >= 3:
                fused.append(t1 - t0)
                b.append(t3 - t2)
                w.append(t4 - t3)
    finally:
        torch.set_num_threads(threads)
    med = statistics.median
    ratios = [(bi + wi) / fi for bi, wi, fi in zip(b, w, fused)]
    return dict(tokens=tokens, bw_ms=med(fused) * 1e3, b_ms=med(b) * 1e3, w_ms=med(w) * 1e3,
                ratio_of_medians=(med(b) + med(w)) / med(fused), median_ratio=med(ratios),
                deferred_fraction=stage.deferred_fraction)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (median)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="a small model and 1 repeat, to check the harness")
    ap.add_argument("--timelines", metavar="DIR", help="draw each configuration's recorded step as DIR/measured-*.png")
    ap.add_argument("--split", action="store_true", help="only measure (B + W) / BW on one block")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 256, 64], help="tokens per micro-batch for --split")
    ap.add_argument("--trainer", action="store_true",
                    help="only compare the step through Trainer(strategy=TwoBPStrategy) with the bare engine's")
    ap.add_argument("--only", nargs="+", metavar="LABEL", help="with --trainer: configurations whose label starts so")
    args = ap.parse_args(argv)
    if args.trainer:
        from lightning_twobp.bench_trainer import bench_trainer

        if args.quick:
            args.batch, args.seq, args.layers, args.repeats = 8, 32, 4, 2
        rows = bench_trainer(args.batch, args.seq, args.microbatches, args.repeats, args.layers, args.only)
        print(f"tiny LLaMa {args.layers} x 512, batch {args.batch} x {args.seq}, m={args.microbatches}, 2 ranks x 1 thread, "
              f"median of {args.repeats} alternated steps")
        print(f"{'configuration':<32}{'Trainer s':>11}{'bare s':>9}{'Trainer/bare (median of pairs)':>32}")
        for label, r in rows.items():
            print(f"{label:<32}{r['lightning_step_s']:>11.3f}{r['bare_step_s']:>9.3f}{r['ratio']:>32.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(batch=args.batch, seq=args.seq, layers=args.layers, microbatches=args.microbatches,
                               repeats=args.repeats, rows=rows), fh, indent=2)
            print(f"wrote {args.json}")
        return 0
    if args.split:
        _keep_freed_memory()
        print(f"{'tokens':>7}{'BW ms':>9}{'B ms':>9}{'W ms':>9}{'(B+W)/BW':>10}")
        for n in args.tokens:
            r = bench_split(n)
            print(f"{n:>7}{r['bw_ms']:>9.2f}{r['b_ms']:>9.2f}{r['w_ms']:>9.2f}{r['median_ratio']:>10.3f}")
        return 0
    if args.quick:
        args.batch, args.seq, args.layers, args.repeats = 8, 32, 4, 1
    start = time.perf_counter()
    per_rank = run_distributed(
        _bench, WORLD, args.batch, args.seq, args.microbatches, args.repeats, args.layers, timeout=3600
    )
    out = per_rank[0]  # step times are the same on every rank (barrier to barrier)
    for other in per_rank[1:]:  # each rank measured the costs of its own stages
        for label, cst in other["costs"].items():
            out["costs"][label].update(cst)
    times = {k: statistics.median(v) for k, v in out["times"].items()}
    single = times["single"]
    ideal = single / WORLD
    ideal_busy = times["single_both"] / WORLD
    rows = []
    for c in configs(args.microbatches):
        cst = out["costs"][c.label]
        pred = _predict(c, cst, comm=0.0)
        t = times[c.label]
        rows.append(
            dict(
                name=c.name,
                split_backward=c.split_backward,
                num_stages=c.num_stages,
                num_microbatches=c.num_microbatches,
                median_step_s=t,
                samples_per_s=args.batch / t,
                ideal_over_step=ideal / t if c.num_microbatches == args.microbatches else None,
                busy_ideal_over_step=ideal_busy / t if c.num_microbatches == args.microbatches else None,
                simulated_step_s=pred,
                all_steps_s=out["times"][c.label],
            )
        )
    print(f"\ntiny LLaMa {args.layers} x 512, batch {args.batch} x {args.seq} tokens, {WORLD} ranks x 1 thread, "
          f"median of {args.repeats} alternated steps ({time.perf_counter() - start:.0f} s in all)")
    print(f"single process, 1 thread, grad accumulation over m={args.microbatches}: {single:.3f} s/step; "
          f"ideal bubble-free 2-stage: {ideal:.3f} s")
    print(f"the same on both cores at once: {times['single_both']:.3f} s/step (two busy cores slow each other "
          f"by {times['single_both'] / single - 1:+.1%}); with that, a bubble-free 2-stage step: {ideal_busy:.3f} s")
    hdr = (f"{'schedule':<20}{'2BP':>5}{'S':>3}{'m':>4}{'step s':>9}{'samples/s':>11}{'ideal/step':>12}"
           f"{'busy-ideal/step':>17}{'simulated s':>13}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        eff = "" if r["ideal_over_step"] is None else f"{r['ideal_over_step']:.3f}"
        eff2 = "" if r["busy_ideal_over_step"] is None else f"{r['busy_ideal_over_step']:.3f}"
        print(f"{r['name']:<20}{'yes' if r['split_backward'] else 'no':>5}{r['num_stages']:>3}{r['num_microbatches']:>4}"
              f"{r['median_step_s']:>9.3f}{r['samples_per_s']:>11.2f}{eff:>12}{eff2:>17}{r['simulated_step_s']:>13.3f}")
    if args.timelines:
        _draw_timelines(per_rank, args.timelines)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                dict(
                    model=asdict(LlamaConfig(vocab_size=1024, dim=512, n_layers=args.layers, n_heads=8, max_seq_len=args.seq)),
                    batch=args.batch, seq=args.seq, world=WORLD, repeats=args.repeats,
                    single_process_step_s=single, ideal_step_s=ideal,
                    single_process_both_cores_step_s=times["single_both"], busy_ideal_step_s=ideal_busy,
                    configs=rows, measured_costs=out["costs"],
                ),
                fh,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
