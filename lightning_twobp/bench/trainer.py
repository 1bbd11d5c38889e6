"""What Lightning costs on top of the engine: the same pipeline step through ``Trainer`` and bare.

    twobp-bench --trainer [--json PATH] [--repeats N] [--quick] [--only LABEL ...]

Two gloo processes with one thread each train the engine benchmark's tiny LLaMa (8 blocks x 512,
batch 32 x 128 tokens) in each of the engine benchmark's configurations (every schedule with and
without 2BP, m = 8, and the paper's 1F1B-1 and 1F1B-2) with ``Trainer(strategy=TwoBPStrategy(...))``. Inside the same
fit, after
every Lightning step a callback runs one bare step of an identical, separately built pipeline (the
engine's ``step`` + ``AdamW.step`` + ``zero_grad``, nothing else), so the two alternate A/B/A/B in one
run. The Lightning step is one loop iteration from ``on_train_batch_start`` to the next, minus the bare
step run inside it: data fetch, micro-batch split, capture, the pipeline, loss and log sharing, the
optimizer step and Lightning's bookkeeping (logger and progress bar off). After two warm-up pairs,
the ratio is the median over the back-to-back pairs.
"""

from __future__ import annotations

import copy
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lightning_twobp.bench.engine import configs
from lightning_twobp.bench.workload import WORLD, Workload, loss_fn
from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.partition import split_sequential
from lightning_twobp.processes import free_port, rank_env, run_distributed

_WARMUP = 2  # untimed pairs at the start of each fit


class SameBatch(Dataset):
    """The benchmark's one batch, over and over (so data loading is as cheap as it can be)."""

    def __init__(self, ids: torch.Tensor, tgt: torch.Tensor, steps: int) -> None:
        self.ids, self.tgt, self.steps = ids, tgt, steps

    def __len__(self) -> int:
        return self.steps * len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i % len(self.ids)], self.tgt[i % len(self.ids)]


def quiet_trainer(world: int, strategy: pl.strategies.Strategy, steps: int, callbacks: list, **options) -> pl.Trainer:
    """A CPU ``Trainer`` of ``world`` processes for ``steps`` steps that writes and prints nothing (no
    logger, checkpoints, progress bar or model summary): the benchmarks' Trainer. ``options`` add to or
    override these ``Trainer`` arguments."""
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        **{**quiet, **options},
    )


class LlamaModule(pl.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:  # the Sequential, or the loop over a ModuleList
        super().__init__()
        self.layers = model

    def training_step(self, batch, batch_idx):
        ids, tgt = batch
        loss = loss_fn(self.layers(ids), tgt)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _Alternate(pl.Callback):
    """Times each Lightning loop iteration and runs one bare engine step after it."""

    def __init__(self, bare) -> None:
        self.bare = bare
        self.starts: list[float] = []
        self.bare_times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dist.barrier()
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dist.barrier()
        t = time.perf_counter()
        self.bare()
        dist.barrier()
        self.bare_times.append(time.perf_counter() - t)


def _worker(rank: int, world: int, wl: Workload, runs: list, repeats: int, port: int) -> dict:
    rank_env(rank, world, port)
    from lightning_twobp import TwoBPStrategy

    ids, tgt = wl.data()
    out = {}
    for c in runs:
        m = c.num_microbatches
        full = wl.model()
        strategy = TwoBPStrategy(
            schedule=c.name, split_backward=c.split_backward, num_microbatches=m, stages_per_rank=c.stages_per_rank
        )
        lm = LlamaModule(copy.deepcopy(full))
        steps = repeats + _WARMUP + 1  # the last iteration has no next start to end it
        # The bare pipeline: the same schedule and cut, its own copy of the weights and its own AdamW.
        state: dict = {}

        # Defaults bind this iteration's values: the closure runs within the iteration anyway.
        def bare(state: dict = state, strategy: TwoBPStrategy = strategy, full=full, m: int = m) -> None:
            if not state:
                sched = strategy.schedule
                parts = split_sequential(full, strategy.stage_sizes)
                mods = {s: parts[s] for s in sched.stages_of(rank)}
                state["ex"] = PipelineExecutor(sched, mods, loss_fn=loss_fn)
                state["opt"] = torch.optim.AdamW([q for md in mods.values() for q in md.parameters()], lr=1e-4)
            ex = state["ex"]
            mbs = ids.chunk(m) if 0 in ex.stages else None
            tgts = tgt.chunk(m) if ex.last in ex.stages else None
            ex.step(mbs, tgts)
            state["opt"].step()
            state["opt"].zero_grad(set_to_none=True)

        timer = _Alternate(bare)
        trainer = quiet_trainer(world, strategy, steps, [timer], use_distributed_sampler=False)
        trainer.fit(lm, DataLoader(SameBatch(ids, tgt, steps + 1), batch_size=wl.batch))
        # iteration i runs from start i to start i + 1 and contains bare step i; the last iteration
        # has no next start, and the first ones warm caches, the allocator and the shape exchange up
        periods = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)]
        lightning = [p - w for p, w in zip(periods, timer.bare_times, strict=False)][_WARMUP:]
        bare_times = timer.bare_times[_WARMUP : len(periods)]
        # Like with like: both pipelines ran the same steps on the same data from the same weights.
        mine = {n: q for n, q in lm.layers.named_parameters() if not q.is_meta}  # the layers it trained
        diff = max((q - mine[n]).abs().max().item() for n, q in full.named_parameters() if n in mine)
        out[c.label] = {"lightning": lightning, "bare": bare_times, "max_param_diff": diff}
    return out


def bench_trainer(wl: Workload = Workload(), m: int = 8, repeats: int = 5, labels: list[str] | None = None) -> dict:
    """Trainer / bare for the engine benchmark's configurations (:func:`lightning_twobp.bench.engine.configs`),
    or those of them whose label starts with one of ``labels``."""
    runs = [c for c in configs(m) if labels is None or any(c.label.startswith(x) for x in labels)]
    per_rank = run_distributed(_worker, WORLD, wl, runs, repeats, free_port(), timeout=7200)
    rows = {}
    for label, t in per_rank[0].items():  # barrier to barrier: the same on both ranks
        light, bare = statistics.median(t["lightning"]), statistics.median(t["bare"])
        pairs = [a / b for a, b in zip(t["lightning"], t["bare"], strict=False)]
        # The ratio is the median over A/B pairs: each pair ran back to back, so drift between
        # pairs (the shared machine) cancels, which a ratio of medians would not do.
        rows[label] = {
            "lightning_step_s": light,
            "bare_step_s": bare,
            "ratio": statistics.median(pairs),
            "ratio_of_medians": light / bare,
            "pair_ratios": pairs,
            "max_param_diff": max(r[label]["max_param_diff"] for r in per_rank),
        }
    return rows
