"""``balance="time"``: forward + backward seconds of every pipelined layer, measured on real data.

Rank 0 measures on one micro-batch of the first batch the running loop will read, each layer on
this rank's device one at a time (so a model that fits only across the pipeline can still be
profiled); every rank gets rank 0's numbers, since ranks that timed on their own could disagree on
the cut and deadlock. Profiling leaves no trace: the RNG is forked around all of it (reading a batch
draws a loader seed and a shuffle; dropout draws too) and buffers (BatchNorm statistics) are put
back, so training afterwards is what it would have been.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.data import IterableDataset

from lightning_twobp.lightning.layer_runs import LayerRuns, layer_runs
from lightning_twobp.lightning.loaders import batch_fingerprint
from lightning_twobp.lightning.step import StepRunner
from lightning_twobp.own_generators import keep_generators
from lightning_twobp.private import data_source, pytree, unset_training_data

log = logging.getLogger(__name__)

__all__ = ["data_loop", "first_batch", "keep_buffers", "now", "profile_layers", "said_lost_stream_batch", "streaming"]


def first_batch(trainer: Any, read: Callable[[Any], Any] = lambda loader: next(iter(loader))) -> Any:
    """The first batch of the data the running Trainer call will read (``read(loader)``: its first batch,
    or what a caller makes of the loader). Its loop sets its data up now (the loop's own ``setup_data``;
    it synchronises the ranks, so every rank calls this), and the batch comes from the Trainer's public
    dataloader properties. In fitting the loop's setup is undone afterwards, for the loop to run it
    again in its place: a checkpoint's loader state is restored after this (set up now, a resumed run
    read the epoch from its first batch again), and its sampler's draws belong outside the caller's
    forked random state.

    Data that streams (an ``IterableDataset``) is read from the loop's source before any setup instead:
    the setup's iterator reads a batch ahead, which a stream that iterates once would lose. What this read
    takes from such a stream cannot be given back (nothing tells it from a stream that ``iter()`` restarts
    before training reads it), so in fitting its fingerprint is kept for the strategy to compare with the
    first training batch (:func:`said_lost_stream_batch`): a stream that lost it is said, not trained past
    silently."""
    fn = trainer.state.fn
    loop = data_loop(trainer)
    streamed = streaming(loop)
    if streamed is not None:
        batch = read(_batches(streamed, fn))
        if fn == TrainerFn.FITTING:
            _STREAM_READS[trainer] = batch_fingerprint(batch, torch.device("cpu"))
        return batch
    loop.setup_data()
    found = _batches(_LOADERS[fn](trainer), fn)
    try:
        return read(found)
    finally:
        if fn == TrainerFn.FITTING:
            unset_training_data(trainer)


def _batches(found: Any, fn: Any) -> Any:
    """What to read the first batch from: in fitting, several loaders (a list, a dict, a ``CombinedLoader``)
    combined as the fit loop combines them (``max_size_cycle`` unless given a ``CombinedLoader``), so the batch
    has the structure the training step receives (the first loader's batch alone failed in a step that takes
    a dict); otherwise the first loader, which an evaluation loop reads first."""
    if fn == TrainerFn.FITTING and isinstance(found, (list, tuple, dict, CombinedLoader)):
        combined = found if isinstance(found, CombinedLoader) else CombinedLoader(found, "max_size_cycle")
        if not pytree.tree_leaves(combined.iterables):
            _first_loader(None)  # none: refused as for a single loader
        return _Combined(combined)
    return _first_loader(found)


class _Combined:
    """A ``CombinedLoader``'s batches without the indices it yields beside them."""

    def __init__(self, combined: CombinedLoader) -> None:
        self.combined = combined

    def __iter__(self) -> Any:
        for batch, _, _ in self.combined:
            yield batch


# A stream's first batch read before training (its fingerprint), per Trainer, until the first training batch.
_STREAM_READS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def said_lost_stream_batch(trainer: Any, batch: Any) -> None:
    """At a fit's first training batch: when :func:`first_batch` read a stream before training and this
    batch is not the one it read, say so (a stream that iterates once lost it to the profile)."""
    read = _STREAM_READS.pop(trainer, None)
    if read is None or trainer.ckpt_path is not None:  # a resumed fit starts where the checkpoint stopped
        return
    if torch.equal(read, batch_fingerprint(batch, torch.device("cpu"))):
        return
    rank_zero_warn(
        "twobp: the first training batch is not the batch balance='time' or schedule='auto' read from the "
        "IterableDataset before training to profile the layers: if the dataset iterates once (iter() does not "
        "restart the stream), training has skipped that batch, which one process would have trained on. Make "
        "__iter__ return a new iterator over the stream (as PyTorch asks of an IterableDataset: each epoch "
        "calls it), or use balance='params' and a named schedule. (A stream that draws its samples at random, "
        "or an on_before_batch_transfer hook that changes the batch, also gives another batch; then ignore this.)"
    )


def streaming(loop: Any) -> Any | None:
    """The loop's loaders, looked at before it sets its data up, when any of them reads an ``IterableDataset``;
    else None. (A fit's ``train_dataloader()`` hook runs once all the same: :mod:`.first_loader`.)"""
    source = data_source(loop)
    if source is None or not source.is_defined():
        return None
    loaders = source.dataloader()
    inner = loaders.iterables if isinstance(loaders, CombinedLoader) else loaders  # the loaders it combines
    streams = any(isinstance(getattr(x, "dataset", None), IterableDataset) for x in pytree.tree_leaves(inner))
    return loaders if streams else None


