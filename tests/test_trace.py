"""Chrome traces of measured and simulated steps."""

from __future__ import annotations

import json
import pathlib

import pytest

from lightning_twobp.engine import ActionRecord
from lightning_twobp.schedules import build_schedule, simulate
from lightning_twobp.trace import chrome_trace, write_chrome_trace


def test_chrome_trace_has_a_track_per_rank_and_the_actions(tmp_path):
    records = [
        [
            ActionRecord(0, 0, "0F0", 0.0, 0.010),
            ActionRecord(0, 1, "0SEND_F0", 0.010, 0.011),
            ActionRecord(0, 2, "0B0", 0.030, 0.050, wait=0.005),
        ],
        [ActionRecord(1, 0, "1RECV_F0", 0.0, 0.012, wait=0.011), ActionRecord(1, 1, "1F0", 0.012, 0.022)],
    ]
    sim = simulate(build_schedule("1f1b", 2, 1, split_backward=False)).timeline
    trace = chrome_trace(records, simulated=sim, simulated_scale=0.01)
    names = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert (0, "0F0") in names and (0, "0B0") in names and (1, "1F0") in names
    assert (0, "wait 0B0") in names and (0, "0SEND_F0") in names
    b = next(e for e in trace["traceEvents"] if e.get("name") == "0B0" and e["pid"] == 0)
    # the box starts once the gradient arrived; the wait is a separate event
    assert b["ts"] == pytest.approx(35000.0) and b["dur"] == pytest.approx(15000.0) and b["args"]["microbatches"] == [0]
    processes = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert processes == [
        "pipeline: rank 0",
        "pipeline: rank 1",
        "pipeline: simulated rank 0",
        "pipeline: simulated rank 1",
    ]
    path = write_chrome_trace(tmp_path / "t.json", records)
    assert json.loads(pathlib.Path(path).read_text())["traceEvents"]
