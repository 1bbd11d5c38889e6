"""SIGTERM, as a scheduler sends it, stops every rank at the same step within seconds, exits non-zero, and
leaves verified checkpoints: sent to every rank mid-step, to one rank only, during a checkpoint save, and
with ``ModelCheckpoint(save_on_exception=True)``, which then saves the step every rank stopped at, from
which a resume mid-epoch trains as the uninterrupted run."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_twobp import Preempted, TwoBPStrategy
from lightning_twobp.lightning import checkpoint as ckpt
from lightning_twobp.processes import free_port, rank_env, run_distributed

from conftest import AdamRegressor, checkpointing_trainer, own_weights, user_script

pytestmark = pytest.mark.dist

AT = 3  # the training step during which the signal comes
STEPS = 40  # what the run would train without a signal


class SignalMidStep(pl.Callback):
    """Sends ``sig`` to this process from inside the forward of training step ``at`` (on ``ranks``)."""

    def __init__(self, ranks: set[int], sig: int = signal.SIGTERM, at: int = AT, by_batch: bool = False) -> None:
        self.ranks, self.sig, self.at, self.by_batch = ranks, sig, at, by_batch  # by_batch: ``at`` counts batches
        self.sent: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if (batch_idx if self.by_batch else trainer.global_step) == self.at:
            self._arm(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        """``trainer.validate``: at batch ``AT`` (its step count stays 0)."""
        if batch_idx == AT:
            self._arm(trainer)

    def _arm(self, trainer):
        if trainer.global_rank not in self.ranks:
            return

        def hook(module, args, out):
            handle.remove()
            self.sent.append(time.monotonic())
            os.kill(os.getpid(), self.sig)

        handle = nn.modules.module.register_module_forward_hook(hook)


def _validate_signalled(world: int) -> dict:
    """SIGTERM to rank 1 in the forward of ``trainer.validate``'s batch ``AT`` (Lightning's handler, a
    broadcast inside it, left rank 0 waiting out pipeline_timeout, then naming a lost peer)."""
    g = torch.Generator().manual_seed(3)
    data = DataLoader(TensorDataset(torch.randn(400, 6, generator=g), torch.randn(400, 2, generator=g)), 8)
    mid = SignalMidStep({1})
    trainer = checkpointing_trainer(world, STEPS, [mid])
    try:
        trainer.validate(AdamRegressor(), data, verbose=False)
        return {"error": None, "step": 0}
    except Preempted as stop:
        took = time.monotonic() - mid.sent[0] if mid.sent else None
        return {"error": str(stop), "code": stop.code, "step": 0, "took": took}


def _signal_during_save(sent: list[float]) -> None:
    """SIGTERM to this process as it starts writing its shards of the second save."""
    write, calls = ckpt._write_shards, {"n": 0}

    def writing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
        return write(*args, **kwargs)

    ckpt._write_shards = writing


def _stateful() -> StatefulDataLoader:
    """8 batches an epoch, from a loader whose position Lightning saves: a resume goes on mid-epoch."""
    g = torch.Generator().manual_seed(2)
    return StatefulDataLoader(TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)), 8)


def _resume_differs(world: int, folder: Path, stop: int, **kw: Any) -> list[str]:
    """Resumed from the checkpoint saved at the stop, trained for 2 epochs (16 batches): the parameters that
    differ from an uninterrupted run's (bitwise), and the step count where it differs."""
    straight, resumed = AdamRegressor(), AdamRegressor()
    uninterrupted = checkpointing_trainer(world, -1, [], max_epochs=2, **kw)
    uninterrupted.fit(straight, _stateful())
    saved = next(folder.glob(f"*-step={stop}.ckpt"))
    trainer = checkpointing_trainer(world, -1, [], max_epochs=2, **kw)
    trainer.fit(resumed, _stateful(), ckpt_path=saved)
    want = own_weights(straight)
    steps = [f"ended at step {trainer.global_step}"] if trainer.global_step != uninterrupted.global_step else []
    return steps + [n for n, q in own_weights(resumed).items() if not torch.equal(q, want[n])]


# Where the signal comes (a training step, or with ``by_batch`` a batch) for the cases that resume. At the
# epoch's second-to-last step (8 an epoch) the stop is agreed at its last, after which Lightning starts the
# next epoch's loader before the step every rank stops at. Accumulating 2 batches a step, a signal in batch
# 5 is seen after batch 6, inside a window: the stop waits for the window's end.
RESUMES = {"resumed": {}, "resumed-at-epoch-end": {"at": 6}, "resumed-accumulating": {"at": 5, "by_batch": True}}


