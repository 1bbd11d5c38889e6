"""``twobp-bench --paper``: the quick run end to end, the peak-bytes replay and the simulated scaling."""

from __future__ import annotations

import json
import math

import pytest

from lightning_twobp.bench import main, paper
from lightning_twobp.bench.paper import LayerCosts, models, peak_held_bytes, rows, scaling
from lightning_twobp.schedules import Action, Schedule, validate


@pytest.fixture(scope="module")
def quick_result():
    return paper.run_paper(quick=True, repeats=1, timeout=240)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_quick_run_writes_every_table_and_plot(quick_result, tmp_path):
    result = quick_result
    want = {(pm.name, r.label) for pm in models(quick=True) for r in rows(result["torch_pipelining"])}
    assert {(r["model"], r["row"]) for r in result["rq1"]} == want
    for r in result["rq1"]:
        assert r["step_s"] > 0 and r["max_grad_diff"] < 1e-5
        if r["baseline"] is not None:
            assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        if r["vs_torch"] is not None:
            assert math.isfinite(r["vs_torch"]) and r["vs_torch"] > 0, r
    # RQ2 and RQ3 cover our rows (torch's stages record no held bytes)
    ours = {(m, lab) for m, lab in want if not lab.startswith("torch")}
    assert {(r["model"], r["row"]) for r in result["rq2"]} == ours
    for r in result["rq2"]:
        assert len(r["peak_held_bytes"]) == 2 and min(r["peak_held_bytes"]) > 0
        if r["baseline"] is not None:
            assert all(math.isfinite(x) and x > 0 for x in r["ratio_per_rank"]), r
    for r in result["rq3"]:
        assert [s["p"] for s in r["simulated"]] == (
            [2, 4] if r["row"] == "ZB-V" and r["model"] != "resnet" else [2, 4, 8]
        )
        for s in r["simulated"]:
            assert math.isfinite(s["samples_per_s"]) and s["samples_per_s"] > 0
            if r["baseline"] is not None:
                assert math.isfinite(s["ratio"]) and s["ratio"] > 0
    paths = paper.write(result, tmp_path)
    names = {p.name for p in paths}
    assert names == {
        "paper.md",
        "paper.json",
        "paper-rq1.csv",
        "paper-rq2.csv",
        "paper-rq3.csv",
        "paper-rq1.png",
        "paper-rq2.png",
        "paper-rq3.png",
    }
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "paper.md").read_text()
    assert "### Summary" in md and "### RQ1" in md and "### RQ2" in md and "### RQ3" in md
    assert all(math.isfinite(x) and x > 0 for x in result["split_over_fused"].values())
    assert json.loads((tmp_path / "paper.json").read_text())["rq1"]
    assert (tmp_path / "paper-rq1.csv").read_text().startswith("model,")


def test_cli_paper_mode_writes_into_out(quick_result, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(paper, "run_paper", lambda **kw: calls.append(kw) or quick_result)
    assert main(["--paper", "--quick", "--out", str(tmp_path)]) == 0
    assert calls == [dict(quick=True, repeats=1)]
    assert (tmp_path / "paper-rq3.png").exists() and "### RQ3" in capsys.readouterr().out


def test_peak_held_bytes_replay_by_hand():
    a = Action.parse
    sched = Schedule(
        "hand",
        2,
        3,
        (0, 1),
        [
            [a("0F0"), a("0F1"), a("0B0"), a("0F2"), a("0B1"), a("0B2"), a("0W0+1+2")],
            [a("1F0"), a("1B0"), a("1F1"), a("1B1"), a("1W0"), a("1F2"), a("1B2"), a("1W1"), a("1W2")],
        ],
        split_backward=True,
    )
    validate(sched)
    held = {(0, 0): 1, (0, 1): 2, (0, 2): 4, (1, 0): 10, (1, 1): 20, (1, 2): 40}
    # Rank 0 frees at B (its stage takes no input gradient): 1, 1+2, 2, 2+4, 4, 0 -> 6.
    # Rank 1 holds each until its W: 10, 10+20, 20 (W0), 20+40 -> 60.
    assert peak_held_bytes(sched, held) == ((6, 60), {0: 6, 1: 60})
    # Held until W on stage 0 as well: 1 + 2 + 4 at once.
    assert peak_held_bytes(sched, held, frees_at_b=()) == ((7, 60), {0: 7, 1: 60})


@pytest.mark.parametrize("label", ["1F1B-1", "1F1B-2", "GPipe"])
def test_scaling_at_unit_costs_has_the_analytic_bubble(label):
    # Embedding and head free, 8 unit blocks: every stage costs F = B = W (BW = 2F) at every p.
    zero_ends = lambda v: (0.0,) + (v,) * 8 + (0.0,)  # noqa: E731
    unit = LayerCosts(f=zero_ends(1.0), b=zero_ends(1.0), w=zero_ends(1.0), bw=zero_ends(2.0))
    row = next(r for r in rows(False) if r.label == label)
    got = scaling(unit, row, blocks=8, mb_size=1)
    assert [s["p"] for s in got] == [2, 4, 8]
    for s in got:
        p, m = s["p"], s["m"]
        assert m == row.mult * p
        assert s["bubble"] == pytest.approx((p - 1) / (m + p - 1))
        assert s["makespan_s"] == pytest.approx((m + p - 1) * 3 * 8 / p)
        assert s["samples_per_s"] == pytest.approx(m / s["makespan_s"])
