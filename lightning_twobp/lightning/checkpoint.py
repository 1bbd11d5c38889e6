"""Checkpoints under ``strategy="twobp"``: save, load, consolidate.

A checkpoint is a directory written with ``torch.distributed.checkpoint``: each rank writes its own
stages' weights and optimizer state, keyed by the parameters' fully qualified names in the whole
model (``torch.distributed.checkpoint.state_dict``: ``get_model_state_dict`` and
``get_optimizer_state_dict`` with ``flatten_optimizer_state_dict=True``, which keys every parameter's
state *and* its param-group settings by name; loading reads every optimizer entry the checkpoint's metadata
lists for the rank's parameters, never stepping the fresh optimizer). Replicas are deduplicated; under
``data_parallel="shard"`` the parameters and their optimizer state are DTensors, which DCP writes
shard by shard (each replica its rows) and reads into whatever each rank holds at load: its rows
again, or whole tensors in a replicated or one-process run. The rest of Lightning's
checkpoint (loops, callbacks, schedulers, hyper-parameters) goes to ``meta.pt`` from rank 0.

Saving is crash-safe and loading verified. Every rank writes into a hidden sibling
``.NAME.partial``; rank 0 writes ``meta.pt`` and then ``twobp-manifest.json`` (the size and SHA-256 of
every file, each rank hashing its own shards) and renames the directory into place last. A process
killed at any point leaves the previous checkpoint at ``NAME`` (``last.ckpt`` included) or, in the
instant between the two renames, a complete one that :func:`resolve` finds. Loading checks every file
against the manifest first (the ranks share the hashing) and refuses a missing, truncated or changed
file by name; ``meta.pt`` loads with ``weights_only=True`` unless the caller says otherwise.

Because everything is keyed by name, a run resumes under another pipeline degree, schedule or cut:
each rank reads the entries of the parameters it holds now.

    twobp-consolidate CHECKPOINT_DIR OUT.ckpt

merges the stages into an ordinary Lightning checkpoint (``state_dict`` under the model's names,
plus the hyper-parameters, epoch and global step, without optimizer state), which the unpipelined
LightningModule loads with ``Model.load_from_checkpoint(OUT.ckpt)``.

    twobp-consolidate CHECKPOINT_DIR OUT_DIR --safetensors --prefix model [--max-shard-size 5GB]

writes the weights under the module ``model`` (the LightningModule's ``self.model``), that prefix
dropped, as Hugging Face safetensors (``OUT_DIR/model.safetensors``, or shards and their index over
``--max-shard-size``, one shard in memory at a time): with the model's ``config.json`` beside it,
``from_pretrained(OUT_DIR)`` loads the fine-tuned model, and ``TwoBPStrategy(pretrained=OUT_DIR)``
starts from it. For diffusers, add ``--weights-name diffusion_pytorch_model.safetensors``, the file its
``from_pretrained`` reads.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import glob
import hashlib
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_twobp.engine.failure import lost_peer
from lightning_twobp.private import collect_rng_states, set_rng_states

__all__ = [
    "CheckpointError",
    "MANIFEST",
    "consolidate",
    "cuda_states",
    "load",
    "main",
    "resolve",
    "rng_state",
    "save",
    "set_rng_state",
    "verify",
]

META = "meta.pt"  # Lightning's checkpoint without weights and optimizer state, from rank 0
MANIFEST = "twobp-manifest.json"  # size and SHA-256 of every other file; written last, it marks completion
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt or not ours: the message names the file and what is wrong."""


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")  # hidden: Lightning's "last*" lookup never sees it