def _run(rank: int, world: int, port: int, root: str, cases: list[str]) -> dict:
    rank_env(rank, world, port)
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)), batch_size=8)
    out = {}
    for case in cases:
        folder = Path(root) / case
        if case == "validate":
            out[case] = _validate_signalled(world) | {"handler": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}
            continue
        saving = ModelCheckpoint(
            dirpath=folder,
            every_n_train_steps=2,
            save_top_k=-1,
            save_last=True,
            save_on_exception=case == "on-exception" or case in RESUMES,
        )
        mid = SignalMidStep({1} if case == "one-rank" else {0, 1}, **RESUMES.get(case, {}))
        kw = {"accumulate_grad_batches": 2} if case == "resumed-accumulating" else {}
        write = ckpt._write_shards
        if case == "during-save":
            _signal_during_save(mid.sent)
        trainer = checkpointing_trainer(world, STEPS, [saving] + ([] if case == "during-save" else [mid]), **kw)
        try:
            trainer.fit(AdamRegressor(), _stateful() if case in RESUMES else data)
            out[case] = {"error": None, "step": trainer.global_step}
        except Preempted as stop:
            took = time.monotonic() - mid.sent[0] if mid.sent else None
            out[case] = {"error": str(stop), "code": stop.code, "step": trainer.global_step, "took": took}
        finally:
            ckpt._write_shards = write
        out[case]["handler"] = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        if case in RESUMES and out[case]["error"] is not None:
            out[case]["differs"] = _resume_differs(world, folder, out[case]["step"], **kw)
    return out


CASES = ["mid-step", "one-rank", "during-save", "on-exception", *RESUMES, "validate"]


def test_sigterm_stops_every_rank_at_one_step_saves_and_exits_non_zero(tmp_path):
    results = run_distributed(_run, 2, free_port(), str(tmp_path), CASES, timeout=300)
    for case in CASES:
        seen = [r[case] for r in results]
        assert all(s["error"] is not None for s in seen), (case, seen)  # no rank trained on to the end
        at = RESUMES.get(case, {}).get("at", AT)
        assert seen[0]["step"] == seen[1]["step"] <= at + 2, (case, seen)  # the same step, at most 2 later
        for s in seen:
            assert s["code"] == 128 + signal.SIGTERM and s["handler"], (case, s)  # 143; handlers put back
            one = case in ("one-rank", "validate")
            assert "SIGTERM on rank(s) [1]" in s["error"] if one else "[0, 1]" in s["error"], s
            if s["took"] is not None:
                assert s["took"] < 30, (case, s)
        if case == "validate":  # an evaluation call: the ranks stop before one batch, nothing to save
            stopped = {s["error"].split("before validation batch ")[1].split(",")[0] for s in seen}
            assert stopped in ({str(AT + 1)}, {str(AT + 2)}), seen  # one batch on both, at most 2 later
            continue
        folder = tmp_path / case
        assert not list(folder.glob(".*")), sorted(p.name for p in folder.iterdir())  # no .partial left
        saved = sorted(p.name for p in folder.iterdir())
        for name in saved:
            assert ckpt.verify(folder / name, shared=False)["layout"]["pipeline_degree"] == 2
        stop = seen[0]["step"]
        if case == "on-exception":  # the step every rank stopped at, saved there
            assert f"epoch={(stop - 1) // 2}-step={stop}.ckpt" in saved, saved
        if case in RESUMES:  # resumed from that save: the uninterrupted run's parameters (the loader's
            # position was saved one batch on, the batch taken before the step that stopped: the resumed run
            # skipped it; at an epoch's end, the ended epoch's position: it skipped an epoch; inside an
            # accumulation window, the window's first half was lost)
            assert seen[0]["differs"] == seen[1]["differs"] == [], seen


