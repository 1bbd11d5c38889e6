"""``twobp-bench --budget``: within each memory budget, the fastest of ours against the fastest of torch's.

    twobp-bench --budget [--out DIR] [--steps K] [--only LABEL ...] [--counts M ...] [--no-auto] [--quick]

Budgets are 0.5x, 1x, 1.5x and 2x fused 1F1B's measured peak at the first micro-batch count (m = 8). Every contender
(ours: each schedule with and without the split, capped 1F1B + 2BP and ZB-H2, at m = 8 and 16; torch's:
each ``torch.distributed.pipelining`` schedule at m = 8 and 16; on both sides some with every block
checkpointed, see below) runs alone in a fresh pair of gloo processes, one thread each, on the same stage
modules as ``--peer`` (:mod:`.peer`):

* **peak memory per rank**: the process's resident high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` once the contender is built) above its resident memory then, over one
  warm-up and one steady training step (pipeline step, AdamW step, ``zero_grad``). Fresh processes,
  since freed memory is kept by the allocator (``keep_freed_memory``) and would hide the next one's;
* **speed**: then fused 1F1B (m = 8) is built in the same processes and the two take turns for ``K``
  rounds, barrier to barrier; ``vs_1f1b`` is the median over rounds of fused 1F1B's step time over the
  contender's (above 1: faster). Each contender is compared with the same reference in its own run, so
  the machine's load cancels in the ratio; ours against torch's is the ratio of the two ratios;
* **exactness**: a second copy from the seed weights runs one step, and its gradients are checked
  against one process at the same micro-batching (rtol 1e-5, computed once per m), as in ``--peer``.

At each budget the table shows the fastest contender of each side whose peak (the larger rank's) fits.
Measured peaks are of a process on a shared CPU machine: a few MiB of noise (thread stacks, Python
objects) come with them.

**Activation checkpointing** is a contender's dimension (:attr:`Contender.checkpointing <.peer.Contender>`,
labels ``+AC`` for ``"full"`` and ``+AC(sel)`` for ``"selective"``): each block of both sides' stages
wrapped the strategy's way (:func:`~lightning_twobp.lightning.checkpointing.apply_activation_checkpointing`,
as ``--peer --activation-checkpointing`` does), the gradients checked against one process as for every
contender. Every contender's steady step counts each block's forwards per micro-batch (recomputes
included: 2 for one recompute; torch's split backward recomputes a checkpointed block in each of its
autograd calls). A torch contender that cannot run a mode (its zero-bubble schedules under
``"selective"``) is listed as not run, with its first error.

**auto**, a third contender, is ``schedule="auto"``'s search (:func:`lightning_twobp.schedules.auto.search`
and ``choose``) without a look at the measurements above: every layer and the loss of the workload are
measured once in this process on one thread (:func:`workload_profile`: bytes F saves, B leaves for W,
F / B / W / fused BW thread seconds), with as fixed bytes what a contender adds above the built model (gradients,
AdamW's two moments), no link time. Budget ``x`` is given to it as the strategy's ``memory_limit="<x>x1f1b"``
reads it, ``x`` times fused 1F1B's *predicted* peak at the baseline's m; its pick, the order it built
at those costs, then runs like every contender, and the table sets its measured peak against the
budget in measured bytes (``x`` times fused 1F1B's measured peak).
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import io
import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_twobp.bench.memory_model import ADAMW_COPIES, layer_costs, partitions
from lightning_twobp.bench.paper import PaperModel
from lightning_twobp.bench.peer import Contender, build_runner, grad_error, torch_pipelining_available
from lightning_twobp.bench.peer_ac import counted_forwards, first_error
from lightning_twobp.bench.progress import say
from lightning_twobp.bench.workload import WORLD, Workload, keep_freed_memory, reference_grads
from lightning_twobp.engine.memory import return_freed_memory
from lightning_twobp.monitor import peak_rss_mb, reset_peak_rss, rss_mb
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules import Schedule, build_schedule, simulate
from lightning_twobp.schedules.auto import Candidate, NoScheduleFits, Profile, choose, search

__all__ = ["BUDGETS", "auto_picks", "budget_contenders", "markdown", "run_budget", "workload_profile", "write"]

BUDGETS = (0.5, 1.0, 1.5, 2.0)
MiB = 2**20
_MARKERS = {None: "o", "full": "^", "selective": "s"}  # the plot's point for each activation checkpointing
_CSV_COLUMNS = (
    "label",
    "side",
    "microbatches",
    "max_pending_w",
    "checkpointing",
    "peak_bytes",
    "vs_1f1b",
    "step_s",
    "max_grad_diff",
)


def budget_contenders(with_torch: bool, counts: tuple[int, ...] = (8, 16)) -> list[tuple[Contender, int]]:
    """(contender, m) pairs: ours with the caps that trade memory, torch's own schedules, and on both sides
    some with every block checkpointed (labels ``+AC``: ``"full"``, ``+AC(sel)``: ``"selective"``)."""
    ours = [
        Contender("ours", "1f1b", False),
        Contender("ours", "1f1b", True),
        *[Contender("ours", "1f1b", True, max_pending_w=k) for k in (0, 1, 2)],
        Contender("ours", "interleaved-1f1b", True, 2),
        Contender("ours", "zb-h1", True),
        Contender("ours", "zb-h2", True),
        *[Contender("ours", "zb-h2", True, max_pending_w=k) for k in (1, 2)],
        Contender("ours", "zb-v", True, 2, "v"),
        Contender("ours", "v-half", True, 2, "v"),
        Contender("ours", "v-min", True, 2, "v"),
        Contender("ours", "1f1b", False, checkpointing="full"),
        Contender("ours", "1f1b", True, max_pending_w=0, checkpointing="full"),
        Contender("ours", "zb-h1", True, checkpointing="full"),
        Contender("ours", "zb-h1", True, checkpointing="selective"),
        Contender("ours", "v-min", True, 2, "v", checkpointing="full"),
    ]
    theirs = [
        Contender("torch", "Schedule1F1B", False),
        Contender("torch", "ScheduleGPipe", False),
        Contender("torch", "ScheduleInterleaved1F1B", False, 2),
        Contender("torch", "ScheduleInterleavedZeroBubble", True, 1),
        Contender("torch", "ScheduleZBVZeroBubble", True, 2, "v"),
        Contender("torch", "Schedule1F1B", False, checkpointing="full"),
        Contender("torch", "Schedule1F1B", False, checkpointing="selective"),
        Contender("torch", "ScheduleInterleavedZeroBubble", True, 1, checkpointing="full"),
        # fails at its first W (its split recomputes a block twice, which selective refuses): listed as not run
        Contender("torch", "ScheduleInterleavedZeroBubble", True, 1, checkpointing="selective"),
        Contender("torch", "ScheduleZBVZeroBubble", True, 2, "v", checkpointing="full"),
    ]
    return [(c, m) for m in counts for c in ours + (theirs if with_torch else [])]


BASELINE = Contender("ours", "1f1b", False)


def _timed(runner: Any, out: list[float]) -> None:
    dist.barrier()
    t = time.perf_counter()
    runner.train_step()
    dist.barrier()
    out.append(time.perf_counter() - t)


def _one(
    rank: int,
    world: int,
    wl: Workload,
    c: Contender,
    m: int,
    steps: int,
    base_m: int,
    refs: str,
    schedule: Schedule | None = None,
) -> dict:
    # The peak with freed blocks returned: the resident set then follows the tensors alive, as a GPU
    # allocator's max_memory_allocated does; kept, the heap's fragments add 15-25% that no model of
    # tensors predicts and that differs between orders (engine.memory.return_freed_memory).
    return_freed_memory()
    model = wl.model()
    ids, tgt = wl.data()
    runner = build_runner(c, model, wl, m, rank, ids, tgt, schedule=schedule)
    dist.barrier()
    before = rss_mb() * 1e6
    reset_peak_rss()
    _timed(runner, [])  # a warm-up (AdamW's state is created there; torch's stages infer their shapes)
    with counted_forwards(runner) as calls:  # and one steady step, its block forwards counted
        _timed(runner, [])
    peak = round(peak_rss_mb() * 1e6 - before)
    keep_freed_memory()  # the timing, as every benchmark and the strategy on CPU run
    # time: alternated with fused 1F1B built in the same processes, so the machine's load cancels in the ratio
    base = build_runner(BASELINE, model, wl, base_m, rank, ids, tgt)
    _timed(base, [])
    ours_t: list[float] = []
    base_t: list[float] = []
    for i in range(steps):
        pair = [(runner, ours_t), (base, base_t)]
        for r, out in pair if i % 2 == 0 else pair[::-1]:
            _timed(r, out)
    del base
    # exactness, after the measurement: a fresh copy from the seed weights, one step, against one process
    check = build_runner(c, model, wl, m, rank, ids, tgt, schedule=schedule)
    check.step()
    worst, bad = grad_error(check.params, torch.load(refs, weights_only=True))
    return {
        "forwards": sorted({n / m for n in calls.values()}),
        "peak_bytes": peak,
        "step_s": statistics.median(ours_t),
        "vs_1f1b": statistics.median(b / o for b, o in zip(base_t, ours_t, strict=True)),
        "max_grad_diff": worst,
        "bad": bad,
    }


def _reference_files(wl: Workload, counts: tuple[int, ...], folder: Path) -> dict[int, str]:
    """One process's gradients at each micro-batch count, computed once and read by every contender."""
    model = wl.model()
    ids, tgt = wl.data()
    paths = {}
    for m in counts:
        paths[m] = str(folder / f"reference-m{m}.pt")
        torch.save(reference_grads(copy.deepcopy(model), ids, tgt, m), paths[m])
    return paths


