"""Side by side with torch.distributed.pipelining: the same stages, data and micro-batching, one process group.

    twobp-bench --peer [--rounds N] [--steps K] [--out DIR] [--only LABEL ...] [--quick]

What a user choosing a pipeline engine would compare. On 2 gloo ranks with one thread each, every
contender gets its own deep copy of the same stage modules (the workload's cut, :mod:`.workload`) and its
own AdamW, and trains on the same batch split into the same micro-batches:

* ours: every schedule, with and without 2BP where both exist, through :class:`PipelineExecutor`;
* torch's: ``PipelineStage`` with ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
  ScheduleInterleavedZeroBubble (1 and 2 stages per rank), ScheduleZBVZeroBubble, ScheduleDualPipeV;
* a single process, one thread, accumulating the same micro-batches (rank 0 alone): a bubble-free
  2-stage pipeline would take half of it, the "ideal".

A timed sample is ``K`` back-to-back training steps (pipeline step, ``optimizer.step()``,
``zero_grad()``) between two barriers, divided by ``K``: with ``K > 1`` ranks are free to run into the
next step as far as the engine lets them, which is what a training loop does. Contenders take turns in
rounds (round ``i`` starts at contender ``i``), after warm-up rounds; the table shows medians, and each
ratio is the median over rounds of the per-round ratio, so drift of the shared machine cancels.

Before any timing each contender runs one step from the seed weights, and its gradients are compared
with the single-process gradients of the same micro-batching (fp32, rtol 1e-5, atol 1e-7); a mismatch
fails the run. Without ``torch.distributed.pipelining`` the table has our rows only, and says so.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_twobp.bench.workload import WORLD, Workload, keep_freed_memory, loss_fn, reference_grads
from lightning_twobp.engine import PipelineExecutor, StepResult
from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing
from lightning_twobp.models.llama import Block
from lightning_twobp.monitor import busy_seconds
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules import Schedule, build_schedule, schedule_label

__all__ = [
    "Contender",
    "Runner",
    "build_runner",
    "contenders",
    "grad_error",
    "grad_failures",
    "heading",
    "run_peer",
    "time_steps",
    "what_ran",
]

RTOL, ATOL = 1e-5, 1e-7
# A contender's activation checkpointing in its label: "zb-h1 +AC", "torch 1F1B +AC(sel)"
_AC_SUFFIX = {None: "", "full": " +AC", "selective": " +AC(sel)"}


@dataclass(frozen=True)
class Contender:
    """One pipeline to time. ``schedule`` is our schedule name or the torch class name."""

    side: str  # "ours" | "torch"
    schedule: str
    split_backward: bool = True
    stages_per_rank: int = 1
    placement: str = "loop"  # stage s on rank s % p ("loop") or the V (rank r holds r and 2p - 1 - r)
    counterpart: str | None = None  # label of the torch contender ours is compared with
    max_pending_w: int | None = None  # ours: the cap on W waiting after their B (None: none)
    checkpointing: str | None = None  # every block checkpointed the strategy's way: "full" | "selective"

    def __post_init__(self) -> None:
        if self.checkpointing not in _AC_SUFFIX:
            raise ValueError(
                f"Contender checkpointing={self.checkpointing!r}: use None, 'full' or 'selective' "
                "(the strategy's activation_checkpointing modes that checkpoint every block)"
            )

    @property
    def label(self) -> str:
        if self.side == "ours":
            cap = "" if self.max_pending_w is None else f" k={self.max_pending_w}"
            name = schedule_label(self.schedule, self.split_backward) + cap
        else:
            per_rank = f" ({self.stages_per_rank}/rank)" if self.schedule == "ScheduleInterleavedZeroBubble" else ""
            name = "torch " + self.schedule.removeprefix("Schedule") + per_rank
        return name + _AC_SUFFIX[self.checkpointing]

    @property
    def num_stages(self) -> int:
        return WORLD * self.stages_per_rank

    def stage_ids(self, rank: int) -> tuple[int, ...]:
        if self.stages_per_rank == 1:
            return (rank,)
        if self.placement == "v":
            return (rank, 2 * WORLD - 1 - rank)
        return tuple(rank + k * WORLD for k in range(self.stages_per_rank))


_T_GPIPE = "torch GPipe"
_T_1F1B = "torch 1F1B"
_T_INTERLEAVED = "torch Interleaved1F1B"
_T_ZB1P = "torch InterleavedZeroBubble (1/rank)"
_T_ZBV = "torch ZBVZeroBubble"


def contenders() -> list[Contender]:
    """Ours, each paired with its torch counterpart (the same order, or for ZB-H2 the nearest torch
    has: ZB1P, its ZB-H1), then torch's."""
    ours = [
        Contender("ours", "gpipe", False, counterpart=_T_GPIPE),
        Contender("ours", "gpipe", True, counterpart=_T_GPIPE),
        Contender("ours", "1f1b", False, counterpart=_T_1F1B),
        Contender("ours", "1f1b", True, counterpart=_T_1F1B),
        Contender("ours", "interleaved-1f1b", False, 2, counterpart=_T_INTERLEAVED),
        Contender("ours", "interleaved-1f1b", True, 2, counterpart=_T_INTERLEAVED),
        Contender("ours", "zb-h1", True, counterpart=_T_ZB1P),
        Contender("ours", "zb-h2", True, counterpart=_T_ZB1P),
        Contender("ours", "zb-v", True, 2, "v", counterpart=_T_ZBV),
    ]
    theirs = [
        Contender("torch", "ScheduleGPipe", False),
        Contender("torch", "Schedule1F1B", False),
        Contender("torch", "ScheduleInterleaved1F1B", False, 2),
        Contender("torch", "ScheduleInterleavedZeroBubble", True, 1),
        Contender("torch", "ScheduleInterleavedZeroBubble", True, 2),
        Contender("torch", "ScheduleZBVZeroBubble", True, 2, "v"),
        Contender("torch", "ScheduleDualPipeV", True, 2, "v"),
    ]
    return ours + theirs


