"""A rank that dies (SIGKILL) or hangs (SIGSTOP) in the middle of ``Trainer.fit`` is named by the
survivors: its pipeline rank, stages, global rank and host, within ``pipeline_timeout``, in the
training step being run; every survivor's fit raises on its own, in seconds, instead of waiting for
torch's 30-minute default. Each case is a launch of its own: a rank of it is lost."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_twobp import TwoBPStrategy
from lightning_twobp.processes import run_distributed

from conftest import Regressor, lightning_env, quiet_trainer, regression_data

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a launch per lost rank, waiting on timeouts: last (conftest.py)

TIMEOUT = 3  # pipeline_timeout, seconds


class _Vanish(pl.Callback):
    """On ``victim``, notes the time in ``folder``, then sends the process ``sig`` when training step
    ``at`` starts."""

    def __init__(self, victim: int, sig: int, at: int, folder: str) -> None:
        self.victim, self.sig, self.at, self.folder = victim, sig, at, Path(folder)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.victim and trainer.global_step == self.at:
            (self.folder / "victim").write_text(f"{os.getpid()} {time.time()}")
            os.kill(os.getpid(), self.sig)


class Report(RuntimeError):
    """What a survivor saw: raised so that the harness collects every survivor's own report."""


def _fit(rank: int, world: int, victim: int, sig: int, folder: str, schedule: str, degree: int | None) -> None:
    lightning_env(rank, world)
    strategy = TwoBPStrategy(schedule=schedule, num_microbatches=4, pipeline_degree=degree, pipeline_timeout=TIMEOUT)
    trainer = quiet_trainer(strategy, world, max_steps=8, callbacks=[_Vanish(victim, sig, at=2, folder=folder)])
    try:  # four Linear(8, 8) layers: enough for the four stages of the largest pipeline here
        trainer.fit(Regressor(widths=(8,) * 5, log=False), regression_data(d_in=8, d_out=8))
    except Exception as e:
        pid, stopped_at = (Path(folder) / "victim").read_text().split()
        took = time.time() - float(stopped_at)
        if sig == signal.SIGSTOP and rank == min(set(range(world)) - {victim}):
            time.sleep(2)
            os.kill(int(pid), signal.SIGKILL)  # the test's cleanup; a launcher does this (torchrun, srun)
        raise Report(f"after {took:.1f} s: {e}") from None
    raise AssertionError(f"rank {rank} finished the fit although rank {victim} stopped")


def _reports(world: int, victim: int, how: str, tmp_path, schedule: str = "1f1b", degree: int | None = None):
    with pytest.raises(RuntimeError) as info:
        run_distributed(
            _fit, world, victim, getattr(signal, how), str(tmp_path), schedule, degree, timeout=180, grace=90
        )
    parts = {int(p.split()[0]): p for p in str(info.value).split("--- rank ")[1:]}
    survivors = set(range(world)) - {victim}
    assert survivors <= set(parts), f"not every survivor reported by itself: {sorted(parts)}"
    for r in survivors:
        assert "Report: after " in parts[r], parts[r][-2000:]  # its fit raised, not the harness
    return {r: parts[r] for r in survivors}, {
        r: float(re.search(r"Report: after ([0-9.]+) s", parts[r])[1]) for r in survivors
    }


def _named(victim: int, stages: str) -> str:
    return f"pipeline rank {victim} ({stages}, global rank {victim}, host {socket.gethostname()})"


@pytest.mark.parametrize("world, victim, how", [(2, 1, "SIGSTOP"), (4, 2, "SIGKILL"), (4, 0, "SIGSTOP")])
def test_a_rank_lost_during_fit_is_named_by_its_neighbours(world, victim, how, tmp_path):
    reports, took = _reports(world, victim, how, tmp_path)
    for r in {victim - 1, victim + 1} & set(reports):  # the ranks that wait on it directly
        assert _named(victim, f"stage {victim}") + " stopped answering" in reports[r], reports[r][-3000:]
        assert (
            f"nothing came for {TIMEOUT} s" in reports[r] if how == "SIGSTOP" else "its connection closed" in reports[r]
        )
        assert ", global step 2, " in reports[r], reports[r][-3000:]  # the training step being run
        assert took[r] < TIMEOUT + 15, took
    # ranks further away name the neighbour that stopped answering them once it raised, a few
    # pipeline timeouts later: none waits for the process group's timeout
    assert max(took.values()) < 4 * TIMEOUT + 20, took


def test_a_rank_of_two_stages_is_named_with_both(tmp_path):
    reports, took = _reports(2, 1, "SIGKILL", tmp_path, schedule="zb-v")
    assert _named(1, "stages 1, 2") + " stopped answering" in reports[0], reports[0][-3000:]
    assert took[0] < TIMEOUT + 15


def test_with_data_parallel_replicas_every_survivor_ends(tmp_path):
    """pipeline 2 x data 2: rank 1's pipeline neighbour names it; its data-parallel peer (rank 3) and
    that peer's neighbour (rank 2) end too, on their own."""
    reports, took = _reports(4, 1, "SIGKILL", tmp_path, degree=2)
    assert _named(1, "stage 1") + " stopped answering" in reports[0], reports[0][-3000:]
    assert max(took.values()) < 70, took  # at most the process group's timeout (60 s at pipeline_timeout=3)