def _row(c: Contender, m: int, per_rank: list[dict], wl: Workload, baseline: bool) -> dict:
    peaks = [r["peak_bytes"] for r in per_rank]
    step = max(r["step_s"] for r in per_rank)
    return dict(
        label=f"{c.label} m={m}",
        side=c.side,
        schedule=c.schedule,
        split_backward=c.split_backward,
        max_pending_w=c.max_pending_w,
        checkpointing=c.checkpointing,
        microbatches=m,
        peak_bytes_per_rank=peaks,
        peak_bytes=max(peaks),
        step_s=step,
        samples_per_s=wl.batch / step,
        vs_1f1b=min(r["vs_1f1b"] for r in per_rank),  # the ranks time the same barrier-to-barrier steps
        max_grad_diff=max(r["max_grad_diff"] for r in per_rank),
        forwards_per_block=[r["forwards"] for r in per_rank],  # per micro-batch, each rank's distinct counts
        baseline=baseline,
    )


def _fastest_within(rows: list[dict], base: dict) -> list[dict]:
    budgets = []
    for x in BUDGETS:
        limit = x * base["peak_bytes"]
        best = {}
        for side in ("ours", "torch"):
            fits = [r for r in rows if r["side"] == side and r["peak_bytes"] <= limit]
            best[side] = max(fits, key=lambda r: r["vs_1f1b"])["label"] if fits else None
        budgets.append(dict(times_1f1b=x, limit_bytes=limit, ours=best["ours"], torch=best["torch"]))
    return budgets


