"""``twobp-bench --peer --activation-checkpointing {full,selective}``: checkpointed blocks under ours and under
torch.distributed.pipelining, the same stage modules, each block checkpointed the same way.

    twobp-bench --peer --activation-checkpointing full [--rounds N] [--steps K] [--out DIR] [--quick]

Three pairs on ``--peer``'s workload and stages (:mod:`.peer`; 2 gloo ranks, one thread each): 1F1B + 2BP
and torch's Schedule1F1B, ZB-H1 and torch's ScheduleInterleavedZeroBubble (1 stage per rank), ZB-V and
torch's ScheduleZBVZeroBubble. Each contender runs without checkpointing and with every block under
``torch.utils.checkpoint(use_reentrant=False)`` the strategy's way
(:func:`~lightning_twobp.lightning.checkpointing.apply_activation_checkpointing`), all in the same two
processes. Per contender:

* **forwards per block per micro-batch**: a pre-hook on each block's ``ffn`` (inside the checkpointed
  forward) counts the block's forwards over one step after a warm-up step (torch's first step also runs
  its stages for shape inference): 1 without checkpointing, 2 for one recompute per block, more when a
  split backward recomputes a block in each half (pytorch#136766);
* **peak bytes per rank**: the resident high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
  over one steady training step (pipeline step, AdamW step, ``zero_grad``) above the resident set before
  it. Meanwhile glibc returns every freed block above 64 KiB to the system at once, so each
  contender's peak is its own although all share the process;
* **exactness**: that step's gradients against one process at the same micro-batching (rtol 1e-5);
* **whether torch's runs at all**: each torch contender first takes one checkpointed step in its own
  launch; one that fails (torch's zero-bubble schedules under ``"selective"``: their W's autograd call
  recomputes the block a second time, which torch's selective checkpointing refuses) gets its first
  error in the table and runs without checkpointing only;
* **step time**, with checkpointing: each pair's two contenders take turns for ``N`` rounds (who goes
  first alternating), glibc then keeping freed memory as ``--peer`` does; the ratio is the median over
  rounds of torch's step over ours (above 1: ours faster). On a shared machine only the ratio means
  anything, and little.
"""

from __future__ import annotations

import copy
import io
import json
import re
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_twobp.bench.peer import (
    Contender,
    Runner,
    build_runner,
    grad_error,
    heading,
    time_steps,
    torch_pipelining_available,
)
from lightning_twobp.bench.workload import WORLD, Workload, keep_freed_memory, reference_grads
from lightning_twobp.engine.memory import return_freed_memory
from lightning_twobp.models.llama import Block
from lightning_twobp.processes import run_distributed

__all__ = ["PAIRS", "counted_forwards", "first_error", "markdown", "run_peer_ac", "write"]

MiB = 2**20
PAIRS: tuple[tuple[Contender, Contender], ...] = (
    (Contender("ours", "1f1b", True), Contender("torch", "Schedule1F1B", False)),
    (Contender("ours", "zb-h1", True), Contender("torch", "ScheduleInterleavedZeroBubble", True, 1)),
    (Contender("ours", "zb-v", True, 2, "v"), Contender("torch", "ScheduleZBVZeroBubble", True, 2, "v")),
)


def _peak_of_step(r: Runner) -> int:
    """Bytes above the resident set at its start that one training step of ``r`` reaches on this rank."""
    dist.barrier()
    before = _resident()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
    r.train_step()
    dist.barrier()
    return _resident()["VmHWM"] - before


def _resident() -> dict[str, int]:
    """The resident set now (``VmRSS``) and its high-water mark (``VmHWM``), in bytes."""
    fields = re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return {name: int(kib) * 1024 for name, kib in fields}


