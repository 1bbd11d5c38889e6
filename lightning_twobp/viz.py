"""Pipeline timelines as pictures: one row per rank, one box per compute action.

Needs matplotlib (``pip install 'lightning_twobp[plots]'``), imported only when a
function here is called, so the rest of the package never depends on it.

Two kinds of timeline are drawn the same way:

* the simulator's ``SimResult.timeline``: ``(rank, Action, start, end)`` tuples;
* what the executor records (``PipelineExecutor(..., record=True)`` gives
  ``ActionRecord(rank, step, op, start, end, wait)``), or any objects with
  ``rank``/``start``/``end`` and an ``action``, ``op`` or ``label``, or plain tuples
  ``(rank, label, start, end)`` / ``(rank, step, label, start, end[, wait])``.
  Labels are parsed with :meth:`Action.parse` (``"1F3"``, ``"0W0+1+2"``); those
  that do not parse are communication ops (``"1SEND_F0"``, batches joined with
  ``"+"``) and are skipped.  Pass the records of one step: times restart per step.

Every box is a ``matplotlib.patches.Rectangle`` whose gid is ``"action <rank> <label>"``,
so a caller (or a test) can find exactly the boxes drawn for compute actions.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lightning_twobp.schedules import Action, Costs, Schedule, schedule_label, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["KIND_COLORS", "plot_schedule", "plot_timeline"]

# Okabe-Ito palette (distinguishable under the common colour-vision deficiencies).
# W gets the only green: it is the action 2BP moves, and the eye should find it.
KIND_COLORS = {
    "F": "#0072B2",  # blue
    "B": "#E69F00",  # orange
    "W": "#009E73",  # bluish green
    "BW": "#D55E00",  # vermillion: the fused backward, B and W in one
}
_KIND_NAMES = {
    "F": "F forward",
    "B": "B input grad",
    "W": "W weight grad",
    "BW": "BW fused backward",
}
_FONT_SIZE = 7
_INSTALL_HINT = "pip install 'lightning_twobp[plots]'"


def _stage_positions(boxes: list[Any]) -> dict[int, list[int]]:
    """Each rank's stages in order: position 0 for its first, 1 for its second (interleaved "loop" or
    V), ..., drawn progressively lighter."""
    local: dict[int, list[int]] = {}
    for rank, action, _, _ in boxes:
        local.setdefault(rank, [])
        if action.stage not in local[rank]:
            local[rank].append(action.stage)
    for stages in local.values():
        stages.sort()
    return local


def _draw_boxes(
    fig: Figure, ax: Axes, boxes: list[Any], local: dict[int, list[int]], depth: int, num_ranks: int
) -> None:
    from matplotlib.patches import Rectangle

    t_end = max(end for _, _, _, end in boxes)
    t_end = t_end if t_end > 0 else 1.0
    ax.set_xlim(0, t_end)
    ax.set_ylim(num_ranks - 0.5, -0.5)  # rank 0 on top
    px_per_unit = _axes_width_px(fig, ax) / t_end
    char_px = 0.62 * _FONT_SIZE * fig.dpi / 72
    for rank, action, start, end in boxes:
        index = local[rank].index(action.stage)
        base = KIND_COLORS[action.kind]
        face = _lighten(base, 0.5 * index / max(depth - 1, 1)) if index else base
        edge = base if index else "white"
        rect = Rectangle(
            (start, rank - 0.4),
            end - start,
            0.8,
            facecolor=face,
            edgecolor=edge,
            hatch="//" if index else None,
            linewidth=0.6,
        )
        rect.set_gid(f"action {rank} {action}")
        ax.add_patch(rect)
        text = _microbatch_text(action)
        if (end - start) * px_per_unit >= len(text) * char_px + 3:
            color = _text_color(face)
            ax.text(
                (start + end) / 2, rank, text, ha="center", va="center", fontsize=_FONT_SIZE, color=color, clip_on=True
            )


def _dress(ax: Axes, boxes: list[Any], depth: int, num_ranks: int, title: str | None, unit: str | None) -> None:
    """Axes, labels and the legend of the kinds drawn."""
    from matplotlib.patches import Patch

    ax.set_yticks(range(num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(num_ranks)])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel(f"time ({unit})" if unit else "time")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_facecolor("white")
    if title:
        ax.set_title(title, fontsize=9)
    kinds = [k for k in KIND_COLORS if any(a.kind == k for _, a, _, _ in boxes)]
    handles = [Patch(facecolor=KIND_COLORS[k], label=_KIND_NAMES[k]) for k in kinds]
    if depth > 1:
        later = Patch(
            facecolor=_lighten("#777777", 0.5), edgecolor="#777777", hatch="//", label="later stage on a rank"
        )
        handles.append(later)
    handles.append(Patch(facecolor="white", edgecolor="#bbbbbb", label="idle"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=_FONT_SIZE,
        frameon=False,
        borderaxespad=0.0,
    )


def plot_timeline(
    timeline: Iterable[Any],
    *,
    num_ranks: int,
    title: str | None = None,
    ax: Axes | None = None,
    path: str | os.PathLike | None = None,
    unit: str | None = None,
) -> Figure:
    """Draw ``timeline`` (see the module docstring for the accepted forms); return the Figure.

    Rank 0 is the top row; a box spans its action's start to end, coloured by kind
    (:data:`KIND_COLORS`), labelled with its micro-batch(es) where it is wide enough;
    a rank's second (third, ...) stage is drawn lighter and hatched; idle time stays
    white.  ``unit`` names the time unit on the x axis (``"s"`` for executor
    records).  With ``ax`` the boxes go onto that Axes; with ``path`` the figure is
    saved there (PNG, SVG, ... by extension).  Raises ValueError if a rank is outside
    ``range(num_ranks)`` or nothing in ``timeline`` is a compute action.
    """
    _require_matplotlib()
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    boxes = list(_compute_boxes(timeline))
    if not boxes:
        raise ValueError(
            "no compute actions to draw: expected labels like '1F3', '0B2' or '0W0+1+2' (communication ops are skipped)"
        )
    for rank, action, _, _ in boxes:
        if not 0 <= rank < num_ranks:
            raise ValueError(f"{action} is on rank {rank}, outside num_ranks={num_ranks}")

    if ax is None:
        fig, ax = _new_axes(num_ranks, saving=path is not None)
    else:
        fig = ax.figure

    local = _stage_positions(boxes)
    depth = max(len(s) for s in local.values())
    _draw_boxes(fig, ax, boxes, local, depth, num_ranks)
    _dress(ax, boxes, depth, num_ranks, title, unit)

    if path is not None:
        fig.savefig(path, dpi=fig.dpi)
    return fig


def plot_schedule(
    schedule: Schedule,
    costs: Costs | None = None,
    path: str | os.PathLike | None = None,
    *,
    name: str | None = None,
    ax: Axes | None = None,
    iterations: int = 1,
) -> Figure:
    """Simulate ``schedule`` at ``costs`` (default unit costs) and plot its timeline.

    The title names the schedule (``name``, default :func:`schedule_label`), the ranks ``p``, the
    micro-batches ``m`` and the simulated bubble fraction (idle time over ``p * makespan``). With
    ``iterations > 1`` the iterations run back to back, overlapping as far as each rank's order
    allows, and the title gives the steady-state period and bubble instead.
    """
    result = simulate(schedule, costs, iterations=iterations)
    p = schedule.num_ranks
    if name is None:
        name = schedule_label(schedule.name, schedule.split_backward)
    shape = f"p={p}"
    if schedule.stages_per_rank > 1:
        shape += f" x {schedule.stages_per_rank} stages"
    if iterations == 1:
        timing = f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}"
    else:
        timing = f"{iterations} iterations overlapped: period {result.period:g}, bubble {result.steady_bubble:.1%}"
    title = f"{name}: {shape}, m={schedule.num_microbatches}, {timing}"
    return plot_timeline(result.timeline, num_ranks=p, title=title, ax=ax, path=path, unit=_cost_unit(costs or Costs()))


# --------------------------------------------------------------------------- helpers


def _require_matplotlib() -> None:
    # Importing the top-level package first also catches sys.modules["matplotlib"] = None
    # when submodules such as matplotlib.patches are still cached.
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"plotting pipeline timelines needs matplotlib, which is not installed: {_INSTALL_HINT}"
        ) from err


def _new_axes(num_ranks: int, saving: bool):
    size = (10.0, 0.9 + 0.42 * num_ranks)  # 10 x 2.6 inches at 4 ranks
    if saving and not _has_display():
        # Headless and only saving: draw on an Agg canvas without touching pyplot's
        # global backend or its figure registry (no figures pile up in a loop).
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=size, dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        return fig, fig.add_subplot()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size, dpi=100, layout="constrained")
    return fig, ax


def _has_display() -> bool:
    if sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _compute_boxes(timeline: Iterable[Any]):
    """Yield ``(rank, Action, start, end)`` for the compute entries of ``timeline``."""
    for item in timeline:
        if all(hasattr(item, a) for a in ("rank", "start", "end")):
            what = next((getattr(item, a) for a in ("action", "op", "label") if hasattr(item, a)), None)
            if what is None:
                raise ValueError(f"timeline entry {item!r} has no 'action', 'op' or 'label'")
            rank, start, end = item.rank, item.start, item.end
        else:
            entry = tuple(item)
            if len(entry) == 4:
                rank, what, start, end = entry
            elif len(entry) in (5, 6):  # ActionRecord order: rank, step, op, start, end[, wait]
                rank, _, what, start, end = entry[:5]
            else:
                raise ValueError(
                    f"timeline entry {item!r}: expected (rank, action, start, end) or "
                    "(rank, step, op, start, end[, wait])"
                )
        if isinstance(what, Action):
            action = what
        else:
            try:
                action = Action.parse(str(what))
            except ValueError:
                continue  # a communication op: not drawn
        yield int(rank), action, float(start), float(end)


def _microbatch_text(action: Action) -> str:
    mbs = action.microbatches
    if len(mbs) > 2 and mbs == tuple(range(mbs[0], mbs[-1] + 1)):
        return f"{mbs[0]}-{mbs[-1]}"
    return "+".join(str(m) for m in mbs)


def _axes_width_px(fig, ax) -> float:
    # Before layout the Axes box is the default subplot one; the legend outside takes
    # about a sixth more, hence the margin.
    return 0.85 * ax.get_position().width * fig.get_figwidth() * fig.dpi


def _lighten(color: str, amount: float) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _text_color(face) -> str:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _cost_unit(costs: Costs) -> str:
    values = (costs.f, costs.b, costs.w)
    numbers = [v for v in values if isinstance(v, (int, float))]  # Costs stores the others as tuples
    if len(numbers) == len(values):
        f, b, w = (float(v) for v in numbers)
        text = "F = B = W = 1" if f == b == w == 1.0 else f"F = {f:g}, B = {b:g}, W = {w:g}"
    else:
        text = "per-stage F, B, W costs"
    if costs.comm:
        text += f", comm = {costs.comm:g}"
    return f"simulated, {text}"
