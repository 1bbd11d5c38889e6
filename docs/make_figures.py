"""Regenerate the schedule pictures and numbers in docs/ from the code.

    python docs/make_figures.py

Builds every schedule at p = 4 ranks, m = 8 micro-batches (plus the 2BP paper's
1F1B-1, m = p = 4), simulates it at unit costs (F = B = W = 1 per stage, no
communication cost), and writes

* ``docs/img/<key>.png``: the timeline (10 x 2.6 inches at 100 dpi), and for the Zero Bubble
  schedules ``docs/img/<key>-overlapped.png``: two iterations back to back;
* ``docs/img/schedules_table.md``: one row per schedule;
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
    peak_activations,
    simulate,
)
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
    key: str           # file name and marker key
    label: str         # shown in the title and the table
    name: str          # build_schedule name
    stages_per_rank: int = 1
    split: bool = True
    microbatches: int = MICROBATCHES

    def build(self) -> Schedule:
        return build_schedule(self.name, RANKS * self.stages_per_rank, self.microbatches,
                              stages_per_rank=self.stages_per_rank, split_backward=self.split,
                              costs=COSTS)


ENTRIES = (
    Entry("gpipe", "GPipe", "gpipe", split=False),
    Entry("gpipe-2bp", "GPipe + 2BP", "gpipe"),
    Entry("1f1b", "1F1B", "1f1b", split=False),
    Entry("1f1b-2bp", "1F1B + 2BP", "1f1b"),
    Entry("1f1b-1", "1F1B-1", "1f1b", split=False, microbatches=RANKS),
    Entry("1f1b-1-2bp", "1F1B-1 + 2BP", "1f1b", microbatches=RANKS),
    Entry("interleaved-1f1b", "interleaved 1F1B", "interleaved-1f1b", stages_per_rank=2,
          split=False),
    Entry("interleaved-1f1b-2bp", "interleaved 1F1B + 2BP", "interleaved-1f1b",
          stages_per_rank=2),
    Entry("zb-h1", "ZB-H1", "zb-h1"),
    Entry("zb-h2", "ZB-H2", "zb-h2"),
    Entry("zb-v", "ZB-V", "zb-v", stages_per_rank=2),
)


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
        paper = "the 2BP paper gives no formula"
    elif value == 0.0:
        paper = (f"the paper's 0 needs overlapping iterations: {STEADY} back to back run at a period of "
                 f"{overlapped.period:g}, bubble {overlapped.steady_bubble:.1%}")
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


def moved_receives(schedule: Schedule) -> int:
    """Receives the lowering moved away from right before their consumer (both repairs)."""
    moved = 0
    for ops in lower_communication(schedule):
        for i, op in enumerate(ops):
            if not (isinstance(op, Comm) and op.kind.startswith("RECV")):
                continue
            consumer = next(a for a in ops[i:] if not isinstance(a, Comm))
            forward = op.kind == "RECV_F"
            moved += (consumer.stage, consumer.microbatch, consumer.kind == "F") != (
                op.stage, op.microbatch, forward)
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
        f"{entry.label} {moved_receives(entry.build())}" for entry in ENTRIES
        if entry.microbatches == MICROBATCHES
    )
    return ("```text\n" + "\n".join(lines) + "\n```\n\n"
            f"Receives the repairs moved earlier, at p = {RANKS}, m = {MICROBATCHES}: {moved}.")


def fill(doc: str, key: str, text: str) -> str:
    k = re.escape(key)
    pattern = re.compile(rf"(<!-- generated:{k} -->\n).*?(<!-- /generated:{k} -->)", re.S)
    if not pattern.search(doc):
        print(f"note: {DOC.name} has no block for {key!r}; left as is")
        return doc
    return pattern.sub(lambda m: m.group(1) + text.rstrip("\n") + "\n" + m.group(2), doc)


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    rows = []
    for entry in ENTRIES:
        schedule = entry.build()
        result = simulate(schedule, COSTS)
        plot_schedule(schedule, COSTS, path=IMG / f"{entry.key}.png", name=entry.label)
        if entry.name.startswith("zb-"):
            plot_schedule(schedule, COSTS, path=IMG / f"{entry.key}-overlapped.png", name=entry.label, iterations=2)
        rows.append((entry, schedule, result))
    text = table(rows)
    (IMG / "schedules_table.md").write_text(text)
    print(text)
    if DOC.exists():
        doc = fill(DOC.read_text(), "table", text)
        doc = fill(doc, "comm-example", comm_example())
        for entry, schedule, result in rows:
            doc = fill(doc, entry.key, summary(entry, schedule, result))
        DOC.write_text(doc)


if __name__ == "__main__":
    main()