@contextmanager
def counted_forwards(r: Runner) -> Iterator[dict[str, int]]:
    """Each of ``r``'s local blocks' forwards while inside, by the block's name in the model: a pre-hook
    on the block's ``ffn``, inside the checkpointed forward, so that each recompute counts too."""
    calls: dict[str, int] = {}
    hooks = []
    for mod in r.modules.values():
        for name, b in mod.named_children():
            if isinstance(b, Block):
                calls[name] = 0
                hooks.append(b.ffn.register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1)))
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def _forwards(r: Runner, m: int) -> dict[str, float]:
    """One step of ``r`` (gradients left for the check) with each local block's forwards counted, per
    micro-batch, by the block's name in the model."""
    with counted_forwards(r) as calls:
        dist.barrier()
        r.step()
    return {n: c / m for n, c in calls.items()}


def _measure(r: Runner, m: int, ref: dict[str, torch.Tensor]) -> dict:
    """Forwards, exactness and peak of one contender on this rank (see the module docstring)."""
    r.step()  # warm-up: torch's first step infers the shapes it sends by running its stages
    r.optimizer.zero_grad(set_to_none=True)
    forwards = _forwards(r, m)
    worst, bad = grad_error(r.params, ref)
    r.optimizer.zero_grad(set_to_none=True)
    r.train_step()  # AdamW's state is made here, so the measured step is a steady one
    return {"forwards": forwards, "peak_bytes": _peak_of_step(r), "max_grad_diff": worst, "bad": bad}


def _probe(rank: int, world: int, wl: Workload, m: int, c: Contender, ac: str) -> None:
    """One step of ``c`` with checkpointed blocks: raises on every rank where it cannot run."""
    ids, tgt = wl.data()
    build_runner(c, wl.model(), wl, m, rank, ids, tgt, ac).step()


def _cannot_run(wl: Workload, m: int, c: Contender, ac: str) -> str | None:
    """Why ``c`` cannot train with checkpointed blocks (its first error, the peer's lost connection
    transport errors left out), or None when it can; in its own launch, since a rank that fails strands its peer."""
    try:
        run_distributed(_probe, WORLD, wl, m, c, ac, timeout=1800)
    except RuntimeError as e:
        return first_error(e)
    return None


def first_error(e: RuntimeError) -> str:
    """The first exception line of :func:`~lightning_twobp.processes.run_distributed`'s error that is not a
    rank's lost connection to a peer that failed (gloo's transport errors); the last such line when all are."""
    errors = [line.strip() for line in str(e).splitlines() if re.match(r"\s*\w+(Error|Exception): ", line)]
    return next((x for x in errors if "gloo/transport" not in x), errors[-1] if errors else str(e).strip())


def _worker(rank: int, world: int, wl: Workload, m: int, ac: str, rounds: int, steps: int, runs: set[str]) -> dict:
    """Measures each contender of :data:`PAIRS` whose label is in ``runs``, off and with ``ac``; then times
    each pair with ``ac`` (see the module docstring). A torch contender not in ``runs`` runs off only."""
    return_freed_memory()
    model: nn.Sequential = wl.model()
    ids, tgt = wl.data()
    ref = reference_grads(copy.deepcopy(model), ids, tgt, m)
    measured: dict[str, dict] = {}
    timed: list[tuple[Runner, ...]] = []
    for pair in PAIRS:
        with_ac = []
        for c in pair if torch_pipelining_available() else pair[:1]:
            for way in (None, ac) if c.label in runs else (None,):
                r = build_runner(c, model, wl, m, rank, ids, tgt, way)
                measured[f"{c.label} | {way or 'off'}"] = _measure(r, m, ref)
                if way is None:
                    del r  # its memory goes now, before the next contender is measured
                else:
                    with_ac.append(r)
        timed.append(tuple(with_ac))
    keep_freed_memory()
    times: dict[str, list[float]] = {r.contender.label: [] for both in timed for r in both}
    for i in range(1 + rounds):  # a warm-up round first
        for both in timed:
            for r in both if i % 2 == 0 else both[::-1]:
                t = time_steps(r, steps)
                if i:
                    times[r.contender.label].append(t)
    return {"measured": measured, "times": times}