def torch_pipelining_available() -> bool:
    try:
        import torch.distributed.pipelining  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Runner:
    """A contender built on this rank: one training step, and its gradients by full-model name."""

    contender: Contender
    step: Callable[[], StepResult | None]  # ours returns the executor's result; torch's schedules return nothing
    params: dict[str, nn.Parameter]
    executor: PipelineExecutor | None = None  # ours only: to record one step's ops
    modules: dict[int, nn.Module] = field(default_factory=dict)  # this rank's stage modules by stage id
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4)

    def train_step(self) -> None:
        self.step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _local_stages(
    c: Contender, model: nn.Sequential, wl: Workload, rank: int, ac: str | None = None
) -> tuple[dict[int, nn.Module], dict[str, nn.Parameter]]:
    """This rank's stages of a fresh copy of ``model``, and their parameters by full-model name (a slice
    of a Sequential keeps the layers' names). ``ac``: each block checkpointed the strategy's way
    (``activation_checkpointing``: "full" or "selective", ``torch.utils.checkpoint(use_reentrant=False)``),
    for ours and torch's alike."""
    parts = wl.stages(copy.deepcopy(model), c.num_stages)
    mods: dict[int, nn.Module] = {s: parts[s] for s in c.stage_ids(rank)}
    if ac is not None:
        blocks = [b for mod in mods.values() for b in mod.children() if isinstance(b, Block)]
        apply_activation_checkpointing(enumerate(blocks), ac)  # copies: nothing to undo
    return mods, {n: q for mod in mods.values() for n, q in mod.named_parameters()}


def build_runner(
    c: Contender,
    model: nn.Sequential,
    wl: Workload,
    m: int,
    rank: int,
    ids: torch.Tensor,
    tgt: torch.Tensor,
    activation_checkpointing: str | None = None,
    schedule: Schedule | None = None,
) -> Runner:
    """``c`` on this rank; ``schedule``: ours, this order (built at measured costs) in place of ``c``'s;
    ``activation_checkpointing``: this mode in place of ``c.checkpointing`` (peer_ac runs one contender both ways)."""
    mods, params = _local_stages(c, model, wl, rank, activation_checkpointing or c.checkpointing)
    last = c.num_stages - 1
    if c.side == "ours":
        sched = schedule or build_schedule(
            c.schedule,
            c.num_stages,
            m,
            stages_per_rank=c.stages_per_rank,
            split_backward=c.split_backward,
            max_pending_w=c.max_pending_w,
        )
        assert set(sched.stages_of(rank)) == set(mods), (c, sched.stage_to_rank)
        ex = PipelineExecutor(sched, mods, loss_fn=loss_fn)
        inputs = list(ids.chunk(m)) if 0 in mods else None
        targets = list(tgt.chunk(m)) if last in mods else None
        return Runner(c, lambda: ex.step(inputs, targets), params, ex, mods)

    import torch.distributed.pipelining as pp

    stages = [pp.PipelineStage(mods[s], s, c.num_stages, torch.device("cpu")) for s in c.stage_ids(rank)]
    cls = getattr(pp, c.schedule)
    single = c.schedule in ("ScheduleGPipe", "Schedule1F1B")
    sched = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=loss_fn)
    args = (ids,) if 0 in mods else ()
    kwargs: dict[str, Any] = {"target": tgt, "losses": []} if last in mods else {}

    def step() -> None:
        if "losses" in kwargs:
            kwargs["losses"].clear()
        sched.step(*args, **kwargs)

    return Runner(c, step, params, modules=mods)


