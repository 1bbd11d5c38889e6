"""Checkpoints of sharded stages (``data_parallel="shard"``, issue 22): each rank writes its DTensor
shards through torch.distributed.checkpoint, under the same manifest and atomic swap as replicated
checkpoints, and a run resumes from them on any layout. pp2 x dp2 sharded, saved at step 2, resumed:
sharded again (parameters and momentum bitwise those of the uninterrupted run), sharded under the
V's other cut, replicated (the shards read back as whole tensors), on four pipeline ranks with one
replica (each stage's tensors gathered from two ranks' shards) and in one process; the step-4
checkpoint consolidates to one file, and refuses a changed shard by name. In the same launch, HF GPT-2
under ZB-V sharded (its tied wte / lm_head two copies on pipeline rank 0) resumes under ZB-V
(bitwise), ZB-H1 and in one process."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning import checkpoint as ckpt
from lightning_twobp.lightning.checkpoint import MANIFEST, CheckpointError, consolidate, verify
from lightning_twobp.processes import run_distributed

from conftest import Regressor, lightning_env, quiet_trainer, regression_data

pytestmark = pytest.mark.dist


class Momentum(Regressor):
    """SGD with momentum: its state is one buffer per parameter, sharded with the parameter. Four
    Linear layers, so that four pipeline ranks each hold one."""

    def __init__(self) -> None:
        super().__init__(widths=(6, 16, 16, 16, 2))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


class Final(pl.Callback):
    """Each step's loss, and at the end of training (before teardown gathers the stages) this rank's
    momentum buffers by parameter name: local shards under "shard", whole tensors otherwise."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.momentum: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])

    def on_train_end(self, trainer, pl_module):
        names = {id(q): n for n, q in pl_module.named_parameters()}
        opt = trainer.optimizers[0]
        self.momentum = {names[id(q)]: _local(st["momentum_buffer"]) for q, st in opt.state.items()}


