"""Benchmarks, one module each, all on the workload of :mod:`.workload` (2 gloo ranks x 1 thread):

* :mod:`.engine`  every schedule with and without 2BP, against one process and the simulator;
* :mod:`.peer`    side by side with torch.distributed.pipelining, schedule for schedule;
* :mod:`.trainer` the same steps through ``Trainer(strategy="twobp")`` against the bare engine;
* :mod:`.split`   (B + W) / BW on one block.

``twobp-bench`` (:mod:`.cli`) runs them.
"""

from lightning_twobp.bench.cli import main

__all__ = ["main"]
