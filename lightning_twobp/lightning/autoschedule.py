"""``TwoBPStrategy(schedule="auto", memory_limit=...)``: measure, agree, search, then train with the choice.

Before the first step (as ``balance="time"`` does), every rank runs each pipelined layer on the first
micro-batch of the first training batch, at each candidate micro-batch count ``m`` (the divisors of
the batch size up to ``4p``, or the one ``num_microbatches`` the user gave): F, B and W as the real
split backward runs them (:func:`~lightning_twobp.engine.footprint.measure_layer`), their seconds
(median of ``repeats`` after a warm-up), the bytes autograd saves from F to B (on CPU: the storages
its saved-tensor hooks see; the same count on CUDA, where the allocator would add its rounding), the
bytes held from B to W, and each layer's weights and gradients. Pipeline ranks 0 and 1 time one
message of the largest layer output. One all-reduce (max) gives every rank the same table, so every
rank makes the same choice: ranks that searched on their own timings could pick different schedules
and deadlock. The search itself is :mod:`lightning_twobp.schedules.auto` (pure data).

Why not time the executor's first steps (the monitor's ``measured_costs``)? Those steps would have
to run some schedule before one is known to fit the limit, and a V schedule cuts the model into
twice the stages, so the choice could not reuse them without moving weights between ranks. Timing
layers gives every layout's stage costs from one table.

Profiling leaves no trace: the random state is forked around it, buffers are put back and the
gradients it made are dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_twobp.engine.footprint import LayerFootprint, layer_cost, measure_layer, storage_key
from lightning_twobp.lightning.contract import SequentialContract
from lightning_twobp.lightning.profile import block_inputs, first_batch, now
from lightning_twobp.lightning.step import StepRunner, batch_size
from lightning_twobp.partition import partition
from lightning_twobp.schedules.auto import (
    AutoChoice,
    LayerCost,
    Profile,
    choose,
    format_choice,
    fused_1f1b_peak,
    resolve_limit,
    search,
)

log = logging.getLogger(__name__)

__all__ = ["SavedBytes", "auto_schedule", "device_bytes", "timed_footprint"]

_FIELDS = 12  # LayerCost's fields, in order, as one row of the agreed table


def device_bytes(device: torch.device) -> float | None:
    """The device's memory: CUDA's total, or the machine's physical memory for the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def timed_footprint(
    layer: nn.Module,
    x: torch.Tensor,
    needs: bool,
    device: torch.device,
    repeats: int,
    clock: Callable[[], float] | None = None,
) -> LayerFootprint:
    """:func:`~lightning_twobp.engine.footprint.measure_layer` ``repeats`` (>= 1) times after a warm-up:
    bytes from the last run, each phase's median seconds by ``clock`` (default: wall time, after a
    device sync). Gradients accumulate: the caller clears them."""
    tick = clock or (lambda: now(device))
    runs = [measure_layer(layer, x, needs, clock=tick) for _ in range(repeats + 1)][1:]
    f, b, w = (statistics.median(r.seconds[i] for r in runs) for i in range(3))
    return dataclasses.replace(runs[-1], seconds=(f, b, w))


def _profile_layers(layers: list[nn.Module], x: tuple, device: torch.device, repeats: int) -> tuple[list, float]:
    """Each layer's footprint on one micro-batch ``x``, and the largest output's bytes (one message)."""
    if len(x) != 1 or not isinstance(x[0], torch.Tensor):
        raise ValueError(
            "schedule='auto' times the layers one by one on a single tensor between them; this model's "
            f"pipelined block takes {len(x)} inputs: name a schedule instead"
        )
    t, rows, largest = x[0], [], 0
    for i, layer in enumerate(layers):
        home = next(iter([*layer.parameters(), *layer.buffers()]), torch.empty(0)).device
        layer.to(device)
        fp = timed_footprint(layer, t, t.is_floating_point() and i > 0, device, repeats)
        fixed = 2.0 * sum(q.numel() * q.element_size() for q in layer.parameters() if q.requires_grad)
        rows.append(layer_cost(fp, fixed))
        layer.zero_grad(set_to_none=True)
        layer.to(home)
        assert fp.output is not None  # measure_layer always returns F's output
        t = fp.output
        largest = max(largest, t.numel() * t.element_size())
    return rows, float(largest)


