"""Checkpoints that survive the way jobs really die: a rank killed with SIGKILL at each point of a save
leaves a checkpoint that resumes to the uninterrupted run's weights, bitwise; a damaged checkpoint is
refused by name, before anything is loaded."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning import checkpoint as ckpt
from lightning_twobp.testing import run_distributed

from conftest import Regressor, lightning_env, quiet_trainer, regression_data

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # an end-to-end run: last (conftest.py)


def _net() -> Regressor:
    return Regressor(optimizer=torch.optim.Adam, lr=0.01, log=False)


def _data() -> DataLoader:
    return regression_data(16)


def _fit(world: int, folder: str, max_steps: int = 4, ckpt_path: str | None = None, save: bool = True) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    cbs = [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, save_last=True)] if save else []
    model = _net()
    trainer = quiet_trainer(
        TwoBPStrategy(schedule="1f1b"), world, callbacks=cbs, enable_checkpointing=save, max_steps=max_steps
    )  # 2 steps an epoch
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return {
        "step": trainer.global_step,
        "weights": {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta},
    }


# Where to die: (function of lightning_twobp.lightning.checkpoint, rank, before or after it runs).
# The fourth save is last.ckpt at step 4; the three before it (step 2's two, step 4's epoch file) complete.
POINTS = {
    "between-shards": ("_write_shards", 1, "before"),  # rank 0 writes its shard, rank 1 never does
    "after-dcp-metadata": ("_write_meta", 0, "before"),  # every shard and .metadata, no meta.pt
    "before-manifest": ("_write_manifest", 0, "before"),  # meta.pt too, no manifest
    "mid-rename": ("os.rename", 0, "mid"),  # the two-rename fallback, killed between the renames
    "after-exchange": ("_exchange", 0, "after"),  # the atomic exchange done, the old copy not yet removed
}


def _die_at(point: str, rank: int) -> None:
    if point not in POINTS:
        return
    name, who, when = POINTS[point]
    if rank != who:
        return
    calls = {"n": 0}
    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if when == "before":
        original = getattr(ckpt, name)

        def wrapped(*a, **k):
            calls["n"] += 1
            if calls["n"] == 4:
                kill()
            return original(*a, **k)

        setattr(ckpt, name, wrapped)
    elif when == "mid":
        ckpt._exchange = lambda a, b: False  # a filesystem without renameat2(RENAME_EXCHANGE)
        rename = os.rename

        def renaming(src, dst):
            rename(src, dst)
            if Path(dst).name == ".last.ckpt.old" and Path(src).name == "last.ckpt":
                calls["n"] += 1
                kill()  # last.ckpt moved aside, the new one not yet in place

        ckpt.os.rename = renaming
    else:
        exchange = ckpt._exchange

        def exchanging(a, b):
            done = exchange(a, b)
            if done and Path(b).name == "last.ckpt":
                kill()
            return done

        ckpt._exchange = exchanging


def _crash(rank: int, world: int, folder: str, point: str) -> None:
    lightning_env(rank, world)
    _die_at(point, rank)
    _fit(world, folder)


def _resume_all(rank: int, world: int, root: str, points: list[str]) -> dict:
    lightning_env(rank, world)
    out = {"straight": _fit(world, f"{root}/straight")}
    for point in points:
        out[point] = _fit(world, f"{root}/{point}", ckpt_path=f"{root}/{point}/last.ckpt", save=False)
    try:
        _fit(world, f"{root}/flipped", ckpt_path=f"{root}/flipped", save=False)
    except ckpt.CheckpointError as err:
        out["flipped"] = str(err)
    return out


def test_kill_9_during_a_save_leaves_a_checkpoint_that_resumes_exactly(tmp_path):
    for point in POINTS:
        with pytest.raises(Exception):  # noqa: B017 the killed rank's exit, and its peer's lost connection
            run_distributed(_crash, 2, str(tmp_path / point), point, timeout=120)
    states = {p: sorted(x.name for x in (tmp_path / p).iterdir()) for p in POINTS}
    assert ".last.ckpt.partial" in states["between-shards"], states  # what the crash left behind
    assert "last.ckpt" not in states["mid-rename"] and ".last.ckpt.partial" in states["mid-rename"], states
    # a complete checkpoint, one bit flipped in a shard: refused by name on every rank
    flipped = tmp_path / "flipped"
    shutil.copytree(tmp_path / "before-manifest" / "epoch=0-step=2.ckpt", flipped)
    shard = sorted(flipped.glob("__1_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))

    with pytest.warns(UserWarning, match="reading the complete checkpoint"):
        ckpt.resolve(tmp_path / "mid-rename" / "last.ckpt")
    results = run_distributed(_resume_all, 2, str(tmp_path), list(POINTS), timeout=240)
    for rank, out in enumerate(results):
        straight = out["straight"]
        assert straight["step"] == 4
        for point in POINTS:
            assert out[point]["step"] == 4, point
            for name, value in straight["weights"].items():
                assert torch.equal(out[point]["weights"][name], value), f"{point}: rank {rank} {name} differs"
        assert shard.name in out["flipped"] and "SHA-256" in out["flipped"], out["flipped"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One complete checkpoint, written by two ranks."""
    root = tmp_path_factory.mktemp("ckpt")
    run_distributed(_crash, 2, str(root / "run"), "nobody dies", timeout=120)
    return root / "run" / "last.ckpt"


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest", "extra-byte"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, damage):
    bad = tmp_path / "bad.ckpt"
    shutil.copytree(saved, bad)
    manifest = ckpt.verify(bad, shared=False)  # the intact copy passes
    assert set(manifest["files"]) >= {".metadata", "meta.pt"}
    shard = sorted(bad.glob("__0_*.distcp"))[0]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
        match = rf"{shard.name}: 100 bytes, the manifest says"
    elif damage == "delete":
        (bad / "meta.pt").unlink()
        match = r"meta.pt: missing"
    elif damage == "manifest":
        (bad / ckpt.MANIFEST).unlink()
        match = r"has no twobp-manifest.json: it was not written completely"
    else:
        shard.write_bytes(shard.read_bytes() + b"\0")
        match = rf"{shard.name}: \d+ bytes, the manifest says"
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.verify(bad, shared=False)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.consolidate(bad, tmp_path / "out.ckpt")


def test_a_consolidated_checkpoint_loads_with_weights_only(saved, tmp_path):
    merged = ckpt.consolidate(saved, tmp_path / "full.ckpt")
    assert merged["global_step"] == 4
    again = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert set(again["state_dict"]) == {n for n, _ in _net().named_parameters()}