def workload_profile(wl: Workload, counts: tuple[int, ...], repeats: int = 3) -> Profile:
    """The search's :class:`~lightning_twobp.schedules.auto.Profile` of ``wl`` at ``counts`` micro-batches:
    every layer and the loss on one thread (:func:`~lightning_twobp.bench.memory_model.layer_costs`: F, B,
    W and the fused BW, so that the search sees what the split costs), cut as the runs cut it (the loss
    joins the last stage), with as fixed bytes what a contender adds above the built model: a gradient
    per weight (``fixed``) and AdamW's two moments (``optimizer``)."""
    kw = (("vocab_size", wl.vocab), ("dim", wl.dim), ("n_layers", wl.layers), ("n_heads", wl.heads))
    pm = PaperModel("llama", "Transformer-7b", (*kw, ("max_seq_len", wl.seq)), wl.batch, wl.seq, wl.layers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank of the runs
    try:
        measured = {m: layer_costs(pm, wl.batch // m, repeats=repeats, clock=time.thread_time) for m in counts}
    finally:
        torch.set_num_threads(threads)
    # layer_costs' fixed is a weight, its gradient and AdamW's two moments; the weight is the built model
    one = 1 / ADAMW_COPIES
    layers = {
        m: tuple(dataclasses.replace(c, fixed=one * c.fixed, optimizer=2 * one * c.fixed) for c in rows)
        for m, rows in measured.items()
    }
    return Profile(WORLD, layers, partitions(pm, WORLD))


def predicted_1f1b_peak(profile: Profile, m: int) -> float:
    """Fused 1F1B's predicted peak (the fuller rank's) at ``m``: the unit of auto's limits here."""
    schedule = build_schedule("1f1b", profile.num_ranks, m, split_backward=False)
    return max(simulate(schedule, profile.costs(m, 1)).peak_bytes)


def auto_picks(profile: Profile, base_m: int) -> list[dict]:
    """At each budget ``x``, what ``schedule="auto"`` picks under ``memory_limit="<x>x1f1b"`` with fused
    1F1B's peak predicted at ``base_m`` (the baseline's m): the candidate (``pick``), or the refusal."""
    base = predicted_1f1b_peak(profile, base_m)
    candidates = search(profile, max_caps=2 * profile.num_ranks)
    out = []
    for x in BUDGETS:
        pick: Candidate | None = None
        refused = None
        try:
            pick = choose(candidates, x * base).best
        except NoScheduleFits as e:
            refused = str(e)
        out.append(dict(times_1f1b=x, predicted_limit_bytes=x * base, pick=pick, refused=refused))
    return out


def _auto_contender(pick: Candidate) -> Contender:
    """The contender that holds ``pick``'s stages (the V's placement where its order has it)."""
    v = pick.stages_per_rank
    shape = "v" if v == 2 and pick.schedule.stages_of(0) == (0, 2 * WORLD - 1) else "loop"
    return Contender("ours", pick.name, pick.split_backward, v, shape, max_pending_w=pick.max_pending_w)


def _auto_row(pick: dict, base: dict, by: dict[str, dict]) -> dict:
    """One budget's auto: its pick, predicted and measured peak per rank, within the budget or not, speed."""
    limit = pick["times_1f1b"] * base["peak_bytes"]
    c: Candidate | None = pick["pick"]
    out = dict(
        times_1f1b=pick["times_1f1b"],
        limit_bytes=limit,
        predicted_limit_bytes=pick["predicted_limit_bytes"],
        refused=pick["refused"],
        label=None,
    )
    if c is None:
        return out
    r = by.get(f"auto: {c.label}")
    out.update(label=f"auto: {c.label}", predicted_peak_bytes_per_rank=list(c.peak_bytes), predicted_step_s=c.step_time)
    if r is not None:
        out.update(peak_bytes_per_rank=r["peak_bytes_per_rank"], within=r["peak_bytes"] <= limit, vs_1f1b=r["vs_1f1b"])
    return out


def _chosen(
    wl: Workload, with_torch: bool, counts: tuple[int, ...], only: set[str] | None
) -> list[tuple[Contender, int]]:
    """The ``(contender, m)`` pairs to run: those labelled as in ``only`` and the baseline, or all. A count
    that does not split the batch, or a label that no contender has (torch's with torch or without), is
    refused before anything runs."""
    if not counts or any(m < 1 or wl.batch % m for m in counts):
        raise ValueError(
            f"--budget --counts {' '.join(map(str, counts))}: a batch of {wl.batch} does not split into that "
            f"many equal micro-batches; use divisors of {wl.batch} (the default is 8 16)"
        )
    pairs = budget_contenders(with_torch, counts)
    if only is None:
        return pairs
    known = {c.label for c, _ in budget_contenders(with_torch=True)}
    unknown = sorted(only - known)
    if unknown:
        raise ValueError(
            f"--budget --only: no contender is labelled {', '.join(map(repr, unknown))}; "
            f"use labels of these: {', '.join(sorted(known))}"
        )
    return [(c, m) for c, m in pairs if c.label in only | {BASELINE.label}]


def run_budget(
    wl: Workload = Workload(),
    steps: int = 5,
    counts: tuple[int, ...] = (8, 16),
    only: set[str] | None = None,
    auto: bool = True,
) -> dict:
    """Every contender alone, then the fastest of each side within each budget, and (``auto``) what
    ``schedule="auto"`` picks at each budget, run the same way (see the module docstring). ``only``: the
    contenders with these labels (fused ``"1f1b"``, the baseline, is always run)."""
    with_torch = torch_pipelining_available()
    chosen = _chosen(wl, with_torch, counts, only)
    rows: list[dict] = []
    skipped: list[str] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        refs = _reference_files(wl, counts, Path(tmp))

        def run(c: Contender, m: int, auto_label: str | None = None, schedule: Schedule | None = None) -> None:
            say(f"--budget: {auto_label or c.label} at m={m}, alone in a fresh pair of processes")
            try:
                per_rank = run_distributed(_one, WORLD, wl, c, m, steps, counts[0], refs[m], schedule, timeout=1800)
            except RuntimeError as e:  # a schedule that does not take this m (torch's checks), or this checkpointing
                skipped.append(f"{auto_label or c.label} m={m}: {first_error(e)}")
                return
            bad = [b for r in per_rank for b in r["bad"]]
            if bad:
                failures.append(f"{auto_label or c.label} m={m}: " + "; ".join(bad[:3]))
            row = _row(c, m, per_rank, wl, baseline=auto_label is None and c == BASELINE and m == counts[0])
            rows.append(row if auto_label is None else {**row, "label": auto_label, "side": "auto"})

        for c, m in chosen:
            run(c, m)
        profile = workload_profile(wl, counts) if auto else None
        picks = auto_picks(profile, counts[0]) if profile is not None else []
        distinct = {f"auto: {p['pick'].label}": p["pick"] for p in picks if p["pick"] is not None}
        for label, pick in distinct.items():  # budgets that pick the same schedule share its run
            run(_auto_contender(pick), pick.num_microbatches, label, pick.schedule)
    if failures:
        raise AssertionError("gradients differ from one process:\n" + "\n".join(failures))
    base = next(r for r in rows if r["baseline"])
    run_info = {"workload": asdict(wl), "world": WORLD, "steps": steps, "torch_pipelining": with_torch}
    by = {r["label"]: r for r in rows}
    autos = [_auto_row(p, base, by) for p in picks]
    predicted_base = predicted_1f1b_peak(profile, counts[0]) if profile is not None else None
    return {
        **run_info,
        "baseline": base["label"],
        "rows": rows,
        "budgets": _fastest_within(rows, base),
        "auto": autos,
        "auto_base_predicted_bytes": predicted_base,
        "skipped": skipped,
    }


def markdown(result: dict) -> str:
    wl = result["workload"]
    by = {r["label"]: r for r in result["rows"]}
    out = io.StringIO()
    w = out.write
    w(
        f"tiny LLaMa {wl['layers']} x {wl['dim']}, batch {wl['batch']} x {wl['seq']}, {result['world']} gloo ranks x "
        f"1 thread, each contender alone in a fresh pair of processes; speed = median over {result['steps']} rounds "
        f"of {result['baseline']}'s (fused 1F1B) step time over the contender's, taking turns in the same "
        f"processes; peak = resident high-water mark above the built contender, the larger rank's; budgets in units of "
        f"{result['baseline']}'s {by[result['baseline']]['peak_bytes'] / MiB:.0f} MiB\n\n"
    )
    w(
        "| budget | MiB | ours: fastest that fits | MiB per rank | speed vs fused 1F1B | torch: fastest that fits "
        "| MiB per rank | speed vs fused 1F1B | ours / torch throughput |\n"
        "|---|---:|---|---:|---:|---|---:|---:|---:|\n"
    )
    for b in result["budgets"]:
        cells = []
        for side in ("ours", "torch"):
            r = by.get(b[side])
            cells += (
                [r["label"], " / ".join(f"{p / MiB:.0f}" for p in r["peak_bytes_per_rank"]), f"{r['vs_1f1b']:.3f}"]
                if r
                else ["none fits", "", ""]
            )
        ratio = f"{by[b['ours']]['vs_1f1b'] / by[b['torch']]['vs_1f1b']:.2f}x" if b["ours"] and b["torch"] else ""
        w(f"| {b['times_1f1b']:g}x | {b['limit_bytes'] / MiB:.0f} | " + " | ".join(cells) + f" | {ratio} |\n")
    if result.get("auto"):
        w(_auto_markdown(result, by))
    w(
        "\nEvery contender (`+AC`: every block under `torch.utils.checkpoint`, `+AC(sel)`: the selective policy; "
        "forwards: each block's forwards per micro-batch in the steady step, recomputes included, rank 0 / rank 1)"
        "\n\n| contender | MiB per rank | forwards / block / micro-batch | speed vs fused 1F1B | s/step "
        "| max grad diff |\n|---|---:|---:|---:|---:|---:|\n"
    )
    for r in sorted(result["rows"], key=lambda r: r["peak_bytes"]):
        peaks = " / ".join(f"{p / MiB:.0f}" for p in r["peak_bytes_per_rank"])
        fwd = " / ".join(",".join(f"{f:g}" for f in fs) for fs in r["forwards_per_block"])
        w(f"| {r['label']} | {peaks} | {fwd} | {r['vs_1f1b']:.3f} | {r['step_s']:.3f} | {r['max_grad_diff']:.1e} |\n")
    if result["skipped"]:
        w("\nnot run: " + "; ".join(result["skipped"]) + "\n")
    return out.getvalue()


def _mib(values: list[float]) -> str:
    return " / ".join(f"{v / MiB:.0f}" for v in values)


def _auto_markdown(result: dict, by: dict[str, dict]) -> str:
    """auto's table: per budget its pick, predicted and measured MiB per rank against the limit, speed."""
    base = result["auto_base_predicted_bytes"]
    lines = [
        f"\n**auto** (`schedule=\"auto\"`'s search on this workload's layers measured in one process; limit "
        f"x times fused 1F1B's predicted peak, {base / MiB:.0f} MiB, against its measured "
        f"{by[result['baseline']]['peak_bytes'] / MiB:.0f} MiB)\n\n",
        "| budget | limit MiB, predicted | auto's pick | predicted MiB per rank | limit MiB, measured | measured MiB "
        "per rank | within | speed vs fused 1F1B | auto / ours' fastest that fits |\n"
        "|---|---:|---|---:|---:|---:|---|---:|---:|\n",
    ]
    fastest = {b["times_1f1b"]: by.get(b["ours"] or "") for b in result["budgets"]}
    for a in result["auto"]:
        head = f"| {a['times_1f1b']:g}x | {a['predicted_limit_bytes'] / MiB:.0f} | "
        if a["label"] is None:
            lines.append(head + f"refused | | {a['limit_bytes'] / MiB:.0f} | | | | |\n")
            continue
        measured = a.get("peak_bytes_per_rank")
        ours = fastest.get(a["times_1f1b"])
        ratio = f"{a['vs_1f1b'] / ours['vs_1f1b']:.2f}x" if measured and ours else ""
        cells = [
            a["label"].removeprefix("auto: "),
            _mib(a["predicted_peak_bytes_per_rank"]),
            f"{a['limit_bytes'] / MiB:.0f}",
            _mib(measured) if measured else "not run",
            ("yes" if a["within"] else "**no**") if measured else "",
            f"{a['vs_1f1b']:.3f}" if measured else "",
            ratio,
        ]
        lines.append(head + " | ".join(cells) + " |\n")
    return "".join(lines)


def write(result: dict, folder: str | Path) -> list[Path]:
    """``budget.md``, ``budget.csv`` (every contender, auto's picks as side ``auto``), ``budget.json``
    and, with matplotlib, ``budget.png`` (throughput against peak memory, one point per contender, the
    budgets as vertical lines) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "budget.md", folder / "budget.csv", folder / "budget.json"]
    paths[0].write_text(markdown(result))
    with paths[1].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=_CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
    paths[2].write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(8, 5))
    for side, color in (("ours", "tab:blue"), ("torch", "tab:orange"), ("auto", "tab:green")):
        for ac, marker in _MARKERS.items():
            rows = [r for r in result["rows"] if r["side"] == side and r["checkpointing"] == ac]
            if rows:
                x, y = [r["peak_bytes"] / MiB for r in rows], [r["vs_1f1b"] for r in rows]
                ax.scatter(x, y, c=color, marker=marker, label=side + (f", checkpointing {ac}" if ac else ""))
            for r in rows:
                ax.annotate(r["label"], (r["peak_bytes"] / MiB, r["vs_1f1b"]), fontsize=6)
    for b in result["budgets"]:
        ax.axvline(b["limit_bytes"] / MiB, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("peak memory, larger rank (MiB above the built model)")
    ax.set_ylabel(f"throughput / {result['baseline']}'s (fused 1F1B), alternated in one run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "budget.png", dpi=110)
    plt.close(fig)
    return [*paths, folder / "budget.png"]
