"""``PipelineMonitor``: throughput, memory and bubbles per pipeline rank while ``Trainer(strategy="twobp")``
trains, and Chrome traces of chosen steps.

Lightning's ``ThroughputMonitor`` multiplies by the world size, so under pipeline parallelism it
counts every sample once per stage; ``DeviceStatsMonitor`` sees only its own rank. This callback
counts each sample once per pipeline (times the data-parallel replicas), with Lightning's own
:class:`~lightning.fabric.utilities.throughput.Throughput` and its names (``throughput/samples_per_sec``,
``throughput/items_per_sec`` with a ``length_fn``, ``throughput/flops_per_sec`` and
``throughput/device/mfu`` with ``flops_per_batch`` on a GPU whose peak is known; ``device/`` there
means one pipeline). FLOPs per batch are measured once, by default, with torch's FLOP formulas (:class:`FlopCount`)
on step ``flops_step`` (every rank counts its own stages' forward and backward, one all-reduce adds
them). At logging steps only, every rank contributes a few numbers through one tensor all-gather,
logged per pipeline stage as ``pipeline/stage{k}/...`` (a rank that holds two stages, as in ZB-V,
logs as ``pipeline/stage{a}_{b}/...``: memory and idle time belong to the process, not to one stage),
for the first data-parallel replica's pipeline:

* ``rss_mb`` (the process's resident memory) and, on GPU, ``max_allocated_mb`` / ``max_reserved_mb``
  since the previous log;
* ``bubble``: the idle fraction of the rank's step measured from the executor's own op timings
  (the step before each logging step is recorded), beside ``bubble_simulated``, what
  :func:`~lightning_twobp.schedules.simulate` predicts for the same schedule at the costs measured in
  that step;
* ``held_mb_per_microbatch``: what one micro-batch's forward saves on the rank until its backward;
* ``predicted_peak_mb``, under ``schedule="auto"``: the peak the choice was made on (weights, gradients
  and what the schedule holds), beside ``max_allocated_mb`` on a GPU.

``trace_steps=[10, 11]`` records those steps on every rank and writes each as a Chrome trace
(``chrome://tracing`` or https://ui.perfetto.dev: a track per rank, with the simulated schedule at
the measured costs below it) and, with matplotlib, a PNG of the same two timelines on one time axis,
into ``trace_dir`` (default:
``<log dir>/traces``).

:meth:`PipelineMonitor.run_figures` gives the whole run's throughput and each rank's peak memory;
:class:`~lightning_twobp.callbacks.RunSummary` prints and writes those.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.flop_counter import flop_registry

from lightning_twobp.lightning.placeholders import Elsewhere
from lightning_twobp.lightning.step import batch_size
from lightning_twobp.private import TorchDispatchMode, pytree
from lightning_twobp.schedules import Action, Costs, simulate
from lightning_twobp.schedules.per_stage import stage_value

__all__ = ["FlopCount", "PipelineMonitor", "busy_seconds", "measured_costs", "rss_mb", "stage_names", "tokens_in"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class RankFigures:
    """One rank's figures at a log, each logged as ``pipeline/<stage>/<field>`` (NaN where not known
    here: CUDA memory on CPU, a bubble before a recorded step). A new figure is a new field and its
    value in :meth:`PipelineMonitor._local`: the gathered tensor follows this order by construction."""

    rss_mb: float
    max_allocated_mb: float
    max_reserved_mb: float
    bubble: float
    bubble_simulated: float
    held_mb_per_microbatch: float
    deferred_fraction: float  # the share of this rank's weight-gradient work W computed

    def tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.float64)


_FIELDS = tuple(f.name for f in fields(RankFigures))


@dataclass
class _RunCounts:
    """What one fit has counted so far, made in ``on_train_start``."""

    t0: float  # the fit's start (perf_counter)
    last_step: int  # the optimizer steps seen (several batches each under accumulation)
    batches: int = 0
    samples: int = 0
    lengths: int = 0
    counted_lengths: bool = False  # whether any batch had a length (tokens)
    peak_cuda: float = 0.0  # the run's peak CUDA memory allocated, bytes (peaks are reset at each log)


def rss_mb() -> float:
    """This process's resident set size in MB (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 1e6
    except OSError:
        return float("nan")


