"""PipelineMonitor: samples counted once per pipeline, memory and measured/simulated bubbles for every
pipeline rank at logging steps, and a Chrome trace of the chosen step with both ranks and the
simulated schedule."""

from __future__ import annotations

import csv
import json
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp import PipelineMonitor, TwoBPStrategy
from lightning_twobp.monitor import measured_costs
from lightning_twobp.testing import free_port, run_distributed

pytestmark = pytest.mark.dist


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(rank: int, world: int, port: int, folder: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 2, generator=g)), batch_size=16)
    monitor = PipelineMonitor(log_every_n_steps=2, length_fn=lambda b: b[0].numel(), trace_steps=[3],
                              trace_dir=f"{folder}/traces")
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=TwoBPStrategy(schedule="zb-h1", num_microbatches=4),
                         max_steps=6, logger=CSVLogger(folder, name="logs"), log_every_n_steps=2,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[monitor])
    trainer.fit(Net(), data)
    return {"last": monitor.last, "traces": monitor.traces}


def test_monitor_logs_every_pipeline_rank_and_writes_a_trace(tmp_path):
    out = run_distributed(_fit, 2, free_port(), str(tmp_path), timeout=180)
    last = out[0]["last"]
    assert last == out[1]["last"] or set(last) == set(out[1]["last"])  # every rank logs the same names
    # one pipeline: each sample counted once, not once per stage as ThroughputMonitor would
    assert last["throughput/samples_per_sec"] == pytest.approx(16 * last["throughput/batches_per_sec"])
    assert last["throughput/items_per_sec"] == pytest.approx(16 * 16 * last["throughput/batches_per_sec"])
    for r in (0, 1):
        assert last[f"pipeline/rank{r}/rss_mb"] > 10
        assert 0 <= last[f"pipeline/rank{r}/bubble"] < 1 and 0 <= last[f"pipeline/rank{r}/bubble_simulated"] < 1
        assert last[f"pipeline/rank{r}/held_mb_per_microbatch"] > 0
    rows = list(csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")))
    logged = [row for row in rows if row.get("pipeline/rank1/bubble")]
    assert [int(row["step"]) for row in logged] == [1, 3, 5]  # steps 2, 4, 6 (Lightning logs step - 1)
    # the trace: both ranks' ops of step 3, and the simulated schedule beside them
    trace_json = [p for p in out[0]["traces"] if p.endswith(".json")]
    assert trace_json == [str(tmp_path / "traces" / "step3.json")] and out[1]["traces"] == []
    events = json.load(open(trace_json[0]))["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"0F0", "1F0", "1B0", "1W0"} <= names, sorted(names)[:20]
    assert len({e["pid"] for e in events if e.get("ph") == "X"}) >= 3  # rank 0, rank 1, simulated


def test_measured_costs_take_medians_per_stage_without_waits():
    from lightning_twobp.engine import ActionRecord

    recs = [ActionRecord(0, 0, "0F0", 0.0, 1.0), ActionRecord(0, 0, "0F1", 1.0, 3.0, wait=1.0),
            ActionRecord(1, 0, "1BW0", 2.0, 5.0), ActionRecord(1, 0, "1W0+1", 5.0, 7.0), ActionRecord(1, 0, "SEND", 7.0, 9.0)]
    c = measured_costs(recs, 2)
    assert c.f == (1.0, 0.0) and c.b == (0.0, 3.0) and c.w == (0.0, 1.0)