def _fit(
    world: int, mode: str, max_steps: int, folder: str | None = None, ckpt: str | None = None, gpt2: bool = False, **kw
) -> dict:
    """``gpt2``: Hugging Face GPT-2 (tied wte / lm_head) on tokens in place of the regressor."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_sharded import TinyGPT2, _tokens  # a test module beside this one (as conftest is)

    final = Final()
    callbacks: list[pl.Callback] = [final]
    if folder is not None:
        callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1))
    model = TinyGPT2() if gpt2 else Momentum()
    kw = {"schedule": "zb-h1", "pipeline_degree": min(world, 2), **kw}
    replicas = world // kw["pipeline_degree"]
    strategy = TwoBPStrategy(data_parallel=mode, **kw)
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=max_steps,
        limit_train_batches=2,  # checkpoints at epoch ends: the data resumes at an epoch's start
        enable_checkpointing=folder is not None,
        callbacks=callbacks,
        use_distributed_sampler=True,  # shuffled by Lightning's DistributedSampler (seed 0 + epoch)
    )
    data = _tokens() if gpt2 else regression_data()
    trainer.fit(model, data if replicas > 1 else _as_replicas_read_epoch_1(data), ckpt_path=ckpt)
    params = {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}
    tied = not gpt2 or model.model.lm_head.weight is model.model.transformer.wte.weight
    return {"params": params, "momentum": final.momentum, "losses": final.losses, "tied": tied}


def _as_replicas_read_epoch_1(loader: DataLoader) -> DataLoader:
    """One replica's batches of 16 in the resumed epoch (1): each step's two replicas' 8 samples, as
    DistributedSampler(shuffle=True, seed=0) gives replica d the samples ``randperm(64)[d::2]`` with the
    generator seeded by seed + epoch."""
    tensors = loader.dataset.tensors
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    order = torch.cat([torch.cat([perm[0::2][i * 8 : (i + 1) * 8], perm[1::2][i * 8 : (i + 1) * 8]]) for i in range(4)])
    return DataLoader(TensorDataset(*(t[order] for t in tensors)), batch_size=16)


def _runs(rank: int, world: int, folder: str) -> dict:
    lightning_env(rank, world)
    straight = _fit(world, "shard", 4, folder=f"{folder}/straight")
    step2 = f"{folder}/straight/epoch=0-step=2.ckpt"
    return {
        "straight": straight,
        "sharded": _fit(world, "shard", 4, ckpt=step2),
        "replicated": _fit(world, "replicate", 4, ckpt=step2),
        # the V: 4 stages, two per rank, cut elsewhere; each DTensor reads its rows of the saved shards
        "v": _fit(world, "shard", 4, ckpt=step2, schedule="zb-v"),
        # pp4 x dp1: one stage (a Linear) per rank, whole tensors from the pp2 stages' shards
        "pp4": _fit(world, "replicate", 4, ckpt=step2, pipeline_degree=4, balance=[1, 2, 2, 2]),
        # GPT-2 under the V: its tied wte / lm_head are two copies on pipeline rank 0, both saved; resumed
        # under the V again and under ZB-H1 (the tie across ranks 0 and 1, each reading its own name)
        **_gpt2_runs(world, folder),
    }


def _gpt2_runs(world: int, folder: str) -> dict:
    straight = _fit(world, "shard", 4, folder=f"{folder}/gpt2", gpt2=True, schedule="zb-v")
    step2 = f"{folder}/gpt2/epoch=0-step=2.ckpt"
    return {
        "gpt2_straight": straight,
        "gpt2_v": _fit(world, "shard", 4, ckpt=step2, gpt2=True, schedule="zb-v"),
        "gpt2_h1": _fit(world, "shard", 4, ckpt=step2, gpt2=True, schedule="zb-h1"),
    }


def _one_process(rank: int, world: int, folder: str) -> dict:
    lightning_env(rank, world)
    return {
        "momentum": _fit(world, "replicate", 4, ckpt=f"{folder}/straight/epoch=0-step=2.ckpt", num_microbatches=2),
        "gpt2": _fit(world, "replicate", 4, ckpt=f"{folder}/gpt2/epoch=0-step=2.ckpt", num_microbatches=2, gpt2=True),
    }


def _tied_phase(rank: int, world: int, folder: str, phase: str) -> str:
    lightning_env(rank, world)
    if phase == "save":
        _fit(world, "replicate", 2, folder=folder, gpt2=True, num_microbatches=2)
        return "saved"
    try:
        _fit(world, "replicate", 4, ckpt=f"{folder}/epoch=0-step=2.ckpt", gpt2=True)
    except CheckpointError as e:
        return str(e)
    return "resumed"


def test_a_tied_weights_state_saved_under_its_other_name_is_refused_not_restarted(tmp_path):
    """One process keys GPT-2's tied wte / lm_head optimizer state by wte's name only; a pipeline's last stage holds
    lm_head as a copy of its own, whose momentum was read as nothing and restarted from zero, silently (a review:
    6.1e-2 off the uninterrupted run). Refused on every rank, naming it."""
    run_distributed(_tied_phase, 1, str(tmp_path), "save", timeout=300)
    for out in run_distributed(_tied_phase, 2, str(tmp_path), "resume", timeout=300):
        assert "Missing key(s) in its optimizer state" in out and "model.lm_head.weight" in out, out


def _whole(results: list[dict], run: str, key: str, shards: bool) -> dict[str, torch.Tensor]:
    """Every parameter's whole tensor from a pp2 x dp2 run (rank d * 2 + r is pipeline rank r of
    replica d); ``shards``: the replicas' local shards joined along dim 0 (FSDP2's ``torch.chunk`` layout)."""
    out = {}
    for r in (0, 1):
        for name, value in results[r][run][key].items():
            out[name] = torch.cat([value, results[r + 2][run][key][name]]) if shards else value
    return out


def _check_bitwise(results: list[dict], straight_run: str, resumed_run: str) -> None:
    """Resumed sharded on the layout it saved: parameters, momentum shards and losses bitwise those of
    the uninterrupted run."""
    for rank, res in enumerate(results):
        straight, resumed = res[straight_run], res[resumed_run]
        assert sorted(resumed["losses"]) == [3, 4]
        for step, loss in resumed["losses"].items():
            assert loss == straight["losses"][step], f"rank {rank}: step {step}'s loss differs after resuming"
        assert set(resumed["momentum"]) == set(straight["momentum"]) and straight["momentum"]
        for name, value in straight["momentum"].items():
            if name in straight["params"]:  # (not a tied copy's second name)
                assert value.shape[0] < straight["params"][name].shape[0], f"{name}: the momentum is a shard"
            assert torch.equal(resumed["momentum"][name], value), f"rank {rank}: momentum of {name} differs"
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), f"rank {rank}: {name} differs after resuming"


def _check_gpt2(results: list[dict], one: dict) -> None:
    """GPT-2 under ZB-V sharded, saved at step 2 with its tied weight as two copies on pipeline rank 0
    (each with its momentum), resumed: under ZB-V bitwise; under ZB-H1 (the tie across two ranks) and
    in one process (one tied Parameter) close; the model tied again after every call."""
    wte, head = "model.transformer.wte.weight", "model.lm_head.weight"
    assert all(res[run]["tied"] for res in results for run in ("gpt2_straight", "gpt2_v", "gpt2_h1")) and one["tied"]
    _check_bitwise(results, "gpt2_straight", "gpt2_v")
    for rank in (0, 2):  # pipeline rank 0 holds the first and the last stage: both copies, equal
        copies = results[rank]["gpt2_straight"]["momentum"]
        assert torch.equal(copies[wte], copies[head]), f"rank {rank}"
    params = _whole(results, "gpt2_straight", "params", False)
    momentum = _whole(results, "gpt2_straight", "momentum", True)
    assert {wte, head} <= set(momentum)
    h1_params = _whole(results, "gpt2_h1", "params", False)
    h1_momentum = _whole(results, "gpt2_h1", "momentum", True)
    assert set(h1_params) == set(params) == set(one["params"]) and set(h1_momentum) == set(momentum)
    for name, value in params.items():
        torch.testing.assert_close(h1_params[name], value, rtol=1e-5, atol=1e-6, msg=f"zb-h1 {name}")
        torch.testing.assert_close(one["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"one process {name}")
    for name, value in momentum.items():
        torch.testing.assert_close(h1_momentum[name], value, rtol=1e-5, atol=1e-6, msg=f"zb-h1 {name}")
    for name, value in one["momentum"].items():  # the one tied Parameter's under its first name
        torch.testing.assert_close(value, momentum[name], rtol=1e-5, atol=1e-6, msg=f"one process {name}")
    assert wte in one["momentum"]


def test_sharded_checkpoints_resume_sharded_replicated_and_in_one_process(tmp_path):
    results = run_distributed(_runs, 4, str(tmp_path), timeout=600)
    step2 = tmp_path / "straight" / "epoch=0-step=2.ckpt"
    manifest = json.loads((step2 / MANIFEST).read_text())
    assert manifest["layout"]["data_parallel"] == "shard" and manifest["layout"]["dp_degree"] == 2
    assert {name.split("_")[2] for name in manifest["files"] if name.startswith("__")} == {"0", "1", "2", "3"}
    _check_bitwise(results, "straight", "sharded")  # sharded -> sharded
    # after the Trainer call every rank holds its stages' whole parameters again; the momentum stays sharded
    params, momentum = _whole(results, "straight", "params", False), _whole(results, "straight", "momentum", True)
    # sharded -> replicated (same pp2 x dp2): the shards read back as whole tensors, on both replicas
    for rank, res in enumerate(results):
        for name, value in res["replicated"]["params"].items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        for name, value in res["replicated"]["momentum"].items():
            torch.testing.assert_close(value, momentum[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    # sharded -> sharded under another cut (the V)
    v, v_momentum = _whole(results, "v", "params", False), _whole(results, "v", "momentum", True)
    assert set(v) == set(params) == set(v_momentum)
    for name, value in v.items():
        torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=f"zb-v {name}")
        torch.testing.assert_close(v_momentum[name], momentum[name], rtol=1e-5, atol=1e-6, msg=f"zb-v {name}")
    # sharded pp2 x dp2 -> replicated pp4 x dp1: each rank's one stage, whole
    pp4 = {n: v for res in results for n, v in res["pp4"]["params"].items()}
    pp4_momentum = {n: v for res in results for n, v in res["pp4"]["momentum"].items()}
    assert set(pp4) == set(params) == set(pp4_momentum)
    assert all(len(res["pp4"]["params"]) == 2 for res in results), "one Linear (weight, bias) per rank"
    for name, value in pp4.items():
        torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=f"pp4 {name}")
        torch.testing.assert_close(pp4_momentum[name], momentum[name], rtol=1e-5, atol=1e-6, msg=f"pp4 {name}")
    # sharded -> one process: every stage's shards into one model
    (both,) = run_distributed(_one_process, 1, str(tmp_path), timeout=300)
    _check_gpt2(results, both["gpt2"])
    one = both["momentum"]
    assert set(one["params"]) == set(params) == set(one["momentum"])
    for name in params:
        torch.testing.assert_close(one["params"][name], params[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(one["momentum"][name], momentum[name], rtol=1e-5, atol=1e-6, msg=name)
    # the step-4 checkpoint of sharded stages merges into one ordinary Lightning checkpoint
    step4 = Path(tmp_path / "straight" / "epoch=1-step=4.ckpt")
    merged = consolidate(step4, tmp_path / "full.ckpt")["state_dict"]
    assert set(merged) == set(params)
    for name, value in params.items():
        assert torch.equal(merged[name], value), name
    assert sorted(os.listdir(tmp_path / "straight")) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    # a replica's shard changed after the save: refused by name, as any checkpoint's file
    shard = sorted(step4.glob("__3_*"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: its SHA-256 differs from the manifest's"):
        verify(step4, shared=False)


def _crash(rank: int, world: int, folder: str) -> None:
    """Rank 3 (pipeline rank 1 of replica 1) is SIGKILLed as the second save (step 4) starts to write
    its shards."""
    lightning_env(rank, world)
    if rank == 3:
        original, calls = ckpt._write_shards, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        ckpt._write_shards = dying
    _fit(world, "shard", 4, folder=folder)


def _straight_and_resumed(rank: int, world: int, ckpt_path: str) -> dict:
    lightning_env(rank, world)
    return {"straight": _fit(world, "shard", 4), "resumed": _fit(world, "shard", 4, ckpt=ckpt_path)}


def test_a_replica_killed_during_a_sharded_save_is_named_and_the_previous_checkpoint_resumes(tmp_path):
    """One replica's rank dies while the step-4 save writes: the others name it, nothing hidden is left,
    and the step-2 checkpoint resumes to the uninterrupted run's weights and momentum, bitwise."""
    with pytest.raises(Exception) as info:  # noqa: B017 the killed rank's exit, and its peers' lost connection
        run_distributed(_crash, 4, str(tmp_path), timeout=180)
    lost = "was not saved: a rank was lost during the save: global rank 3 (pipeline rank 1, stage(s) 1, host "
    assert lost in str(info.value), info.value
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt"]
    results = run_distributed(_straight_and_resumed, 4, str(tmp_path / "epoch=0-step=2.ckpt"), timeout=300)
    for rank, res in enumerate(results):
        straight, resumed = res["straight"], res["resumed"]
        for key in ("params", "momentum"):
            assert set(resumed[key]) == set(straight[key]) and straight[key]
            for name, value in straight[key].items():
                assert torch.equal(resumed[key][name], value), f"rank {rank}: {key} of {name} differs"