def reset_peak_rss() -> None:
    """Start :func:`peak_rss_mb` from the resident set now (Linux >= 4.0: ``/proc/self/clear_refs``). The
    kernel's lifetime peak (``ru_maxrss``) counts what importing torch and Lightning briefly held, which
    may exceed a whole training run of a small model; a benchmark resets the peak where it starts counting."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_rss_mb() -> float:
    """The resident high-water mark (``VmHWM``) in MB since the last :func:`reset_peak_rss`."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("/proc/self/status has no VmHWM")


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tokens_in(batch: Any) -> int | None:
    """Tokens in a language-model batch: the element count of its first tensor when that is a
    ``(B, T)`` integer tensor of token ids; ``None`` for other batches (images, features)."""
    leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if leaves and leaves[0].dim() == 2 and not leaves[0].is_floating_point():
        return leaves[0].numel()
    return None


class FlopCount(TorchDispatchMode):
    """FLOPs of the ops run inside it, by torch's own formulas (``torch.utils.flop_counter``).

    Not ``FlopCounterMode`` itself: its per-module attribution hooks every module's inputs for the
    backward, which breaks the split backward's ``autograd.grad`` over stage inputs; and it decomposes
    ops it has no formula for, which would change what the counted step computes. This runs every op
    as it is and adds up only the ones torch has a formula for (matmuls, convolutions, attention).
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _formula(func._overloadpacket)
        if formula is not None and not _on_meta(out):  # shape passes standing in for other stages
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def _on_meta(out: Any) -> bool:
    """Whether ``out`` stands in for another stage's values (meta, or an ``Elsewhere`` placeholder of the
    ModuleList contract, whose ops compute on meta): its op's FLOPs are not this rank's."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(leaves) and (leaves[0].is_meta or isinstance(leaves[0], Elsewhere))


def _formula(packet: Any) -> Callable | None:
    """torch's FLOP formula for an op; an in-place op (``addmm_``, with which W accumulates into
    ``.grad``) costs what its out-of-place form does."""
    formula = flop_registry.get(packet)
    name = getattr(packet, "__name__", "")
    if formula is None and name.endswith("_"):
        formula = flop_registry.get(getattr(torch.ops.aten, name[:-1], None))
    return formula


def stage_names(schedule: Any, pipeline_degree: int) -> list[str]:
    """The log name of each pipeline rank: ``stage{k}``, or ``stage{a}_{b}`` for a rank of two stages
    (not ``+``, which MLflow's logger strips from metric names)."""
    return ["stage" + "_".join(str(k) for k in schedule.stages_of(r)) for r in range(pipeline_degree)]


def _parse(op: str) -> Action | None:
    try:
        return Action.parse(op)
    except ValueError:
        return None  # communication and bookkeeping ops


def op_medians(records: Sequence[Any]) -> dict[tuple[str, int], float]:
    """Median seconds per micro-batch of each compute kind (F, B, W, BW) on each stage, from
    recorded ops, their receive waits excluded (a W of several micro-batches counts per micro-batch)."""
    per: dict[tuple[str, int], list[float]] = {}
    for r in records:
        a = _parse(r.op)
        if a is None or a.kind not in ("F", "B", "W", "BW"):
            continue
        per.setdefault((a.kind, a.stage), []).append((r.end - r.start - r.wait) / len(a.microbatches))
    return {k: statistics.median(v) for k, v in per.items()}


def measured_costs(records: Sequence[Any], num_stages: int) -> Costs:
    """Median F, B and W seconds per stage from recorded ops (:func:`op_medians`; a fused BW counts
    as B, with W zero). A stage that ran both (a split schedule fused in part: schedules.fusion) gives its
    BW as ``bw``, so the fused ones are timed at what they took."""
    med = op_medians(records)

    def col(kind: str) -> tuple[float, ...]:
        fallback = "BW" if kind == "B" else kind  # a stage that ran fused backwards has no B
        return tuple(med.get((kind, s), med.get((fallback, s), 0.0)) for s in range(num_stages))

    f, b, w = col("F"), col("B"), col("W")
    mixed = any(("BW", s) in med and ("B", s) in med for s in range(num_stages))
    bw = tuple(med.get(("BW", s), b[s] + w[s]) for s in range(num_stages)) if mixed else None
    return Costs(f=f, b=b, w=w, bw=bw)


