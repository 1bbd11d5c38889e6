"""Regenerate the schedule pictures and numbers in docs/ from the code.

    python docs/make_figures.py

Builds every schedule at p = 4 ranks, m = 8 micro-batches (plus the 2BP paper's
1F1B-1, m = p = 4), simulates it at unit costs (F = B = W = 1 per stage, no
communication cost), and writes

* ``docs/img/<key>.png``: the timeline (10 x 2.6 inches at 100 dpi), and for the Zero Bubble
  schedules ``docs/img/<key>-overlapped.png``: two iterations back to back;
* ``docs/img/schedules_table.md``: one row per schedule;
* ``docs/img/zb-v-p2-split.png`` and ``docs/img/zb-v-p2-fused.png``: ZB-V at p = 2, m = 8 with the fused
  backward at 1/1.1 of B + W, as built and fused where the split loses (schedules.fusion);
* ``docs/img/memory.png``: what rank 0 holds over one iteration, for 1F1B, 1F1B + 2BP (uncapped and
  capped), ZB-H1, V-Half and V-Min; and the bubble-vs-memory table (KEY ``memory-table``) at m = 8 and
  16, unit and measured-like costs;
* the blocks of ``docs/schedules.md`` between ``<!-- generated:KEY -->`` and
  ``<!-- /generated:KEY -->``: the table (KEY ``table``) and each section's numbers,
  so the prose never carries a number the code did not produce.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lightning_twobp.schedules import (
    Comm,
    Costs,
    Schedule,
    SimResult,
    build_schedule,
    lower_communication,
    memory_levels,
    peak_activations,
    simulate,
)
from lightning_twobp.schedules.fusion import fuse_where_split_loses, num_fused
from lightning_twobp.viz import plot_schedule

DOCS = Path(__file__).resolve().parent
IMG = DOCS / "img"
DOC = DOCS / "schedules.md"
RANKS = 4
MICROBATCHES = 8
COSTS = Costs()  # unit costs, the Zero Bubble paper's handcrafted analysis
STEADY = 4  # iterations simulated back to back for the steady state


@dataclass(frozen=True)
class Entry:
    key: str  # file name and marker key
    label: str  # shown in the title and the table
    name: str  # build_schedule name
    stages_per_rank: int = 1
    split: bool = True
    microbatches: int = MICROBATCHES
    max_pending_w: int | None = None

    def build(self, costs: Costs = COSTS, microbatches: int | None = None) -> Schedule:
        return build_schedule(
            self.name,
            RANKS * self.stages_per_rank,
            microbatches or self.microbatches,
            stages_per_rank=self.stages_per_rank,
            split_backward=self.split,
            costs=costs,
            max_pending_w=self.max_pending_w,
        )


ENTRIES = (
    Entry("gpipe", "GPipe", "gpipe", split=False),
    Entry("gpipe-2bp", "GPipe + 2BP", "gpipe"),
    Entry("1f1b", "1F1B", "1f1b", split=False),
    Entry("1f1b-2bp", "1F1B + 2BP", "1f1b"),
    Entry("1f1b-1", "1F1B-1", "1f1b", split=False, microbatches=RANKS),
    Entry("1f1b-1-2bp", "1F1B-1 + 2BP", "1f1b", microbatches=RANKS),
    Entry("interleaved-1f1b", "interleaved 1F1B", "interleaved-1f1b", stages_per_rank=2, split=False),
    Entry("interleaved-1f1b-2bp", "interleaved 1F1B + 2BP", "interleaved-1f1b", stages_per_rank=2),
    Entry("zb-h1", "ZB-H1", "zb-h1"),
    Entry("zb-h2", "ZB-H2", "zb-h2"),
    Entry("zb-v", "ZB-V", "zb-v", stages_per_rank=2),
    Entry("v-half", "V-Half", "v-half", stages_per_rank=2),
    Entry("v-min", "V-Min", "v-min", stages_per_rank=2),
)

# Measured-like costs per full stage, from the tiny LLaMa's measured 2-rank run (docs/benchmarks.md,
# "Measured costs per stage", in units of F): stage 0 takes token ids, so its B is the whole backward
# (317 / 162 ms) and its W empty; the other stages B = 187 / 174, W = 146 / 174. A V stage is half of one.
MEASURED_FIRST = (1.0, 1.96, 0.0)
MEASURED_REST = (1.0, 1.07, 0.84)
MEMORY_MS = (8, 16)  # the bubble-vs-memory table's micro-batch counts


def measured_costs(num_stages: int, stages_per_rank: int) -> Costs:
    """The measured-like costs above for ``num_stages`` stages, each ``1 / stages_per_rank`` of a full one."""
    per = [MEASURED_FIRST if s == 0 else MEASURED_REST for s in range(num_stages)]
    return Costs(*([c[k] / stages_per_rank for c in per] for k in range(3)))


def floor(result: SimResult) -> float:
    """No single-iteration schedule ends earlier: the last rank starts after p - 1 F."""
    return max(result.busy) + (RANKS - 1) * COSTS.of("F", 0)


def paper_bubble(entry: Entry, m: int) -> tuple[str, float | None]:
    """The published bubble for this schedule at unit costs: text and fraction (None: no formula).

    The 2BP paper gives no closed form for its placements, hence a dash for those.
    """
    p, v = RANKS, entry.stages_per_rank
    f, b, w = (COSTS.of(k, 0) for k in "FBW")
    if entry.name in ("gpipe", "1f1b") and not entry.split:
        value = (p - 1) / (m + p - 1)
        return f"(p-1)/(m+p-1) = {value:.1%}", value
    if entry.name == "interleaved-1f1b" and not entry.split:
        value = (p - 1) / (v * m + p - 1)
        return f"(p-1)/(vm+p-1) = {value:.1%}", value
    if entry.name == "zb-h1":
        idle = (p - 1) * (f + b - w)
        value = idle / (m * (f + b + w) + idle)
        return f"idle (p-1)(F+B-W) = {idle:g}: {value:.1%}", value
    if entry.name in ("zb-h2", "zb-v"):
        return "0 (iterations overlap)", 0.0
    if entry.name == "v-half":  # Qi et al., NeurIPS 2024: no closed form, a ratio to 1F1B's
        return "about half of 1F1B's", None
    if entry.name == "v-min":
        return "comparable to 1F1B's", None
    return "—", None


def steady(schedule: Schedule) -> SimResult:
    """``STEADY`` iterations back to back, overlapping as far as each rank's order allows."""
    return simulate(schedule, COSTS, iterations=STEADY)


