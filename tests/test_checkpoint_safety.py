"""Checkpoints that survive the way jobs really die: a rank killed with SIGKILL at each point of a save
leaves a checkpoint that resumes to the uninterrupted run's weights, bitwise; a damaged checkpoint is
refused by name, before anything is loaded."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning import checkpoint as ckpt
from lightning_twobp.testing import free_port, rank_env, run_distributed

from conftest import lightning_env

pytestmark = pytest.mark.dist


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)), batch_size=8)


def _env(rank: int, world: int) -> None:
    lightning_env(rank, world)  # the port run_distributed's process group already uses


def _trainer(world: int, max_steps: int, callbacks: list, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=TwoBPStrategy(schedule="1f1b"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        max_steps=max_steps,
        **kw,
    )


def _fit(world: int, folder: str, max_steps: int = 4, ckpt_path: str | None = None, save: bool = True) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    cbs = [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, save_last=True)] if save else []
    model = Net()
    trainer = _trainer(world, max_steps, cbs)  # 2 steps an epoch
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
    _env(rank, world)
    _die_at(point, rank)
    _fit(world, folder)


def _resume_all(rank: int, world: int, root: str, points: list[str]) -> dict:
    _env(rank, world)
    out = {"straight": _fit(world, f"{root}/straight")}
    for point in points:
        out[point] = _fit(world, f"{root}/{point}", ckpt_path=f"{root}/{point}/last.ckpt", save=False)
    try:
        _fit(world, f"{root}/flipped", ckpt_path=f"{root}/flipped", save=False)
    except ckpt.CheckpointError as err:
        out["flipped"] = str(err)
    return out


def test_kill_9_during_a_save_leaves_a_checkpoint_that_resumes_exactly(tmp_path):
    seen = {}
    for point in POINTS:
        with pytest.raises(Exception) as info:  # noqa: B017 the killed rank's exit, and its peer's lost connection
            run_distributed(_crash, 2, str(tmp_path / point), point, timeout=120)
        seen[point] = str(info.value)
    states = {p: sorted(x.name for x in (tmp_path / p).iterdir()) for p in POINTS}
    # rank 1 killed as it starts writing: rank 0 names it, and removes the hidden partial checkpoint
    assert "was not saved: a rank was lost during the save: global rank 1 (pid " in seen["between-shards"], seen
    assert ".last.ckpt.partial" not in states["between-shards"], states
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


def _rewrite_manifest(folder: Path, keep) -> None:
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    manifest["files"] = {n: e for n, e in manifest["files"].items() if keep(n)}
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


DAMAGES = ["truncate", "delete", "manifest", "extra-byte", "list-emptied", "list-shortened", "shard-and-entry-gone"]


@pytest.mark.parametrize("damage", DAMAGES)
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
    elif damage == "extra-byte":
        shard.write_bytes(shard.read_bytes() + b"\0")
        match = rf"{shard.name}: \d+ bytes, the manifest says"
    elif damage in ("list-emptied", "list-shortened"):  # a flipped byte in a shard the list leaves out
        _flip(shard)
        _rewrite_manifest(bad, lambda n: damage == "list-shortened" and n != shard.name)
        match = rf"{shard.name}: not in the manifest, so it cannot be checked"
    else:  # the shard and its entry both gone: only DCP's metadata still names it
        shard.unlink()
        _rewrite_manifest(bad, lambda n: n != shard.name)
        match = rf"{shard.name}: named by .metadata but not in the manifest"
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.verify(bad, shared=False)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.consolidate(bad, tmp_path / "out.ckpt")


def test_a_consolidated_checkpoint_loads_with_weights_only(saved, tmp_path):
    merged = ckpt.consolidate(saved, tmp_path / "full.ckpt")
    assert merged["global_step"] == 4
    again = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert set(again["state_dict"]) == {n for n, _ in Net().named_parameters()}


class Shorter(Net):
    """Net without its last layer: the saved checkpoint holds two weights it does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*list(self.layers)[:3])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.layers(x)[:, :2].pow(2).mean()


def _load_into_shorter(rank: int, world: int, saved: str) -> dict:
    _env(rank, world)
    out = {}
    for strict in (True, False):
        model = Shorter()
        model.strict_loading = strict
        trainer = _trainer(world, 5, [])
        try:
            trainer.fit(model, _data(), ckpt_path=saved)
            out[strict] = trainer.global_step
        except ckpt.CheckpointError as err:
            out[strict] = str(err)
    return out


def test_a_checkpoint_with_weights_the_model_lacks_is_refused_unless_strict_loading_is_off(saved):
    for out in run_distributed(_load_into_shorter, 2, str(saved), timeout=120):
        assert 'Unexpected key(s) in state_dict: "layers.4.bias", "layers.4.weight"' in str(out[True]), out
        assert out[False] == 5, out  # strict_loading=False: loaded and trained on, as one process does


def _disk_full_on(case: str, rank: int) -> None:
    """The second save (last.ckpt at step 2) finds the disk full: rank 0 writing meta.pt with torch.save,
    or rank 1 writing its shard inside torch.distributed.checkpoint."""
    full = OSError(errno.ENOSPC, "No space left on device")
    if case == "meta" and rank == 0:
        original, calls = ckpt._write_meta, {"n": 0}

        def write_meta(*a, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                raise full
            return original(*a, **k)

        ckpt._write_meta = write_meta
    elif case == "shard" and rank == 1:
        original_write, calls = ckpt.dcp.FileSystemWriter.write_data, {"n": 0}

        def write_data(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                raise full
            return original_write(self, *a, **k)

        ckpt.dcp.FileSystemWriter.write_data = write_data


def _fill_the_disk(rank: int, world: int, port: int, root: str) -> dict:
    rank_env(rank, world, port)
    write_meta, write_data = ckpt._write_meta, ckpt.dcp.FileSystemWriter.write_data
    out = {}
    for case in ("meta", "shard"):
        _disk_full_on(case, rank)
        try:
            _fit(world, f"{root}/{case}")
            out[case] = "saved"
        except ckpt.CheckpointError as err:
            out[case] = str(err)
        finally:
            ckpt._write_meta, ckpt.dcp.FileSystemWriter.write_data = write_meta, write_data
    return out


def test_a_full_disk_is_named_and_leaves_nothing_hidden(tmp_path):
    for out in run_distributed(_fill_the_disk, 2, free_port(), str(tmp_path), timeout=180):
        for case in ("meta", "shard"):
            assert "was not saved: the disk is full" in out[case], (case, out[case])
            assert "The previous checkpoint at" in out[case] and "the partial one was removed" in out[case]
    for case in ("meta", "shard"):
        left = sorted(p.name for p in (tmp_path / case).iterdir())
        assert left == ["epoch=0-step=2.ckpt"], left  # no .last.ckpt.partial
        ckpt.verify(tmp_path / case / "epoch=0-step=2.ckpt", shared=False)
