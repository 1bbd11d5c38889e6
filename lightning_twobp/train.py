"""The default job: the tiny LLaMa trained through a 2BP pipeline on 2 CPU processes.

    python -m lightning_twobp.train [--max-steps N] [--schedule zb-h1] [--devices 2]

The data is synthetic and learnable, so the loss visibly falls: each sequence counts upwards from a
random start (token t+1 = token t + 1 mod vocab), and the model learns to predict the next token.
Lightning launches the processes itself (gloo on CPU), shows a progress bar, writes CSV logs and a
sharded checkpoint under ``--out``, and rank 0 ends with a short summary. Recipes with the paper's
models replace this with Hydra configs (``twobp-train``).
"""

from __future__ import annotations

import argparse
import sys
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_twobp import TwoBPStrategy
from lightning_twobp.models.llama import LlamaConfig, build_llama


class CountingTokens(Dataset):
    """Sequences that count upwards from a random start: learnable in a few dozen steps."""

    def __init__(self, vocab: int, seq: int, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (size, 1), generator=g)
        self.tokens = (starts + torch.arange(seq + 1)) % vocab  # (N, T + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tokens[i]
        return t[:-1], t[1:]


class TinyLlama(pl.LightningModule):
    """An ordinary LightningModule: its layers are one nn.Sequential (``self.model``)."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4, seq: int = 64,
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = build_llama(LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, max_seq_len=seq))

    def training_step(self, batch, batch_idx):
        ids, target = batch
        logits = self.model(ids)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class _Timer(pl.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.seconds = time.perf_counter() - self.start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-steps", type=int, default=120)
    ap.add_argument("--schedule", default="zb-h1")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default="outputs/cpu-tiny-llama")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # one intra-op thread per rank: the ranks share the CPU's cores
    model = TinyLlama()
    data = DataLoader(CountingTokens(256, 64, size=4096), batch_size=args.batch_size, shuffle=True, drop_last=True)
    timer = _Timer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=TwoBPStrategy(schedule=args.schedule, num_microbatches=args.microbatches),
        max_steps=args.max_steps,
        logger=CSVLogger(args.out, name="logs"),
        default_root_dir=args.out,
        callbacks=[timer],
        log_every_n_steps=10,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        strategy = trainer.strategy
        ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        samples = args.max_steps * args.batch_size
        print(
            f"\ntrained {args.max_steps} steps of {args.batch_size} sequences: {samples / timer.seconds:.1f} samples/s "
            f"({strategy.schedule.name}, {strategy.schedule.num_stages} stages on {args.devices} CPU processes, "
            f"{args.microbatches} micro-batches); final train_loss {float(trainer.callback_metrics['train_loss']):.3f} "
            f"(ln 256 = 5.545 at the start)\n"
            f"logs: {trainer.logger.log_dir}/metrics.csv\ncheckpoint (sharded, one directory): {ckpt}\n"
            f"one-file checkpoint: twobp-consolidate {ckpt} model.ckpt"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