def run_peer_ac(
    wl: Workload = Workload(), m: int = 8, activation_checkpointing: str = "full", rounds: int = 5, steps: int = 1
) -> dict:
    """Run the comparison (see the module docstring); returns its rows and pairs for :func:`markdown`."""
    torch_too = torch_pipelining_available()
    ac = activation_checkpointing
    failed = {t.label: why for _, t in PAIRS if torch_too and (why := _cannot_run(wl, m, t, ac)) is not None}
    runs = {c.label for pair in PAIRS for c in pair if c.label not in failed}
    per_rank = run_distributed(_worker, WORLD, wl, m, ac, rounds, steps, runs, timeout=14400)
    rows = []
    for key in per_rank[0]["measured"]:
        ranks = [out["measured"][key] for out in per_rank]
        bad = [b for r in ranks for b in r["bad"]]
        if bad:
            raise AssertionError(f"{key}: gradients differ from one process: " + "; ".join(bad[:5]))
        label, way = key.split(" | ")
        rows.append(
            dict(
                label=label,
                checkpointing=way,
                forwards_per_block=[sorted(set(r["forwards"].values())) for r in ranks],
                peak_bytes_per_rank=[r["peak_bytes"] for r in ranks],
                max_grad_diff=max(r["max_grad_diff"] for r in ranks),
            )
        )
    rows += [dict(label=label, checkpointing=ac, failed=why) for label, why in failed.items()]
    times = per_rank[0]["times"]  # barrier to barrier: the same on every rank
    pairs = [
        dict(
            ours=o.label,
            torch=t.label,
            torch_over_ours=statistics.median(b / a for a, b in zip(times[o.label], times[t.label], strict=True)),
        )
        for o, t in PAIRS
        if t.label in times
    ]
    meta = {"workload": asdict(wl), "world": WORLD, "microbatches": m, "activation_checkpointing": ac}
    meta |= {"rounds": rounds, "steps_per_sample": steps, "torch_version": torch.__version__}
    step_s = {k: statistics.median(v) for k, v in times.items()}
    return {**meta, "torch_pipelining": torch_too, "rows": rows, "pairs": pairs, "step_s": step_s}


def markdown(result: dict) -> str:
    out = io.StringIO()
    w = out.write
    ac = result["activation_checkpointing"]
    w(heading(result, f"checkpointing {ac!r} on every block, the same stage modules on both sides"))
    w(
        "| contender | checkpointing | forwards / block / micro-batch, rank 0 · rank 1 | peak MiB of a step, "
        "rank 0 · rank 1 | max grad diff vs 1 process |\n|---|---|---|---|---:|\n"
    )
    for r in result["rows"]:
        if "failed" in r:
            w(f"| {r['label']} | {r['checkpointing']} | fails: {r['failed']} | | |\n")
            continue
        fwd = " · ".join("/".join(f"{f:g}" for f in fs) for fs in r["forwards_per_block"])
        peak = " · ".join(f"{p / MiB:.1f}" for p in r["peak_bytes_per_rank"])
        w(f"| {r['label']} | {r['checkpointing']} | {fwd} | {peak} | {r['max_grad_diff']:.1e} |\n")
    if result["pairs"]:
        w(
            f"\nWith checkpointing, step time (median of {result['rounds']} alternated rounds; a shared machine's "
            "figures are ratios under its load, not a speed claim):\n\n"
            "| ours | torch | ours s | torch s | torch / ours |\n|---|---|---:|---:|---:|\n"
        )
        s = result["step_s"]
        for p in result["pairs"]:
            ours, theirs = s[p["ours"]], s[p["torch"]]
            w(f"| {p['ours']} | {p['torch']} | {ours:.3f} | {theirs:.3f} | {p['torch_over_ours']:.3f} |\n")
    return out.getvalue()


def write(result: dict, folder: str | Path) -> list[Path]:
    """``peer-ac.md`` and ``peer-ac.json`` into ``folder``."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    texts = {Path(folder, "peer-ac.md"): markdown(result), Path(folder, "peer-ac.json"): json.dumps(result, indent=2)}
    for path, text in texts.items():
        path.write_text(text)
    return list(texts)
