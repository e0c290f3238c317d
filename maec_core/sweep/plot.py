"""The sweep plot: the objective against each knob, the constraint marked (sweep.png).

matplotlib with the Agg backend (no display); imported only when a plot is drawn.
"""

from __future__ import annotations

import io
import math

from maec_core.sweep.board import Leaderboard

# Inches: one panel per knob, and the margins around and between them.
PANEL_WIDTH, PANEL_HEIGHT = 4.2, 3.4
LEFT, RIGHT, BOTTOM, TOP, GAP, PANEL_TITLE = 0.85, 0.15, 0.55, 0.4, 0.85, 0.25


def plot_png(board: Leaderboard) -> bytes:
    """One panel per knob: every candidate's objective at its knob value; candidates
    that break the constraint are crosses, the winner a star; with an absolute or
    reference bound on the objective's own set, the bound is a dashed line."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    knobs = board.knobs or ["candidate"]
    width, height = PANEL_WIDTH * len(knobs), PANEL_HEIGHT
    fig = Figure(figsize=(width, height), dpi=100)
    # Fixed margins in inches, room for tick labels, axis labels, the title and (with a
    # constraint) a panel title: a layout engine measuring every text costs more than
    # the drawing itself (about half of this function's time).
    top = TOP + (PANEL_TITLE if _titled(board) else 0.0)
    fig.subplots_adjust(left=LEFT / width, right=1 - RIGHT / width, bottom=BOTTOM / height,
                        top=1 - top / height,
                        wspace=GAP / ((width - LEFT - RIGHT - GAP * (len(knobs) - 1))
                                      / len(knobs)))
    axes = fig.subplots(1, len(knobs), squeeze=False)[0]
    obj = board.objective
    for ax, knob in zip(axes, knobs, strict=True):
        for feasible, marker, label in ((True, "o", "meets constraint"),
                                        (False, "x", "breaks constraint")):
            rows = [r for r in board.rows if r.feasible is feasible]
            if rows:
                ax.scatter([_x(r.values, knob, r.id) for r in rows],
                           [_y(r.objective) for r in rows], marker=marker,
                           color="tab:blue" if feasible else "tab:red", label=label)
        if board.winner is not None:
            w = board.row(board.winner)
            ax.scatter([_x(w.values, knob, w.id)], [_y(w.objective)], marker="*", s=220,
                       color="gold", edgecolors="black", zorder=3, label=f"winner {w.id}")
        _bound(ax, board)
        ax.set_xlabel(knob)
        ax.set_ylabel(f"{obj['metric']} on {obj['set']}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"sweep: {obj['metric']} ({obj.get('goal') or ''}) on {obj['set']}",
                 y=1 - 0.08 / height, va="top")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _x(values: dict[str, int | float], knob: str, cid: str) -> float:
    return float(values.get(knob, int(cid[1:])))


def _y(v: float) -> float:
    return v if math.isfinite(v) else float("nan")


def _titled(board: Leaderboard) -> bool:
    """Whether the panels name the constraint in a title (it is not a line on them)."""
    c = board.constraint
    return c is not None and (c.get("set") != board.objective["set"] or "bound" not in c)


def _bound(ax: object, board: Leaderboard) -> None:
    """The constraint's bound as a dashed line, when it is on the objective's metric."""
    c = board.constraint
    if c is None or _titled(board):
        if c is not None:
            ax.set_title(f"constraint: {c.get('text', '')}", fontsize="small")  # type: ignore[attr-defined]
        return
    ax.axhline(c["bound"], linestyle="--", color="tab:red",  # type: ignore[attr-defined]
               label=f"constraint {c.get('text', '')}")
