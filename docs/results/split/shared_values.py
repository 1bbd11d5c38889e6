"""(B + W) / BW for modules whose weight values several ops use (docs/benchmarks.md): one thread, split and
fused backward alternated on the same stage, the median ratio of the pairs, timed by this thread's CPU
time (less sensitive to other jobs on a shared machine than the wall clock). Freed memory is kept in the
process, as ``twobp-bench --split`` and the strategy on CPU do (``engine.memory.keep_freed_memory``): with
glibc's defaults B, which holds W's gradients while it allocates, faults in fresh pages the fused backward
reuses (2,000 minor faults a B on the decoder layer against none).

    PYTHONPATH=. python docs/results/split/shared_values.py 9
"""

import statistics
import sys
import time

import torch
from torch import nn

from lightning_twobp.engine import Stage
from lightning_twobp.engine.memory import keep_freed_memory


class FirstOutput(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)[0]


class CrossAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x, x.flip(1))


CASES = {
    "nn.GRU(256, 256, num_layers=2), 4 x 64 steps": (
        lambda: FirstOutput(nn.GRU(256, 256, num_layers=2, batch_first=True)),
        (4, 64, 256),
    ),
    "nn.TransformerDecoderLayer(512, 8), 4 x 128 tokens": (lambda: CrossAttention(512, 8), (4, 128, 512)),
    # no weight value used twice: what the split costs this attention without the shared path, for comparison
    "nn.TransformerEncoderLayer(512, 8), 4 x 128 tokens": (
        lambda: nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True),
        (4, 128, 512),
    ),
}


def backward_seconds(stage: Stage, x: torch.Tensor, grad: torch.Tensor, split: bool) -> float:
    stage.forward(0, x.clone().requires_grad_())
    start = time.thread_time()
    if split:
        stage.backward_input(0, grad)
        stage.backward_weight(0)
    else:
        stage.backward(0, grad)
    return time.thread_time() - start


def main(pairs: int) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()
    for name, (make, shape) in CASES.items():
        torch.manual_seed(0)
        stage, x, grad = Stage(make()), torch.randn(*shape), torch.randn(*shape)
        for _ in range(2):  # warm-up
            backward_seconds(stage, x, grad, True)
            backward_seconds(stage, x, grad, False)
        ratios = [
            backward_seconds(stage, x, grad, True) / backward_seconds(stage, x, grad, False) for _ in range(pairs)
        ]
        print(f"{name}: (B + W) / BW {statistics.median(ratios):.3f}, median of {pairs} alternated pairs")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
