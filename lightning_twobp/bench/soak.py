"""Does memory stay flat over a long run? ``twobp-bench --soak N``.

Two gloo processes train the default recipe's model and data (tiny LLaMa 4 x 128, counting task,
ZB-H1, m = 4, batch 16 x 64) with ``Trainer(strategy="twobp")`` for N steps, several epochs, with
checkpointing and validation off. Every rank samples its resident set size (``/proc/self/statm``)
every ``every`` steps; the report gives each rank's RSS after warm-up, at the end, and the slope
of a least-squares line through the samples after warm-up and through the second half (MB per
1,000 steps): growth that levels off (allocator arenas filling) shows as a second-half slope near zero. A leak of one
micro-batch's activations per step would show as tens of MB per 1,000 steps; allocator noise as
well under one.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc

import lightning.pytorch as pl
import torch

from lightning_twobp.monitor import rss_mb
from lightning_twobp.processes import free_port, rank_env, run_distributed

__all__ = ["markdown", "soak"]


class _Sampler(pl.Callback):
    def __init__(self, every: int) -> None:
        self.every = every
        # (step, seconds since start, RSS MB, Python's own allocations MB or NaN without tracemalloc)
        self.samples: list[tuple[int, float, float, float]] = []
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every == 0:
            python = tracemalloc.get_traced_memory()[0] / 1e6 if tracemalloc.is_tracing() else float("nan")
            self.samples.append((step, time.perf_counter() - self._t0, rss_mb(), python))


def _worker(rank: int, world: int, port: int, steps: int, every: int, python: bool) -> list[tuple]:
    if python:
        tracemalloc.start(1)  # Python's own allocations, to tell a leak of objects from native growth
    from lightning_twobp import TwoBPStrategy
    from lightning_twobp.bench.trainer import quiet_trainer
    from lightning_twobp.data import TokenDataModule
    from lightning_twobp.models import LlamaLM

    rank_env(rank, world, port)
    model = LlamaLM(vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=64, lr=3e-3)
    data = TokenDataModule(vocab_size=256, seq_len=64, batch_size=16, num_train=4096, num_val=0, seed=0)
    sampler = _Sampler(every)
    strategy = TwoBPStrategy(schedule="zb-h1", num_microbatches=4)
    trainer = quiet_trainer(world, strategy, steps, [sampler], limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    return sampler.samples


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (step, MB), in MB per 1,000 steps."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / var if var else 0.0


def soak(steps: int = 2000, every: int = 20, warmup: float = 0.1, python: bool = False) -> dict:
    """Run the soak; returns per rank: RSS after warm-up (the first ``warmup`` fraction of steps) and
    at the end, the slopes after warm-up, over the second half and per quarter, steps per second, and
    the samples. ``python``: also trace Python's own allocations (tracemalloc; slower)."""
    per_rank = run_distributed(_worker, 2, free_port(), steps, every, python, timeout=max(600, steps * 3))
    ranks = []
    for rank, samples in enumerate(per_rank):
        after = [(s[0], s[2]) for s in samples if s[0] >= warmup * steps]
        late = [(s[0], s[2]) for s in samples if s[0] >= steps / 2]
        quarters = [
            _slope([(s[0], s[2]) for s in samples if q * steps / 4 <= s[0] <= (q + 1) * steps / 4]) for q in range(4)
        ]
        python_mb = [s[3] for s in samples if s[0] >= warmup * steps and s[3] == s[3]]
        ranks.append(
            dict(
                rank=rank,
                rss_first_mb=samples[0][2],
                rss_after_warmup_mb=after[0][1],
                rss_last_mb=samples[-1][2],
                slope_mb_per_1000_steps=_slope(after),
                slope_second_half_mb_per_1000_steps=_slope(late),
                slope_per_quarter=quarters,
                python_after_warmup_mb=python_mb[0] if python_mb else None,
                python_last_mb=python_mb[-1] if python_mb else None,
                steps_per_s=samples[-1][0] / samples[-1][1] if samples[-1][1] else 0.0,
                samples=samples,
            )
        )
    return dict(
        steps=steps, every=every, warmup_fraction=warmup, python=python, torch_version=torch.__version__, ranks=ranks
    )


def markdown(result: dict) -> str:
    lines = [
        f"{result['steps']} steps of the default recipe's model (tiny LLaMa 4 x 128, ZB-H1, m = 4) on 2 gloo "
        f"ranks; RSS sampled every {result['every']} steps",
        "",
        "| rank | RSS first MB | after warm-up MB | last MB | slope after warm-up | slope, second half "
        "| slope per quarter | Python's own MB (after warm-up → last) | steps/s |",
        "|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in result["ranks"]:
        quarters = " / ".join(f"{q:+.1f}" for q in r.get("slope_per_quarter", []))
        py = (
            f"{r['python_after_warmup_mb']:.2f} → {r['python_last_mb']:.2f}"
            if r.get("python_after_warmup_mb") is not None
            else "not traced"
        )
        lines.append(
            f"| {r['rank']} | {r['rss_first_mb']:.1f} | {r['rss_after_warmup_mb']:.1f} | {r['rss_last_mb']:.1f} "
            f"| {r['slope_mb_per_1000_steps']:+.2f} | {r['slope_second_half_mb_per_1000_steps']:+.2f} "
            f"| {quarters} | {py} | {r['steps_per_s']:.1f} |"
        )
    lines.append("\nslopes in MB per 1,000 steps (least squares through the samples)")
    return "\n".join(lines)
