"""The user's data loaders under the pipeline: with one data-parallel replica they stay as given.

Every rank of a pipeline must read the same batches. With several replicas Lightning's injected
``DistributedSampler`` does that (split by the strategy's ``distributed_sampler_kwargs``: data-parallel
rank and size). With one replica there is nothing to split, yet Lightning would still replace the
loader's sampler with a shuffling ``DistributedSampler`` (it shuffles every training loader it
rebuilds), so a ``shuffle=False`` loader would be read in another order than by one process. Here
the loader is left alone, as ``Trainer(use_distributed_sampler=False)`` leaves it: every rank builds
the same loader and, with the same seed, draws the same order (the stages' random draws go to
streams of their own, :mod:`.rng`, so the global generator a ``RandomSampler`` reads stays in step
across the ranks).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function

from lightning_twobp.lightning.step import batch_tensors
from lightning_twobp.private import without_distributed_sampler

__all__ = [
    "batch_fingerprint",
    "check_same_batch",
    "eval_length",
    "keep_users_sampler",
    "lengths_differ",
    "seed_workers_by_replica",
]


def keep_users_sampler(trainer: Any) -> Callable[[], None]:
    """For this Trainer call, tell Lightning not to inject a distributed sampler; return the undo.

    Lightning reads ``Trainer(use_distributed_sampler=...)`` from its accelerator connector when it
    prepares each loader (after the strategy's ``setup``); there is no public setter, so this is the
    one place that writes the private attribute (``tests/test_strategy.py`` guards it: a pipeline-only
    fit on a ``shuffle=False`` loader must match one process)."""
    undo = without_distributed_sampler(trainer)
    if undo is None:
        warnings.warn(
            "twobp: this Lightning version keeps its distributed-sampler switch elsewhere, so with one "
            "data-parallel replica Lightning's shuffling DistributedSampler replaces the loader's sampler; "
            "pass Trainer(use_distributed_sampler=False) to read batches in the loader's order",
            stacklevel=2,
        )
        return lambda: None
    return undo


def seed_workers_by_replica(dataloader: Any, dp_rank: int) -> Any:
    """Under ``seed_everything(workers=True)`` give a loader without a ``worker_init_fn`` Lightning's own,
    seeded by data-parallel rank rather than by global rank (what Lightning gives it after this hook).

    Seeded by global rank, the workers of the first stage and of the last draw different numbers for the
    same sample: noise or masking drawn in ``__getitem__`` or a ``collate_fn`` (a masked-LM collator) would
    meet the first stage's inputs with another draw's targets. By data-parallel rank every rank of one
    pipeline draws alike, replicas draw apart as DDP's ranks do, and a pipeline alone draws as one process."""
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", False) is None:
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=dp_rank)
    return dataloader


def batch_fingerprint(batch: Any, device: Any) -> torch.Tensor:
    """Four float64 numbers that tell batches apart: their tensors' element count, sum, sum of squares and
    a sum weighted by position (two batches of the same samples in another order differ in it), computed
    where the tensors are. Equal batches give bitwise equal numbers on every rank: the same ops on the
    same values."""
    stats = torch.zeros(4, dtype=torch.float64, device=device)
    for t in batch_tensors(batch):
        x = t.detach().reshape(-1).to(device, torch.float64)
        weights = torch.arange(x.numel(), dtype=torch.float64, device=device).remainder_(7).add_(1)
        stats += torch.stack([x.new_tensor(float(x.numel())), x.sum(), (x * x).sum(), (x * weights).sum()])
    return stats


def check_same_batch(
    batch: Any, group: Any, device: Any, where: str, ranks: list[int], length: tuple[str, float] | None = None
) -> None:
    """Every rank of one pipeline must read the same batch: the first stage computes from its inputs and
    the last stage's loss reads its own copy's labels. Data sharded by *global* rank (a
    ``DistributedSampler`` built with the world size, an ``IterableDataset`` splitting by
    ``dist.get_rank()``) gives each stage other samples and trains on inputs paired with another
    sample's labels, silently. One all-gather of :func:`batch_fingerprint` over the pipeline's ranks;
    every rank raises alike, before any pipeline step of the batch. ``length``: (what, count) of the loader's
    batches (``trainer.num_training_batches``; ``inf`` for an unsized loader), gathered in the same
    all-gather: they must agree too (:func:`lengths_differ`)."""
    mine = torch.cat([batch_fingerprint(batch, device), _count(length, device)])
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(g[:4], gathered[0][:4]) for g in gathered):
        counts = [float(g[4]) for g in gathered]
        if length is not None and any(c != counts[0] for c in counts):
            raise ValueError(lengths_differ(length[0], dict(zip(ranks, counts, strict=True)), where))
        return
    groups: dict[tuple[float, ...], list[int]] = {}
    for rank, g in zip(ranks, gathered, strict=True):
        groups.setdefault(tuple(g[:4].tolist()), []).append(rank)
    raise ValueError(
        f"twobp: the ranks of one pipeline read different batches at {where} (global ranks "
        f"{' / '.join(str(r) for r in groups.values())} hold different data): every stage of a pipeline must "
        f"read the same batch, or the first stage's inputs meet another sample's labels on the last. Something "
        f"depends on the global rank: a DistributedSampler built with the world size, a dataset that shards by "
        f"dist.get_rank() / trainer.global_rank (split by trainer.strategy.dp_rank of dp_degree instead, or "
        f"leave the sampler to Lightning: use_distributed_sampler=True splits by replica), a seed that differs "
        f"per rank, or a worker_init_fn that seeds DataLoader workers by global rank (seed them by "
        f"trainer.strategy.dp_rank, or leave worker_init_fn unset under seed_everything(workers=True), which "
        f"the strategy seeds by data-parallel rank)"
    )


