"""(B + W) / BW on one block: what the split backward costs over the fused one.

twobp-bench --split [--tokens 512 256 64]
"""

from __future__ import annotations

import statistics
import time

import torch

from lightning_twobp.engine import Stage
from lightning_twobp.models.llama import Block, LlamaConfig


def bench_split(tokens: int = 512, repeats: int = 21, seq: int = 128) -> dict:
    """(B + W) / BW on one block of the tiny LLaMa (hidden 512, 8 heads), one thread, alternated.

    BW is plain ``loss.backward()``-style autograd (``out.backward(grad)``) on the block; B + W is
    :class:`Stage`'s split. Each pair starts from ``.grad = None``, so both pay the first
    accumulation. Medians over ``repeats`` pairs after 3 warm-up pairs.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        seq = min(seq, tokens)
        block = Block(LlamaConfig(dim=512, n_heads=8, max_seq_len=seq))
        x = torch.randn(tokens // seq, seq, 512)
        g = torch.randn_like(x)
        stage = Stage(block)
        fused, b, w = [], [], []
        for i in range(repeats + 3):
            block.zero_grad(set_to_none=True)
            out = block(x.requires_grad_())
            t0 = time.perf_counter()
            out.backward(g)
            t1 = time.perf_counter()
            del out
            x.grad = None
            block.zero_grad(set_to_none=True)
            stage.forward(0, x)
            t2 = time.perf_counter()
            stage.backward_input(0, g)
            t3 = time.perf_counter()
            stage.backward_weight(0)
            t4 = time.perf_counter()
            if i >= 3:
                fused.append(t1 - t0)
                b.append(t3 - t2)
                w.append(t4 - t3)
    finally:
        torch.set_num_threads(threads)
    med = statistics.median
    ratios = [(bi + wi) / fi for bi, wi, fi in zip(b, w, fused, strict=False)]
    return dict(
        tokens=tokens,
        bw_ms=med(fused) * 1e3,
        b_ms=med(b) * 1e3,
        w_ms=med(w) * 1e3,
        ratio_of_medians=(med(b) + med(w)) / med(fused),
        median_ratio=med(ratios),
        deferred_fraction=stage.deferred_fraction,
    )
