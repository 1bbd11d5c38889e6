"""Benchmarks, one module each, all on the workload of :mod:`.workload` (2 gloo ranks x 1 thread):

* :mod:`.engine`  every schedule with and without 2BP, against one process and the simulator;
* :mod:`.peer`    side by side with torch.distributed.pipelining, schedule for schedule;
* :mod:`.trainer` the same steps through ``Trainer(strategy="twobp")`` against the bare engine;
* :mod:`.split`   (B + W) / BW on one block;
* :mod:`.paper`   the 2BP paper's three questions (throughput, peak memory, scaling) on its four models;
* :mod:`.soak`    memory over a long Trainer run;
* :mod:`.monitor` what ``PipelineMonitor`` costs (``python -m lightning_twobp.bench.monitor``);
* :mod:`.modulelist` the ModuleList contract against the Sequential one (``python -m
lightning_twobp.bench.modulelist``);
* :mod:`.gpu`     on one GPU in bf16: a LLaMa-7B layer's F/B/W, the pipeline on the GPU, the 7B costs simulated.
* :mod:`.sharded` ``data_parallel="shard"`` against ``"replicate"``: state bytes, peak RSS and step time per rank.

Each writes its JSON through :func:`.report.write_json`.

``twobp-bench`` (:mod:`.cli`) runs them.
"""

from lightning_twobp.bench.cli import main

__all__ = ["main"]
