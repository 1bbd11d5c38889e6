"""A model built on every rank's CPU against one built on the meta device: ``twobp-bench --meta-build``.

``world`` gloo processes (one thread each) build a Sequential of ``layers`` ``Linear(width, width)``
(8 x 2048: 128 MiB in fp32) either on the CPU or under ``torch.device("meta")``, and train it for two
steps of 1F1B + 2BP with ``Trainer(strategy="twobp")``. Each rank reports its resident memory
(``/proc/self/statm``, and its high-water mark, ``VmHWM``, reset before building) above what it held then: after
building, at ``on_fit_start`` (setup done: the stages cut, and on meta made), and its peak, with the
``fit`` call's seconds (setup included: the meta build's replay of every module's initialization).
Each variant runs in a fresh set of processes, alternated, ``rounds`` times.

With ``pretrained`` the model starts from saved weights (a safetensors file written once, before the
runs) instead: ``cpu-load`` builds on every rank's CPU and loads the file whole (``load_state_dict`` of
``safetensors.torch.load_file``, what a user of one process writes), ``meta-pretrained`` builds on meta and
names the directory to ``TwoBPStrategy(pretrained=...)``, each rank reading its stages' tensors only.
``total_s`` counts from before building to the end of ``fit`` (the load included either way).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp.monitor import peak_rss_mb, reset_peak_rss, rss_mb
from lightning_twobp.processes import free_port, rank_env, run_distributed

__all__ = ["markdown", "run_meta_build"]

VARIANTS = ("cpu", "meta")
LOADING = ("cpu-load", "meta-pretrained")


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


def _worker(rank: int, world: int, port: int, variant: str, width: int, layers: int, weights: str) -> dict[str, float]:
    from lightning_twobp import TwoBPStrategy
    from lightning_twobp.bench.trainer import quiet_trainer

    rank_env(rank, world, port)
    torch.set_num_threads(1)
    before = rss_mb()
    reset_peak_rss()
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("meta") if variant.startswith("meta") else contextlib.nullcontext():
        model = _Regression(width, layers)
    if variant == "cpu-load":
        from safetensors.torch import load_file

        model.load_state_dict(load_file(f"{weights}/model.safetensors"))
    built = rss_mb()
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(16, width, generator=g), torch.randn(16, width, generator=g)), 8)
    fit_start = _FitStart()
    strategy = TwoBPStrategy(num_microbatches=4, pretrained=weights if variant == "meta-pretrained" else None)
    trainer = quiet_trainer(world, strategy, 2, [fit_start], use_distributed_sampler=False)
    t0 = time.perf_counter()
    trainer.fit(model, data)
    return dict(
        built=built - before,
        setup=fit_start.rss - before,
        peak=peak_rss_mb() - before,
        fit_s=time.perf_counter() - t0,
        total_s=time.perf_counter() - start,
    )


def _save_weights(width: int, layers: int) -> str:
    """Weights of the benchmark's model, as safetensors in a folder of their own (seed 1: not the build's)."""
    from safetensors.torch import save_file

    folder = tempfile.mkdtemp(prefix="twobp-bench-weights-")
    with torch.random.fork_rng():
        torch.manual_seed(1)
        save_file(_Regression(width, layers).state_dict(), f"{folder}/model.safetensors")
    return folder


def run_meta_build(
    world: int = 4,
    width: int = 2048,
    layers: int = 8,
    rounds: int = 2,
    timeout: float = 600.0,
    pretrained: bool = False,
) -> dict[str, Any]:
    """Each variant ``rounds`` times, alternated; per variant and rank the median over its rounds."""
    variants = LOADING if pretrained else VARIANTS
    weights = _save_weights(width, layers) if pretrained else ""
    runs: dict[str, list[list[dict[str, float]]]] = {v: [] for v in variants}
    order = []
    try:
        for r in range(rounds):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                order.append(variant)
                args = (variant, width, layers, weights)
                runs[variant].append(run_distributed(_worker, world, free_port(), *args, timeout=timeout))
    finally:
        if weights:
            shutil.rmtree(weights, ignore_errors=True)
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
    w(
        "| built on | rank | after building MB | at fit start MB | peak MB | fit s | build to fit end s |\n"
        "|---|---|---:|---:|---:|---:|---:|\n"
    )
    for r in result["rows"]:
        mb = " | ".join(f"{r[k]:.0f}" for k in ("built", "setup", "peak"))
        w(f"| {r['variant']} | {r['rank']} | {mb} | {r['fit_s']:.2f} | {r['total_s']:.2f} |\n")
    return out.getvalue()
