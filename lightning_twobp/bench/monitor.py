"""What ``PipelineMonitor`` costs: step time with and without it, alternated in one process group.

    python -m lightning_twobp.bench.monitor [--rounds 5] [--steps 150] [--every 50] [--json PATH]

Two gloo processes (one intra-op thread each) fit the default recipe's model and data (tiny LLaMa
4 x 128, counting task, ZB-H1, m = 4, batch 16 x 64) with ``Trainer(strategy="twobp")``, once with the
monitor logging every ``--every`` steps (as the recipes run it, FLOPs counted on step 1) and once
without, alternated A/B/A/B for ``--rounds`` rounds. A callback takes the time of every step.

Both fits log through a CSVLogger, as the recipes do. On a shared machine two fits differ by more
than 1% whatever they run, so the overhead is also measured inside each monitored fit, where the
noise cannot reach it: the time spent in the monitor's own hooks (logging steps: one all-gather,
the simulator, ``self.log``), plus what each recorded step and the step after it (where Lightning
hands the logged values to the logger) take beyond the median of their neighbours, over the time of
all steps from step 5 on. That counts the logger's write of the model's own loss too, so it
overstates the monitor's share. The FLOP-counting step 1 is reported on its own (once per run), as
its time over the next steps' median in the same fit, divided by the same ratio in the fit without
the monitor. On a GPU a recorded step also synchronizes the device at each op; this benchmark runs
on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch

from lightning_twobp.bench.report import write_json
from lightning_twobp.processes import free_port, rank_env, run_distributed

__all__ = ["bench_monitor"]


class _StepClock(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.ends:
            self.ends.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())

    def durations(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


def _timed_monitor(every: int):
    from lightning_twobp import PipelineMonitor

    class Timed(PipelineMonitor):
        """The monitor, with the seconds its hooks take per global step."""

        def __init__(self) -> None:
            super().__init__(log_every_n_steps=every)
            self.hook_s: dict[int, float] = {}

        def _timed(self, step: int, fn, *args) -> None:
            t = time.perf_counter()
            fn(*args)
            self.hook_s[step] = self.hook_s.get(step, 0.0) + time.perf_counter() - t

        def on_train_batch_start(self, trainer, *args):
            self._timed(trainer.global_step, super().on_train_batch_start, trainer, *args)

        def on_train_batch_end(self, trainer, *args):
            self._timed(trainer.global_step - 1, super().on_train_batch_end, trainer, *args)

    return Timed()


def _fit(rank: int, world: int, steps: int, every: int, monitored: bool) -> dict:
    import tempfile

    from lightning.pytorch.loggers import CSVLogger

    from lightning_twobp import TwoBPStrategy
    from lightning_twobp.bench.trainer import quiet_trainer
    from lightning_twobp.data import TokenDataModule
    from lightning_twobp.models import LlamaLM

    model = LlamaLM(vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=64, lr=3e-3)
    data = TokenDataModule(vocab_size=256, seq_len=64, batch_size=16, num_train=4096, num_val=0, seed=0)
    clock = _StepClock()
    monitor = _timed_monitor(every) if monitored else None
    # the clock last: step k's time then holds the monitor's hooks of step k
    callbacks = ([monitor] if monitor else []) + [clock]
    with tempfile.TemporaryDirectory() as logs:  # the recipes' logger: the monitor's figures are written too
        strategy = TwoBPStrategy(schedule="zb-h1", num_microbatches=4)
        options = {"logger": CSVLogger(logs), "limit_val_batches": 0, "log_every_n_steps": every}
        trainer = quiet_trainer(world, strategy, steps, callbacks, **options)
        trainer.fit(model, datamodule=data)
    return {"durations": clock.durations(), "hook_s": monitor.hook_s if monitor else {}}


def _inside(run: dict, every: int) -> dict:
    """The monitor's cost measured inside one monitored fit (see the module docstring)."""
    d, hooks = run["durations"], run["hook_s"]
    total = sum(d[5:])
    hook_total = sum(v for k, v in hooks.items() if k >= 5)
    excess = []
    for s in range(5, len(d) - 1):  # the last step has no next one to hold its logger's write
        if (s + 1) % every == 0:  # recorded, and logged at its end; Lightning hands the logged values to
            # the logger after the callbacks' batch end, inside step s + 1's time: both count
            near = d[max(5, s - 6) : s - 1] + d[s + 3 : s + 8]
            excess.append(d[s] + d[s + 1] - hooks.get(s, 0.0) - hooks.get(s + 1, 0.0) - 2 * statistics.median(near))
    # the steps whose logging was not measured (the last) are charged at the measured mean
    logged = sum(1 for s in range(5, len(d)) if (s + 1) % every == 0)
    if excess and logged > len(excess):
        excess += [statistics.fmean(excess)] * (logged - len(excess))
    return dict(
        hooks_fraction=hook_total / total,
        recorded_fraction=sum(excess) / total,
        overhead_fraction=(hook_total + sum(excess)) / total,
    )


