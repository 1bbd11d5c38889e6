"""Checkpoints that survive the way jobs really die: a rank killed with SIGKILL at each point of a save
leaves a checkpoint that resumes to the uninterrupted run's weights, bitwise; a damaged checkpoint is
refused by name, before anything is loaded."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch

from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning import checkpoint as ckpt
from lightning_twobp.processes import run_distributed

import conftest
from conftest import (
    AdamRegressor,
    Regressor,
    checkpointing_trainer,
    launch,
    lightning_env,
    own_weights,
    quiet_trainer,
    regression_data,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]  # a fixture runs the launches: the first test waits


def _fit(world: int, folder: str, max_steps: int = 4, ckpt_path: str | None = None, save: bool = True) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    cbs = [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, save_last=True)] if save else []
    model = AdamRegressor()
    trainer = checkpointing_trainer(world, max_steps, cbs)
    trainer.fit(model, regression_data(n=16), ckpt_path=ckpt_path)  # 2 steps an epoch
    return {"step": trainer.global_step, "weights": own_weights(model)}


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


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict:
    """A launch killed at each point of a save (each its own launch: a rank of it dies), what the other
    rank said, what each left on disk, and what reading the interrupted rename warns."""
    root = tmp_path_factory.mktemp("crashed")
    seen = {}
    for point in POINTS:
        with pytest.raises(Exception) as info:  # noqa: B017 the killed rank's exit, and its peer's lost connection
            run_distributed(_crash, 2, str(root / point), point, timeout=120)
        seen[point] = str(info.value)
    states = {p: sorted(x.name for x in (root / p).iterdir()) for p in POINTS}
    # a complete checkpoint, one bit flipped in a shard
    flipped = root / "flipped"
    shutil.copytree(root / "before-manifest" / "epoch=0-step=2.ckpt", flipped)
    shard = sorted(flipped.glob("__1_*.distcp"))[0]
    _flip(shard)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        ckpt.resolve(root / "mid-rename" / "last.ckpt")
    return {"root": root, "seen": seen, "states": states, "shard": shard.name, "warned": warned}


def test_kill_9_during_a_save_leaves_a_checkpoint_that_resumes_exactly(two_ranks, crashed):
    seen, states = crashed["seen"], crashed["states"]
    # rank 1 killed as it starts writing: rank 0 names it, and removes the hidden partial checkpoint
    assert (
        "was not saved: a rank was lost during the save: global rank 1 (pipeline rank 1, stage(s) 1, host "
        in seen["between-shards"]
    ), seen
    assert ".last.ckpt.partial" not in states["between-shards"], states
    assert "last.ckpt" not in states["mid-rename"] and ".last.ckpt.partial" in states["mid-rename"], states
    warned = [w for w in crashed["warned"] if issubclass(w.category, UserWarning)]
    assert any("reading the complete checkpoint" in str(w.message) for w in warned), warned
    for rank, out in enumerate(two_ranks[KILL]):
        straight = out["straight"]
        assert straight["step"] == 4
        for point in POINTS:
            assert out[point]["step"] == 4, point
            for name, value in straight["weights"].items():
                assert torch.equal(out[point]["weights"][name], value), f"{point}: rank {rank} {name} differs"
        # the flipped bit: refused by name on every rank
        assert crashed["shard"] in out["flipped"] and "SHA-256" in out["flipped"], out["flipped"]


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
    assert set(again["state_dict"]) == {n for n, _ in AdamRegressor().named_parameters()}


class Shorter(Regressor):
    """The saved model without its last layer: the checkpoint holds two weights it does not have."""

    def __init__(self) -> None:
        super().__init__(optimizer=torch.optim.Adam, lr=0.01, log=False)
        self.layers = self.layers[:3]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.layers(x)[:, :2].pow(2).mean()


def _load_into_shorter(rank: int, world: int, saved: str) -> dict:
    lightning_env(rank, world)
    out = {}
    for strict in (True, False):
        model = Shorter()
        model.strict_loading = strict
        trainer = quiet_trainer(TwoBPStrategy(schedule="1f1b"), world, max_steps=5)
        try:
            trainer.fit(model, regression_data(n=16), ckpt_path=saved)
            out[strict] = trainer.global_step
        except ckpt.CheckpointError as err:
            out[strict] = str(err)
    return out


def test_a_checkpoint_with_weights_the_model_lacks_is_refused_unless_strict_loading_is_off(two_ranks):
    for out in two_ranks[SHORTER]:
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


def _fill_the_disk(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
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


def test_a_full_disk_is_named_and_leaves_nothing_hidden(two_ranks, full_disk):
    tmp_path = full_disk
    for out in two_ranks[DISK]:
        for case in ("meta", "shard"):
            assert "was not saved: the disk is full" in out[case], (case, out[case])
            # no last.ckpt was saved before this one: nothing is said to be intact
            assert "The partial one was removed" in out[case] and "previous" not in out[case], out[case]
    for case in ("meta", "shard"):
        left = sorted(p.name for p in (tmp_path / case).iterdir())
        assert left == ["epoch=0-step=2.ckpt"], left  # no .last.ckpt.partial
        ckpt.verify(tmp_path / case / "epoch=0-step=2.ckpt", shared=False)


def _save_after_another_layout(rank: int, world: int, root: str) -> dict:
    """Fit with ZB-V (two stages a rank), validate with another Trainer under 1F1B (one), then save with the
    first: the second call replaced layers the first one's optimizer steps."""
    lightning_env(rank, world)
    model = AdamRegressor()
    first = quiet_trainer(TwoBPStrategy(schedule="zb-v", gather_full_model=True), world, max_steps=2)
    first.fit(model, regression_data(n=16))
    quiet_trainer(TwoBPStrategy(gather_full_model=True), world).validate(model, regression_data(n=16), verbose=False)
    out = {}
    try:
        first.save_checkpoint(f"{root}/full.ckpt")
        out["full"] = "saved"
    except ckpt.CheckpointError as err:
        out["full"] = str(err)
    first.save_checkpoint(f"{root}/weights.ckpt", weights_only=True)
    out["weights"] = {n: q.detach().clone() for n, q in model.named_parameters()}
    try:  # resuming a fit from the weights alone is refused by Lightning, as in one process
        quiet_trainer(TwoBPStrategy(), world, max_steps=4).fit(
            AdamRegressor(), regression_data(n=16), ckpt_path=f"{root}/weights.ckpt"
        )
        out["resumed"] = "resumed"
    except KeyError as err:
        out["resumed"] = str(err)
    return out


