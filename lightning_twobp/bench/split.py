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


def bench_paper_blocks(repeats: int = 7, quick: bool = False) -> dict[str, float]:
    """(B + W) / BW of each paper model's layers after the first (``--paper``'s RQ1 column), one
    thread, timed with ``time.thread_time()`` (CPU time of this thread: less sensitive to other jobs
    on a shared machine than the wall clock). Per repetition every layer runs B, W, then BW; the
    result is the median over repetitions of sum(B + W) / sum(BW)."""
    from lightning_twobp.bench.paper import inputs_of, models
    from lightning_twobp.bench.workload import WORLD

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for pm in models(quick):
            layers, _ = pm.build()
            x, _ = pm.data()
            x = x[: pm.batch // (2 * WORLD)]
            ins = inputs_of(layers, x)
            pairs = zip(list(layers)[1:], ins[1:], strict=True)  # the first layer's input takes no gradient
            runs = [(Stage(layer), inp.detach().requires_grad_()) for layer, inp in pairs]
            ratios = []
            for rep in range(repeats + 1):
                split = fused = 0.0
                for st, inp in runs:
                    g = torch.ones_like(st.forward(0, inp))
                    t0 = time.thread_time()
                    st.backward_input(0, g)
                    st.backward_weight(0)
                    t1 = time.thread_time()
                    st.forward(0, inp)
                    t2 = time.thread_time()
                    st.backward(0, g)
                    t3 = time.thread_time()
                    split, fused = split + t1 - t0, fused + t3 - t2
                if rep:  # the first is a warm-up
                    ratios.append(split / fused)
            out[pm.name] = statistics.median(ratios)
    finally:
        torch.set_num_threads(threads)
    return out
