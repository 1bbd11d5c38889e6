"""The benchmark harness runs end to end (a tiny model, one repeat): a smoke test, not a timing."""

from __future__ import annotations

import json

import pytest

from lightning_twobp import bench

pytestmark = pytest.mark.dist


def test_bench_quick_writes_every_configuration(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    names = {(c["name"], c["split_backward"], c["num_microbatches"]) for c in data["configs"]}
    assert names == {(c.name, c.split_backward, c.num_microbatches) for c in bench.configs(8)}
    for c in data["configs"]:
        assert c["median_step_s"] > 0 and c["samples_per_s"] > 0 and c["simulated_step_s"] > 0
    assert data["single_process_step_s"] > 0
    assert "zb-h1" in capsys.readouterr().out


def test_split_ratio_harness():
    r = bench.bench_split(tokens=32, repeats=2, seq=16)
    assert r["deferred_fraction"] == 1.0 and r["bw_ms"] > 0 and r["median_ratio"] > 0


def test_trainer_harness_compares_like_with_like():
    from lightning_twobp.bench_trainer import bench_trainer

    rows = bench_trainer(batch=8, seq=16, m=4, repeats=1, layers=2, labels=["zb-h1", "zb-v", "gpipe+2BP"])
    assert set(rows) == {"zb-h1 S=2 m=4", "zb-v S=4 m=4", "gpipe+2BP S=2 m=4"}
    for r in rows.values():
        assert r["lightning_step_s"] > 0 and r["bare_step_s"] > 0
        # the Trainer's pipeline and the bare one trained the same weights on the same batches
        assert r["max_param_diff"] < 1e-5, r