def _first_loader(found: Any) -> Any:
    """The first of the loaders ``found`` (one, a list or a dict of them); ValueError when there is none."""
    if isinstance(found, (list, tuple)):
        found = found[0] if found else None
    if isinstance(found, dict):
        found = next(iter(found.values()), None)
    if found is None:
        raise ValueError(
            "schedule='auto' and balance='time' profile the layers on the first batch of the data, and none was "
            "found (no loader, or limit_train_batches=0): pass the dataloader to the Trainer call, or name a "
            "schedule and use balance='params' or a list of layer counts"
        )
    return found


_LOOPS: dict[Any, Callable[[Any], Any]] = {
    TrainerFn.FITTING: lambda t: t.fit_loop,
    TrainerFn.VALIDATING: lambda t: t.validate_loop,
    TrainerFn.TESTING: lambda t: t.test_loop,
    TrainerFn.PREDICTING: lambda t: t.predict_loop,
}
_LOADERS: dict[Any, Callable[[Any], Any]] = {
    TrainerFn.FITTING: lambda t: t.train_dataloader,
    TrainerFn.VALIDATING: lambda t: t.val_dataloaders,
    TrainerFn.TESTING: lambda t: t.test_dataloaders,
    TrainerFn.PREDICTING: lambda t: t.predict_dataloaders,
}


def data_loop(trainer: Any) -> Any:
    """The loop of the running Trainer call, which reads its data."""
    return _LOOPS[trainer.state.fn](trainer)


def keep_buffers(layers: list[nn.Module]) -> Callable[[], None]:
    """A copy of every buffer of ``layers`` (BatchNorm's running statistics) and the call that puts them
    back. By name, not by tensor: profiling moves a layer to the device and back (on a GPU, before the
    model is moved there), which replaces its buffer tensors."""
    saved = [(layer, name, b.clone()) for layer in layers for name, b in layer.named_buffers()]
    generators = keep_generators([m for layer in layers for m in layer.modules()])  # a module's own generator

    def put_back() -> None:
        with torch.no_grad():
            for layer, name, value in saved:
                layer.get_buffer(name).copy_(value)
        generators()

    return put_back


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def profile_layers(
    runner: StepRunner,
    layers: list[nn.Module],
    trainer: Any,
    m: int,
    device: torch.device,
    precision: Any,
    repeats: int = 3,
) -> list[float]:
    """Seconds per layer (median of ``repeats`` after a warm-up run), the same list on every rank. Rank 0's
    failure reaches the others as an error of the same kind (a refusal, ``ValueError``, stays one)."""
    sent: list[float] | tuple[bool, str] | None = None
    failed: Exception | None = None
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        batch = first_batch(trainer)
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                with layer_runs(runner, layers, trainer, batch, m, device, precision, several=True) as runs:
                    sent = _time_layers(runs, repeats)
            except Exception as e:  # noqa: BLE001 - sent on: the other ranks raise it too, naming rank 0's error
                failed, sent = e, (isinstance(e, ValueError), f"{type(e).__name__}: {e}")
    box = [sent]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    if failed is not None:
        raise failed
    timed = box[0]
    if isinstance(timed, tuple):
        refused, message = timed
        raise (ValueError if refused else RuntimeError)(f'balance="time": rank 0 could not time the layers: {message}')
    assert timed is not None  # rank 0 timed the layers and sent them to the others
    return timed


def _time_layers(runs: LayerRuns, repeats: int) -> list[float]:
    costs = []
    put_back = keep_buffers([run.layer for run in runs.runs])
    try:
        x = runs.inputs
        for i, run in enumerate(runs.runs):
            # the first stage's inputs need no gradient (the executor's first B is the whole backward)
            x = _leaves(x, i > 0)
            with runs.placed(run.layer):
                seconds, out = _seconds(run.call, x, runs.device, repeats)
                run.layer.zero_grad(set_to_none=True)
            costs.append(seconds)
            x = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out if isinstance(out, tuple) else (out,))
    finally:
        put_back()
    log.info("twobp: forward+backward seconds per layer: %s", ", ".join(f"{c:.2e}" for c in costs))
    return costs


def _leaves(x: tuple, grad: bool) -> tuple:
    """``x``'s tensors, nested in tuples too (a bare nn.LSTM's ``(out, (h, c))``), each a leaf as a stage gets it."""
    return tuple(pytree.tree_map_only(torch.Tensor, lambda t: _leaf(t, grad), x))


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(grad and t.is_floating_point())


def _seconds(call: nn.Module, x: tuple, device: torch.device, repeats: int) -> tuple[float, Any]:
    """Forward + backward seconds of ``call`` on ``x``, as a stage runs it: median of ``repeats`` after a
    warm-up run (caches, allocators); and the output, which the next layer is fed."""
    times, out = [], None
    for _ in range(repeats + 1):
        start = now(device)
        out = call(*x)  # the layer as its stage runs it (layer_runs: tuples, an in-place first layer)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        times.append(now(device) - start)
    return sorted(times[1:])[len(times[1:]) // 2], out