def same(values: tuple) -> str:
    """One value when every rank has it, else the tuple."""
    if len(set(values)) == 1:
        return f"{values[0]:g}"
    return "(" + ", ".join(f"{x:g}" for x in values) + ")"


def table(rows: list[tuple[Entry, Schedule, SimResult]]) -> str:
    head = (
        "| figure | schedule | stages | m | makespan | idle per rank | bubble | overlapped: period, bubble "
        "| paper's bubble | floor | peak in-flight F→last B/W | peak F→B |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for entry, schedule, result in rows:
        overlapped = steady(schedule)
        lines.append(
            f"| [{entry.key}](img/{entry.key}.png) | {entry.label} "
            f"| {schedule.num_stages} on {schedule.num_ranks} ranks | {schedule.num_microbatches} "
            f"| {result.makespan:g} | {same(result.bubble_time)} | {result.bubble_fraction:.1%} "
            f"| {overlapped.period:g}, {overlapped.steady_bubble:.1%} "
            f"| {paper_bubble(entry, schedule.num_microbatches)[0]} | {floor(result):g} "
            f"| {same(result.peak_inflight)} | {same(peak_activations(schedule))} |"
        )
    return head + "\n".join(lines) + "\n"


def summary(entry: Entry, schedule: Schedule, result: SimResult) -> str:
    lower = floor(result)
    verdict = "reaches it" if result.makespan <= lower else f"{result.makespan - lower:g} above it"
    text, value = paper_bubble(entry, schedule.num_microbatches)
    overlapped = steady(schedule)
    if value is None:
        paper = "the 2BP paper gives no formula" if text == "—" else f"the paper gives no formula: {text}"
    elif value == 0.0:
        paper = (
            f"the paper's 0 needs overlapping iterations: {STEADY} back to back run at a period of "
            f"{overlapped.period:g}, bubble {overlapped.steady_bubble:.1%}"
        )
    elif abs(value - result.bubble_fraction) < 1e-9:
        paper = f"as the paper's {text}"
    else:
        paper = f"the paper's formula: {text}"
    return (
        f"Simulated at p = {schedule.num_ranks} ranks, m = {schedule.num_microbatches}, "
        f"unit costs: makespan {result.makespan:g}, idle {same(result.bubble_time)} per rank, "
        f"bubble {result.bubble_fraction:.1%} ({paper}); floor {lower:g}, {verdict}. "
        f"Peak in-flight micro-batches per rank: {same(result.peak_inflight)} from F to the "
        f"last B/W, {same(peak_activations(schedule))} from F to B."
    )


# ------------------------------------------------------------------ memory: the table and the picture
def memory_entries() -> list[Entry]:
    """1F1B, capped 1F1B + 2BP at k = 0..p and uncapped, the Zero Bubble family, V-Half and V-Min."""
    capped = [Entry(f"1f1b-2bp-k{k}", f"1F1B + 2BP, k = {k}", "1f1b", max_pending_w=k) for k in range(RANKS + 1)]
    by_key = {e.key: e for e in ENTRIES}
    return [by_key["1f1b"], *capped, *(by_key[k] for k in ("1f1b-2bp", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min"))]


def memory_row(entry: Entry, m: int, measured: bool) -> str:
    spr = entry.stages_per_rank
    costs = measured_costs(RANKS * spr, spr) if measured else COSTS
    schedule = entry.build(costs, m)
    one, overlapped = simulate(schedule, costs), simulate(schedule, costs, iterations=STEADY)
    fused = min(RANKS, m)  # fused 1F1B's peak: p full-stage micro-batches on rank 0
    to_w, to_b = max(one.peak_inflight) / spr / fused, max(peak_activations(schedule)) / spr / fused
    return (
        f"| {entry.label} | {m} | {'measured-like' if measured else 'unit'} | {one.makespan:.4g} "
        f"| {one.bubble_fraction:.1%} | {overlapped.steady_bubble:.1%} | {to_w:.2f} | {to_b:.2f} |"
    )


def memory_table() -> str:
    head = (
        "| schedule | m | costs | makespan | bubble | overlapped bubble | peak F→last W (× 1F1B) "
        "| peak F→B (× 1F1B) |\n|---|---|---|---|---|---|---|---|\n"
    )
    rows = [memory_row(e, m, measured) for measured in (False, True) for m in MEMORY_MS for e in memory_entries()]
    return head + "\n".join(rows) + "\n"


def plot_memory(path: Path) -> None:
    """Rank 0's micro-batches held from F to their last B/W over one simulated iteration (unit costs per
    full stage: a V stage costs half), in fused 1F1B stages' micro-batches (a V pair is half of one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("1f1b", "1f1b-2bp", "1f1b-2bp-k1", "zb-h1", "v-half", "v-min")
    entries = {e.key: e for e in [*ENTRIES, *memory_entries()]}
    fig, ax = plt.subplots(figsize=(10, 3.2), dpi=100)
    for key in keys:
        entry = entries[key]
        half = 1.0 / entry.stages_per_rank  # a V stage is half a full one: half the time too
        costs = Costs(f=half, b=half, w=half)
        schedule = entry.build(costs)
        ends = [end for rank, _, _, end in simulate(schedule, costs).timeline if rank == 0]
        levels = [x / entry.stages_per_rank for x in memory_levels(schedule)[0]]
        ax.step([0.0, *ends], [0.0, *levels], where="post", label=entry.label)
    ax.set_xlabel("time (unit costs: F = B = W = 1 per full stage)")
    ax.set_ylabel("held on rank 0 (stages' micro-batches)")
    ax.set_title(f"What rank 0 holds from F to the last B/W, p = {RANKS}, m = {MICROBATCHES}")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def moved_receives(schedule: Schedule) -> int:
    """Receives the lowering moved away from right before their consumer (both repairs)."""
    moved = 0
    for ops in lower_communication(schedule):
        for i, op in enumerate(ops):
            if not (isinstance(op, Comm) and op.kind.startswith("RECV")):
                continue
            consumer = next(a for a in ops[i:] if not isinstance(a, Comm))
            forward = op.kind == "RECV_F"
            moved += (consumer.stage, consumer.microbatch, consumer.kind == "F") != (op.stage, op.microbatch, forward)
    return moved


def comm_example() -> str:
    """1F1B + 2BP on 2 ranks, 2 micro-batches: the compute lists and the lowered op lists."""
    schedule = build_schedule("1f1b", 2, 2)
    lowered = lower_communication(schedule)
    lines = [str(schedule), "", "lowered (a [...] run is one batch):"]
    for rank, ops in enumerate(lowered):
        cells, batch = [], []
        for op in ops:
            if isinstance(op, Comm):
                batch.append(str(op))
                continue
            if batch:
                cells.append("[" + " ".join(batch) + "]")
                batch = []
            cells.append(str(op))
        if batch:
            cells.append("[" + " ".join(batch) + "]")
        lines.append(f"rank {rank}  " + " ".join(cells))
    moved = ", ".join(
        f"{entry.label} {moved_receives(entry.build())}" for entry in ENTRIES if entry.microbatches == MICROBATCHES
    )
    return (
        "```text\n" + "\n".join(lines) + "\n```\n\n"
        f"Receives the repairs moved earlier, at p = {RANKS}, m = {MICROBATCHES}: {moved}."
    )


def fill(doc: str, key: str, text: str) -> str:
    k = re.escape(key)
    pattern = re.compile(rf"(<!-- generated:{k} -->\n).*?(<!-- /generated:{k} -->)", re.S)
    if not pattern.search(doc):
        print(f"note: {DOC.name} has no block for {key!r}; left as is")
        return doc
    return pattern.sub(lambda m: m.group(1) + text.rstrip("\n") + "\n" + m.group(2), doc)


def plot_fused() -> None:
    """ZB-V at p = 2, m = 8, BW = (B + W) / 1.1 on every stage but the first (whose B is its whole backward):
    split as built, and fused where the split loses (two steps back to back: the period auto times)."""
    b, w = [2 / 1.1, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]
    costs = Costs(f=1.0, b=b, w=w, bw=2 / 1.1)
    split = build_schedule("zb-v", 4, 8, stages_per_rank=2, costs=costs)
    fused = fuse_where_split_loses(split, costs, lambda sim: sim.period, 2)
    plot_schedule(split, costs, path=IMG / "zb-v-p2-split.png", name="ZB-V, split", iterations=2)
    n = num_fused(fused)
    label = f"ZB-V, {n} of 32 backwards fused where the split loses"
    plot_schedule(fused, costs, path=IMG / "zb-v-p2-fused.png", name=label, iterations=2)


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    plot_fused()
    rows = []
    for entry in ENTRIES:
        schedule = entry.build()
        result = simulate(schedule, COSTS)
        plot_schedule(schedule, COSTS, path=IMG / f"{entry.key}.png", name=entry.label)
        if entry.name.startswith("zb-"):
            plot_schedule(schedule, COSTS, path=IMG / f"{entry.key}-overlapped.png", name=entry.label, iterations=2)
        rows.append((entry, schedule, result))
    plot_memory(IMG / "memory.png")
    memory = memory_table()
    print(memory)
    text = table(rows)
    (IMG / "schedules_table.md").write_text(text)
    print(text)
    if DOC.exists():
        doc = fill(DOC.read_text(), "table", text)
        doc = fill(doc, "comm-example", comm_example())
        doc = fill(doc, "memory-table", memory)
        for entry, schedule, result in rows:
            doc = fill(doc, entry.key, summary(entry, schedule, result))
        DOC.write_text(doc)


if __name__ == "__main__":
    main()
