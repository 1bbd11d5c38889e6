"""twobp-bench --memory-model --simulate (issue 20): the budget tables on paper, end to end on one small model."""

from __future__ import annotations

import json

import pytest

from lightning_twobp.bench import budget_sim
from lightning_twobp.bench.budget import BUDGETS


@pytest.fixture(scope="module")
def llama() -> dict:
    """The quick tiny LLaMa at p = 4 (8 blocks, a batch of 16, m in {4, 8}): about 10 s on one thread."""
    return budget_sim.run_budget_sim(quick=True, names=("llama",))


def _check_picks(budget: dict, rows: list[dict], side: str) -> None:
    """The side's pick fits the budget and is the fastest predicted of its rows that fit; none when none fits."""
    pick, fits = budget[side], [r for r in rows if r["peak"] <= budget["limit"]]
    if pick is None:
        assert not fits, (side, budget["times_1f1b"], fits[:3])
        return
    assert pick["peak"] <= budget["limit"] and pick in rows
    assert pick["step_s"] == min(r["step_s"] for r in fits)


def test_every_pick_fits_its_budget_and_is_the_fastest_that_does(llama):
    (table,) = llama["tables"]
    assert (table["model"], table["p"], table["microbatches"]) == ("llama", 4, [4, 8])
    assert [b["times_1f1b"] for b in table["budgets"]] == list(BUDGETS)
    assert table["considered"] == len(table["ours_rows"]) > 0
    for b in table["budgets"]:
        assert b["limit"] == pytest.approx(b["times_1f1b"] * table["fused_1f1b_peak"])
        _check_picks(b, table["ours_rows"], "ours")
        _check_picks(b, table["torch_rows"], "torch")
    # fused 1F1B at m = 2p is among ours and defines the unit: from 1x on, something of ours fits
    fused = next(r for r in table["ours_rows"] if r["label"] == "1f1b (m=8)")
    assert fused["peak"] == table["fused_1f1b_peak"]
    assert all(b["ours"] is not None for b in table["budgets"] if b["times_1f1b"] >= 1)
    # a larger budget is never predicted slower
    picked = [b["ours"]["step_s"] for b in table["budgets"] if b["ours"] is not None]
    assert picked == sorted(picked, reverse=True)


def test_the_tables_are_written(llama, tmp_path):
    paths = budget_sim.write(llama, tmp_path)
    md = (tmp_path / "budget-sim.md").read_text()
    assert paths == [tmp_path / "budget-sim.md"]
    assert "**llama, p = 4**" in md and md.count("\n| 1x |") == 1
    saved = json.loads((tmp_path / "budget-sim.json").read_text())
    assert saved["tables"][0]["budgets"][1]["ours"] == llama["tables"][0]["budgets"][1]["ours"]


def test_an_unknown_model_name_is_refused():
    with pytest.raises(ValueError, match="choose among llama, bert, mamba, resnet"):
        budget_sim.run_budget_sim(quick=True, names=("gpt",))


def test_checkpointed_blocks_are_weighed_on_both_sides(llama):
    """Every block checkpointed "full": ours under every schedule, torch's fused 1F1B and GPipe. Fused 1F1B
    checkpointed holds less than plain and its step is longer (B recomputes F), the same on both sides."""
    (table,) = llama["tables"]
    ac = "activation_checkpointing='full'"
    ours = {r["label"]: r for r in table["ours_rows"]}
    theirs = {r["label"]: r for r in table["torch_rows"]}
    plain, checkpointed = ours["1f1b (m=8)"], ours[f"1f1b (m=8, {ac})"]
    assert checkpointed["peak"] < plain["peak"] and checkpointed["step_s"] > plain["step_s"]
    assert theirs["torch 1F1B +AC (m=8)"]["peak"] == checkpointed["peak"]
    assert any(ac in label and "+2BP" in label for label in ours)
    assert not any("ZB" in label and "+AC" in label for label in theirs)  # not priced: the docstring
