"""PipelineMonitor: samples counted once per pipeline, memory and measured/simulated bubbles for every
pipeline rank at logging steps, and a Chrome trace of the chosen step with both ranks and the
simulated schedule."""

from __future__ import annotations

import csv
import importlib.util
import json
import pathlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp import PipelineMonitor, TwoBPStrategy
from lightning_twobp.monitor import measured_costs

import conftest
from conftest import Regressor, launch, lightning_env, quiet_trainer, regression_data

pytestmark = pytest.mark.dist


def _net() -> Regressor:
    return Regressor(widths=(16, 64, 64, 2), lr=0.01)


def _data() -> DataLoader:
    return regression_data(n=256, d_in=16, batch_size=16)


def _fit(rank: int, world: int, folder: str, schedule: str = "zb-h1", summary: bool = False) -> dict:
    from lightning_twobp.callbacks import RunSummary

    lightning_env(rank, world)
    monitor = PipelineMonitor(
        log_every_n_steps=2, length_fn=lambda b: b[0].numel(), trace_steps=[3], trace_dir=f"{folder}/traces"
    )
    callbacks = [RunSummary()] if summary else [monitor]  # RunSummary alone: it brings a silent monitor
    trainer = quiet_trainer(
        TwoBPStrategy(schedule=schedule, num_microbatches=4),
        world,
        max_steps=6,
        logger=CSVLogger(folder, name="logs"),
        log_every_n_steps=2,
        callbacks=callbacks,
        default_root_dir=folder,
    )
    trainer.fit(_net(), _data())
    if summary:
        return {"summary": callbacks[0].summary}
    return {"last": monitor.last, "traces": monitor.traces, "flops": monitor.flops_per_batch}


class _CountLogs(PipelineMonitor):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.logged_at: list[int] = []

    def _log(self, trainer, pl_module, strategy):
        self.logged_at.append(trainer.global_step)
        super()._log(trainer, pl_module, strategy)


