"""What the ModuleList contract costs: the tiny LLaMa through ``Trainer`` as one ``nn.Sequential`` and in
the loop form, alternated in one run.

    python -m lightning_twobp.bench.modulelist [--rounds N] [--steps K] [--schedules S ...] [--json PATH] [--quick]

Two gloo processes with one thread each train the benchmark workload (:mod:`.workload`: 8 blocks x 512,
batch 32 x 128 tokens, m = 8) with ``Trainer(strategy=TwoBPStrategy(schedule=S))``, once as
:func:`~lightning_twobp.models.llama.build_llama`'s Sequential (the Sequential contract) and once as
:class:`~lightning_twobp.models.llama_loop.LlamaLoop` (the same modules and weights, its blocks in an
``nn.ModuleList`` called in a loop with the rotary tables as keyword side inputs: the ModuleList
contract), with the same blocks on each stage (``balance=``; the embedding with the first stage's
blocks, the head with the last's). The two forms alternate, one fit of ``K`` steps each per round (A/B/A/B in the same
processes); each fit times its loop iterations barrier to barrier (``on_train_batch_start`` to the
next), drops the first two (warm-up, shape exchange) and takes the median. The ratio is the median over
rounds of loop-form step / Sequential step: each round's two fits ran back to back, so drift on a
shared machine cancels. Both forms train the same steps on the same data from the same weights, so
their weights must come out equal (``max_param_diff``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_twobp.bench.report import write_json
from lightning_twobp.bench.trainer import LlamaModule, SameBatch, quiet_trainer
from lightning_twobp.bench.workload import WORLD, Workload, keep_freed_memory, stage_sizes
from lightning_twobp.models.llama_loop import LlamaLoop
from lightning_twobp.partition import even_sizes
from lightning_twobp.processes import free_port, rank_env, run_distributed
from lightning_twobp.schedules.placement import default_stages_per_rank

__all__ = ["bench_modulelist", "main"]

_WARMUP = 2  # untimed iterations at the start of each fit


def _sequential(wl: Workload, num_stages: int) -> tuple[torch.nn.Module, list[int]]:
    """The Sequential, with the embedding joining the first stage's blocks and the head the last's."""
    return wl.model(), stage_sizes(wl.layers, num_stages)  # seed 0


def _loop(wl: Workload, num_stages: int) -> tuple[torch.nn.Module, list[int]]:
    """The loop form, with the same blocks per stage (its layers are the blocks; the embedding and the
    head belong to the first and the last)."""
    torch.manual_seed(0)  # as Workload.model: the same modules in the same order, so the same weights
    return LlamaLoop(wl.config), even_sizes(wl.layers, num_stages)


class _Timer(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dist.barrier()
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        dist.barrier()
        self.starts.append(time.perf_counter())


def _fit(
    form: Callable[[Workload, int], tuple[torch.nn.Module, list[int]]], wl: Workload, schedule: str, m: int, steps: int
) -> tuple[list[float], list[torch.Tensor]]:
    from lightning_twobp import TwoBPStrategy

    ids, tgt = wl.data()
    model, balance = form(wl, WORLD * default_stages_per_rank(schedule))
    lm = LlamaModule(model)  # either form as self.layers: the Sequential, or the loop whose ModuleList is found
    timer = _Timer()
    strategy = TwoBPStrategy(schedule=schedule, num_microbatches=m, balance=balance)
    trainer = quiet_trainer(WORLD, strategy, steps, [timer], use_distributed_sampler=False)
    trainer.fit(lm, DataLoader(SameBatch(ids, tgt, steps), batch_size=wl.batch))
    periods = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)][_WARMUP:]
    return periods, [q.detach().clone() for q in lm.layers.parameters() if not q.is_meta]  # what this rank trained


def _worker(
    rank: int, world: int, wl: Workload, schedules: list[str], m: int, rounds: int, steps: int, port: int
) -> dict:
    rank_env(rank, world, port)
    keep_freed_memory()
    out: dict = {}
    for schedule in schedules:
        seq_steps, loop_steps, diff = [], [], 0.0
        for _ in range(rounds):
            a, wa = _fit(_sequential, wl, schedule, m, steps)
            b, wb = _fit(_loop, wl, schedule, m, steps)
            seq_steps.append(statistics.median(a))
            loop_steps.append(statistics.median(b))
            diff = max([diff] + [(x - y).abs().max().item() for x, y in zip(wa, wb, strict=False)])
        out[schedule] = {"sequential": seq_steps, "loop": loop_steps, "max_param_diff": diff}
    return out


def bench_modulelist(
    wl: Workload = Workload(),
    schedules: tuple[str, ...] = ("1f1b", "zb-v"),
    m: int = 8,
    rounds: int = 3,
    steps: int = 5,
) -> dict:
    """Per schedule: the two forms' step times per round, the ratio (median over rounds of loop /
    Sequential) and the largest weight difference between the two forms after each fit."""
    if steps <= _WARMUP:
        raise ValueError(f"steps={steps}: each fit needs more than the {_WARMUP} warm-up steps")
    per_rank = run_distributed(_worker, WORLD, wl, list(schedules), m, rounds, steps, free_port(), timeout=7200)
    rows = {}
    for schedule, t in per_rank[0].items():  # barrier to barrier: the same on both ranks
        ratios = [b / a for a, b in zip(t["sequential"], t["loop"], strict=False)]
        rows[schedule] = {
            "sequential_step_s": statistics.median(t["sequential"]),
            "loop_step_s": statistics.median(t["loop"]),
            "ratio": statistics.median(ratios),
            "round_ratios": ratios,
            "max_param_diff": max(r[schedule]["max_param_diff"] for r in per_rank),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lightning_twobp.bench.modulelist",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds: each form fitted once per round")
    ap.add_argument("--steps", type=int, default=5, help=f"steps per fit (the first {_WARMUP} are not timed)")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb-v"])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--quick", action="store_true", help="a small model, one round: checks the harness")
    args = ap.parse_args(argv)
    wl = Workload.quick() if args.quick else Workload()
    rows = bench_modulelist(wl, tuple(args.schedules), args.microbatches, 1 if args.quick else args.rounds, args.steps)
    print(f"{'schedule':<12}{'Sequential s':>14}{'ModuleList s':>14}{'ratio':>8}  rounds{'':>14}max weight diff")
    for schedule, r in rows.items():
        rounds = " ".join(f"{x:.3f}" for x in r["round_ratios"])
        print(
            f"{schedule:<12}{r['sequential_step_s']:>14.3f}{r['loop_step_s']:>14.3f}{r['ratio']:>8.3f}  {rounds:<20}"
            f"{r['max_param_diff']:.3g}"
        )
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