class SignalInEvaluation(pl.Callback):
    """SIGTERM to global rank ``rank`` from inside the forward of its evaluation batch ``at``."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at = rank, at

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._arm(trainer, batch_idx)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._arm(trainer, batch_idx)

    def _arm(self, trainer, batch_idx):
        if trainer.global_rank == self.rank and batch_idx == self.at:
            SignalMidStep({self.rank})._arm(trainer)


# pp2 x dp2 (tests/test_sharded.py's shared launch): (data_parallel, call, the rank signalled, in its
# batch, each replica's batches). "tail": a batch only replica 0 reads; "short-last": the last batch of
# replica 1, which reads fewer; "last": the call's last batch, stopped at the call's end.
EVALUATION_CASES = {
    "validate-shard": ("shard", "validate", 1, 3, (6, 6)),
    "predict-replicate": ("replicate", "predict", 1, 3, (6, 6)),
    "validate-uneven-tail": ("replicate", "validate", 1, 7, (10, 6)),
    "validate-uneven-short-last": ("replicate", "validate", 3, 5, (10, 6)),
    "predict-shard-last": ("shard", "predict", 2, 5, (6, 6)),
}


def evaluation_preempted(rank: int, world: int) -> dict:
    """Each of EVALUATION_CASES on this rank: what the call raised, and where every rank stopped."""
    from conftest import lightning_env, quiet_trainer, regression_data

    lightning_env(rank, world)
    out = {}
    for case, (how, call, signalled, at, batches) in EVALUATION_CASES.items():
        strategy = TwoBPStrategy(schedule="1f1b", pipeline_degree=2, data_parallel=how, pipeline_timeout=60)
        trainer = quiet_trainer(strategy, world, callbacks=[SignalInEvaluation(signalled, at)])
        data = regression_data(n=8 * batches[rank // 2])
        try:
            getattr(trainer, call)(AdamRegressor(), data, **({"verbose": False} if call == "validate" else {}))
            out[case] = {"error": None}
        except Preempted as stop:
            where = str(stop).split("every rank stopped before ")[1].split(",")[0]
            out[case] = {"error": str(stop), "code": stop.code, "before": where}
        out[case]["handler"] = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    return out


def check_evaluation_preempted(results: list[dict]) -> None:
    """Every rank raised Preempted (143) before the same batch, one or two after the signal's, or at the
    call's end after its last batch; nothing else (PeerLost, a hang, a finished call)."""
    for case, (_, call, signalled, at, batches) in EVALUATION_CASES.items():
        seen = [r[case] for r in results]
        assert all(s["error"] is not None for s in seen), (case, seen)
        assert len({s["before"] for s in seen}) == 1, (case, seen)
        kind = "validation" if call == "validate" else call
        last = at + 1 >= max(batches)
        allowed = {f"the end of the {kind} call"} if last else {f"{kind} batch {at + 1}", f"{kind} batch {at + 2}"}
        assert seen[0]["before"] in allowed, (case, seen)
        for s in seen:
            assert s["code"] == 128 + signal.SIGTERM and s["handler"], (case, s)
            assert f"SIGTERM on rank(s) [{signalled}]" in s["error"], (case, s)


def _requeue(rank: int, world: int, port: int, root: str) -> dict:
    """Under SLURM (its variables as srun sets them) with Lightning's auto-requeue, SIGUSR1 to rank 1."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    rank_env(rank, world, port)
    os.environ.update(
        SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(world), SLURM_NNODES="1", SLURM_PROCID=str(rank)
    )
    os.environ.update(SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="twobp")
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)), batch_size=8)
    mid = SignalMidStep({1}, signal.SIGUSR1)
    trainer = checkpointing_trainer(
        world, STEPS, [mid], plugins=[SLURMEnvironment(auto_requeue=True)], default_root_dir=root
    )
    with pytest.raises(Preempted) as stop:
        trainer.fit(AdamRegressor(), data)
    return {"error": str(stop.value), "code": stop.value.code, "step": trainer.global_step}


def test_slurms_requeue_signal_saves_the_hpc_checkpoint_at_one_step_and_stops(tmp_path):
    seen = run_distributed(_requeue, 2, free_port(), str(tmp_path), timeout=180)
    assert seen[0]["step"] == seen[1]["step"] <= AT + 2, seen
    for s in seen:
        assert s["code"] == 128 + signal.SIGUSR1 and "SIGUSR1 on rank(s) [1]" in s["error"], s
    manifest = ckpt.verify(tmp_path / "hpc_ckpt_1.ckpt", shared=False)  # saved by both ranks, complete
    assert manifest["layout"]["pipeline_degree"] == 2, manifest


SCRIPT = """

class Started(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            Path({folder!r}, f"rank{{trainer.global_rank}}").write_text(str(os.getpid()))
        time.sleep(0.05)


if __name__ == "__main__":
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=TwoBPStrategy(), logger=False, max_steps=100000,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[Started()])
    trainer.fit(AdamRegressor(), regression_data(n=16))
"""


def test_sigterm_to_lightnings_launcher_stops_both_ranks_and_exits_143(tmp_path):
    """What a scheduler does: SIGTERM to the process it started (rank 0 under Lightning's launcher)."""
    proc = user_script(tmp_path, SCRIPT)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "rank1").exists() or not (tmp_path / "rank0").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        child = int((tmp_path / "rank1").read_text())
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert took < 30, took
    assert "every rank stopped before training step" in err, err[-3000:]
    # the launcher ended first: its observer never saw a rank's 143 while it ran, so it killed nothing
    # (when it did, every few runs, the job's status was -9: preemption.exit_after_launcher)
    assert "Forcefully terminating" not in err, err[-3000:]
    for _ in range(50):  # the rank Lightning started ends too: no orphan
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"rank 1 (pid {child}) outlived the job")
