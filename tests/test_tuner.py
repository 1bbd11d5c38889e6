"""Lightning's ``Tuner(trainer).lr_find`` under ``strategy="twobp"``: it saves a checkpoint, trains with a
scheduler of its own (which adds ``initial_lr`` to the param groups), then restores the checkpoint. The
restore used to fail in torch.distributed.checkpoint ("Missing key in checkpoint state_dict:
optimizer_0.param_groups.layers.0.weight.initial_lr"); now the learning rates tried, the suggestion and
the fit after it equal one process's."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.tuner import Tuner

from lightning_twobp import TwoBPStrategy
from lightning_twobp.processes import run_distributed

from conftest import AdamRegressor, lightning_env, quiet_trainer, regression_data

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _tune_and_fit(strategy, devices: int, root: str) -> dict:
    model = AdamRegressor()
    trainer = quiet_trainer(strategy, devices, max_steps=3, default_root_dir=root)
    found = Tuner(trainer).lr_find(model, regression_data(n=128), num_training=10, max_lr=0.1, update_attr=True)
    out = {"lrs": found.results["lr"], "losses": found.results["loss"], "lr": model.lr}
    trainer.fit(model, regression_data(n=32))
    out["params"] = {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}
    return out


def _ranks(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    return _tune_and_fit(TwoBPStrategy(schedule="1f1b"), world, root)


def test_lr_find_restores_and_matches_one_process(tmp_path, no_leftover_process_group):
    ref = _tune_and_fit("auto", 1, str(tmp_path / "one"))
    outs = run_distributed(_ranks, 2, str(tmp_path / "pipelined"), timeout=240)
    for out in outs:
        assert out["lrs"] == pytest.approx(ref["lrs"])
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-4)
        assert out["lr"] == pytest.approx(ref["lr"])
        for name, value in out["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-6)
    assert set(outs[0]["params"]) | set(outs[1]["params"]) == set(ref["params"])
    assert not list(tmp_path.rglob(".lr_find*"))  # its checkpoint removed, as one process removes it
