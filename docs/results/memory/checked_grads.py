"""Peak resident memory of a 2-rank Trainer fit (ZB-V, post-validation on by default, no clipping, m = 4, six
Linear(2048, 2048), SGD) above the built model, per rank: with the checked step's gradients let go (since
stop 58) and kept until the next step's verdict (as before), alternated in fresh processes.

    PYTHONPATH=. python docs/results/memory/checked_grads.py [rounds]
"""

import sys

import lightning.pytorch as pl
import torch

from lightning_twobp import TwoBPStrategy
from lightning_twobp.engine.memory import return_freed_memory
from lightning_twobp.engine.post_validation import StepValidation
from lightning_twobp.monitor import reset_peak_rss, rss_mb
from lightning_twobp.processes import run_distributed

sys.path.insert(0, "docs/results/memory")
from old_grads import WIDTH, Big, Peak  # noqa: E402


def _keep_the_checked_gradients() -> None:
    """As before stop 58: the speculative step's gradients held until its verdict, after the next step."""
    before_step = StepValidation.before_step

    def keeping(self, extra=None):
        grads = [(q, q.grad) for q in self._params_with_grads()]
        out = before_step(self, extra)
        if self.pending:
            self._grads = grads
        return out

    StepValidation.before_step = keeping


def worker(rank: int, world: int, kept: bool) -> tuple[float, float]:
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # run_distributed exported MASTER_PORT
    torch.set_num_threads(1)
    if kept:
        _keep_the_checked_gradients()
    model, peak = Big(), Peak()
    x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
    return_freed_memory()
    peak.before = rss_mb()
    reset_peak_rss()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=TwoBPStrategy(schedule="zb-v", num_microbatches=4),
        max_steps=4,
        callbacks=[peak],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    grads_mb = sum(4 * q.numel() for q in model.parameters() if not q.is_meta) / 1e6
    return round(peak.peak, 1), round(grads_mb, 1)


if __name__ == "__main__":
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        for kept in (True, False):
            peaks = run_distributed(worker, 2, kept, timeout=300)
            print("kept   " if kept else "let go ", "(peak MB above the model, this rank's gradients MB):", peaks)
