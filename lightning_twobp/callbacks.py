"""Callbacks for pipelined runs."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils import _pytree as pytree
from typing_extensions import override

from lightning_twobp.lightning.layout import schedule_label

__all__ = ["RunSummary"]


class RunSummary(pl.Callback):
    """At the end of fit, rank 0 prints (and writes ``summary.json`` into the run directory):
    throughput, the loss from first to last, peak memory per pipeline rank, and where the logs and
    checkpoint went.

    Throughput counts each sample once: under pipeline parallelism every rank of a pipeline sees the
    same batch (Lightning's ThroughputMonitor multiplies by the world size, which over-counts), so the
    global batch is the batch size times the data-parallel replicas. Peak memory is
    ``torch.cuda.max_memory_allocated`` on a GPU and the process's peak resident set on CPU.
    """

    def __init__(self, filename: str = "summary.json") -> None:
        self.filename = filename
        self.summary: dict[str, Any] = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        self._start = time.perf_counter()
        self._samples = self._tokens = self._steps = 0
        self._first_loss: float | None = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
        if leaves:
            self._samples += leaves[0].shape[0]
            if leaves[0].dim() == 2 and not leaves[0].is_floating_point():  # (B, T) token ids
                self._tokens += leaves[0].numel()
        self._steps += 1
        if self._first_loss is None and "train_loss" in trainer.callback_metrics:
            self._first_loss = float(trainer.callback_metrics["train_loss"])

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = time.perf_counter() - self._start
        strategy = trainer.strategy
        device = strategy.root_device
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        peaks = strategy.all_gather(torch.tensor([float(peak)], device=device)).reshape(-1).tolist()
        if trainer.global_rank != 0:
            return
        p = getattr(strategy, "pipeline_degree", 1)
        dp = trainer.world_size // p
        pipeline = {}
        if hasattr(strategy, "stage_sizes") and strategy.stage_sizes is not None:
            sched = strategy.schedule
            bounds = [0]
            for n in strategy.stage_sizes:
                bounds.append(bounds[-1] + n)
            pipeline = {
                "schedule": sched.name, "split_backward": sched.split_backward, "num_stages": sched.num_stages,
                "num_microbatches": sched.num_microbatches, "pipeline_degree": p, "data_parallel": dp,
                "stages_per_rank": {r: [f"stage {s}: layers {bounds[s]}-{bounds[s + 1] - 1}" for s in sched.stages_of(r)]
                                    for r in range(p)},
            }
        loss = trainer.callback_metrics.get("train_loss")
        ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        log_dir = trainer.logger.log_dir if trainer.logger is not None else None
        self.summary = {
            "steps": self._steps,
            "seconds": seconds,
            "samples_per_s": self._samples * dp / seconds,
            "tokens_per_s": self._tokens * dp / seconds if self._tokens else None,
            "first_train_loss": self._first_loss,
            "final_train_loss": None if loss is None else float(loss),
            "peak_memory_bytes_per_rank": peaks,
            "peak_memory_kind": "peak CUDA memory allocated" if device.type == "cuda" else "peak RSS",
            "checkpoint": ckpt or None,
            "log_dir": log_dir,
            **pipeline,
        }
        s = self.summary
        lines = [f"\nrun summary: {s['steps']} steps in {seconds:.1f} s, {s['samples_per_s']:.1f} samples/s"
                 + (f", {s['tokens_per_s']:.0f} tokens/s" if s["tokens_per_s"] else "")]
        if pipeline:
            lines.append(f"pipeline: {schedule_label(pipeline['schedule'], pipeline['split_backward'])}, "
                         f"{pipeline['num_stages']} stages on {p} ranks x {dp} replica(s), {pipeline['num_microbatches']} micro-batches")
        if s["final_train_loss"] is not None:
            first = "" if s["first_train_loss"] is None else f"{s['first_train_loss']:.3f} -> "
            lines.append(f"train_loss: {first}{s['final_train_loss']:.3f}")
        for r, b in enumerate(peaks):
            where = "; ".join(pipeline["stages_per_rank"].get(r % p, [])) if pipeline else ""
            lines.append(f"  rank {r}: {s['peak_memory_kind']} {b / 2**20:,.0f} MiB" + (f"  ({where})" if where else ""))
        if log_dir:
            lines.append(f"logs: {log_dir}")
        if ckpt:
            lines.append(f"checkpoint (sharded directory): {ckpt}\n  one file: twobp-consolidate {ckpt} model.ckpt")
        print("\n".join(lines), flush=True)
        out_dir = Path(trainer.default_root_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / self.filename).write_text(json.dumps(s, indent=2, default=str))
