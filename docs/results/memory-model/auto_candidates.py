"""Every candidate ``schedule="auto"`` weighs on tests/test_auto_schedule.py's tiny blocks (m = 4 and 8), forced one
at a time through Trainer on 2 ranks: each rank's predicted peak against the full meter (``footprint.StepMeter``:
what autograd saved, what the stages keep for W, receive buffers, sends), weights and state added to both.

    python docs/results/memory-model/auto_candidates.py > docs/results/memory-model/auto_candidates.txt

(from the repository root; about a minute on 2 cores)."""

import sys

sys.path.insert(0, "tests")

import test_auto_schedule as T  # noqa: E402

from lightning_twobp.processes import run_distributed  # noqa: E402


def _forced(real, keep):
    """``search_profiles`` with only the candidates ``keep`` accepts."""
    return lambda profiles, **kw: tuple(c for c in real(profiles, **kw) if keep(c))


def worker(rank: int, world: int) -> list[tuple[str, float, int]]:
    from lightning_twobp.schedules import auto as A

    real, out = A.search_profiles, []
    try:
        for m in (4, 8):
            labels: list[str] = []
            A.search_profiles = _forced(real, lambda c, seen=labels: seen.append(c.label) or not seen[1:])
            T._fit_auto(rank, world, "16x1f1b", num_microbatches=m)  # every candidate's label, the first trained
            for label in labels:
                A.search_profiles = _forced(real, lambda c, label=label: c.label == label)
                r = T._fit_auto(rank, world, "16x1f1b", num_microbatches=m)
                out.append((label, r["predicted"], r["measured"]))
    finally:
        A.search_profiles = real
    return out


if __name__ == "__main__":
    over = 0
    results = run_distributed(worker, 2, timeout=900)
    for rank, rows in enumerate(results):
        for label, predicted, measured in rows:
            over += measured > predicted
            flag = "OVER" if measured > predicted else ""
            print(
                rank,
                f"{label:55s} predicted {predicted:8.0f} measured {measured:8d} {measured - predicted:+6.0f} {flag}",
            )
    print("over:", over, "of", sum(len(rows) for rows in results))
