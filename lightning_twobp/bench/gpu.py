"""On one GPU in bf16: the costs the 2BP paper's 7B result rests on, and the CUDA path run end to end.

    twobp-bench --gpu [--json PATH] [--repeats N] [--quick]

One short script (about 2 to 4 minutes on one H200) in three parts:

1. **One LLaMa-7B layer** (dim 4096, 32 heads, SwiGLU 11008, 1024 tokens) and the 7B head (vocabulary
   32000 with its cross-entropy), in bf16: F, B, W and the fused BW, timed by CUDA events, alternated,
   medians over ``repeats``; ``(B + W) / BW`` is what the split costs on a GPU.
2. **The benchmark's tiny LLaMa through** :class:`~lightning_twobp.engine.PipelineExecutor` **in one
   process**, every stage on the GPU (fp32): step time by CUDA events, ``torch.cuda.max_memory_allocated``,
   and every gradient against one process, for GPipe ± 2BP, interleaved 1F1B ± 2BP and the V.
3. **The measured 7B costs fed to** :func:`~lightning_twobp.schedules.simulate` for 4 stages of 8 layers
   (the head on the last): 1F1B-1 (m = p) with and without 2BP, 1F1B-2, and every Zero Bubble schedule,
   each against the fused 1F1B at the same m, beside the paper's 1.70x (1F1B-1 + 2BP over 1F1B-1).
   Fused schedules are simulated at the fused BW's measured time, split ones at B and W.

Without a GPU, ``--quick`` runs the same code on the CPU in fp32 at toy sizes: that is how the tests
keep this script working on a machine with no GPU. The figures are then not the paper's.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_twobp.bench.workload import Workload, grad_of, loss_fn, reference_grads
from lightning_twobp.engine import PipelineExecutor, Stage
from lightning_twobp.models.llama import Block, Head, LlamaConfig
from lightning_twobp.schedules import Costs, build_schedule, schedule_label, simulate

__all__ = ["LAYER_7B", "markdown", "run_gpu"]

# The 2BP paper's Transformer-7b (LLaMa-7B's shape) and its sequence length.
LAYER_7B = dict(dim=4096, n_heads=32, ffn_hidden=11008, vocab_size=32000, tokens=1024, seq=1024)
LAYER_QUICK = dict(dim=64, n_heads=4, ffn_hidden=176, vocab_size=128, tokens=64, seq=32)
PAPER_SPEEDUP = 1.70  # 2BP paper, Transformer-7b, 1F1B-1 + 2BP over 1F1B-1, 4 GPUs
STAGES, LAYERS_PER_STAGE = 4, 8  # 7B: 32 layers over 4 GPUs


class _Clock:
    """Marks on the device's own timeline: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return b - a
        torch.cuda.synchronize(self.device)
        return a.elapsed_time(b) / 1e3