def _worker(rank: int, world: int, port: int, rounds: int, steps: int, every: int) -> dict:
    rank_env(rank, world, port)
    out: dict[str, list[dict]] = {"with": [], "without": []}
    _fit(rank, world, 10, every, True)  # warm-up: imports, allocator, the first process group
    for _ in range(rounds):
        for label, monitored in (("with", True), ("without", False)):
            out[label].append(_fit(rank, world, steps, every, monitored))
    return out


def bench_monitor(rounds: int = 5, steps: int = 150, every: int = 50) -> dict:
    per_rank = run_distributed(_worker, 2, free_port(), rounds, steps, every, timeout=3600)
    runs = per_rank[0]  # barrier-bound: every rank's step ends together
    rows = []
    for k in range(rounds):
        a, b = runs["with"][k]["durations"], runs["without"][k]["durations"]
        rows.append(
            dict(
                round=k,
                with_s=statistics.median(a[5:]),
                without_s=statistics.median(b[5:]),
                with_mean_s=statistics.fmean(a[5:]),
                without_mean_s=statistics.fmean(b[5:]),
                flops_step_with_s=a[1],
                flops_step_without_s=b[1],
                # step 1 against its own fit's next steps, over the same in the fit without it
                flops_step_ratio=(a[1] / statistics.median(a[2:7])) / (b[1] / statistics.median(b[2:7])),
                **_inside(runs["with"][k], every),
            )
        )
    for r in rows:
        r["mean_ratio"] = r["with_mean_s"] / r["without_mean_s"]
    return dict(
        rounds=rounds,
        steps=steps,
        every=every,
        torch_version=torch.__version__,
        rows=rows,
        median_mean_ratio=statistics.median(r["mean_ratio"] for r in rows),
        median_overhead_fraction=statistics.median(r["overhead_fraction"] for r in rows),
        median_flops_step_ratio=statistics.median(r["flops_step_ratio"] for r in rows),
    )


def markdown(result: dict) -> str:
    lines = [
        f"PipelineMonitor logging every {result['every']} steps vs none: {result['steps']} steps of the default "
        f"recipe's model (tiny LLaMa 4 x 128, ZB-H1, m = 4) per fit, 2 gloo ranks, alternated over "
        f"{result['rounds']} rounds",
        "",
        "| round | mean step with (ms) | without (ms) | with / without | inside: hooks | recorded steps "
        "| overhead | step 1 (FLOPs counted) / its neighbours, with / without |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['round']} | {1e3 * r['with_mean_s']:.1f} | {1e3 * r['without_mean_s']:.1f} | "
            f"{r['mean_ratio']:.3f} | {r['hooks_fraction']:.2%} | {r['recorded_fraction']:+.2%} | "
            f"{r['overhead_fraction']:.2%} | {r['flops_step_ratio']:.2f} |"
        )
    lines.append(
        f"\nmedian over rounds: overhead measured inside the monitored fits {result['median_overhead_fraction']:.2%} "
        f"of step time; with / without across fits {result['median_mean_ratio']:.3f} (steps 5 on, noise "
        f"between fits included); the FLOP-counting step {result['median_flops_step_ratio']:.2f}x, once per run"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lightning_twobp.bench.monitor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    result = bench_monitor(args.rounds, args.steps, args.every)
    print(markdown(result))
    if args.json:
        write_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