def _message_seconds(nbytes: float, group: Any, device: torch.device, repeats: int) -> float:
    """Half a round trip of ``nbytes`` between pipeline ranks 0 and 1 (0 elsewhere: the max agrees)."""
    if group is None or dist.get_world_size(group) < 2:
        return 0.0
    me = dist.get_rank(group)
    if me > 1:
        return 0.0
    peer = dist.get_global_rank(group, 1 - me)
    buf = torch.zeros(max(1, int(nbytes) // 4), device=device)
    times = []
    for _ in range(repeats + 1):
        start = now(device)
        if me == 0:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
        times.append((now(device) - start) / 2)
    return statistics.median(times[1:])


def _from_row(row: Sequence[float]) -> LayerCost:
    """A layer's row of the agreed table (its bools went through it as 0 and 1)."""
    f, b, w, act, held, kept, saved_input, saves_output, fixed, output, grad_held, input_held = row[:_FIELDS]
    kept_, saves = bool(kept), bool(saves_output)
    return LayerCost(f, b, w, act, held, kept_, saved_input, saves, fixed, output, grad_held, input_held)


def _agree(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The element-wise max over every rank: one table, one choice everywhere."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        table = table.to(device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return table.cpu()


def _partitions(layers: list[nn.Module], p: int, balance: Any, weights: list[float]) -> dict[int, tuple[int, ...]]:
    """Layers per stage for one and two stages per rank (where the model has enough layers)."""
    out = {}
    for v in (1, 2):
        try:
            costs = weights if balance == "time" else None
            out[v] = tuple(partition(nn.Sequential(*layers), p * v, balance, costs=costs))
        except ValueError:
            continue
    return out


def auto_schedule(
    runner: StepRunner,
    layers: list[nn.Module],
    trainer: Any,
    device: torch.device,
    precision: Any,
    pp_group: Any,
    num_ranks: int,
    balance: Any,
    memory_limit: float | str,
    num_microbatches: int | None = None,
    split_backward: bool | None = None,
    repeats: int = 2,
) -> tuple[AutoChoice, Profile]:
    """Profile, agree, search and log (see the module docstring); the same answer on every rank."""
    if not isinstance(runner.contract, SequentialContract):
        raise ValueError(
            f"schedule='auto' times the layers of an nn.Sequential one by one; {runner.contract.name} is pipelined "
            f"as an nn.ModuleList of blocks (the ModuleList contract): name a schedule instead"
        )
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        batch = first_batch(trainer)
        size = batch_size(batch)
        counts = [num_microbatches] if num_microbatches else _divisors(size, 4 * num_ranks)
        buffers = [(b, b.clone()) for layer in layers for b in layer.buffers()]
        rows = []
        with precision.forward_context():
            for m in counts:
                x = block_inputs(runner, layers, trainer, batch, m, device)
                costs, largest = _profile_layers(layers, x, device, repeats)
                seconds = _message_seconds(largest, pp_group, device, repeats)
                rows.append([[getattr(c, f) for f in LayerCost.__dataclass_fields__] + [seconds] for c in costs])
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    table = _agree(torch.tensor(rows, dtype=torch.float64), device).tolist()
    by_m = {m: tuple(_from_row(r) for r in layer_rows) for m, layer_rows in zip(counts, table, strict=True)}
    comm = {m: table[i][0][_FIELDS] for i, m in enumerate(counts)}
    weights = [c.f + c.b + c.w for c in by_m[counts[-1]]]
    profile = Profile(num_ranks, by_m, _partitions(layers, num_ranks, balance, weights), comm)
    limit = resolve_limit(memory_limit, device_bytes(device), fused_1f1b_peak(profile))
    candidates = search(profile, split_backward=split_backward, max_caps=2 * num_ranks)
    choice = choose(candidates, limit)
    rank_zero_info("twobp: " + format_choice(choice))
    return choice, profile


class SavedBytes:
    """The bytes autograd holds for the backward, live, while inside (a context manager): every tensor
    saved by a forward counts from its save until autograd lets go of it (views of one storage once,
    parameters never: they live anyway). ``peak`` is the most held at once. On CPU, where no
    allocator keeps statistics, this is the measured side of ``schedule="auto"``'s predicted peak."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._exclude = {storage_key(t) for t in exclude}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.now = 0
        self.peak = 0
        self._hooks: Any = None

    @property
    def live(self) -> dict[int, int]:
        """The storages held now: one key per storage (:func:`storage_key`), its bytes."""
        return dict(self._bytes)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        k = storage_key(t)
        alias = t.detach()  # a saved output itself would make a cycle through its grad_fn
        if k in self._exclude:
            return alias
        if k not in self._refs:
            self._refs[k] = 0
            self._bytes[k] = t.untyped_storage().nbytes()
            self.now += self._bytes[k]
            self.peak = max(self.peak, self.now)
        self._refs[k] += 1
        weakref.finalize(alias, self._release, k)
        return alias

    def _release(self, k: int) -> None:
        self._refs[k] -= 1
        if not self._refs[k]:
            del self._refs[k]
            self.now -= self._bytes.pop(k)

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
