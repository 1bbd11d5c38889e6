"""Callbacks for pipelined runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_twobp.lightning.layout import schedule_label
from lightning_twobp.monitor import PipelineMonitor

__all__ = ["RunSummary"]


def _pipeline_figures(strategy: Any, p: int, dp: int) -> dict[str, Any]:
    """The pipeline's layout for the summary ({} for a strategy that is not a pipeline)."""
    if getattr(strategy, "stage_sizes", None) is None:
        return {}
    sched = strategy.schedule
    bounds = [0]
    for n in strategy.stage_sizes:
        bounds.append(bounds[-1] + n)
    return {
        "schedule": sched.name,
        "split_backward": sched.split_backward,
        "num_stages": sched.num_stages,
        "num_microbatches": sched.num_microbatches,
        "pipeline_degree": p,
        "data_parallel": dp,
        "stages_per_rank": {
            r: [f"stage {s}: layers {bounds[s]}-{bounds[s + 1] - 1}" for s in sched.stages_of(r)] for r in range(p)
        },
    }


class RunSummary(pl.Callback):
    """At the end of fit, rank 0 prints (and writes ``summary.json`` into the run directory):
    throughput, the loss from first to last, peak memory per pipeline rank, and where the logs and
    checkpoint went.

    The figures are :class:`~lightning_twobp.PipelineMonitor`'s (:meth:`~PipelineMonitor.run_figures`):
    the monitor among the Trainer's callbacks, or a silent one of its own when there is none. So each
    sample counts once per pipeline (Lightning's ThroughputMonitor multiplies by the world size, which
    over-counts), times the data-parallel replicas. Peak memory is CUDA's peak allocated on a GPU and
    the process's peak resident set on CPU.
    """

    def __init__(self, filename: str = "summary.json") -> None:
        self.filename = filename
        self.summary: dict[str, Any] = {}
        self._own: PipelineMonitor | None = None

    def _monitor(self, trainer: pl.Trainer) -> PipelineMonitor:
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
        found = next((c for c in callbacks if isinstance(c, PipelineMonitor)), None)
        if found is not None:
            return found
        if self._own is None:
            self._own = PipelineMonitor(log=False, measure_flops=False, log_every_n_steps=10**9)
        return self._own

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_loss: float | None = None
        if self._monitor(trainer) is self._own:
            self._own.on_train_start(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._monitor(trainer) is self._own:
            self._own.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._first_loss is None and "train_loss" in trainer.callback_metrics:
            self._first_loss = float(trainer.callback_metrics["train_loss"])

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        monitor = self._monitor(trainer)
        figures = monitor.run_figures(trainer)  # a collective: every rank
        peaks = figures["peak_memory_bytes_per_rank"]
        if trainer.global_rank != 0:
            return
        strategy: Any = trainer.strategy  # any strategy; a pipeline's has stage_sizes and schedule
        p = getattr(strategy, "pipeline_degree", 1)
        dp = trainer.world_size // p
        pipeline = _pipeline_figures(strategy, p, dp)
        loss = trainer.callback_metrics.get("train_loss")
        checkpoint: Any = trainer.checkpoint_callback  # a ModelCheckpoint (Lightning declares the base Checkpoint)
        ckpt = checkpoint.best_model_path if checkpoint else ""
        log_dir = trainer.logger.log_dir if trainer.logger is not None else None
        seconds = figures["seconds"]
        self.summary = {
            **figures,
            "first_train_loss": self._first_loss,
            "final_train_loss": None if loss is None else float(loss),
            "checkpoint": ckpt or None,
            "log_dir": log_dir,
            "traces": list(monitor.traces),
            **pipeline,
        }
        s = self.summary
        lines = [
            f"\nrun summary: {s['steps']} steps in {seconds:.1f} s, {s['samples_per_s']:.1f} samples/s"
            + (f", {s['tokens_per_s']:.0f} tokens/s" if s["tokens_per_s"] else "")
        ]
        if pipeline:
            lines.append(
                f"pipeline: {schedule_label(pipeline['schedule'], pipeline['split_backward'])}, "
                f"{pipeline['num_stages']} stages on {p} ranks x {dp} replica(s), {pipeline['num_microbatches']} "
                f"micro-batches"
            )
        if s["flops_per_batch"]:
            how = "measured, forward + backward" if monitor.flops_measured else "as given"
            lines.append(
                f"FLOPs per batch ({how}): {s['flops_per_batch']:.3e}; achieved "
                f"{s['flops_per_batch'] * s['steps'] * dp / seconds / 1e12:.3f} TFLOP/s over the run"
            )
        if s["final_train_loss"] is not None:
            first = "" if s["first_train_loss"] is None else f"{s['first_train_loss']:.3f} -> "
            lines.append(f"train_loss: {first}{s['final_train_loss']:.3f}")
        for r, b in enumerate(peaks):
            where = "; ".join(pipeline["stages_per_rank"].get(r % p, [])) if pipeline else ""
            deferred = s["deferred_fraction_per_rank"][r]
            lines.append(
                f"  rank {r}: {s['peak_memory_kind']} {b / 2**20:,.0f} MiB"
                + (f", {deferred:.0%} of the weight backward deferred to W" if deferred is not None else "")
                + (
                    " (the first stage's input takes no gradient: its backward runs whole in B)"
                    if deferred == 0 and r % p == 0
                    else ""
                )
                + (f"  ({where})" if where else "")
            )
        if log_dir:
            lines.append(f"logs: {log_dir}")
        if monitor.traces:
            lines.append(
                "pipeline timelines (Chrome traces: https://ui.perfetto.dev; pictures): " + ", ".join(monitor.traces)
            )
        if ckpt:
            lines.append(f"checkpoint (sharded directory): {ckpt}\n  one file: twobp-consolidate {ckpt} model.ckpt")
        print("\n".join(lines), flush=True)
        out_dir = Path(trainer.default_root_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / self.filename).write_text(json.dumps(s, indent=2, default=str))
