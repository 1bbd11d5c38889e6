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

_Timed = tuple[int, Action, float, float]  # (rank, action, start, end) of a simulated timeline

__all__ = ["chrome_trace", "write_chrome_trace"]

_US = 1e6  # the format counts microseconds


def _action(op: str) -> Action | None:
    try:
        return Action.parse(op)
    except ValueError:
        return None


def _span(name: str, pid: int, tid: int, ts: float, dur: float, cat: str, **args: Any) -> dict:
    """One complete event ("X"): times in microseconds."""
    event = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "cat": cat}
    if args:
        event["args"] = args
    return event


def _rank_events(pid: int, name: str, records: Iterable[Any]) -> list[dict]:
    """A measured rank: compute on thread 0; communication and the waits inside ops on thread 1."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "communication"}},
    ]
    for r in records:
        action = _action(r.op)
        ts = r.start * _US
        if action is None:  # a batch of sends and receives, a reduce
            events.append(_span(r.op, pid, 1, ts, max((r.end - r.start) * _US, 0.0), "comm"))
            continue
        if r.wait > 0:
            events.append(_span(f"wait {r.op}", pid, 1, ts, r.wait * _US, "wait"))
        dur = max((r.end - r.start - r.wait) * _US, 0.0)
        args = {
            "stage": action.stage,
            "microbatches": list(action.microbatches),
            "kind": action.kind,
            "wait_ms": r.wait * 1e3,
            "step": r.step,
        }
        events.append(_span(r.op, pid, 0, ts + r.wait * _US, dur, action.kind, **args))
    return events


def _simulated_events(
    first: int, title: str, timeline: list[tuple[int, Action, float, float]], scale: float
) -> list[dict]:
    """The simulated timeline, one process per rank after the measured ones, times scaled to seconds."""
    ranks = sorted({rank for rank, *_ in timeline})
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": first + rank, "args": {"name": f"{title}: simulated rank {rank}"}}
        for rank in ranks
    ]
    for rank, action, start, end in timeline:
        mbs = list(action.microbatches)
        ts, dur = start * scale * _US, (end - start) * scale * _US
        events.append(_span(str(action), first + rank, 0, ts, dur, action.kind, stage=action.stage, microbatches=mbs))
    return events


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
        events += _rank_events(pid, f"{title}: rank {rank}", records)
        pid += 1
    if simulated is not None:
        events += _simulated_events(pid, title, list(simulated), simulated_scale)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, records_by_rank: Sequence[Iterable[Any]], **kwargs: Any) -> str:
    """Write :func:`chrome_trace` as JSON to ``path``; returns the path."""
    with open(path, "w") as fh:
        json.dump(chrome_trace(records_by_rank, **kwargs), fh)
    return str(path)