def test_a_save_after_another_layouts_call_is_refused_naming_the_weights_only_save(two_ranks, another_layout):
    """A Trainer's optimizer, after another Trainer's call with another layout replaced layers it steps: the
    save is refused on every rank before anything is written (torch's bare KeyError on some ranks, the others
    waiting), naming the fix; saved with weights_only=True, the checkpoint holds the weights alone, as one
    process's does, and a fit resumed from it is refused by Lightning."""
    for out in two_ranks[ANOTHER_LAYOUT]:
        assert "checkpoint" in out["full"] and "no longer the model's" in out["full"], out["full"]
        assert "weights_only=True" in out["full"] and "previous checkpoint" not in out["full"], out["full"]
        assert "contains only the model" in out["resumed"], out["resumed"]
    assert not (another_layout / "full.ckpt").exists()
    saved = ckpt.dcp.FileSystemReader(another_layout / "weights.ckpt").read_metadata().state_dict_metadata
    assert saved and not [k for k in saved if k.startswith("optimizer_")], sorted(saved)
    merged = ckpt.consolidate(another_layout / "weights.ckpt", another_layout / "merged.ckpt")["state_dict"]
    whole = two_ranks[ANOTHER_LAYOUT][0]["weights"]  # gather_full_model: every rank holds the whole model
    assert set(merged) == set(whole) and all(torch.equal(merged[n], whole[n]) for n in whole)


KILL = "test_kill_9_during_a_save_leaves_a_checkpoint_that_resumes_exactly"
ANOTHER_LAYOUT = "test_a_save_after_another_layouts_call_is_refused_naming_the_weights_only_save"
SHORTER = "test_a_checkpoint_with_weights_the_model_lacks_is_refused_unless_strict_loading_is_off"
DISK = "test_a_full_disk_is_named_and_leaves_nothing_hidden"


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("full-disk")


@pytest.fixture(scope="module")
def another_layout(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("another-layout")


@pytest.fixture(scope="module")
def two_ranks(request, saved, full_disk, another_layout) -> conftest.Launch:
    """The runs that end on every rank alike, in one launch of 2 ranks (the killed ones are ``crashed``'s):
    resuming from each crash (those only when their test runs), loading into a shorter model, a full disk,
    a save after another layout's call."""
    cases = {
        SHORTER: (_load_into_shorter, (str(saved),)),
        DISK: (_fill_the_disk, (str(full_disk),)),
        ANOTHER_LAYOUT: (_save_after_another_layout, (str(another_layout),)),
    }
    if KILL in conftest.wanted(request):
        cases[KILL] = (_resume_all, (str(request.getfixturevalue("crashed")["root"]), list(POINTS)))
    return launch(request, 2, cases, timeout=600)
