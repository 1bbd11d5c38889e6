"""The benchmark harnesses run end to end (a tiny model, one repeat): smoke tests, not timings."""

from __future__ import annotations

import json

import pytest

from lightning_twobp.bench import main
from lightning_twobp.bench.engine import configs
from lightning_twobp.bench.peer import contenders, run_peer, write
from lightning_twobp.bench.split import bench_paper_blocks, bench_split
from lightning_twobp.bench.workload import Workload

pytestmark = pytest.mark.dist


def test_bench_quick_writes_every_configuration(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    names = {(c["name"], c["split_backward"], c["num_microbatches"]) for c in data["configs"]}
    assert names == {(c.name, c.split_backward, c.num_microbatches) for c in configs(8)}
    for c in data["configs"]:
        assert c["median_step_s"] > 0 and c["samples_per_s"] > 0 and c["simulated_step_s"] > 0
    assert data["single_process_step_s"] > 0
    assert "zb-h1" in capsys.readouterr().out


def test_split_ratio_harness():
    r = bench_split(tokens=32, repeats=2, seq=16)
    assert r["deferred_fraction"] == 1.0 and r["bw_ms"] > 0 and r["median_ratio"] > 0
    r = bench_split(tokens=32, repeats=2, seq=16, batch=3)
    assert r["batch"] == 3 and r["median_ratio"] > 0 and r["median_ratio_unbatched"] > 0


def test_paper_blocks_harness_gives_each_model_a_ratio():
    r = bench_paper_blocks(repeats=1, quick=True)
    assert set(r) == {"llama", "bert", "mamba", "resnet"} and all(v > 0 for v in r.values())


def test_full_size_without_the_paper_blocks_is_refused(capsys):
    from lightning_twobp.bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--split", "--full-size"])
    assert info.value.code == 2 and "add both" in capsys.readouterr().err


def test_full_size_blocks_are_the_named_real_sizes():
    from lightning_twobp.bench.paper import models
    from lightning_twobp.bench.split import full_size

    for pm in map(full_size, models()):
        layers, _ = pm.build()
        x, _ = pm.data()
        widths = {q.shape[-1] for q in layers[1].parameters() if q.dim() == 2}
        if pm.name == "resnet":
            assert x.shape[-1] == 224 and layers[0][0].out_channels == 64, pm
        else:
            assert 768 in widths and x.shape[-1] == 256 and len(layers) == 4, (pm.name, widths, len(layers))


def test_trainer_harness_compares_like_with_like():
    from lightning_twobp.bench.trainer import bench_trainer

    wl = Workload(batch=8, seq=16, layers=2, dim=32, heads=2, vocab=64)
    rows = bench_trainer(wl, m=4, repeats=1, labels=["zb-h1", "zb-v", "gpipe+2BP"])
    assert set(rows) == {"zb-h1 S=2 m=4", "zb-v S=4 m=4", "gpipe+2BP S=2 m=4"}
    for r in rows.values():
        assert r["lightning_step_s"] > 0 and r["bare_step_s"] > 0
        # the Trainer's pipeline and the bare one trained the same weights on the same batches
        assert r["max_param_diff"] < 1e-5, r


def test_peer_benchmark_checks_every_contender_against_one_process(tmp_path):
    # Every contender, ours and torch's, in one process group; gradients checked before timing.
    result = run_peer(Workload.quick(), m=4, rounds=1, warmup=0, steps=2)
    labels = {r["label"] for r in result["rows"]}
    assert labels == {c.label for c in contenders()}
    assert all(r["max_grad_diff"] < 1e-5 and r["step_s"] > 0 for r in result["rows"])
    # each of ours is paired with its torch counterpart; torch has no ZB-H2, so ZB1P stands in
    pairs = {p["ours"]: p["torch"] for p in result["pairs"]}
    assert pairs["zb-h2"] == "torch InterleavedZeroBubble (1/rank)" and pairs["zb-v"] == "torch ZBVZeroBubble"
    assert result["best"]["ours"] in labels and result["best_vs_best"] > 0
    paths = write(result, tmp_path)
    assert "best vs best" in paths[0].read_text() and paths[1].read_text().startswith("label,")
    assert json.loads(paths[2].read_text())["rows"]


def test_peer_benchmark_without_torch_pipelining(monkeypatch):
    import lightning_twobp.bench.peer as peer

    monkeypatch.setattr(peer, "torch_pipelining_available", lambda: False)
    result = run_peer(Workload.quick(), m=4, rounds=1, warmup=0, labels=["zb-h1", "torch 1F1B"])
    assert [r["label"] for r in result["rows"]] == ["zb-h1"]
    assert result["pairs"] == [] and result["best_vs_best"] is None
    assert "not importable" in peer.markdown(result)


def test_soak_harness_samples_every_rank():
    from lightning_twobp.bench.soak import markdown, soak

    result = soak(steps=12, every=4, warmup=0.3, python=True)
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for r in result["ranks"]:
        assert [s[0] for s in r["samples"]] == [4, 8, 12] and r["rss_last_mb"] > 0
        assert 0 < r["python_after_warmup_mb"] < r["rss_last_mb"]  # traced: Python's own share of the RSS
    assert "slope after warm-up" in markdown(result) and "not traced" not in markdown(result)


BUILDS = [((), ("cpu", "meta")), (("--pretrained",), ("cpu-load", "meta-pretrained"))]


@pytest.mark.parametrize(("flags", "variants"), BUILDS)
def test_meta_build_benchmark_reports_every_rank_of_both_builds(tmp_path, capsys, flags, variants):
    out = tmp_path / "meta.json"
    assert main(["--meta-build", *flags, "--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["rank"]) for r in rows] == [(v, rank) for v in variants for rank in (0, 1)]
    assert all(r["fit_s"] > 0 and r["total_s"] >= r["fit_s"] and r["peak"] >= 0 for r in rows)
    assert f"| {variants[1]} | 1 |" in capsys.readouterr().out


def test_gpu_script_runs_its_cuda_code_path_on_the_cpu_at_toy_sizes(tmp_path, capsys, monkeypatch):
    # The one-GPU script (twobp-bench --gpu) must stay runnable where no GPU is: --quick takes the same
    # code at toy sizes on the CPU. Every one-process pipeline's gradients equal plain autograd's.
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the exact CPU check, also on a GPU box
    out = tmp_path / "gpu.json"
    assert main(["--gpu", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for part in ("layer", "head"):
        c = r["costs_s"][part]
        assert all(c[k] > 0 for k in ("F", "B", "W", "BW", "host_B", "host_W", "host_BW")) and c["split_over_fused"] > 0
    assert {p["schedule"] for p in r["pipeline"]} == {
        "gpipe",
        "gpipe+2BP",
        "interleaved-1f1b",
        "interleaved-1f1b+2BP",
        "zb-v",
    }
    assert all(p["grads_match"] and p["max_grad_diff"] < 1e-5 for p in r["pipeline"]), r["pipeline"]
    sims = {(s["schedule"], s["m"]): s for s in r["simulated"]}
    assert sims[("1f1b", 4)]["speedup_over_1f1b"] == pytest.approx(1.0)
    assert {k[0] for k in sims} == {"1f1b", "1f1b+2BP", "zb-h1", "zb-h2", "zb-v"}
    assert "(B + W) / BW" in capsys.readouterr().out


def test_gpu_script_without_a_gpu_says_to_use_quick(monkeypatch):
    from lightning_twobp.bench.gpu import run_gpu

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU; on a CPU run it with --quick"):
        run_gpu()


def test_budget_benchmark_measures_each_contender_alone(tmp_path):
    """twobp-bench --budget on the quick workload, four contenders (one with checkpointed blocks) and
    auto's picks: peaks per rank, times, exactness, the fastest per side within each budget, auto's pick
    per budget run like the others, and the four files."""
    from lightning_twobp.bench.budget import BUDGETS, markdown, run_budget
    from lightning_twobp.bench.budget import write as write_budget

    only = {"1f1b+2BP k=0", "1f1b+2BP k=0 +AC", "torch 1F1B"}
    result = run_budget(Workload.quick(), steps=1, counts=(4,), only=only)
    labels = {r["label"] for r in result["rows"]}
    assert {"1f1b m=4", "1f1b+2BP k=0 m=4", "1f1b+2BP k=0 +AC m=4"} <= labels
    by = {r["label"]: r for r in result["rows"]}
    # checkpointed blocks run twice per micro-batch (F, and B's one recompute) on both ranks, and the
    # gradients are still one process's (run_budget raises otherwise, rtol 1e-5)
    assert by["1f1b+2BP k=0 +AC m=4"]["checkpointing"] == "full"
    assert by["1f1b+2BP k=0 +AC m=4"]["forwards_per_block"] == [[2.0], [2.0]]
    assert by["1f1b+2BP k=0 m=4"]["forwards_per_block"] == [[1.0], [1.0]]
    assert result["baseline"] == "1f1b m=4"
    for r in result["rows"]:
        assert len(r["peak_bytes_per_rank"]) == 2 and r["peak_bytes"] >= 0 and r["step_s"] > 0 and r["vs_1f1b"] > 0
        assert r["max_grad_diff"] < 1e-4
    assert [b["times_1f1b"] for b in result["budgets"]] == list(BUDGETS)
    assert result["budgets"][-1]["ours"] is not None  # twice fused 1F1B's peak: fused 1F1B itself fits
    assert "| budget |" in markdown(result)
    _check_auto(result)
    names = {p.name for p in write_budget(result, tmp_path)}
    assert {"budget.md", "budget.csv", "budget.json"} <= names
    csv_text = (tmp_path / "budget.csv").read_text()
    assert "auto: " in csv_text and "1f1b+2BP k=0 +AC m=4,ours,4,0,full," in csv_text
    assert "| 1f1b+2BP k=0 +AC m=4 |" in (tmp_path / "budget.md").read_text()


def _check_auto(result: dict) -> None:
    """Each budget's auto: a pick within its predicted limit, run like every contender (or a refusal)."""
    from lightning_twobp.bench.budget import BUDGETS, markdown

    autos = result["auto"]
    assert [a["times_1f1b"] for a in autos] == list(BUDGETS)
    assert autos[-1]["label"] is not None  # twice fused 1F1B's predicted peak: fused 1F1B itself fits
    by = {r["label"]: r for r in result["rows"]}
    picked = [a for a in autos if a["label"] is not None]
    for a in picked:
        assert max(a["predicted_peak_bytes_per_rank"]) <= a["predicted_limit_bytes"], a
        row = by[a["label"]]  # run, alone, like the other contenders
        assert row["side"] == "auto" and row["max_grad_diff"] < 1e-4
        assert a["peak_bytes_per_rank"] == row["peak_bytes_per_rank"]
        assert a["within"] == (row["peak_bytes"] <= a["limit_bytes"])
    # a larger budget never picks a schedule predicted slower
    steps = [a["predicted_step_s"] for a in picked]
    assert steps == sorted(steps, reverse=True)
    assert all(a["refused"] for a in autos if a["label"] is None)
    assert "**auto**" in markdown(result)


def test_contender_labels_name_their_checkpointing():
    from lightning_twobp.bench.peer import Contender

    assert Contender("ours", "zb-h1", True, checkpointing="full").label == "zb-h1 +AC"
    assert Contender("ours", "1f1b", True, max_pending_w=0, checkpointing="full").label == "1f1b+2BP k=0 +AC"
    assert Contender("torch", "Schedule1F1B", False, checkpointing="selective").label == "torch 1F1B +AC(sel)"
    zb1p = Contender("torch", "ScheduleInterleavedZeroBubble", True, 1, checkpointing="full")
    assert zb1p.label == "torch InterleavedZeroBubble (1/rank) +AC"
    assert Contender("ours", "zb-h1", True).label == "zb-h1"
    with pytest.raises(ValueError, match="checkpointing='Full': use None, 'full' or 'selective'"):
        Contender("ours", "zb-h1", True, checkpointing="Full")


def test_budget_contenders_checkpoint_both_sides_under_distinct_labels():
    from lightning_twobp.bench.budget import budget_contenders

    pairs = budget_contenders(with_torch=True, counts=(8, 16))
    for m in (8, 16):
        labels = [c.label for c, n in pairs if n == m]
        assert len(labels) == len(set(labels))  # --only picks one contender per label and m
        assert {
            "1f1b +AC",
            "1f1b+2BP k=0 +AC",
            "zb-h1 +AC",
            "zb-h1 +AC(sel)",
            "v-min +AC",
            "torch 1F1B +AC",
            "torch 1F1B +AC(sel)",
            "torch InterleavedZeroBubble (1/rank) +AC",
            "torch ZBVZeroBubble +AC",
        } <= set(labels)
    ours = [c for c, _ in budget_contenders(with_torch=False, counts=(8,))]
    assert all(c.side == "ours" for c in ours) and {c.checkpointing for c in ours} == {None, "full", "selective"}


def test_budget_refuses_an_unknown_label_or_count_before_running_anything():
    unknown = r"no contender is labelled 'zb-h1 \+AC\(full\)'; use labels of these: .*zb-h1 \+AC, zb-h1 \+AC\(sel\)"
    with pytest.raises(ValueError, match=unknown):
        main(["--budget", "--only", "zb-h1 +AC(full)", "torch 1F1B +AC(sel)"])
    with pytest.raises(ValueError, match="--counts 8 5: a batch of 32 does not split into that many"):
        main(["--budget", "--counts", "8", "5"])


def test_first_error_skips_the_peers_lost_connection():
    from lightning_twobp.bench.peer_ac import first_error

    text = (
        'a rank failed:\n--- rank 0 ---\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
        '--- rank 1 ---\nTraceback (most recent call last):\n  File "y.py", line 2\n'
        "RuntimeError: Trying to backward an extra time.\n"
    )
    assert first_error(RuntimeError(text)) == "RuntimeError: Trying to backward an extra time."
    assert first_error(RuntimeError("  no exception line  ")) == "no exception line"


def test_eval_sends_harness_times_both_ways_on_the_same_ranks():
    from lightning_twobp.bench.eval_sends import WAYS, markdown, run_eval_sends

    result = run_eval_sends(quick=True, rounds=1)
    assert set(result["seconds"]) == set(WAYS) and all(s > 0 for s in result["seconds"].values())
    assert set(result["message_ms"]) == {"tensors 1 MB", "objects 1 MB"} and "| 1 MB |" in markdown(result)


def test_moe_harness_measures_the_experts_formula_against_autograd():
    """--split --moe: every weight of the Mixtral block by formula, and B frees the graph autograd's path keeps."""
    pytest.importorskip("transformers")
    from lightning_twobp.bench.split import bench_moe_block

    r = bench_moe_block(repeats=1, tokens=128)
    assert r["deferred_fraction"] == 1.0
    assert r["held_formula_mib"] < r["held_autograd_mib"]
    assert r["formula"] > 0 and r["autograd"] > 0