def grad_error(params: dict[str, nn.Parameter], ref: dict[str, torch.Tensor]) -> tuple[float, list[str]]:
    """Largest absolute gradient difference from the reference, and the parameters outside tolerance."""
    worst, bad = 0.0, []
    for name, q in params.items():
        if q.grad is None:
            bad.append(f"{name}: no gradient")
            continue
        diff = (q.grad - ref[name]).abs()
        worst = max(worst, diff.max().item())
        if not torch.allclose(q.grad, ref[name], rtol=RTOL, atol=ATOL):
            bad.append(f"{name}: max abs diff {diff.max().item():.3g}")
    return worst, bad


def _worker(
    rank: int,
    world: int,
    wl: Workload,
    m: int,
    rounds: int,
    warmup: int,
    steps: int,
    labels: list[str] | None,
    with_torch: bool,
) -> dict:
    keep_freed_memory()
    model = wl.model()
    ids, tgt = wl.data()
    ref = reference_grads(copy.deepcopy(model), ids, tgt, m)
    chosen = [
        c
        for c in contenders()
        if (with_torch or c.side == "ours") and (labels is None or any(c.label.startswith(x) for x in labels))
    ]
    runners = [build_runner(c, model, wl, m, rank, ids, tgt) for c in chosen]

    # Exactness first: one step from the seed weights, gradients against one process, no optimizer step.
    checks = {}
    for r in runners:
        dist.barrier()
        r.step()
        checks[r.contender.label] = grad_error(r.params, ref)
        r.optimizer.zero_grad(set_to_none=True)

    single = copy.deepcopy(model)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-4)

    def run_single(both: bool) -> float:
        """Gradient accumulation of the whole model on one thread; ``both``: every rank at once, which
        shows what two busy cores cost each other (shared caches and memory bandwidth)."""
        dist.barrier()
        t = time.perf_counter()
        if rank == 0 or both:
            for _ in range(steps):
                for x, y in zip(ids.chunk(m), tgt.chunk(m), strict=False):
                    (loss_fn(single(x), y) / m).backward()
                single_opt.step()
                single_opt.zero_grad(set_to_none=True)
        dist.barrier()
        return (time.perf_counter() - t) / steps

    times: dict[str, list[float]] = {r.contender.label: [] for r in runners}
    times["single"], times["single (both cores)"] = [], []
    for i in range(warmup + rounds):
        order = runners[i % len(runners) :] + runners[: i % len(runners)]
        sample = {r.contender.label: time_steps(r, steps) for r in order}
        sample["single"] = run_single(False)
        sample["single (both cores)"] = run_single(True)
        if i >= warmup:
            for k, v in sample.items():
                times[k].append(v)
    return {"times": times, "checks": checks, "busy": _busy(runners, steps)}


def time_steps(r: Runner, steps: int) -> float:
    """Seconds per training step of ``r`` over ``steps`` back-to-back steps, barrier to barrier."""
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        r.train_step()
    dist.barrier()
    return (time.perf_counter() - t) / steps


