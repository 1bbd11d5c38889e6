"""Peak resident memory of a 2-rank Trainer fit (ZB-V, post-validation on by default, no clipping, m = 4, six
Linear(2048, 2048), SGD) above the built model, per rank: with the checked step's gradients let go (since
stop 58) and kept until the next step's verdict (as before), alternated in fresh processes.

    PYTHONPATH=. python docs/results/memory/checked_grads.py [rounds]
"""

import sys

import torch

from lightning_twobp.engine.post_validation import StepValidation
from lightning_twobp.processes import run_distributed

sys.path.insert(0, "docs/results/memory")
from old_grads import fit_peak  # noqa: E402


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
    torch.set_num_threads(1)
    if kept:
        _keep_the_checked_gradients()
    return fit_peak(rank, world, "zb-v")


if __name__ == "__main__":
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        for kept in (True, False):
            peaks = run_distributed(worker, 2, kept, timeout=300)
            print("kept   " if kept else "let go ", "(peak MB above the model, this rank's gradients MB):", peaks)
