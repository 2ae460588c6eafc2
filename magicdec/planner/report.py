"""Plain-text tables and matplotlib plots of planner rows (lists of dicts)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Render rows as an aligned plain-text table; `columns` picks and orders the keys."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())
    cells = [[_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    lines = ["  ".join(column.ljust(width) for column, width in zip(columns, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def plot_speedup(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], *, x: str = "batch",
                 y: str = "predicted_speedup", group: str = "context", title: str = "", ylabel: str | None = None,
                 logx: bool = True) -> None:
    """Plot `y` against `x`, one line per value of `group`, and save a PNG at `path`.

    The defaults draw predicted speedup against batch size, one line per context length."""
    # Imported here so the planner works without matplotlib, and with the headless backend.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({row[group] for row in rows}, key=lambda v: (isinstance(v, str), v)):
        points = sorted((row[x], row[y]) for row in rows if row[group] == key)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{group}={key}")
    if logx:
        ax.set_xscale("log", base=2)
    if y == "predicted_speedup":
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set(xlabel=x, ylabel=ylabel or y, title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    save_figure(fig, path)


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 100) -> Path:
    """Lay out a matplotlib figure, write it to `path` and close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)