def _old(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _entry(file: Path) -> dict[str, Any]:
    return {"size": file.stat().st_size, "sha256": _sha256(file)}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_to_zero(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    rank, world = _world()
    if world == 1:
        return [value]
    out = [None] * world if rank == 0 else None
    dist.gather_object(value, out, dst=0, group=group)
    return out or []


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _world()[1] > 1:
        dist.barrier(group=group)


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random states (Lightning's ``_collect_rng_states``: torch, CUDA, NumPy, Python)
    as tensors, so torch.distributed.checkpoint stores them per rank without pickling."""
    states = collect_rng_states(include_cuda=torch.cuda.is_available())
    out = {"torch": states["torch"]}
    for i, t in enumerate(states.get("torch.cuda", [])):
        out[f"cuda{i}"] = t
    version, words, gauss = states["python"]
    out["python"] = torch.tensor([version, *words], dtype=torch.int64)
    out["python_gauss"] = torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64)
    if "numpy" in states:
        _, key, pos, has_gauss, cached = states["numpy"]
        out["numpy"] = torch.tensor([*key.tolist(), pos, has_gauss], dtype=torch.int64)
        out["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    return out


def cuda_states(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The CUDA generators' states of :func:`rng_state`, in device order: ``cuda10`` after ``cuda9``, where
    sorting the names as text put it before ``cuda2`` (a host with more than ten GPUs resumed each device
    with another's stream)."""
    return [state[k] for k in sorted((k for k in state if k.startswith("cuda")), key=lambda k: int(k[4:]))]


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_state` took."""
    python = state["python"].tolist()
    gauss = float(state["python_gauss"][0])
    states: dict[str, Any] = {
        "torch": state["torch"],
        "python": (python[0], python[1:], None if gauss != gauss else gauss),
    }
    cuda = cuda_states(state)
    if cuda and torch.cuda.is_available():
        states["torch.cuda"] = cuda
    if "numpy" in state:
        import numpy as np

        words = state["numpy"].tolist()
        states["numpy"] = (
            "MT19937",
            np.array(words[:-2], dtype=np.uint32),
            words[-2],
            words[-1],
            float(state["numpy_gauss"][0]),
        )
    set_rng_states(states)


# Each step of a save is a function of its own, so a test can kill the process between any two of them.
def _write_shards(state: dict[str, Any], tmp: Path, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every rank writes its tensors (torch.distributed.checkpoint names rank r's files ``__r_*``) and
    hashes its own files while the others hash theirs.

    A tensor every data-parallel replica holds is written once, by the lowest rank holding it: replica 0's
    (its ranks are the lowest, ``Layout.global_rank_of``). DCP's default gives it to the rank with the least
    to write so far, any replica: equal for parameters, but a buffer each replica updates from the data it
    reads (a batch norm's running statistics, between the broadcasts from replica 0 before each step) came
    from replica 1 for one stage and replica 0 for another, and the resumed run's buffers were neither the
    uninterrupted run's nor the model the run validated (review 60). The price: replicas past the first
    write no replicated tensor, so a replicated save's writing is not spread over them."""
    dcp.save(state, checkpoint_id=tmp, process_group=group, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    rank = _world()[0]
    return {f.name: _entry(f) for f in sorted(tmp.glob(f"__{rank}_*")) if f.is_file()}


def _write_meta(checkpoint: dict[str, Any], tmp: Path) -> None:
    torch.save(checkpoint, tmp / META)


def _write_manifest(files: dict[str, Any], tmp: Path, layout: dict[str, Any]) -> None:
    files = {**files, ".metadata": _entry(tmp / ".metadata"), META: _entry(tmp / META)}
    body = json.dumps({"format": 1, "layout": layout, "files": files}, indent=1, sort_keys=True)
    with open(tmp / MANIFEST, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    for name in files:
        _fsync(tmp / name)
    _fsync(tmp)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically: ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+, glibc 2.28+, local
    filesystems); False where the system or the filesystem cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0  # AT_FDCWD, RENAME_EXCHANGE


def _swap_into_place(tmp: Path, path: Path) -> None:
    """The complete checkpoint at ``tmp`` replaces ``path``. Where the filesystem can, in one atomic
    exchange: ``path`` holds the previous checkpoint or the new one at every instant. Elsewhere in
    two renames (a directory cannot be renamed over a non-empty one): a crash between them leaves
    ``path`` missing and the new checkpoint complete under its hidden name, which :func:`resolve` reads."""
    old = _old(path)
    _rmtree(old)
    if path.exists() or path.is_symlink():
        if _exchange(tmp, path):
            _fsync(path.parent)
            _rmtree(tmp)  # now the previous checkpoint
            return
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync(path.parent)
    _rmtree(old)


def save(
    checkpoint: dict[str, Any],
    path: Path,
    module: nn.Module,
    optimizers: list[Any],
    layout: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    streams: dict[str, dict[str, torch.Tensor]] | None = None,
    lost: Callable[[], str] | None = None,
) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a sharded directory at ``path``; every rank calls it.
    ``group``: the process group of its collectives (the world's by default; the strategy passes one
    whose timeout covers writing and hashing a large checkpoint). ``streams``: this rank's stages'
    random streams, by name (:meth:`~.rng.StageStreams.state_dict`), stored beside the rank's own.
    ``lost``: names the ranks whose process is gone, for the error when one is lost during the save.

    Crash-safe: everything goes into the hidden sibling ``.NAME.partial``; rank 0 writes the
    Lightning metadata and a manifest (size and SHA-256 of every file) last, then renames the
    directory into place. Until that rename ``path`` holds the previous checkpoint untouched. A save
    that fails (a full disk, a lost rank) raises :class:`CheckpointError` on every rank saying which,
    and removes the hidden directory."""
    rank, _ = _world()
    path = Path(path)
    tmp = _partial(path)
    try:
        _save(checkpoint, path, tmp, module, optimizers, layout, group, streams)
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        if rank == 0:
            _rmtree(tmp)  # nothing hidden left behind; the previous checkpoint stays at ``path``
        raise CheckpointError(_why_not_saved(err, path, lost)) from err


def _why_not_saved(err: BaseException, path: Path, lost: Callable[[], str] | None) -> str:
    """What a failed save says: a full disk by name, a lost rank by name where it can be found."""
    if _disk_full(err):
        try:
            free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        return (
            f"checkpoint {path} was not saved: the disk is full (no space left on the filesystem of "
            f"{path.parent}, {free}).{_previous(path)} The partial one was removed: free space, or keep fewer "
            f"checkpoints (ModelCheckpoint(save_top_k=...))"
        )
    if lost_peer(err):
        who = (lost() if lost is not None else "") or "another rank (its process died, hung or was stopped)"
        return (
            f"checkpoint {path} was not saved: a rank was lost during the save: {who} "
            f"({_first_line(err)}).{_previous(path)}"
        )
    if isinstance(err, CheckpointError):  # ours, refused before any write: its message whole
        return f"checkpoint {path} was not saved: {err}.{_previous(path)}"
    return f"checkpoint {path} was not saved: {_first_line(err)}.{_previous(path)}"


def _previous(path: Path) -> str:
    """What a failed save left at ``path``: the previous checkpoint, where there is one."""
    return f" The previous checkpoint at {path} is intact." if path.exists() else ""


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in str(err).splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]


def _disk_full(err: BaseException) -> bool:
    """ENOSPC or EDQUOT anywhere in the error, its causes, or DCP's per-rank failures; or torch.save's
    zip writer failing while the disk has (almost) no space left."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        if isinstance(e, CheckpointException):
            todo.extend(exc for exc, _ in e.failures.values())
        todo.extend((e.__cause__, e.__context__))
    return False


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _check_held(on_meta: set[str], group: dist.ProcessGroup | None) -> None:
    """Every weight some rank left on meta is held by another rank, else no rank can write it: refused on
    every rank alike, before anything is written (a checkpoint without it would read back as built)."""
    _, world = _world()
    if world > 1:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, on_meta, group=group)
        on_meta = set.intersection(*every)
    if on_meta:
        raise CheckpointError(
            f"{len(on_meta)} weight(s) are on the meta device on every rank, so no rank "
            f"holds their values ({', '.join(sorted(on_meta)[:5])}): save during or after a Trainer call that "
            f"made them (a model built on meta is made at setup)"
        )


def _check_stepped(module: nn.Module, optimizers: list[Any], group: dist.ProcessGroup | None, shard: bool) -> None:
    """Every parameter the optimizers step is one of the model's: their state is saved under the model's
    parameter names. Refused on every rank alike, before anything is written (torch's own lookup failed on
    the ranks holding one, with a bare KeyError, while the others went on to wait for them)."""
    held = {id(q) for q in module.parameters()}
    gone = [q for opt in optimizers for g in opt.param_groups for q in g["params"] if id(q) not in held]
    mine = (len(gone), shard and any(isinstance(q, DTensor) for q in gone))
    _, world = _world()
    every: list[Any] = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine, group=group)
    if any(sharded for _, sharded in every):
        raise CheckpointError(
            "under data_parallel='shard' the optimizer's state stays sharded over the replicas after the Trainer "
            "call, while the model is whole again, so it cannot be saved by the model's parameter names: save "
            "during the call (ModelCheckpoint, or trainer.save_checkpoint in a callback), or the weights alone "
            "after it (trainer.save_checkpoint(path, weights_only=True))"
        )
    if any(n for n, _ in every):
        ranks = [r for r, (n, _) in enumerate(every) if n]
        stale = max(n for n, _ in every)
        raise CheckpointError(
            f"the optimizer steps {stale} parameter(s) that are no longer the model's (on rank(s) {ranks}), "
            f"so its state cannot be saved by their names. Under strategy='twobp' a rank holds only the layers it "
            f"trains and those it did not are replaced: a Trainer call since this one's fit, with another pipeline "
            f"layout (another Trainer's predict, say), replaced some this optimizer steps. Save with the Trainer "
            f"that used the model last, before that call, or the weights alone "
            f"(trainer.save_checkpoint(path, weights_only=True))"
        )


def _save(
    checkpoint: dict[str, Any],
    path: Path,
    tmp: Path,
    module: nn.Module,
    optimizers: list[Any],
    layout: dict[str, Any],
    group: dist.ProcessGroup | None,
    streams: dict[str, dict[str, torch.Tensor]] | None,
) -> None:
    rank, _ = _world()
    if rank == 0:
        _rmtree(tmp)  # left by a save that crashed
        tmp.mkdir(parents=True)
    _barrier(group)
    checkpoint.pop("state_dict", None)
    if checkpoint.pop("optimizer_states", None) is None:  # save_checkpoint(weights_only=True): the weights alone
        optimizers = []
    # after a Trainer call (trainer.save_checkpoint once fit returned) the model is whole again, with the
    # other ranks' layers on the meta device: each rank writes the weights it holds, as during the call
    whole = get_model_state_dict(module)
    model = {name: value for name, value in whole.items() if not _is_meta(value)}
    _check_held(set(whole) - set(model), group)
    _check_stepped(module, optimizers, group, layout.get("data_parallel") == "shard")
    state: dict[str, Any] = {"model": model}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, opt, options=_OPTIM)
    state["rng"] = {f"rank{rank}": rng_state(), **(streams or {})}  # the rank's streams, and its stages'
    mine = _write_shards(state, tmp, group)
    files = {name: entry for part in _gather_to_zero(mine, group) for name, entry in part.items()}
    failed: BaseException | None = None
    if rank == 0:
        try:
            _write_meta({**checkpoint, "twobp": layout}, tmp)
            _write_manifest(files, tmp, layout)
            _swap_into_place(tmp, path)
        except Exception as err:  # told to every rank below: they must not wait for a rename that never comes
            failed = err
    _agree(failed, group)


def _agree(failed: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Every rank learns whether rank 0 finished the save (in place of a barrier), and raises if not."""
    if _world()[1] > 1:
        told = [None if failed is None else (_first_line(failed), _disk_full(failed))]
        dist.broadcast_object_list(told, src=0, group=group)
        if failed is None and told[0] is not None:
            message, full = told[0]
            failed = OSError(errno.ENOSPC, message) if full else RuntimeError(message)
    if failed is not None:
        raise failed


def resolve(path: str | os.PathLike) -> Path:
    """The directory to read for ``path``: ``path`` itself, or, when a crash fell between the two
    renames of a save, the complete checkpoint under its hidden name (newest first)."""
    path = Path(path)
    if path.exists():
        return path
    for candidate in (_partial(path), _old(path)):
        if (candidate / MANIFEST).is_file():
            warnings.warn(
                f"{path} is missing (a save was interrupted while renaming); reading the complete "
                f"checkpoint {candidate} instead",
                stacklevel=2,
            )
            return candidate
    raise FileNotFoundError(f"no checkpoint at {path}")


def _check(path: Path, names: list[str], files: dict[str, Any]) -> list[str]:
    problems = []
    for name in names:
        file, want = path / name, files[name]
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif (size := file.stat().st_size) != want["size"]:
            problems.append(f"{file}: {size} bytes, the manifest says {want['size']} (truncated or partly written)")
        elif _sha256(file) != want["sha256"]:
            problems.append(
                f"{file}: its SHA-256 differs from the manifest's (the file was changed or damaged "
                f"after it was written)"
            )
    return problems


def _unlisted(path: Path, files: dict[str, Any]) -> list[str]:
    """Files in the directory the manifest does not list (a shortened or emptied list must not let a
    file through unchecked), and the two every checkpoint has."""
    present = {f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file()} - {MANIFEST}
    missing = [n for n in (".metadata", META) if n not in files]
    return [
        f"{path / name}: not in the manifest, so it cannot be checked (the manifest was shortened or replaced)"
        for name in sorted((present - set(files)) | set(missing))
    ]


def _unlisted_shards(path: Path, files: dict[str, Any]) -> list[str]:
    """Files torch.distributed.checkpoint's metadata reads from that the manifest does not list."""
    try:
        storage = dcp.FileSystemReader(path).read_metadata().storage_data
    except Exception as err:  # noqa: BLE001 - any unreadable .metadata is a damaged checkpoint
        return [f"{path / '.metadata'}: unreadable ({err})"]
    named = {info.relative_path for info in storage.values()}
    return [f"{path / n}: named by .metadata but not in the manifest" for n in sorted(named - set(files))]


def verify(path: str | os.PathLike, *, shared: bool = True, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Check every file of the checkpoint against its manifest; return the manifest. With ``shared``
    (and a process group), rank r hashes every world-size-th file and the verdict is shared, so all
    ranks raise the same :class:`CheckpointError` together."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not (path / META).is_file() and not manifest_file.is_file():
        raise CheckpointError(
            f"{path} is not a strategy='twobp' checkpoint (no {META}, no {MANIFEST}): pass the checkpoint "
            f"directory ModelCheckpoint wrote, or load a consolidated file with strategy='auto'"
        )
    if not manifest_file.is_file():
        raise CheckpointError(
            f"{path} has no {MANIFEST}: it was not written completely (or by a version of "
            f"lightning_twobp before 0.2); resume from an earlier checkpoint"
        )
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_file}: unreadable manifest ({err}); resume from another checkpoint") from err
    rank, world = _world() if shared else (0, 1)
    names = sorted(files)
    problems = _check(path, names[rank::world], files)
    if rank == 0:  # what the manifest leaves out: every file present, every file DCP's metadata reads
        problems = _unlisted(path, files) + problems
        if not problems and ".metadata" in files:
            problems = _unlisted_shards(path, files)
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, problems, group=group)
        problems = [p for part in gathered for p in part]
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is damaged, not loaded: "
            + "; ".join(problems)
            + ". Resume from another checkpoint (the previous save is kept until a new one "
            "is complete)"
        )
    return manifest


def _refuse_unexpected(path: Path, saved: dict[str, Any], model: dict[str, Any], group: Any) -> None:
    """Weights in the checkpoint that the whole model does not have (a deeper model's checkpoint): refused
    as one-process Lightning's ``load_state_dict`` refuses them. The whole model's names are the union of
    every rank's, since each rank holds only its stages' during a Trainer call."""
    names = set(model)
    if _world()[1] > 1:
        every: list[Any] = [None] * _world()[1]
        dist.all_gather_object(every, sorted(names), group=group)
        names = {n for part in every for n in part}
    unexpected = sorted(k[len("model.") :] for k in saved if k.startswith("model.") and k[len("model.") :] not in names)
    if unexpected:
        shown = ", ".join(f'"{k}"' for k in unexpected[:8]) + (
            f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        )
        raise CheckpointError(
            f"Error(s) in loading checkpoint {path}: Unexpected key(s) in state_dict: {shown}. The checkpoint "
            f"holds weights this model does not have (saved from a larger model?); load the matching model, "
            f"or set self.strict_loading = False in the LightningModule to ignore them"
        )


def _refuse_lost_state(path: Path, optimizers: list[Any], names: list[list[list[str]]], saved: Any, group: Any) -> None:
    """A parameter an optimizer steps whose state the checkpoint lacks, where it holds state for that optimizer's
    others: a checkpoint of another layout that keyed it under another name (a head tied to the embedding, saved
    in one process under the embedding's name). Read as it is, its state would restart from zero, silently (a
    review: GPT-2's tied head resumed 6.1e-2 off); torch's template refused it as a missing key. Every rank refuses
    alike: one refusing alone would leave the others waiting in the load's collectives."""
    lost: list[str] = []
    for i, (opt, fqns) in enumerate(zip(optimizers, names, strict=True)):
        stored = _by_param(saved, f"optimizer_{i}.state.", {f for g in fqns for f in g})
        if stored:  # an optimizer keeping no state (SGD without momentum) saved none for any
            for group_, gnames in zip(opt.param_groups, fqns, strict=True):
                steps = zip(group_["params"], gnames, strict=True)
                lost += [f for q, f in steps if q.requires_grad and f not in stored]
    if _world()[1] > 1:
        every: list[Any] = [None] * _world()[1]
        dist.all_gather_object(every, lost, group=group)
        lost = sorted({f for part in every for f in part})
    if lost:
        raise CheckpointError(
            f"Error(s) in loading checkpoint {path}: Missing key(s) in its optimizer state: the optimizer state of "
            f"{', '.join(lost[:4])}{' and more' if len(lost) > 4 else ''}, which the optimizer steps and whose "
            f"neighbours' state the checkpoint holds. A checkpoint written under another layout keys a tied weight by "
            f"one of its names only (a head tied to the embedding, saved in one process under the embedding's "
            f"name): resume under the layout that wrote it"
        )


def load(
    path: Path,
    module: nn.Module,
    optimizers: list[Any],
    weights_only: bool | None,
    strict: bool = True,
    group: dist.ProcessGroup | None = None,
    streams: Sequence[str] = (),
) -> dict[str, Any]:
    """Verify the checkpoint, load this rank's weights (and, when ``optimizers`` are given, their
    state) from it into ``module`` and ``optimizers`` in place; return the rest of the checkpoint.
    ``group``: as for :func:`save`. ``streams``: the names of the stage streams to read, where the
    checkpoint has them (returned under ``twobp_streams``)."""
    path = resolve(path)
    verify(path, group=group)
    try:
        checkpoint = torch.load(path / META, map_location="cpu", weights_only=weights_only is not False)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path / META} holds objects that torch.load(weights_only=True) refuses ({err}). If you trust "
            f"this checkpoint, pass weights_only=False (Trainer.fit(..., weights_only=False)), or register "
            f"the types with torch.serialization.add_safe_globals"
        ) from err
    saved: dict[str, Any] = dcp.FileSystemReader(path).read_metadata().state_dict_metadata  # tensors' metadata
    if not any(k.startswith("optimizer_") for k in saved):
        # saved with weights_only=True: a resumed fit is then refused by Lightning, as in one process, naming
        # the state the checkpoint lacks
        optimizers = []
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    names = [_param_names(module, opt) for opt in optimizers]
    for i, opt in enumerate(optimizers):
        # Built from the checkpoint's own entries for this rank's parameters, not from the fresh optimizer's
        # state (torch's helper steps an optimizer that has none, and reads no state at all from one that has
        # any entry, an empty one included: the saved state was then dropped without a word)
        state[f"optimizer_{i}"] = _optimizer_template(opt, names[i], saved, f"optimizer_{i}.")
    _refuse_lost_state(path, optimizers, names, saved, group)
    if strict:
        _refuse_unexpected(path, saved, state["model"], group)
    # This rank's random states and its stages', where the checkpoint has them (it may come from another
    # world size or layout).
    own = f"rank{_world()[0]}"
    rng = {}
    for name in (own, *streams):
        prefix = f"rng.{name}."
        found = {
            k[len(prefix) :]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in saved.items()
            if k.startswith(prefix)
        }
        if found:
            rng[name] = found
    if rng:
        state["rng"] = rng
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        _set_optimizer(opt, names[i], state[f"optimizer_{i}"])
    checkpoint["twobp_rng"] = rng.pop(own, None)  # restored by the strategy right before the next training step
    checkpoint["twobp_streams"] = rng
    return checkpoint


def _param_names(module: nn.Module, opt: Any) -> list[list[str]]:
    """The names the checkpoint keys ``opt``'s parameters by, group by group: torch's
    (``get_optimizer_state_dict``'s, which drop wrappers' prefixes), read from a stand-in optimizer over the
    same parameters that holds one placeholder entry, so that torch's helper neither steps ``opt`` (it runs
    a step on an optimizer whose state is empty) nor reads its state."""
    stand_in = torch.optim.Optimizer([{"params": g["params"]} for g in opt.param_groups], {})
    first = next((q for g in opt.param_groups for q in g["params"]), None)
    if first is None:
        return [[] for _ in opt.param_groups]
    stand_in.state[first] = {"placeholder": 0}
    groups: Any = get_optimizer_state_dict(module, stand_in)["param_groups"]
    return [list(g["params"]) for g in groups]


def _optimizer_template(opt: Any, names: list[list[str]], saved: dict[str, Any], prefix: str) -> dict[str, Any]:
    """What :func:`load` reads for ``opt``, flat as it was saved: the param-group settings ``opt`` has that
    the checkpoint has too (one it lacks, which an LR scheduler made since the save added, ``initial_lr``
    after Lightning's lr_find swapped in its own scheduler, is not read: DCP would refuse the missing key,
    and :func:`_set_optimizer` leaves it out), and every state entry the checkpoint holds for its
    parameters (``state.<name>.<key>``, nested keys dotted), allocated from the checkpoint's metadata:
    shaped like the parameter (a DTensor where the parameter is one, so each rank reads its rows), or as
    saved."""
    template: dict[str, Any] = {}
    stored = _by_param(saved, f"{prefix}state.", {f for fqns in names for f in fqns})
    for group, fqns in zip(opt.param_groups, names, strict=True):
        for param, fqn in zip(group["params"], fqns, strict=True):
            for k, v in group.items():
                if k != "params" and f"{prefix}param_groups.{fqn}.{k}" in saved:
                    template[f"param_groups.{fqn}.{k}"] = v
            for key in stored.get(fqn, ()):
                template[f"state.{fqn}.{key}"] = _placeholder(saved[f"{prefix}state.{fqn}.{key}"], param)
    return template


def _by_param(keys: Any, head: str, fqns: set[str]) -> dict[str, list[str]]:
    """The keys under ``head`` (``state.``) of the parameters ``fqns`` names, as ``name -> [rest]``: a
    parameter's name ends at the dot after which the rest (``exp_avg``, or a nested ``a.b``) begins."""
    out: dict[str, list[str]] = {}
    for key in keys:
        if key.startswith(head):
            parts = key[len(head) :].split(".")
            for j in range(1, len(parts)):
                if (fqn := ".".join(parts[:j])) in fqns:
                    out.setdefault(fqn, []).append(".".join(parts[j:]))
                    break
    return out


def _placeholder(meta: Any, param: torch.Tensor) -> Any:
    """Room for one saved optimizer value: a tensor of its saved shape and dtype (on the CPU where it is a
    scalar, as torch's optimizers keep ``step``; ``load_state_dict`` moves the rest to the parameter's
    device), or a stand-in that DCP replaces by the saved object."""
    if not isinstance(meta, TensorStorageMetadata):
        return 0
    size, dtype = tuple(meta.size), meta.properties.dtype
    if isinstance(param, DTensor) and size == tuple(param.shape):
        return torch.empty_like(param, dtype=dtype)
    return torch.empty(size, dtype=dtype, device="cpu" if not size else param.device)


def _set_optimizer(opt: Any, names: list[list[str]], flat: dict[str, Any]) -> None:
    """Load what :func:`load` read into ``opt`` with its own ``load_state_dict``, as one process does: the
    state the checkpoint holds for each parameter, whole (nested keys rebuilt), and the saved param-group
    settings. A setting the optimizer has now but the checkpoint lacks is left out, so the optimizer fills
    in its own default again through ``__setstate__`` (a checkpoint of an older torch lacks a newer default,
    Adam's ``decoupled_weight_decay``)."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for group, fqns in zip(opt.param_groups, names, strict=True):
        if not fqns:  # a group with none of this rank's parameters: nothing of it was saved here, it stays
            groups.append(dict(group, params=[]))
            continue
        settings: dict[str, Any] = {}
        for k in group:
            found = [flat[f"param_groups.{f}.{k}"] for f in fqns if f"param_groups.{f}.{k}" in flat]
            if k != "params" and found:
                settings[k] = found[0]
        groups.append({**settings, "params": list(fqns)})
    for fqn, keys in _by_param(flat, "state.", {f for fqns in names for f in fqns}).items():
        entries: dict[str, Any] = state.setdefault(fqn, {})
        for key in keys:
            *parents, last = key.split(".")
            node = entries
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = flat[f"state.{fqn}.{key}"]
    opt.load_state_dict({"state": state, "param_groups": groups})


def consolidate(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike) -> dict:
    """Merge the stages of ``checkpoint_dir`` into one Lightning checkpoint at ``out_path``; return it."""
    src, weights = _merged_model(checkpoint_dir)
    checkpoint = torch.load(src / META, map_location="cpu", weights_only=True)
    for key in ("optimizer_states", "lr_schedulers", "loops", "twobp"):
        checkpoint.pop(key, None)
    checkpoint["state_dict"] = weights
    torch.save(checkpoint, out_path)
    return checkpoint


def _merged_model(checkpoint_dir: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor]]:
    """The verified checkpoint directory, and every weight of its model, merged in this process."""
    src = resolve(checkpoint_dir)
    verify(src, shared=False)
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(src, merged)  # no process group needed: reads every shard
        return src, torch.load(merged, map_location="cpu", weights_only=True)["model"]


def to_safetensors(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    prefix: str = "",
    max_shard_bytes: int = 5 * 10**9,
    weights_name: str = "model.safetensors",
) -> int:
    """The model's weights under the module ``prefix`` (``""``: all), that prefix dropped from their names,
    as Hugging Face safetensors in ``out_dir``, what ``from_pretrained`` reads: ``weights_name``
    (transformers' ``model.safetensors``; diffusers reads ``diffusion_pytorch_model.safetensors``), or
    shards of at most ``max_shard_bytes`` (a tensor larger than that alone) and their index, named after it
    as ``save_pretrained`` names them (a variant's index too: :func:`_index_name`). One shard in memory at a
    time, read from the checkpoint's shards (a model larger than one process's memory is written); the number
    of tensors."""
    from safetensors.torch import save_file

    stem = weights_name.removesuffix(".safetensors")
    if not stem or "/" in weights_name or not weights_name.endswith(".safetensors"):
        raise ValueError(
            f"--weights-name {weights_name!r}: a file name ending in .safetensors, e.g. model.safetensors "
            f"(transformers) or diffusion_pytorch_model.safetensors (diffusers)"
        )
    src = resolve(checkpoint_dir)
    verify(src, shared=False)
    chosen = _stored_weights(src, prefix, checkpoint_dir)
    shards = _shards(chosen, max_shard_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = out / _index_name(weights_name)
    # an earlier save's under this name (from_pretrained would read it), not another variant's (model.fp16...)
    earlier = [out / weights_name, *out.glob(f"{glob.escape(stem)}-[0-9]*-of-[0-9]*.safetensors"), index]
    for old in earlier:
        old.unlink(missing_ok=True)
    names = [weights_name] if len(shards) == 1 else [
        f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    for name, shard in zip(names, shards, strict=True):
        state = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in (chosen[n] for n in shard)}
        with warnings.catch_warnings():  # one process reads every shard: torch says it assumes so
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(src), no_dist=True)
        save_file({n: state[chosen[n][0]] for n in shard}, out / name, metadata={"format": "pt"})
        del state
    if len(shards) > 1:
        total = sum(math.prod(m.size) * m.properties.dtype.itemsize for _, m in chosen.values())
        where = {n: name for name, shard in zip(names, shards, strict=True) for n in shard}
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": where}, indent=2))
    return len(chosen)


def _index_name(weights_name: str) -> str:
    """The shards' index as ``save_pretrained`` names it (transformers' and diffusers' ``_add_variant``): a
    variant's (``model.fp16.safetensors``) goes before ``.json``, ``model.safetensors.index.fp16.json``, where
    ``from_pretrained(..., variant="fp16")`` looks for it."""
    stem = weights_name.removesuffix(".safetensors")
    base, _, variant = stem.rpartition(".")
    if base in _READ_NAMES:  # a variant of a name from_pretrained reads; another dot is part of a name
        return f"{base}.safetensors.index.{variant}.json"
    return f"{weights_name}.index.json"


_READ_NAMES = ("model", "diffusion_pytorch_model")  # transformers' and diffusers' weights files, as stems


def _stored_weights(src: Path, prefix: str, named: Any) -> dict[str, tuple[str, Any]]:
    """The checkpoint's model tensors under ``prefix``: the name to write -> (DCP key, its metadata)."""
    stored = dcp.FileSystemReader(src).read_metadata().state_dict_metadata
    head = "model." + (prefix.strip(".") + "." if prefix.strip(".") else "")
    chosen = {
        k[len(head) :]: (k, m) for k, m in stored.items() if k.startswith(head) and isinstance(m, TensorStorageMetadata)
    }
    if not chosen:
        tops = sorted({k.split(".")[1] for k in stored if k.startswith("model.") and k.count(".") > 1})
        raise ValueError(
            f"twobp-consolidate --prefix {prefix!r}: no weight of {named} is under it; its modules: "
            f"{', '.join(tops)} (e.g. --prefix {tops[0] if tops else 'model'})"
        )
    return dict(sorted(chosen.items()))


def _shards(chosen: dict[str, tuple[str, Any]], max_bytes: int) -> list[list[str]]:
    """The names in order, cut into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (_, m) in chosen.items():
        nbytes = math.prod(m.size) * m.properties.dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _bytes(text: str) -> int:
    """``5GB``, ``500MB``, ``200KB`` or a number of bytes (Hugging Face's ``max_shard_size``)."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * scale)
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: a size such as 5GB, 500MB or a number of bytes")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="twobp-consolidate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("checkpoint_dir", help="a checkpoint directory written under strategy='twobp'")
    ap.add_argument("out", help="where to write the consolidated .ckpt file (with --safetensors: a directory)")
    ap.add_argument("--safetensors", action="store_true", help="write the weights as Hugging Face safetensors into OUT")
    ap.add_argument(
        "--max-shard-size",
        type=_bytes,
        default=5 * 10**9,
        help="--safetensors: the largest file to write (default 5GB, as save_pretrained); more: shards and an index",
    )
    ap.add_argument(
        "--prefix",
        default="",
        help="--safetensors: the module whose weights to write, its name dropped: for self.model = AutoModel..., "
        "--prefix model (the default, none, keeps the LightningModule's names, which from_pretrained does not read)",
    )
    ap.add_argument(
        "--weights-name",
        default="model.safetensors",
        help="--safetensors: the file from_pretrained reads (default model.safetensors, transformers'; "
        'diffusion_pytorch_model.safetensors for diffusers; model.fp16.safetensors for variant="fp16"); shards '
        "and their index are named after it, as save_pretrained names them",
    )
    args = ap.parse_args(argv)
    if args.safetensors:
        count = to_safetensors(args.checkpoint_dir, args.out, args.prefix, args.max_shard_size, args.weights_name)
        print(f"wrote {args.out}: {count} tensors as Hugging Face safetensors")
        return 0
    ckpt = consolidate(args.checkpoint_dir, args.out)
    n = sum(t.numel() for t in ckpt["state_dict"].values() if isinstance(t, torch.Tensor))
    print(f"wrote {args.out}: {len(ckpt['state_dict'])} tensors, {n} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