def _count(length: tuple[str, float] | None, device: Any) -> torch.Tensor:
    return torch.tensor([-1.0 if length is None else float(length[1])], dtype=torch.float64, device=device)


def lengths_differ(what: str, counts: dict[int, float], where: str) -> str:
    """The refusal of a pipeline whose ranks' loaders have different numbers of batches ``counts`` (global rank
    -> count): the rank whose loader ends first leaves the loop while the others wait on it in the next step
    (found by a trial: litdata gave one stage 8 batches and the other 4; after step 4 the first waited out
    pipeline_timeout, 600 s by default, then raised a PeerLost that read like a crash)."""
    shown = ", ".join(f"global rank {r}: {_batches(c)}" for r, c in counts.items())
    return (
        f"twobp: the {what} of one pipeline's ranks have different lengths ({shown}; seen at {where}): every "
        f"stage of a pipeline must read the same batches, or the rank whose loader ends first leaves the loop while "
        f"the others wait for it in the next step (until pipeline_timeout, then a PeerLost that reads like a crash). "
        f"Split the data by trainer.strategy.dp_rank of trainer.strategy.dp_degree, not by the global rank or the "
        f"world size (use_distributed_sampler=True does; a dataset that reads the world size from the environment "
        f"when it is built sees another one on each rank). For litdata's StreamingDataset, set "
        f"dataset.distributed_env = _DistributedEnv(trainer.strategy.dp_degree, trainer.strategy.dp_rank, 1) in "
        f"train_dataloader (from litdata.utilities.env import _DistributedEnv: a private API of litdata's, which has "
        f"no public one to shard by replica)"
    )


def check_sharded_replicas_alike(length: tuple[str, float] | None, group: Any, device: Any, ranks: list[int]) -> None:
    """Under ``data_parallel="shard"``, the replicas of a stage (global ``ranks``, ``group``) must read as many
    batches of an evaluation loader: each batch gathers the stage's shards over them, so a replica whose loader
    ends first leaves the others waiting in the next batch's gather (found by a review: replicas of 3 and 2
    validation batches, a PeerLost after the process group's timeout). Replicated stages need no such thing. One
    all-gather of the count at each loader's first batch; every rank raises alike (every pipeline rank of a
    replica reads the same count)."""
    mine = _count(length, device)
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    counts = {r: float(g[0]) for r, g in zip(ranks, gathered, strict=True)}
    if length is None or len(set(counts.values())) == 1:
        return
    shown = ", ".join(f"global rank {r}: {_batches(c)}" for r, c in counts.items())
    raise ValueError(
        f"twobp: under data_parallel='shard' the data-parallel replicas read different numbers of batches of the "
        f"{length[0]} ({shown}): each batch gathers the stage's shards over the replicas, so the replica whose loader "
        f"ends first would leave the others waiting in the next gather. Give every replica as many batches: "
        f"use_distributed_sampler=True (Lightning's DistributedSampler pads the last one), or pad a split of your "
        f"own (dataset[dp_rank::dp_degree] of a size dp_degree does not divide), or data_parallel='replicate'"
    )


def _batches(count: float) -> str:
    return "unsized (inf) batches" if math.isinf(count) else f"{int(count)} batches"


def eval_lengths(trainer: Any, kind: str) -> list[float] | None:
    """The batches of each evaluation loader of ``kind`` as Lightning counts them for this run, or None where
    it keeps no count (the lengths :func:`eval_length` names)."""
    counts = _eval_counts(trainer, kind)
    return [float(n) for n in counts] if counts is not None else None


def _eval_counts(trainer: Any, kind: str) -> list | tuple | None:
    name = {"validation": "num_val_batches", "test": "num_test_batches", "predict": "num_predict_batches"}.get(kind)
    if kind == "validation" and trainer.sanity_checking:
        name = "num_sanity_val_batches"
    counts = getattr(trainer, name, None) if name is not None else None
    return counts if isinstance(counts, list | tuple) else None


def eval_length(trainer: Any, kind: str, index: int) -> tuple[str, float] | None:
    """(what, batches) of evaluation loader ``index`` of ``kind`` (validation, test, predict) as Lightning counts
    them for this run (the sanity check's own count in it), or None where Lightning keeps no count."""
    counts = _eval_counts(trainer, kind)
    if counts is None or not 0 <= index < len(counts):
        return None
    return f"{kind} loaders (dataloader_idx {index})", float(counts[index])
