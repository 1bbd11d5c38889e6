"""Forward-only passes (validation, test, predict): ``twobp-bench --eval-sends``.

The benchmarks' workload on 2 gloo ranks (one thread each), cut into 2 stages, runs
``PipelineExecutor.forward_only`` over its batch in ``m`` micro-batches two ways, alternated in the same
processes: the activations sent as tensors after a header of their shapes (``P2P.send_tensors``, what
the executor does) and pickled as objects (``send_object_list``, what it did before). Each rank reports
each round's seconds of both; the figure is the median over rounds of objects' seconds over tensors'
(above 1: the header way is faster), measured on the last rank, which waits for every activation.
Then single messages alone, stage 0 to stage 1, 1 MB and 16 MB, ten of each way per round, alternated:
what one activation costs to move, apart from the compute around it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lightning_twobp.bench.workload import Workload, loss_fn
from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.engine.p2p import P2P
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules import build_schedule

__all__ = ["WAYS", "markdown", "run_eval_sends"]

WAYS = ("tensors", "objects")


@contextmanager
def _pickled(p2p: P2P, device: torch.device) -> Iterator[None]:
    """The way before: every activation through ``send_object_list`` (the object messages of
    :class:`P2P`, which the shape exchange still uses)."""
    p2p.send_tensors = p2p.send_object  # type: ignore[method-assign,assignment]
    p2p.recv_tensors = lambda s: tuple(t.to(device) for t in p2p.recv_object(s))  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del p2p.send_tensors, p2p.recv_tensors  # the class's methods again


def _messages(executor: PipelineExecutor, rank: int, rounds: int, sizes_mb: tuple[int, ...]) -> dict[str, list[float]]:
    """Seconds per message of each size and way (on the receiving rank), rounds alternated."""
    p2p = executor._p2p
    out: dict[str, list[float]] = {}
    for mb in sizes_mb:
        value = (torch.randn(mb * 2**18),)
        for r in range(rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                send = p2p.send_tensors if way == "tensors" else p2p.send_object
                dist.barrier()
                start = time.perf_counter()
                for _ in range(10):
                    send(value, 1) if rank == 0 else (p2p.recv_tensors(0) if way == "tensors" else p2p.recv_object(0))
                out.setdefault(f"{way} {mb} MB", []).append((time.perf_counter() - start) / 10)
    return out


def _rank(
    rank: int, world: int, workload: Workload, m: int, rounds: int, sizes_mb: tuple[int, ...]
) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    stages = workload.stages(workload.model(), world)
    executor = PipelineExecutor(build_schedule("1f1b", world, m), {rank: stages[rank]}, loss_fn=loss_fn)
    ids, _ = workload.data()
    inputs = list(ids.chunk(m)) if rank == 0 else None
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    executor.forward_only(inputs, m)  # warm-up
    for r in range(rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            with _pickled(executor._p2p, device) if way == "objects" else _no_change():
                dist.barrier()
                start = time.perf_counter()
                executor.forward_only(inputs, m)
                seconds[way].append(time.perf_counter() - start)
    return seconds | _messages(executor, rank, rounds, sizes_mb)


@contextmanager
def _no_change() -> Iterator[None]:
    yield


def run_eval_sends(quick: bool = False, rounds: int = 7, m: int = 8) -> dict[str, Any]:
    workload = Workload.quick() if quick else Workload()
    sizes_mb = (1,) if quick else (1, 16)
    ranks = run_distributed(_rank, 2, workload, m, rounds, sizes_mb, timeout=600)
    last = ranks[-1]
    ratios = [o / t for o, t in zip(last["objects"], last["tensors"], strict=True)]
    return {
        "workload": f"{workload.layers} blocks x {workload.dim}, batch {workload.batch} x {workload.seq}, m = {m}",
        "activation_mb": workload.batch // m * workload.seq * workload.dim * 4 / 1e6,
        "rounds": rounds,
        "seconds": {way: statistics.median(last[way]) for way in WAYS},
        "objects_over_tensors": statistics.median(ratios),
        "ratios": ratios,
        "message_ms": {k: 1e3 * statistics.median(v) for k, v in last.items() if k not in WAYS},
        "message_sizes_mb": list(sizes_mb),
    }


def markdown(result: dict[str, Any]) -> str:
    s, ms = result["seconds"], result["message_ms"]
    return "\n".join(
        [
            f"forward-only, 2 ranks, {result['workload']} ({result['activation_mb']:.1f} MB per activation), "
            f"{result['rounds']} rounds alternated, last rank:",
            "",
            "| activations sent | s per pass (median) |",
            "|---|---:|",
            f"| as tensors after a header | {s['tensors']:.4f} |",
            f"| pickled (send_object_list) | {s['objects']:.4f} |",
            "",
            f"pickled / tensors, median of per-round ratios: **{result['objects_over_tensors']:.2f}** "
            f"(rounds: {', '.join(f'{r:.2f}' for r in result['ratios'])})",
            "",
            "one message alone, ms (median of rounds, 10 messages each):",
            "",
            "| message | as tensors | pickled |",
            "|---|---:|---:|",
            *(
                f"| {mb} MB | {ms[f'tensors {mb} MB']:.2f} | {ms[f'objects {mb} MB']:.2f} |"
                for mb in result["message_sizes_mb"]
            ),
        ]
    )
