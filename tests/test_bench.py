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