def _busy(runners: list[Runner], steps: int) -> dict[str, float]:
    """This rank's compute per step in each of our contenders: ``steps`` recorded steps, the F, B, W
    and BW ops' durations less their time blocked on receives, averaged (recording adds a little to
    each F). The busiest rank's figure is a floor for that contender's step; the optimizer step and the
    sends' completion are not in it."""
    out = {}
    for r in runners:
        if r.executor is None:
            continue
        r.executor.record = True
        total = 0.0
        dist.barrier()
        for _ in range(steps):
            res = r.step()
            assert res is not None  # ours: the executor's result
            total += busy_seconds(res.records)[0]
            r.optimizer.step()
            r.optimizer.zero_grad(set_to_none=True)
        r.executor.record = False
        out[r.contender.label] = total / steps
    return out


def run_peer(
    wl: Workload = Workload(),
    m: int = 8,
    rounds: int = 7,
    warmup: int = 1,
    steps: int = 1,
    labels: list[str] | None = None,
) -> dict:
    """Run the side-by-side benchmark; returns the rows, the pairs and best-vs-best (see :func:`report`)."""
    with_torch = torch_pipelining_available()
    per_rank = run_distributed(_worker, WORLD, wl, m, rounds, warmup, steps, labels, with_torch, timeout=14400)
    times = per_rank[0]["times"]  # barrier to barrier: the same on every rank
    ideal = statistics.median(times["single"]) / WORLD
    by_label = {c.label: c for c in contenders()}
    failures: list[str] = []
    rows = []
    for label in times:
        if not label.startswith("single"):
            failures += grad_failures(per_rank, label, 5)
            rows.append(_row(by_label[label], per_rank, wl, ideal))
    if failures:
        raise AssertionError("gradients differ from one process:\n" + "\n".join(failures))
    best = {}
    for side in ("ours", "torch"):
        side_rows = [r for r in rows if r["side"] == side]
        if side_rows:
            best[side] = min(side_rows, key=lambda r: r["step_s"])["label"]
    return dict(
        workload=asdict(wl),
        world=WORLD,
        microbatches=m,
        rounds=rounds,
        warmup_rounds=warmup,
        steps_per_sample=steps,
        torch_version=torch.__version__,
        torch_pipelining=with_torch,
        single_step_s=statistics.median(times["single"]),
        ideal_step_s=ideal,
        single_both_cores_step_s=statistics.median(times["single (both cores)"]),
        rows=rows,
        pairs=_pairs(rows, times),
        best=best,
        best_vs_best=_pair_ratio(times, best["ours"], best["torch"]) if len(best) == 2 else None,
        ours_best_over_ideal=ideal / min(r["step_s"] for r in rows if r["side"] == "ours"),
        busiest_rank_bound_s=min((r["busiest_rank_s"] for r in rows if r["side"] == "ours"), default=None),
    )


def what_ran(c: Any) -> dict[str, Any]:
    """A result row's pipeline: ``side``, ``schedule`` and ``split_backward`` of a :class:`Contender` (or of
    the paper benchmark's rows)."""
    return dict(side=c.side, schedule=c.schedule, split_backward=c.split_backward)


def grad_failures(per_rank: list[dict], label: str, most: int) -> list[str]:
    """Contender ``label``'s gradient mismatches against one process on any rank (the first ``most``),
    from each rank's ``checks[label] = (worst difference, mismatches)``."""
    bad = [b for out in per_rank for b in out["checks"][label][1]]
    return [f"{label}: " + "; ".join(bad[:most])] if bad else []


def _row(c: Contender, per_rank: list[dict], wl: Workload, ideal: float) -> dict:
    """Contender ``c``'s row: its median step against the ideal (one process's step / WORLD), its
    largest gradient difference, and (ours) the busiest rank's compute seconds."""
    samples = per_rank[0]["times"][c.label]
    med = statistics.median(samples)
    busiest = max((out["busy"][c.label] for out in per_rank), default=None) if c.side == "ours" else None
    return dict(
        label=c.label,
        **what_ran(c),
        stages_per_rank=c.stages_per_rank,
        counterpart=c.counterpart,
        step_s=med,
        samples_per_s=wl.batch / med,
        ideal_over_step=ideal / med,
        max_grad_diff=max(out["checks"][c.label][0] for out in per_rank),
        busiest_rank_s=busiest,
        samples_s=samples,
    )


def _pair_ratio(times: dict, a: str, b: str) -> float:
    """Median over rounds of time(b) / time(a): above 1 means ``a`` is faster."""
    return statistics.median(_per_round(times, a, b))


