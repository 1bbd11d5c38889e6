"""Timeline plots: simulated and recorded timelines, one box per compute action, ImportError."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from lightning_twobp.schedules import build_schedule, simulate

pytest.importorskip("matplotlib")

from lightning_twobp.viz import KIND_COLORS, plot_schedule, plot_timeline  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def boxes(fig) -> list[str]:
    """gids of the boxes plot_timeline drew ("action <rank> <label>")."""
    return [p.get_gid() for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("action ")]


@dataclass(frozen=True)
class RecordLike:
    """Same fields as lightning_twobp.engine.ActionRecord (which would import torch)."""

    rank: int
    step: int
    op: str
    start: float
    end: float
    wait: float = 0.0


# Two ranks, one step of a recorded 2-stage run: compute ops and the comm batches
# between them (which do not parse as actions and are not drawn).
RECORDS = [
    (0, 0, "0F0", 0.00, 0.10, 0.0),
    (0, 1, "0SEND_F0", 0.10, 0.11, 0.0),
    (0, 2, "0F1", 0.11, 0.21, 0.0),
    (0, 3, "0SEND_F1+0RECV_B0", 0.21, 0.40, 0.18),
    (0, 4, "0B0", 0.40, 0.50, 0.0),
    (0, 5, "0RECV_B1", 0.50, 0.52, 0.01),
    (0, 6, "0B1", 0.52, 0.62, 0.0),
    (0, 7, "0W0+1", 0.62, 0.82, 0.0),
    (1, 0, "1RECV_F0", 0.00, 0.11, 0.10),
    (1, 1, "1F0", 0.11, 0.21, 0.0),
    (1, 2, "1B0", 0.21, 0.31, 0.0),
    (1, 3, "1SEND_B0+1RECV_F1", 0.31, 0.33, 0.0),
    (1, 4, "1F1", 0.33, 0.43, 0.0),
    (1, 5, "1B1", 0.43, 0.53, 0.0),
    (1, 6, "1SEND_B1", 0.53, 0.54, 0.0),
    (1, 7, "1W0", 0.54, 0.64, 0.0),
    (1, 8, "1W1", 0.64, 0.74, 0.0),
]
COMPUTE = [r for r in RECORDS if "SEND" not in r[2] and "RECV" not in r[2]]


def test_simulated_timeline_png_one_box_per_action(tmp_path):
    schedule = build_schedule("1f1b", 4, 8)
    result = simulate(schedule)
    path = tmp_path / "1f1b.png"
    fig = plot_timeline(result.timeline, num_ranks=4, title="1f1b", path=path)
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert path.stat().st_size > 1000
    drawn = boxes(fig)
    assert len(drawn) == len(result.timeline)
    assert sorted(drawn) == sorted(f"action {r} {a}" for r, a, _, _ in result.timeline)


def test_two_stages_per_rank_and_batched_w(tmp_path):
    # The V puts stages 0 and 7 on rank 0; GPipe + 2BP writes one W over all micro-batches.
    for name, stages, spr in (("zb-v", 8, 2), ("gpipe", 4, 1)):
        result = simulate(build_schedule(name, stages, 8, stages_per_rank=spr))
        fig = plot_timeline(result.timeline, num_ranks=4, path=tmp_path / f"{name}.png")
        assert len(boxes(fig)) == len(result.timeline)
    assert "action 0 0W0+1+2+3+4+5+6+7" in boxes(fig)


@pytest.mark.parametrize("form", ["tuples", "records", "4-tuples"])
def test_recorded_timeline_skips_comm(tmp_path, form):
    if form == "tuples":
        timeline = RECORDS
    elif form == "records":
        timeline = [RecordLike(*r) for r in RECORDS]
    else:
        timeline = [(r[0], r[2], r[3], r[4]) for r in RECORDS]
    path = tmp_path / f"{form}.png"
    fig = plot_timeline(timeline, num_ranks=2, path=path, unit="s")
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert sorted(boxes(fig)) == sorted(f"action {r[0]} {r[2]}" for r in COMPUTE)
    assert fig.axes[0].get_xlabel() == "time (s)"
    # rank 0 is the top row: the y axis runs downwards.
    bottom, top = fig.axes[0].get_ylim()
    assert bottom > top


def test_boxes_span_start_to_end_coloured_by_kind(tmp_path):
    from matplotlib.colors import to_hex

    fig = plot_timeline(COMPUTE, num_ranks=2, path=tmp_path / "t.png")
    rects = {p.get_gid(): p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("action ")}
    w = rects["action 0 0W0+1"]
    assert w.get_x() == pytest.approx(0.62) and w.get_width() == pytest.approx(0.20)
    assert to_hex(w.get_facecolor()) == KIND_COLORS["W"].lower()
    assert to_hex(rects["action 1 1F0"].get_facecolor()) == KIND_COLORS["F"].lower()


def test_onto_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    out = plot_timeline(COMPUTE, num_ranks=2, ax=ax)
    assert out is fig
    assert len(boxes(fig)) == len(COMPUTE)


def test_plot_schedule_title(tmp_path):
    schedule = build_schedule("1f1b", 4, 8)
    fig = plot_schedule(schedule, path=tmp_path / "s.png")
    title = fig.axes[0].get_title()
    bubble = simulate(schedule).bubble_fraction
    assert "1f1b+2BP" in title and "p=4" in title and "m=8" in title
    assert f"{bubble:.1%}" in title
    assert (tmp_path / "s.png").stat().st_size > 0
    # Overlapped iterations: the title gives the steady state.
    zb = build_schedule("zb-h2", 4, 8)
    title = plot_schedule(zb, iterations=2).axes[0].get_title()
    steady = simulate(zb, iterations=2)
    assert "2 iterations overlapped" in title and f"period {steady.period:g}" in title


def test_bad_input_raises():
    with pytest.raises(ValueError, match="outside num_ranks=2"):
        plot_timeline([(3, "3F0", 0.0, 1.0)], num_ranks=2)
    with pytest.raises(ValueError, match="no compute actions"):
        plot_timeline([(0, "0SEND_F0", 0.0, 1.0)], num_ranks=1)
    with pytest.raises(ValueError, match="num_ranks"):
        plot_timeline(COMPUTE, num_ranks=0)


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    timeline = simulate(build_schedule("gpipe", 2, 2)).timeline
    with pytest.raises(ImportError, match=r"pip install 'lightning_twobp\[plots\]'"):
        plot_timeline(timeline, num_ranks=2)
    with pytest.raises(ImportError, match="matplotlib"):
        plot_schedule(build_schedule("gpipe", 2, 2))