def _accumulating(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    monitor = _CountLogs(log_every_n_steps=2)
    strategy = TwoBPStrategy(schedule="zb-h1", num_microbatches=4)
    trainer = quiet_trainer(strategy, world, max_steps=4, accumulate_grad_batches=2, callbacks=[monitor])
    trainer.fit(_net(), _data())
    return {"logged_at": monitor.logged_at, "flops": monitor.flops_per_batch}


def _one_process_flops() -> int:
    """FLOPs of one batch's forward and backward of the whole model in one process."""
    from torch.utils.flop_counter import FlopCounterMode

    x, y = next(iter(_data()))
    net = _net()
    with FlopCounterMode(display=False) as counter:
        F.mse_loss(net.layers(x), y).backward()
    return counter.get_total_flops()


def _loop_model(name: str) -> pl.LightningModule:
    from lightning_twobp.models import HFCausalLM, LlamaLoopLM

    torch.manual_seed(0)
    if name == "hf-gpt2":
        return HFCausalLM(arch="gpt2", vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16, lr=1e-2)
    return LlamaLoopLM(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16, lr=1e-2)


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(5)
    ids = (torch.randint(0, 64, (64, 1), generator=g) + torch.arange(16)) % 64
    return DataLoader(TensorDataset(ids, (ids + 1) % 64), batch_size=8)


def _loop_flops(rank: int, world: int, name: str) -> float:
    lightning_env(rank, world)
    monitor = PipelineMonitor(log_every_n_steps=2)
    strategy = TwoBPStrategy(schedule="zb-h1", num_microbatches=4)
    trainer = quiet_trainer(strategy, world, max_steps=3, callbacks=[monitor])
    trainer.fit(_loop_model(name), _tokens())
    return monitor.flops_per_batch


def _two_stages(rank: int, world: int, folder: str) -> tuple[dict, dict]:
    """zb-v (two stages a rank) with the monitor, then zb-h1 with RunSummary alone."""
    return _fit(rank, world, f"{folder}/v", "zb-v"), _fit(rank, world, f"{folder}/s", "zb-h1", True)


ACCUMULATING = "test_under_gradient_accumulation_it_logs_once_per_optimizer_step"
TRACE = "test_monitor_logs_every_pipeline_rank_and_writes_a_trace"
TWO_STAGES = "test_a_rank_of_two_stages_logs_under_both_and_run_summary_uses_the_same_figures"
LOOP = "test_flops_of_a_modulelist_model_equal_one_process"
LOOP_MODELS = ["llama-loop"] + (["hf-gpt2"] if importlib.util.find_spec("transformers") else [])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("monitor")


@pytest.fixture(scope="module")
def two_ranks(request, folder) -> conftest.Launch:
    """Every case in one launch of 2 ranks: a test's first call may wait for all of them."""
    cases = {
        ACCUMULATING: (_accumulating, ()),
        TRACE: (_fit, (str(folder / "trace"),)),
        TWO_STAGES: (_two_stages, (str(folder),)),
        **{f"{LOOP}[{name}]": (_loop_flops, (name,)) for name in LOOP_MODELS},
    }
    return launch(request, 2, cases, timeout=840)


def test_under_gradient_accumulation_it_logs_once_per_optimizer_step(two_ranks):
    out = two_ranks[ACCUMULATING]
    assert out[0]["logged_at"] == out[1]["logged_at"] == [2, 4]  # not after each of the 2 batches
    assert out[0]["flops"] == _one_process_flops()  # per batch, as Throughput counts


def test_monitor_logs_every_pipeline_rank_and_writes_a_trace(two_ranks, folder):
    out, tmp_path = two_ranks[TRACE], folder / "trace"
    last = out[0]["last"]
    assert last == out[1]["last"] or set(last) == set(out[1]["last"])  # every rank logs the same names
    # one pipeline: each sample counted once, not once per stage as ThroughputMonitor would
    assert last["throughput/samples_per_sec"] == pytest.approx(16 * last["throughput/batches_per_sec"])
    assert last["throughput/items_per_sec"] == pytest.approx(16 * 16 * last["throughput/batches_per_sec"])
    for k in (0, 1):
        assert last[f"pipeline/stage{k}/rss_mb"] > 10
        assert 0 <= last[f"pipeline/stage{k}/bubble"] < 1 and 0 <= last[f"pipeline/stage{k}/bubble_simulated"] < 1
        assert last[f"pipeline/stage{k}/held_mb_per_microbatch"] > 0
    # zb-h1: the last stage defers its whole weight backward; the first (no input grad) takes it in B
    assert last["pipeline/stage1/deferred_fraction"] == 1.0 and last["pipeline/stage0/deferred_fraction"] == 0.0
    # FLOPs measured on step 1, each rank its own stages, added up: the one-process count exactly
    assert out[0]["flops"] == out[1]["flops"] == _one_process_flops()
    assert last["throughput/flops_per_sec"] == pytest.approx(out[0]["flops"] * last["throughput/batches_per_sec"])
    rows = list(csv.DictReader((tmp_path / "logs" / "version_0" / "metrics.csv").open()))
    logged = [row for row in rows if row.get("pipeline/stage1/bubble")]
    assert [int(row["step"]) for row in logged] == [1, 3, 5]  # steps 2, 4, 6 (Lightning logs step - 1)
    # the trace: both ranks' ops of step 3, and the simulated schedule beside them
    trace_json = [p for p in out[0]["traces"] if p.endswith(".json")]
    assert trace_json == [str(tmp_path / "traces" / "step3.json")] and out[1]["traces"] == []
    events = json.loads(pathlib.Path(trace_json[0]).read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"0F0", "1F0", "1B0", "1W0"} <= names, sorted(names)[:20]
    assert len({e["pid"] for e in events if e.get("ph") == "X"}) >= 3  # rank 0, rank 1, simulated


def test_a_rank_of_two_stages_logs_under_both_and_run_summary_uses_the_same_figures(two_ranks, folder):
    out, summaries = zip(*two_ranks[TWO_STAGES], strict=True)
    last = out[0]["last"]
    assert {"pipeline/stage0_3/bubble", "pipeline/stage1_2/bubble"} <= set(last), sorted(last)
    assert out[0]["flops"] == _one_process_flops()
    summary = summaries[0]["summary"]
    assert summary["steps"] == 6 and len(summary["peak_memory_bytes_per_rank"]) == 2
    assert min(summary["peak_memory_bytes_per_rank"]) > 10e6 and summary["peak_memory_kind"] == "peak RSS"
    assert summary["samples_per_s"] == pytest.approx(6 * 16 / summary["seconds"])
    assert summary["tokens_per_s"] is None  # float features, no token ids
    assert json.loads((folder / "s" / "summary.json").read_text())["steps"] == 6
    assert summary["deferred_fraction_per_rank"] == [0.0, 1.0]


@pytest.mark.parametrize("name", ["llama-loop", "hf-gpt2"])
def test_flops_of_a_modulelist_model_equal_one_process(two_ranks, request, name):
    """The ModuleList contract runs other stages' blocks on the meta device to learn shapes: none of
    that may count, and the split backward's W must count like autograd's weight gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    if name not in LOOP_MODELS:
        pytest.skip("transformers is not installed")
    got = two_ranks[request.node.name]
    model = _loop_model(name)
    with FlopCounterMode(display=False) as counter:
        model.training_step(next(iter(_tokens())), 0).backward()
    assert got[0] == got[1] == counter.get_total_flops()


def test_measured_costs_take_medians_per_stage_without_waits():
    from lightning_twobp.engine import ActionRecord

    recs = [
        ActionRecord(0, 0, "0F0", 0.0, 1.0),
        ActionRecord(0, 0, "0F1", 1.0, 3.0, wait=1.0),
        ActionRecord(1, 0, "1BW0", 2.0, 5.0),
        ActionRecord(1, 0, "1W0+1", 5.0, 7.0),
        ActionRecord(1, 0, "SEND", 7.0, 9.0),
    ]
    c = measured_costs(recs, 2)
    assert c.f == (1.0, 0.0) and c.b == (0.0, 3.0) and c.w == (0.0, 1.0) and c.bw is None
    # a stage that ran some backwards fused and others split (schedules.fusion): BW timed as measured
    mixed = measured_costs([*recs, ActionRecord(1, 0, "1B1", 9.0, 11.0)], 2)
    assert mixed.b == (0.0, 2.0) and mixed.bw == (0.0, 3.0)