def _per_round(times: dict, a: str, b: str) -> list[float]:
    return [tb / ta for ta, tb in zip(times[a], times[b], strict=False)]


def _pairs(rows: list[dict], times: dict) -> list[dict]:
    """Each of our contenders against its torch counterpart, round by round."""
    return [
        dict(
            ours=r["label"],
            torch=r["counterpart"],
            speedup=_pair_ratio(times, r["label"], r["counterpart"]),
            rounds=_per_round(times, r["label"], r["counterpart"]),
        )
        for r in rows
        if r["side"] == "ours" and r["counterpart"] in times
    ]


def heading(result: dict, what: str) -> str:
    """A side-by-side report's opening: the workload, the ranks, torch's version, ``what``, and whether
    torch.distributed.pipelining could be compared."""
    wl = result["workload"]
    text = (
        f"tiny LLaMa {wl['layers']} x {wl['dim']}, batch {wl['batch']} x {wl['seq']}, m = {result['microbatches']}, "
        f"{result['world']} gloo ranks x 1 thread, torch {result['torch_version']}; {what}\n\n"
    )
    if not result["torch_pipelining"]:
        text += "torch.distributed.pipelining is not importable in this torch build: only our rows are shown.\n\n"
    return text


def markdown(result: dict) -> str:
    """The result as Markdown: the contenders, the pairs, best against best."""
    out = io.StringIO()
    w = out.write
    steps, rounds = result["steps_per_sample"], result["rounds"]
    w(heading(result, f"a sample is {steps} back-to-back training step(s), median of {rounds} rounds"))
    w(
        f"single process, 1 thread: {result['single_step_s']:.3f} s/step; ideal bubble-free 2-stage step "
        f"(half of it): **{result['ideal_step_s']:.3f} s**; single process on both cores at once: "
        f"{result['single_both_cores_step_s']:.3f} s/step\n\n"
    )
    bound = result.get("busiest_rank_bound_s")
    if bound:
        w(
            f"busiest rank's compute per step, least over our contenders (recorded steps, waits excluded; a floor "
            f"for those steps): **{bound:.3f} s** = {result['ideal_step_s'] / bound:.3f} of the ideal\n\n"
        )
    w(
        "| contender | s/step | samples/s | ideal / step | busiest rank s | max grad diff vs 1 process |\n"
        "|---|---:|---:|---:|---:|---:|\n"
    )
    for r in sorted(result["rows"], key=lambda r: r["step_s"]):
        busy = "" if r.get("busiest_rank_s") is None else f"{r['busiest_rank_s']:.3f}"
        w(
            f"| {r['label']} | {r['step_s']:.3f} | {r['samples_per_s']:.2f} | {r['ideal_over_step']:.3f} | {busy} | "
            f"{r['max_grad_diff']:.1e} |\n"
        )
    if result["pairs"]:
        w(
            "\n| ours | torch counterpart | speed-up (median of per-round ratios) | min – max over rounds "
            "| rounds ours faster |\n|---|---|---:|---:|---:|\n"
        )
        for p in result["pairs"]:
            rounds = p.get("rounds") or [p["speedup"]]
            w(
                f"| {p['ours']} | {p['torch']} | **{p['speedup']:.3f}x** | {min(rounds):.3f} – {max(rounds):.3f} "
                f"| {sum(x > 1 for x in rounds)}/{len(rounds)} |\n"
            )
    if result["best_vs_best"] is not None:
        w(
            f"\nbest vs best: ours ({result['best']['ours']}) is **{result['best_vs_best']:.3f}x** torch's "
            f"({result['best']['torch']}); "
        )
    w(f"our best is {result['ours_best_over_ideal']:.3f} of the ideal step\n")
    return out.getvalue()


def write(result: dict, folder: str | Path) -> list[Path]:
    """``peer.md``, ``peer.csv`` (one row per contender) and ``peer.json`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "peer.md", folder / "peer.csv", folder / "peer.json"]
    paths[0].write_text(markdown(result))
    with paths[1].open("w", newline="") as fh:
        cols = [
            "label",
            "side",
            "schedule",
            "split_backward",
            "stages_per_rank",
            "counterpart",
            "step_s",
            "samples_per_s",
            "ideal_over_step",
            "busiest_rank_s",
            "max_grad_diff",
        ]
        writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
    paths[2].write_text(json.dumps(result, indent=2))
    return paths
