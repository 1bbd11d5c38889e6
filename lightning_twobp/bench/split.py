"""(B + W) / BW on one block: what the split backward costs over the fused one.

twobp-bench --split [--tokens 512 256 64] [--batch-w K]
twobp-bench --split --paper-blocks [--full-size] [--repeats N]
twobp-bench --split --moe [--repeats N]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from lightning_twobp.bench.paper import PaperModel
from lightning_twobp.engine import Stage, formulas
from lightning_twobp.engine.footprint import measure_layer
from lightning_twobp.models.llama import Block, LlamaConfig


def bench_split(tokens: int = 512, repeats: int = 21, seq: int = 128, batch: int = 1) -> dict:
    """(B + W) / BW on one block of the tiny LLaMa (hidden 512, 8 heads), one thread, alternated.

    BW is plain ``loss.backward()``-style autograd (``out.backward(grad)``) on the block; B + W is
    :class:`Stage`'s split. With ``batch`` = K > 1 each sample is K micro-batches: K fused backwards
    against K B's and one W over all K, twice: each weight's K GEMMs joined into one (the 2BP paper's
    batched W, whatever the size) and one per micro-batch (``stage.batch_w_bytes = 0``). Each sample starts from
    ``.grad = None``, so all pay the first accumulation. Medians over ``repeats`` samples after 3 warm-ups.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        seq = min(seq, tokens)
        block = Block(LlamaConfig(dim=512, n_heads=8, max_seq_len=seq))
        xs = [torch.randn(tokens // seq, seq, 512) for _ in range(batch)]
        g = torch.randn_like(xs[0])
        stage = Stage(block)
        times: dict[str, list[float]] = {"fused": [], "b": [], "w": [], "w_each": []}
        for i in range(repeats + 3):
            sample = _sample(block, stage, xs, g)
            if i >= 3:
                for k, v in sample.items():
                    times[k].append(v)
    finally:
        torch.set_num_threads(threads)
    med = statistics.median
    fused, b, w, w_each = (times[k] for k in ("fused", "b", "w", "w_each"))
    return dict(
        tokens=tokens,
        batch=batch,
        bw_ms=med(fused) * 1e3,
        b_ms=med(b) * 1e3,
        w_ms=med(w) * 1e3,
        ratio_of_medians=(med(b) + med(w)) / med(fused),
        median_ratio=med([(bi + wi) / fi for bi, wi, fi in zip(b, w, fused, strict=True)]),
        median_ratio_unbatched=med([(bi + wi) / fi for bi, wi, fi in zip(b, w_each, fused, strict=True)]),
        deferred_fraction=stage.deferred_fraction,
    )


def _sample(block: torch.nn.Module, stage: Stage, xs: list[torch.Tensor], g: torch.Tensor) -> dict[str, float]:
    """One sample of :func:`bench_split`: the fused backwards, then B + W with W batched and per
    micro-batch (the latter only when there are several), each from ``.grad = None``."""
    mbs = list(range(len(xs)))
    out = {"fused": 0.0, "b": 0.0}
    block.zero_grad(set_to_none=True)
    for x in xs:
        y = block(x.requires_grad_())
        t0 = time.perf_counter()
        y.backward(g)
        out["fused"] += time.perf_counter() - t0
        x.grad = None
    for key, limit in (("w", 1 << 62), ("w_each", 0)):  # every weight joined; none joined
        if key == "w_each" and len(xs) == 1:
            out["w_each"] = out["w"]
            break
        block.zero_grad(set_to_none=True)
        stage.batch_w_bytes = limit
        b = 0.0
        for m, x in enumerate(xs):
            stage.forward(m, x)
            t0 = time.perf_counter()
            stage.backward_input(m, g)
            b += time.perf_counter() - t0
        t0 = time.perf_counter()
        stage.backward_weight(mbs)
        out[key] = time.perf_counter() - t0
        out["b"] = b if key == "w" else out["b"]
    return out


# The --paper models at sizes where a layer's work is no longer dominated by per-call costs (each a small
# real model's: BERT-base / LLaMa at 768 wide and 256 tokens a sequence, Mamba-130M's 768, ResNet-50's
# 64-wide stem at ImageNet's 224 pixels), two blocks each for the sequence models (the ratio is per layer):
# (kwargs overrides, batch, size). Batch is the whole batch, as in ``models``; a micro-batch is a quarter.
FULL_SIZE = {
    "llama": ({"dim": 768, "n_heads": 12, "max_seq_len": 256, "n_layers": 2}, 16, 256),
    "bert": ({"dim": 768, "n_heads": 12, "max_seq_len": 256, "n_layers": 2}, 16, 256),
    "mamba": ({"dim": 768, "max_seq_len": 256, "n_layers": 2}, 8, 256),
    "resnet": ({"width": 64, "image_size": 224}, 16, 224),
}


def full_size(pm: PaperModel) -> PaperModel:
    """``pm`` at :data:`FULL_SIZE`."""
    over, batch, size = FULL_SIZE[pm.name]
    kwargs = tuple((k, over.get(k, v)) for k, v in pm.kwargs)
    return replace(pm, kwargs=kwargs, batch=batch, size=size, blocks=over.get("n_layers", pm.blocks))


def bench_paper_blocks(repeats: int = 7, quick: bool = False, full: bool = False) -> dict[str, float]:
    """(B + W) / BW of each paper model's layers after the first (``--paper``'s RQ1 column), one
    thread, timed with ``time.thread_time()`` (CPU time of this thread: less sensitive to other jobs
    on a shared machine than the wall clock). Per repetition every layer runs B, W, then BW; the
    result is the median over repetitions of sum(B + W) / sum(BW). ``full``: at :data:`FULL_SIZE`."""
    from lightning_twobp.bench.paper import inputs_of, models
    from lightning_twobp.bench.workload import WORLD

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for pm in models(quick):
            pm = full_size(pm) if full else pm
            layers, _ = pm.build()
            x, _ = pm.data()
            x = x[: pm.batch // (2 * WORLD)]
            ins = inputs_of(layers, x)
            pairs = zip(list(layers)[1:], ins[1:], strict=True)  # the first layer's input takes no gradient
            runs = [(Stage(layer), inp.detach().requires_grad_()) for layer, inp in pairs]
            _ratio(runs)  # a warm-up
            out[pm.name] = statistics.median(_ratio(runs) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return out


def _ratio(runs: list[tuple[Stage, torch.Tensor]]) -> float:
    """One repetition of :func:`bench_paper_blocks`: sum(B + W) / sum(BW) over the layers."""
    split = fused = 0.0
    for st, inp in runs:
        g = torch.ones_like(st.forward(0, inp))
        t0 = time.thread_time()
        st.backward_input(0, g)
        st.backward_weight(0)
        t1 = time.thread_time()
        whole = Stage(st.module)  # the fused run on a twin: st's deferred_fraction reads the split's alone
        whole.forward(0, inp)
        t2 = time.thread_time()
        whole.backward(0, g)
        t3 = time.thread_time()
        split, fused = split + t1 - t0, fused + t3 - t2
    return split / fused


def bench_moe_block(repeats: int = 21, tokens: int = 512) -> dict[str, float]:
    """(B + W) / BW of a Hugging Face Mixtral mixture-of-experts block (hidden 512, 8 experts of 1024, 2 per
    token; ``tokens`` per micro-batch as sequences of 128), one thread, thread CPU time: the split with the
    experts' W by formula and without it (their grouped matmuls back through autograd from a graph kept until
    W, as before the formula), alternated with the fused BW each repetition; medians of the per-repetition
    ratios. Also the bytes one micro-batch holds from B to W, each way (:func:`measure_layer`)."""
    import transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        cfg = transformers.MixtralConfig(
            hidden_size=512,
            intermediate_size=1024,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=1,
            vocab_size=64,
        )
        # through the model, as a user has it: its constructor picks the experts' grouped matmul
        block = _FirstOutput(transformers.MixtralForCausalLM(cfg).model.layers[0].mlp)
        x = torch.randn(tokens // 128, 128, 512, requires_grad=True)
        with_formula, without = Stage(block), Stage(block)
        ratios: dict[str, list[float]] = {"formula": [], "autograd": []}
        for _ in range(repeats + 3):
            ratios["formula"].append(_ratio([(with_formula, x)]))
            with _no_grouped_formula():
                ratios["autograd"].append(_ratio([(without, x)]))
        held = _held(block, x)
        with _no_grouped_formula():
            held_autograd = _held(block, x)
    finally:
        torch.set_num_threads(threads)
    return {
        "formula": statistics.median(ratios["formula"][3:]),
        "autograd": statistics.median(ratios["autograd"][3:]),
        "held_formula_mib": held / 2**20,
        "held_autograd_mib": held_autograd / 2**20,
        "deferred_fraction": with_formula.deferred_fraction,
    }


def _held(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes one micro-batch holds from B to W: W's operands and gradients, and the graph where one is kept
    (about what F saved), as the plan counts them."""
    fp = measure_layer(block, x, True)
    return fp.held_bytes + (fp.activation_bytes if fp.graph_kept else 0)


class _FirstOutput(torch.nn.Module):
    """A block that returns a tuple (Hugging Face's MoE blocks: the output and the router logits), as its
    first output alone: what the next block takes."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out[0] if isinstance(out, tuple) else out


@contextmanager
def _no_grouped_formula() -> Iterator[None]:
    """The grouped matmul without its W formula while open (as before it had one)."""
    finder = formulas._FINDERS.pop("GroupedMmBackward0")
    try:
        yield
    finally:
        formulas._FINDERS["GroupedMmBackward0"] = finder
