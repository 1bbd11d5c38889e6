"""Pipeline timelines as Chrome traces (chrome://tracing, https://ui.perfetto.dev).

:func:`chrome_trace` turns the executor's records (``StepResult.records`` with ``record=True``, one
list per rank) and, optionally, the simulator's timeline of the same schedule into the Trace Event
Format: a process per rank (measured, and "simulated" beside it), F/B/W/BW boxes named like the
actions (``1F3``), with the stage, the micro-batches and the time blocked on receives as arguments,
and communication batches and receive waits on a thread of their own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from lightning_twobp.schedules import Action

__all__ = ["chrome_trace", "write_chrome_trace"]

_US = 1e6  # the format counts microseconds


def _action(op: str) -> Action | None:
    try:
        return Action.parse(op)
    except ValueError:
        return None


def chrome_trace(
    records_by_rank: Sequence[Iterable[Any]],
    *,
    simulated: Iterable[tuple[int, Action, float, float]] | None = None,
    simulated_scale: float = 1.0,
    title: str = "pipeline",
) -> dict:
    """The trace as a dict (``json.dump`` it, or use :func:`write_chrome_trace`).

    ``records_by_rank[r]`` are rank r's ``ActionRecord`` (times in seconds from its step's start);
    ``simulated`` a ``SimResult.timeline``, its times multiplied by ``simulated_scale`` to seconds.
    """
    events: list[dict] = []
    pid = 0
    for rank, records in enumerate(records_by_rank):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{title}: rank {rank}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "communication"}})
        for r in records:
            action = _action(r.op)
            ts = r.start * _US
            if action is None:  # a batch of sends and receives, a reduce
                events.append(
                    {
                        "ph": "X",
                        "name": r.op,
                        "pid": pid,
                        "tid": 1,
                        "ts": ts,
                        "dur": max((r.end - r.start) * _US, 0.0),
                        "cat": "comm",
                    }
                )
                continue
            if r.wait > 0:
                events.append(
                    {
                        "ph": "X",
                        "name": f"wait {r.op}",
                        "pid": pid,
                        "tid": 1,
                        "ts": ts,
                        "dur": r.wait * _US,
                        "cat": "wait",
                    }
                )
            events.append(
                {
                    "ph": "X",
                    "name": r.op,
                    "pid": pid,
                    "tid": 0,
                    "ts": ts + r.wait * _US,
                    "dur": max((r.end - r.start - r.wait) * _US, 0.0),
                    "cat": action.kind,
                    "args": {
                        "stage": action.stage,
                        "microbatches": list(action.microbatches),
                        "kind": action.kind,
                        "wait_ms": r.wait * 1e3,
                        "step": r.step,
                    },
                }
            )
        pid += 1
    if simulated is not None:
        ranks = sorted({rank for rank, *_ in simulated})
        first = pid
        for rank in ranks:
            events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": first + rank,
                    "args": {"name": f"{title}: simulated rank {rank}"},
                }
            )
        for rank, action, start, end in simulated:
            events.append(
                {
                    "ph": "X",
                    "name": str(action),
                    "pid": first + rank,
                    "tid": 0,
                    "ts": start * simulated_scale * _US,
                    "dur": (end - start) * simulated_scale * _US,
                    "cat": action.kind,
                    "args": {"stage": action.stage, "microbatches": list(action.microbatches)},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, records_by_rank: Sequence[Iterable[Any]], **kwargs: Any) -> str:
    """Write :func:`chrome_trace` as JSON to ``path``; returns the path."""
    with open(path, "w") as fh:
        json.dump(chrome_trace(records_by_rank, **kwargs), fh)
    return str(path)
