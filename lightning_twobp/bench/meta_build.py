"""A model built on every rank's CPU against one built on the meta device: ``twobp-bench --meta-build``.

``world`` gloo processes (one thread each) build a Sequential of ``layers`` ``Linear(width, width)``
(8 x 2048: 128 MiB in fp32) either on the CPU or under ``torch.device("meta")``, and train it for two
steps of 1F1B + 2BP with ``Trainer(strategy="twobp")``. Each rank reports its resident memory
(``/proc/self/statm``, and the kernel's peak, ``ru_maxrss``) above what it held before building: after
building, at ``on_fit_start`` (setup done: the stages cut, and on meta made), and its peak, with the
``fit`` call's seconds (setup included: the meta build's replay of every module's initialization).
Each variant runs in a fresh set of processes, alternated, ``rounds`` times.
"""

from __future__ import annotations

import contextlib
import io
import resource
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp.monitor import rss_mb
from lightning_twobp.processes import free_port, rank_env, run_distributed

__all__ = ["markdown", "run_meta_build"]

VARIANTS = ("cpu", "meta")


class _Regression(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _FitStart(pl.Callback):
    def __init__(self) -> None:
        self.rss = float("nan")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rss = rss_mb()


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux


def _worker(rank: int, world: int, port: int, variant: str, width: int, layers: int) -> dict[str, float]:
    from lightning_twobp import TwoBPStrategy
    from lightning_twobp.bench.trainer import quiet_trainer

    rank_env(rank, world, port)
    torch.set_num_threads(1)
    before, peak_before = rss_mb(), _peak_mb()
    torch.manual_seed(0)
    with torch.device("meta") if variant == "meta" else contextlib.nullcontext():
        model = _Regression(width, layers)
    built = rss_mb()
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(16, width, generator=g), torch.randn(16, width, generator=g)), 8)
    fit_start = _FitStart()
    trainer = quiet_trainer(world, TwoBPStrategy(num_microbatches=4), 2, [fit_start], use_distributed_sampler=False)
    t0 = time.perf_counter()
    trainer.fit(model, data)
    return dict(
        built=built - before,
        setup=fit_start.rss - before,
        peak=_peak_mb() - max(before, peak_before),
        fit_s=time.perf_counter() - t0,
    )


def run_meta_build(
    world: int = 4, width: int = 2048, layers: int = 8, rounds: int = 2, timeout: float = 600.0
) -> dict[str, Any]:
    """Each variant ``rounds`` times, alternated; per variant and rank the median over its rounds."""
    runs: dict[str, list[list[dict[str, float]]]] = {v: [] for v in VARIANTS}
    order = []
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            order.append(variant)
            runs[variant].append(run_distributed(_worker, world, free_port(), variant, width, layers, timeout=timeout))
    rows = [
        dict(
            variant=v,
            rank=rank,
            **{k: statistics.median(launch[rank][k] for launch in launches) for k in launches[0][0]},
        )
        for v, launches in runs.items()
        for rank in range(world)
    ]
    model_mb = layers * (width * width + width) * 4 / 1e6
    return dict(world=world, width=width, layers=layers, rounds=rounds, order=order, model_mb=model_mb, rows=rows)


def markdown(result: dict[str, Any]) -> str:
    out = io.StringIO()
    w = out.write
    w(
        f"{result['layers']} x Linear({result['width']}, {result['width']}) ({result['model_mb']:.0f} MB fp32), "
        f"{result['world']} gloo processes x 1 thread, 1F1B + 2BP, m = 4, 2 steps; medians of {result['rounds']} "
        f"launches per variant, in the order {', '.join(result['order'])}; MB above the process before building\n\n"
    )
    w("| built on | rank | after building MB | at fit start MB | peak MB | fit s |\n|---|---|---:|---:|---:|---:|\n")
    for r in result["rows"]:
        mb = " | ".join(f"{r[k]:.0f}" for k in ("built", "setup", "peak"))
        w(f"| {r['variant']} | {r['rank']} | {mb} | {r['fit_s']:.2f} |\n")
    return out.getvalue()
