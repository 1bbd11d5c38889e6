"""Checkpoints under ``strategy="twobp"``: save, load, consolidate.

A checkpoint is a directory written with ``torch.distributed.checkpoint``: each rank writes its own
stages' weights and optimizer state, keyed by the parameters' fully qualified names in the whole
model (``torch.distributed.checkpoint.state_dict``: ``get_model_state_dict`` and
``get_optimizer_state_dict`` with ``flatten_optimizer_state_dict=True``, which keys every parameter's
state *and* its param-group settings by name). Replicas are deduplicated. The rest of Lightning's
checkpoint (loops, callbacks, schedulers, hyper-parameters) goes to ``meta.pt`` from rank 0.

Because everything is keyed by name, a run resumes under another pipeline degree, schedule or cut:
each rank reads the entries of the parameters it holds now.

    twobp-consolidate CHECKPOINT_DIR OUT.ckpt

merges the stages into an ordinary Lightning checkpoint (``state_dict`` under the model's names,
plus the hyper-parameters, epoch and global step, without optimizer state), which the unpipelined
LightningModule loads with ``Model.load_from_checkpoint(OUT.ckpt)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["consolidate", "load", "main", "save"]

META = "meta.pt"  # Lightning's checkpoint without weights and optimizer state, from rank 0
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def save(checkpoint: dict[str, Any], path: Path, module: nn.Module, optimizers: list[Any], rank: int,
         layout: dict[str, Any]) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a sharded directory at ``path``. Every rank calls it;
    the caller makes the directory and synchronises around it."""
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    state = {"model": get_model_state_dict(module)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, opt, options=_OPTIM)
    dcp.save(state, checkpoint_id=path)
    if rank == 0:
        torch.save({**checkpoint, "twobp": layout}, path / META)


def load(path: Path, module: nn.Module, optimizers: list[Any], weights_only: bool | None,
         strict: bool = True) -> dict[str, Any]:
    """Load this rank's weights (and, when ``optimizers`` are given, their state) from the sharded
    directory ``path`` into ``module`` and ``optimizers`` in place; return the rest of the checkpoint."""
    if not (path / META).is_file():
        raise FileNotFoundError(
            f"{path} is not a strategy='twobp' checkpoint (no {META}): pass the checkpoint directory "
            f"ModelCheckpoint wrote, or load a consolidated file with strategy='auto'"
        )
    checkpoint = torch.load(path / META, map_location="cpu", weights_only=True if weights_only is None else weights_only)
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    for i, opt in enumerate(optimizers):
        # The optimizer's own state dict as the template (torch fills a fresh optimizer's state first).
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, opt, options=_OPTIM)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"], options=_OPTIM)
    return checkpoint


def consolidate(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike) -> dict:
    """Merge the stages of ``checkpoint_dir`` into one Lightning checkpoint at ``out_path``; return it."""
    src = Path(checkpoint_dir)
    if not (src / META).is_file() or not (src / ".metadata").is_file():
        raise FileNotFoundError(
            f"{src} is not a strategy='twobp' checkpoint directory (it needs {META} and .metadata, "
            f"as ModelCheckpoint writes them under strategy='twobp')"
        )
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(src, merged)  # no process group needed: reads every shard
        tensors = torch.load(merged, map_location="cpu", weights_only=True)
    checkpoint = torch.load(src / META, map_location="cpu", weights_only=True)
    for key in ("optimizer_states", "lr_schedulers", "loops", "twobp"):
        checkpoint.pop(key, None)
    checkpoint["state_dict"] = tensors["model"]
    torch.save(checkpoint, out_path)
    return checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="twobp-consolidate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir", help="a checkpoint directory written under strategy='twobp'")
    ap.add_argument("out", help="where to write the consolidated .ckpt file")
    args = ap.parse_args(argv)
    ckpt = consolidate(args.checkpoint_dir, args.out)
    n = sum(t.numel() for t in ckpt["state_dict"].values() if isinstance(t, torch.Tensor))
    print(f"wrote {args.out}: {len(ckpt['state_dict'])} tensors, {n} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
