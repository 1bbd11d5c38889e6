"""Consolidating a sharded ``strategy="twobp"`` checkpoint into one file.

    twobp-consolidate CHECKPOINT_DIR OUT.ckpt

The result is an ordinary Lightning checkpoint: ``state_dict`` under the model's original parameter
names, plus the hyperparameters, epoch and global step from the run, without optimizer state
(which is stored per pipeline stage). The unpipelined LightningModule loads it with
``Model.load_from_checkpoint(OUT.ckpt)`` or ``model.load_state_dict(torch.load(OUT.ckpt)["state_dict"])``,
and it resumes training under any other pipeline degree as weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

__all__ = ["consolidate", "main"]


def consolidate(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike) -> dict:
    """Merge the stages of ``checkpoint_dir`` into one Lightning checkpoint at ``out_path``; return it."""
    src = Path(checkpoint_dir)
    if not (src / "meta.pt").is_file() or not (src / ".metadata").is_file():
        raise FileNotFoundError(
            f"{src} is not a strategy='twobp' checkpoint directory (it needs meta.pt and .metadata, "
            f"as ModelCheckpoint writes them under strategy='twobp')"
        )
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(src, merged)  # no process group needed: reads every shard
        tensors = torch.load(merged, map_location="cpu", weights_only=False)
    checkpoint = torch.load(src / "meta.pt", map_location="cpu", weights_only=False)
    for key in ("optimizer_states", "lr_schedulers", "loops", "twobp"):
        checkpoint.pop(key, None)
    checkpoint["state_dict"] = tensors["model"]
    torch.save(checkpoint, out_path)
    return checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir", help="a checkpoint directory written under strategy='twobp'")
    ap.add_argument("out", help="where to write the consolidated .ckpt file")
    args = ap.parse_args(argv)
    ckpt = consolidate(args.checkpoint_dir, args.out)
    n = sum(t.numel() for t in ckpt["state_dict"].values() if isinstance(t, torch.Tensor))
    print(f"wrote {args.out}: {len(ckpt['state_dict'])} tensors, {n} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