def busy_seconds(records: Sequence[Any]) -> tuple[float, float]:
    """(compute seconds, step seconds) of one rank's recorded step."""
    ops = [r for r in records if _parse(r.op) is not None]
    if not ops:
        return 0.0, 0.0
    return sum(r.end - r.start - r.wait for r in ops), max(r.end for r in records)


class PipelineMonitor(pl.Callback):
    """Throughput, memory and bubbles per pipeline rank, logged every ``log_every_n_steps`` (the
    Trainer's by default), and Chrome traces of ``trace_steps``.

    Args:
        log_every_n_steps: how often to log (default: ``trainer.log_every_n_steps``).
        batch_size_fn: samples in a batch (default: the first dimension of its first tensor).
        length_fn: items (tokens) in a batch, for ``throughput/items_per_sec`` (default:
            :func:`tokens_in`, the token count of a ``(B, T)`` batch of ids; nothing for others).
        flops_per_batch: FLOPs of one training batch (forward and backward). By default measured
            on step ``flops_step`` (``measure_flops=False``: not measured); gives
            ``flops_per_sec`` and, where the device's peak is known, ``device/mfu``.
        window_size: batches over which throughput is averaged (at most one logging interval).
        trace_steps: global steps to record and write as Chrome traces.
        trace_dir: where the traces go.
        prog_bar: show ``samples_per_sec`` in the progress bar.
        measure_flops, flops_step: count the FLOPs of that training step (the second, by default:
            the first may hold one-off work) with :class:`FlopCount`; it runs that step a little slower.
        log: log the figures (``False``: only gather them, for :class:`RunSummary`).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        flops_per_batch: float | None = None,
        window_size: int = 50,
        trace_steps: Sequence[int] = (),
        trace_dir: str | os.PathLike | None = None,
        prog_bar: bool = True,
        measure_flops: bool = True,
        flops_step: int = 1,
        log: bool = True,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"PipelineMonitor(log_every_n_steps={log_every_n_steps}): must be at least 1")
        if not isinstance(flops_step, int) or isinstance(flops_step, bool) or flops_step < 0:
            raise ValueError(
                f"PipelineMonitor(flops_step={flops_step!r}): the global step whose FLOPs are counted, "
                f"an int >= 0 (default 1)"
            )
        self.log_every_n_steps = log_every_n_steps
        self.batch_size_fn = batch_size_fn or batch_size
        self.length_fn = length_fn if length_fn is not None else tokens_in
        self.flops_per_batch = flops_per_batch
        self.measure_flops = measure_flops and flops_per_batch is None
        self.flops_step = flops_step
        self.flops_measured = False  # whether flops_per_batch was counted here (not given)
        self.log = log
        self._counter: FlopCount | None = None
        self.window_size = window_size
        self.trace_steps = {int(s) for s in trace_steps}
        self.trace_dir = trace_dir
        self.prog_bar = prog_bar
        self.traces: list[str] = []  # the files written
        self.last: dict[str, float] = {}  # the latest logged values

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _pipeline(trainer: pl.Trainer) -> Any | None:
        strategy = trainer.strategy
        return strategy if hasattr(strategy, "record_next_step") else None

    def _every(self, trainer: pl.Trainer) -> int:
        # the Trainer's logger connector sets log_every_n_steps on it; Lightning declares no such attribute
        return self.log_every_n_steps or max(1, trainer.log_every_n_steps)  # type: ignore[attr-defined]

    def _records_wanted(self, trainer: pl.Trainer, step: int) -> bool:
        """Record the step that ends right before a logging step, and the traced ones."""
        return (step + 1) % self._every(trainer) == 0 or step in self.trace_steps

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._pipeline(trainer)
        dp = strategy.world_size // strategy.pipeline_degree if strategy is not None else trainer.world_size
        pp = strategy.pipeline_degree if strategy is not None else 1
        device = trainer.strategy.root_device
        peak = None
        if device.type == "cuda":
            dtype = (
                torch.bfloat16
                if "bf16" in str(trainer.precision)
                else (torch.float16 if "16" in str(trainer.precision) else torch.float32)
            )
            peak = get_available_flops(device, dtype)
        # One "device" of Throughput is one pipeline: its peak is pp devices' peak.
        # Throughput reports rates once its window is full: at most one logging interval long, so the
        # first log already has them.
        window = max(2, min(self.window_size, self._every(trainer)))
        self._throughput = Throughput(
            available_flops=peak * pp if peak else None, world_size=dp, window_size=window, separator="/"
        )
        self._run = _RunCounts(t0=time.perf_counter(), last_step=trainer.global_step)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        strategy = self._pipeline(trainer)
        if strategy is not None and self._records_wanted(trainer, trainer.global_step):
            strategy.record_next_step()
        if self.measure_flops and trainer.global_step == self.flops_step and self._counter is None:
            # Counts this rank's share of the step: its stages' F, B and W (the optimizer's
            # elementwise ops count nothing). The ModuleList contract's stand-ins for other stages'
            # modules compute on placeholders (mostly at the first step): not counted (_on_meta).
            self._counter = FlopCount()
            self._counter.__enter__()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._counter is not None:  # the step's F, B and W are done: the optimizer is not counted
            self._stop_counting(trainer)

    def _stop_counting(self, trainer: pl.Trainer) -> None:
        counter, self._counter = self._counter, None
        assert counter is not None  # called while counting
        counter.__exit__(None, None, None)
        self.measure_flops = False
        self.flops_measured = True
        total = torch.tensor(float(counter.total), dtype=torch.float64, device=trainer.strategy.root_device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)  # every rank's stages, over all replicas
        strategy = self._pipeline(trainer)
        dp = strategy.world_size // strategy.pipeline_degree if strategy is not None else trainer.world_size
        self.flops_per_batch = float(total) / dp

    def _drop_counter(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._drop_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drop_counter()  # a counted batch that was skipped (on_train_batch_start returned -1)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counter is not None:
            self._stop_counting(trainer)
        device = trainer.strategy.root_device
        if device.type == "cuda":  # the host runs ahead of the device: time the batch's work done, as Lightning's
            torch.cuda.synchronize(device)  # ThroughputMonitor does
        now = time.perf_counter() - self._run.t0
        self._run.batches += 1
        self._run.samples += self.batch_size_fn(batch)
        n = self.length_fn(batch)
        if n is not None:
            self._run.lengths += n
            self._run.counted_lengths = True
        flops = self.flops_per_batch or None  # Throughput takes each batch's FLOPs, not a running total
        self._throughput.update(
            time=now,
            batches=self._run.batches,
            samples=self._run.samples,
            lengths=self._run.lengths if self._run.counted_lengths else None,
            flops=flops,  # type: ignore[arg-type]  # Lightning annotates int; it computes with floats
        )
        step = trainer.global_step  # counted: the step that just ran is step - 1
        if step == self._run.last_step:
            return  # accumulating: no optimizer step ended with this batch
        self._run.last_step = step
        strategy = self._pipeline(trainer)
        if strategy is not None and step - 1 in self.trace_steps:
            self._write_trace(trainer, strategy, step - 1)
        if step % self._every(trainer) == 0:
            self._log(trainer, pl_module, strategy)

    # ------------------------------------------------------------------ logging
    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy: Any | None) -> None:
        computed = self._throughput.compute()
        for k in [k for k in computed if k.startswith("device/")]:
            computed.setdefault(k[len("device/") :], computed[k])  # one replica: the global rate is the pipeline's
        values = {
            f"throughput/{k}": float(v)
            for k, v in computed.items()
            if k not in ("time", "batches", "samples", "lengths", "flops")
        }
        if strategy is not None:
            values.update(self._per_rank(trainer, strategy))
        self.last = values
        if not self.log:
            return
        for name, value in values.items():
            if value == value:  # NaN: not known here (CUDA memory on CPU, ...)
                pl_module.log(
                    name,
                    value,
                    on_step=True,
                    on_epoch=False,
                    prog_bar=self.prog_bar and name == "throughput/samples_per_sec",
                )

    def _local(self, trainer: pl.Trainer, strategy: Any) -> torch.Tensor:
        nan = float("nan")
        device = strategy.root_device
        alloc = reserved = nan
        if device.type == "cuda":
            self._run.peak_cuda = max(self._run.peak_cuda, torch.cuda.max_memory_allocated(device))
            alloc = torch.cuda.max_memory_allocated(device) / 1e6
            reserved = torch.cuda.max_memory_reserved(device) / 1e6
            torch.cuda.reset_peak_memory_stats(device)
        bubble = simulated = held = nan
        rec = strategy.last_records
        if rec is not None and rec.records:
            busy, span = busy_seconds(rec.records)
            bubble = 1.0 - busy / span if span > 0 else nan
            if rec.held_bytes:
                held = statistics.fmean(rec.held_bytes.values()) / 1e6
        return RankFigures(
            rss_mb=rss_mb(),
            max_allocated_mb=alloc,
            max_reserved_mb=reserved,
            bubble=bubble,
            bubble_simulated=simulated,
            held_mb_per_microbatch=held,
            deferred_fraction=strategy.deferred_fraction,  # NaN under a fused schedule
        ).tensor()

    def _per_rank(self, trainer: pl.Trainer, strategy: Any) -> dict[str, float]:
        """Every rank's numbers, gathered with one tensor all-gather (and the simulated bubble from
        the records of every stage, gathered as a small tensor of per-stage costs)."""
        mine = self._local(trainer, strategy)
        costs = self._local_costs(strategy)
        row = torch.cat([mine, costs]).to(strategy.root_device)  # NCCL gathers CUDA tensors only
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, row)
        else:
            rows = [row]
        rows = [r.cpu() for r in rows]
        sim = self._simulated(strategy, [r[len(_FIELDS) :] for r in rows])
        out: dict[str, float] = {}
        pp = strategy.pipeline_degree
        names = stage_names(strategy.schedule, pp)
        for r in range(pp):  # the first replica's pipeline: global ranks 0 .. pp - 1 (consecutive)
            for name, value in zip(_FIELDS, rows[r][: len(_FIELDS)].tolist(), strict=False):
                if name == "bubble_simulated" and sim is not None:
                    value = sim[r]
                out[f"pipeline/{names[r]}/{name}"] = value
        choice = getattr(strategy, "auto_choice", None)
        if choice is not None:  # schedule="auto": its prediction beside what was measured (known everywhere)
            for r in range(pp):
                out[f"pipeline/{names[r]}/predicted_peak_mb"] = choice.best.peak_bytes[r] / 1e6
        return out

    # ------------------------------------------------------------------ the whole run
    def run_figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The run so far: steps, seconds, samples/s and tokens/s (each sample once per pipeline,
        times the replicas), FLOPs per batch, and every rank's peak memory (CUDA's peak allocated on
        a GPU, the peak resident set on CPU), gathered with one all-gather: call it on every rank."""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            peak, kind = max(self._run.peak_cuda, torch.cuda.max_memory_allocated(device)), "peak CUDA memory allocated"
        else:
            peak, kind = peak_rss_bytes(), "peak RSS"
        strategy = self._pipeline(trainer)
        deferred = strategy.deferred_fraction if strategy is not None else float("nan")
        mine = torch.tensor([float(peak), deferred], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
        else:
            rows = [mine]
        dp = strategy.world_size // strategy.pipeline_degree if strategy is not None else trainer.world_size
        seconds = time.perf_counter() - self._run.t0
        rows = [r.cpu() for r in rows]
        return {
            "steps": self._run.batches,
            "seconds": seconds,
            "samples_per_s": self._run.samples * dp / seconds if seconds else None,
            "tokens_per_s": self._run.lengths * dp / seconds if seconds and self._run.counted_lengths else None,
            "flops_per_batch": self.flops_per_batch,
            "peak_memory_bytes_per_rank": [float(r[0]) for r in rows],
            # 2BP: the share of each rank's weight backward that ran in W (None: a fused schedule)
            "deferred_fraction_per_rank": [None if r[1] != r[1] else float(r[1]) for r in rows],
            "peak_memory_kind": kind,
        }

    def _local_costs(self, strategy: Any) -> torch.Tensor:
        """This rank's measured (F, B, W) per stage of the whole pipeline, zeros for stages it does
        not hold, so that the sum over the pipeline's ranks is the full table."""
        schedule = strategy.schedule
        n = schedule.num_stages
        table = torch.zeros(3 * n, dtype=torch.float64)
        rec = strategy.last_records
        if rec is None or not rec.records:
            return table
        c = measured_costs(rec.records, n)
        for s in schedule.stages_of(strategy.pp_rank):
            table[s], table[n + s], table[2 * n + s] = stage_value(c.f, s), stage_value(c.b, s), stage_value(c.w, s)
        return table

    def _simulated(self, strategy: Any, tables: list[torch.Tensor]) -> list[float] | None:
        schedule = strategy.schedule
        n = schedule.num_stages
        total = sum(tables[: strategy.pipeline_degree], torch.zeros_like(tables[0]))
        if not bool((total[:n] > 0).all()):
            return None
        costs = Costs(f=tuple(total[:n].tolist()), b=tuple(total[n : 2 * n].tolist()), w=tuple(total[2 * n :].tolist()))
        result = simulate(schedule, costs)
        return [(result.makespan - b) / result.makespan for b in result.busy]

    # ------------------------------------------------------------------ traces
    def _write_trace(self, trainer: pl.Trainer, strategy: Any, step: int) -> None:
        from lightning_twobp.trace import write_chrome_trace

        # Every rank asks: trainer.log_dir broadcasts from rank 0 for some loggers (CSVLogger).
        out = Path(self.trace_dir or Path(trainer.log_dir or trainer.default_root_dir) / "traces")
        mine = list(strategy.last_records.records) if strategy.last_records is not None else []
        everyone: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if len(everyone) > 1:
            dist.all_gather_object(everyone, mine)  # traced steps only
        else:
            everyone = [mine]
        if trainer.global_rank != 0:
            return
        pp = strategy.pipeline_degree
        by_rank = everyone[:pp]
        costs = measured_costs([r for recs in by_rank for r in recs], strategy.schedule.num_stages)
        sim = simulate(strategy.schedule, costs)
        out.mkdir(parents=True, exist_ok=True)
        path = write_chrome_trace(
            out / f"step{step}.json", by_rank, simulated=sim.timeline, title=f"{strategy.schedule_name} step {step}"
        )
        self.traces.append(str(path))
        rank_zero_info(
            f"twobp: step {step} on every pipeline rank, with the simulated schedule at its measured "
            f"costs, as a Chrome trace: {path} (open in https://ui.perfetto.dev or chrome://tracing)"
        )
        try:
            import matplotlib.pyplot as plt

            from lightning_twobp.viz import plot_timeline

            # measured above, simulated at the measured costs below, on one time axis
            flat = [r for recs in by_rank for r in recs]
            fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 1.2 + 1.2 * pp), sharex=True)
            plot_timeline(flat, num_ranks=pp, title=f"step {step}, measured", ax=top, unit="s")
            plot_timeline(
                sim.timeline,
                num_ranks=pp,
                ax=bottom,
                unit="s",
                title=f"simulated at the measured costs ({sim.makespan:.3f} s)",
            )
            top.set_xlim(0, max([sim.makespan] + [r.end for r in flat]))  # shared: neither panel cut off
            fig.tight_layout()
            fig.savefig(out / f"step{step}.png", dpi=110)
            plt.close(fig)
            self.traces.append(str(out / f"step{step}.png"))
        except ImportError:
            pass
