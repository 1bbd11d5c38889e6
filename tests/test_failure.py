"""An error of one rank's own (the user's training_step on one rank, torch refusing reentrant
checkpointing) ends every rank within seconds: the failing rank with its error, the others with
``PeerFailed`` naming it (rank, stage, step, cause), not a timeout or a lost peer; with
``ModelCheckpoint(save_on_exception=True)`` nothing is saved across ranks that are not at one step."""

from __future__ import annotations

import socket
import time

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from test_checkpoint_safety import Net, _data, _trainer
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_twobp.engine.failure import PeerFailed
from lightning_twobp.testing import free_port, rank_env, run_distributed

pytestmark = pytest.mark.dist

AT = 2


class FailsOnRank1(Net):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and self.global_step == AT:
            raise ValueError("a bug in the user's step on rank 1")
        return super().training_step(batch, batch_idx)


class Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 2)

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=True)


class ReentrantOnLastStage(Net):
    def __init__(self) -> None:
        super().__init__()
        self.layers[4] = Reentrant()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(x), y)


def _fit(rank: int, world: int, port: int, folder: str, model: str) -> dict:
    rank_env(rank, world, port)
    saving = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True, save_on_exception=True)
    trainer = _trainer(world, 20, [saving])
    start = time.monotonic()
    try:
        trainer.fit({"user": FailsOnRank1, "reentrant": ReentrantOnLastStage}[model](), _data())
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        return {"type": type(err).__name__, "error": str(err), "took": time.monotonic() - start}
    return {"type": None}


@pytest.mark.parametrize(
    "model, cause",
    [
        ("user", "ValueError: a bug in the user's step on rank 1"),
        ("reentrant", "RuntimeError: When use_reentrant=True, torch.utils.checkpoint is incompatible"),
    ],
)
def test_one_ranks_error_ends_every_rank_naming_it(tmp_path, model, cause):
    seen = run_distributed(_fit, 2, free_port(), str(tmp_path), model, timeout=120)
    assert seen[1]["type"] is not None and cause in seen[1]["error"], seen[1]  # its own error, as before
    first = f"global rank 1 (pipeline rank 1, stage(s) 1, host {socket.gethostname()}) failed at global step"
    assert seen[0]["type"] == "PeerFailed", seen[0]
    assert first in seen[0]["error"] and cause in seen[0]["error"], seen[0]["error"]
    assert seen[0]["error"].startswith("global rank 0 (pipeline rank 0, stage(s) 0"), seen[0]["error"]
    assert max(s["took"] for s in seen) < 30, seen  # not pipeline_timeout's 600 s
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in saved if n.startswith(".")], saved  # no save was begun after the error
    if model == "user":
        assert saved == ["epoch=0-step=2.ckpt", "last.ckpt"], saved  # step 2, the last one before the error


def test_the_store_is_reachable_where_torch_keeps_it():
    """The one private torch API the failure channel uses: fails here when a torch release moves it."""
    assert callable(dist.distributed_c10d._get_default_store)
    assert issubclass(PeerFailed, RuntimeError)
