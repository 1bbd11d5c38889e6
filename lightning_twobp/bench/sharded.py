"""Sharded against replicated data parallelism beside the pipeline: ``twobp-bench --sharded``.

    twobp-bench --sharded [--json PATH] [--quick]

The tiny LLaMa of the activation-checkpointing benchmark (dim 256, 8 blocks, 4 heads, seq 128, vocab
256; batch 16 per replica in m = 4 micro-batches) trains through ``Trainer(strategy=TwoBPStrategy(
pipeline_degree=2, data_parallel=...))`` on 4 gloo processes (pp 2 x dp 2, one thread each) for a few
steps with AdamW, once per layout per round, the layouts alternated round by round (replicate, shard,
then shard, replicate, ...). One launch per layout: a process's peak RSS is its own, so two layouts in
one launch would report the larger for both.

Per rank:

* **state bytes**: its parameters, gradients and AdamW state right before the second optimizer step
  (the gradients are there, and the optimizer state from the first step), local shards of DTensors
  (:func:`~lightning_twobp.lightning.sharding.state_bytes`): between steps, sharded holds ``1/dp``;
* **peak RSS growth**: the process's peak resident set size at the end of ``fit`` less its RSS when
  ``fit`` starts (glibc keeps freed blocks, ``engine/memory.py``: this is the heap's high-water mark,
  and it includes the step's gathered parameters and unsharded gradients);
* **step s**: the median over the steps after the first two of the time between two batch ends.
"""

from __future__ import annotations

import io
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_twobp.monitor import peak_rss_bytes, rss_mb
from lightning_twobp.processes import free_port, rank_env, run_distributed

__all__ = ["LAYOUTS", "markdown", "run_sharded"]

LAYOUTS = ("replicate", "shard")
WORLD, PIPELINE = 4, 2
MiB = 2**20


def _model_kwargs(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16)
    return dict(vocab_size=256, dim=256, n_layers=8, n_heads=4, max_seq_len=128)


class _Meter(pl.Callback):
    """The module docstring's three figures, on this rank."""

    def __init__(self) -> None:
        self.state: dict[str, int] = {}
        self.ends: list[float] = []
        self.rss_start = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rss_start = rss_mb() * 1e6

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from lightning_twobp.lightning.sharding import state_bytes

        if trainer.global_step == 1:
            self.state = state_bytes([q for q in pl_module.parameters() if q.requires_grad], [optimizer])

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def _worker(rank: int, world: int, port: int, layout: str, steps: int, quick: bool) -> dict[str, Any]:
    from lightning_twobp import TwoBPStrategy
    from lightning_twobp.bench.trainer import quiet_trainer
    from lightning_twobp.data import TokenDataModule
    from lightning_twobp.models import LlamaLM

    rank_env(rank, world, port)
    kw = _model_kwargs(quick)
    pl.seed_everything(0, verbose=False)
    model = LlamaLM(**kw, lr=1e-3)
    data = TokenDataModule(
        vocab_size=kw["vocab_size"], seq_len=kw["max_seq_len"], batch_size=16, num_train=4096, num_val=0, seed=0
    )
    meter = _Meter()
    strategy = TwoBPStrategy(schedule="1f1b", num_microbatches=4, pipeline_degree=PIPELINE, data_parallel=layout)
    quiet_trainer(world, strategy, steps, [meter], limit_val_batches=0).fit(model, datamodule=data)
    times = [b - a for a, b in zip(meter.ends, meter.ends[1:], strict=False)][1:]  # from the third step
    return dict(
        state=meter.state,
        rss_growth=peak_rss_bytes() - meter.rss_start,
        step_s=statistics.median(times) if times else float("nan"),
    )


def run_sharded(steps: int = 8, rounds: int = 2, quick: bool = False, timeout: float = 900.0) -> dict[str, Any]:
    """Each layout ``rounds`` times, alternated; per layout and rank the median over its rounds."""
    runs: dict[str, list[list[dict]]] = {layout: [] for layout in LAYOUTS}
    order = []
    for r in range(rounds):
        for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
            order.append(layout)
            runs[layout].append(run_distributed(_worker, WORLD, free_port(), layout, steps, quick, timeout=timeout))
    rows = []
    for layout, launches in runs.items():
        for rank in range(WORLD):
            mine = [launch[rank] for launch in launches]
            state = mine[0]["state"]  # the same bytes in every round
            rows.append(
                dict(
                    layout=layout,
                    rank=rank,
                    pipeline_rank=rank % PIPELINE,
                    **{k: state.get(k, 0) for k in ("params", "grads", "optimizer")},
                    rss_growth=statistics.median(m["rss_growth"] for m in mine),
                    step_s=statistics.median(m["step_s"] for m in mine),
                )
            )
    model = dict(_model_kwargs(quick), batch=16, microbatches=4)
    return dict(model=model, world=WORLD, pipeline=PIPELINE, steps=steps, order=order, rows=rows)


def markdown(result: dict[str, Any]) -> str:
    out = io.StringIO()
    w = out.write
    kw = result["model"]
    w(
        f"tiny LLaMa {kw['n_layers']} x {kw['dim']}, seq {kw['max_seq_len']}, vocab {kw['vocab_size']}; batch "
        f"{kw['batch']} per replica, m = {kw['microbatches']}, 1F1B + 2BP, AdamW; pp {result['pipeline']} x dp "
        f"{result['world'] // result['pipeline']} on {result['world']} gloo processes x 1 thread, "
        f"{result['steps']} steps per launch; launches in the order {', '.join(result['order'])}\n\n"
    )
    w("| layout | rank (stage) | params MiB | grads MiB | AdamW MiB | total MiB | / replicated | peak RSS growth MiB ")
    w("| step s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    total = {(r["layout"], r["rank"]): r["params"] + r["grads"] + r["optimizer"] for r in result["rows"]}
    for r in result["rows"]:
        t = total[(r["layout"], r["rank"])]
        ratio = t / total[("replicate", r["rank"])] if total[("replicate", r["rank"])] else float("nan")
        w(
            f"| {r['layout']} | {r['rank']} ({r['pipeline_rank']}) | {r['params'] / MiB:.2f} | {r['grads'] / MiB:.2f} "
            f"| {r['optimizer'] / MiB:.2f} | {t / MiB:.2f} | {ratio:.2f} | {r['rss_growth'] / MiB:.1f} "
            f"| {r['step_s']:.3f} |\n"
        )
    w(f"\ntorch {torch.__version__}; the state bytes are exact, the RSS and times are this machine's\n")
    return out.getvalue()
