"""``twobp-bench --peer --activation-checkpointing``: ours and torch.distributed.pipelining with the same
checkpointed blocks, end to end on a tiny model (a smoke test of the harness and its counts, not timings)."""

from __future__ import annotations

import json

import pytest

from lightning_twobp.bench import main
from lightning_twobp.bench.peer_ac import PAIRS

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

ZERO_BUBBLE_TORCH = {"torch InterleavedZeroBubble (1/rank)", "torch ZBVZeroBubble"}


def test_checkpointed_pipelines_side_by_side(tmp_path, capsys):
    """Every contender exact against one process with and without checkpointing; ours run each
    checkpointed block twice per micro-batch (F and B's one recompute), as does torch's fused 1F1B; each
    row has a peak per rank. Under "selective" torch's zero-bubble schedules fail (their split runs two
    autograd calls over each checkpointed block) and the table says why."""
    pytest.importorskip("torch.distributed.pipelining")
    argv = ["--peer", "--activation-checkpointing", "selective", "--quick", "--microbatches", "4", "--rounds", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "peer-ac.json").read_text())
    rows = {(r["label"], r["checkpointing"]): r for r in result["rows"]}
    assert set(rows) == {(c.label, way) for pair in PAIRS for c in pair for way in ("off", "selective")}
    for (label, way), r in rows.items():
        if "failed" in r:  # torch's W recomputes the block again, which its selective checkpointing refuses
            assert label in ZERO_BUBBLE_TORCH and way == "selective", (label, r["failed"])
            assert "backward an extra time" in r["failed"], r["failed"]
            continue
        assert r["max_grad_diff"] < 1e-5 and len(r["peak_bytes_per_rank"]) == 2, (label, way)
        expected = [[1.0]] * 2 if way == "off" else [[2.0]] * 2
        if way == "off" or not label.startswith("torch") or label == "torch 1F1B":
            assert r["forwards_per_block"] == expected, (label, way, r["forwards_per_block"])
    ran = {label for (label, way), r in rows.items() if way == "selective" and "failed" not in r}
    assert {(p["ours"], p["torch"]) for p in result["pairs"]} == {
        (o.label, t.label) for o, t in PAIRS if t.label in ran
    }
    assert "torch / ours" in capsys.readouterr().out