class _HeadLoss(nn.Module):
    """The last stage's extra work: final norm, vocabulary projection and the cross-entropy."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head = Head(cfg)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def time_split(
    module: nn.Module,
    make: Callable[[], tuple[tuple, dict, torch.Tensor | None]],
    clock: _Clock,
    repeats: int,
    warmup: int = 3,
) -> dict[str, float]:
    """Median seconds of F, B, W and the fused BW of ``module``, alternated ``warmup + repeats`` times.

    ``make()`` gives fresh ``(inputs, kwargs, grad_output)`` (``grad_output=None`` for a scalar loss).
    BW is plain autograd (``backward``) and B + W :class:`Stage`'s split, each from ``.grad = None``.
    ``host_*``: the host's time to issue each phase (on a GPU the device's time between two marks also counts
    the device idling while the host runs the split's Python: a phase whose host time reaches its device time
    is bound by the host, not by its kernels).
    """
    stage = Stage(module)
    times: dict[str, list[float]] = {k: [] for k in ("F", "B", "W", "BW", "host_F", "host_B", "host_W", "host_BW")}
    for i in range(warmup + repeats):
        inputs, kwargs, grad = make()
        module.zero_grad(set_to_none=True)
        out = module(*inputs, **kwargs)
        t1, h1 = clock.mark(), time.perf_counter()
        out.backward(grad)
        t2, h2 = clock.mark(), time.perf_counter()
        del out
        module.zero_grad(set_to_none=True)
        inputs, kwargs, grad = make()
        t3, h3 = clock.mark(), time.perf_counter()
        stage.forward(0, *inputs, **kwargs)
        t4, h4 = clock.mark(), time.perf_counter()
        stage.backward_input(0, grad)
        t5, h5 = clock.mark(), time.perf_counter()
        stage.backward_weight(0)
        t6, h6 = clock.mark(), time.perf_counter()
        if i >= warmup:
            for k, a, b, ha, hb in (
                ("BW", t1, t2, h1, h2),
                ("F", t3, t4, h3, h4),
                ("B", t4, t5, h4, h5),
                ("W", t5, t6, h5, h6),
            ):
                times[k].append(clock.seconds(a, b))
                times[f"host_{k}"].append(hb - ha)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["split_over_fused"] = (med["B"] + med["W"]) / med["BW"]
    return med


def layer_costs(device: torch.device, dtype: torch.dtype, shape: dict, repeats: int) -> dict[str, dict]:
    """Part 1: one transformer layer and the head, timed as :func:`time_split` does."""
    cfg = LlamaConfig(
        vocab_size=shape["vocab_size"],
        dim=shape["dim"],
        n_heads=shape["n_heads"],
        ffn_hidden=shape["ffn_hidden"],
        max_seq_len=shape["seq"],
    )
    clock = _Clock(device)
    batch = shape["tokens"] // shape["seq"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, shape["seq"], shape["dim"], generator=gen).to(device, dtype)
    g = torch.randn(x.shape, generator=gen).to(device, dtype)
    target = torch.randint(0, shape["vocab_size"], (batch, shape["seq"]), generator=gen).to(device)
    torch.manual_seed(0)
    block = Block(cfg).to(device, dtype)
    head = _HeadLoss(cfg).to(device, dtype)
    out = {
        "layer": time_split(block, lambda: ((x.detach().requires_grad_(),), {}, g), clock, repeats),
        "head": time_split(head, lambda: ((x.detach().requires_grad_(), target), {}, None), clock, repeats),
    }
    del block, head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def one_process_pipeline(device: torch.device, wl: Workload, m: int, repeats: int) -> list[dict]:
    """Part 2: every stage in this process, on ``device``, through the executor (fp32)."""
    clock = _Clock(device)
    ids, tgt = (t.to(device) for t in wl.data())
    inputs, targets = list(ids.chunk(m)), list(tgt.chunk(m))
    ref_model = wl.model().to(device)
    ref = reference_grads(ref_model, ids, tgt, m)  # also the warm-up of the plain-autograd timing
    plain = []
    for _ in range(repeats):
        t0 = clock.mark()
        reference_grads(ref_model, ids, tgt, m)
        plain.append(clock.seconds(t0, clock.mark()))
    reference_s = statistics.median(plain)
    rows = []
    for name, num_stages, per_rank, split in (
        ("gpipe", 4, 4, False),
        ("gpipe", 4, 4, True),
        ("interleaved-1f1b", 4, 4, False),
        ("interleaved-1f1b", 4, 4, True),
        ("zb-v", 2, 2, True),
    ):
        model = copy.deepcopy(ref_model)
        stages = wl.stages(model, num_stages)
        schedule = build_schedule(name, num_stages, m, stages_per_rank=per_rank, split_backward=split)
        ex = PipelineExecutor(schedule, dict(enumerate(stages)), loss_fn=loss_fn, device=device)
        model.zero_grad(set_to_none=True)
        ex.step(inputs, targets)  # the gradient check, and the warm-up
        diff = max((grad_of(p) - ref[n]).abs().max().item() for n, p in model.named_parameters())
        close = all(torch.allclose(grad_of(p), ref[n], rtol=1e-5, atol=1e-6) for n, p in model.named_parameters())
        model.zero_grad(set_to_none=True)  # the baseline holds the weights only, not the check's grads
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        steps = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            a = clock.mark()
            ex.step(inputs, targets)
            b = clock.mark()
            steps.append(clock.seconds(a, b))
        peak_mb = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
        rows.append(
            dict(
                schedule=schedule_label(name, split),
                stages=num_stages,
                step_s=statistics.median(steps),
                over_one_process=statistics.median(steps) / reference_s,
                peak_mb_over_weights=peak_mb,
                max_grad_diff=diff,
                grads_match=close,
            )
        )
        del ex, model, stages
    return rows


def simulated_7b(layer: dict, head: dict) -> list[dict]:
    """Part 3: the measured per-layer costs on 4 stages of 8 layers; stage 0's input is token ids, so
    its B is the whole backward at the fused BW's cost and its W empty (as the engine runs it)."""
    n = LAYERS_PER_STAGE

    def per_stage(kind: str, num_stages: int, per: int) -> list[float]:
        vals = [per * layer[kind] for _ in range(num_stages)]
        vals[-1] += head[kind]
        return vals

    rows = []
    for m in (STAGES, 2 * STAGES):
        fused = Costs(f=per_stage("F", STAGES, n), b=per_stage("BW", STAGES, n), w=0.0)
        b = per_stage("B", STAGES, n)
        w = per_stage("W", STAGES, n)
        b[0], w[0] = per_stage("BW", STAGES, n)[0], 0.0  # stage 0 runs one fused backward (token-id input)
        split = Costs(f=per_stage("F", STAGES, n), b=b, w=w)
        base = simulate(build_schedule("1f1b", STAGES, m, split_backward=False), fused).makespan
        vs = 2 * STAGES  # the V: 8 stages of 4 layers
        bv, wv = per_stage("B", vs, n // 2), per_stage("W", vs, n // 2)
        bv[0], wv[0] = per_stage("BW", vs, n // 2)[0], 0.0
        v_costs = Costs(f=per_stage("F", vs, n // 2), b=bv, w=wv)
        cases = [
            ("1f1b", False, STAGES, 1, fused),
            ("1f1b", True, STAGES, 1, split),
            ("zb-h1", True, STAGES, 1, split),
            ("zb-h2", True, STAGES, 1, split),
            ("zb-v", True, vs, 2, v_costs),
        ]
        for name, sb, ns, spr, costs in cases:
            sim = simulate(build_schedule(name, ns, m, stages_per_rank=spr, split_backward=sb, costs=costs), costs)
            rows.append(
                dict(
                    schedule=schedule_label(name, sb),
                    m=m,
                    makespan_s=sim.makespan,
                    bubble=sim.bubble_fraction,
                    speedup_over_1f1b=base / sim.makespan,
                )
            )
    return rows


def run_gpu(*, quick: bool = False, repeats: int = 20) -> dict:
    """All three parts; on a CPU only with ``quick`` (toy sizes, fp32)."""
    cuda = torch.cuda.is_available()
    if not cuda and not quick:
        raise RuntimeError("twobp-bench --gpu needs a CUDA GPU; on a CPU run it with --quick (toy sizes)")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = LAYER_QUICK if quick else LAYER_7B
    costs = layer_costs(device, dtype, shape, 3 if quick else repeats)
    wl = Workload.quick() if quick else Workload()
    result = dict(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        torch_version=torch.__version__,
        shape=shape,
        costs_s=costs,
        pipeline=one_process_pipeline(device, wl, 8 if not quick else 4, 2 if quick else 10),
        simulated=simulated_7b(costs["layer"], costs["head"]),
        paper_speedup=PAPER_SPEEDUP,
    )
    return result


def markdown(r: dict) -> str:
    out = [
        f"{r['device']}, {r['dtype']}, torch {r['torch_version']}; layer dim {r['shape']['dim']}, "
        f"{r['shape']['n_heads']} heads, SwiGLU {r['shape']['ffn_hidden']}, {r['shape']['tokens']} tokens",
        "",
        "| module | F ms | B ms | W ms | fused BW ms | (B + W) / BW | host B / W / BW ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in r["costs_s"].items():
        host = " / ".join(f"{c[f'host_{k}'] * 1e3:.2f}" for k in ("B", "W", "BW"))
        out.append(
            f"| {name} | {c['F'] * 1e3:.2f} | {c['B'] * 1e3:.2f} | {c['W'] * 1e3:.2f} | {c['BW'] * 1e3:.2f} "
            f"| **{c['split_over_fused']:.3f}** | {host} |"
        )
    out += [
        "",
        "| one process, every stage here | stages | step ms | / plain autograd | peak MB | max grad diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in r["pipeline"]:
        peak = "" if p["peak_mb_over_weights"] is None else f"{p['peak_mb_over_weights']:.1f}"
        out.append(
            f"| {p['schedule']} | {p['stages']} | {p['step_s'] * 1e3:.2f} | {p['over_one_process']:.3f} "
            f"| {peak} | {p['max_grad_diff']:.1e}{'' if p['grads_match'] else ' (MISMATCH)'} |"
        )
    out += [
        "",
        f"Simulated at these costs, {STAGES} stages x {LAYERS_PER_STAGE} layers (the paper: "
        f"{r['paper_speedup']:.2f}x for 1F1B-1 + 2BP over 1F1B-1):",
        "",
        "| schedule | m | makespan ms | bubble | over fused 1F1B, same m |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in r["simulated"]:
        out.append(
            f"| {s['schedule']} | {s['m']} | {s['makespan_s'] * 1e3:.1f} | {s['bubble']:.3f} "
            f"| **{s['speedup_over_1f1b']:.3f}x** |"
        )
    return "\n".join(out)
