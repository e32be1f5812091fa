"""The one renderer: Markdown tables, figure formats and the plots."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any


def table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table, columns padded to their widest cell."""
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) if i < len(r) else 0 for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join(
        [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in cells[1:]]
    )


def fx(x: float | None, digits: int = 2) -> str:
    """A ratio as ``1.23x`` (a dash when missing)."""
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}x"


def rate(x: float | None) -> str:
    """Samples/s in millions, 3 decimals (a dash when missing)."""
    return "-" if x is None or math.isnan(x) else f"{x / 1e6:.3f}"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def verdict(value: float | None, goal: float, at_least: bool) -> str:
    """``met``, ``**missed** by 1.23x`` or ``not measured``."""
    if value is None:
        return "not measured"
    if (value >= goal) if at_least else (value <= goal):
        return "met"
    return f"**missed** by {(goal / value if at_least else value / goal):.2f}x"


def others(section: dict[str, Any]) -> str:
    """The sentence saying how busy the machine was during a section."""
    cpu = section.get("cpu", {})
    used = cpu.get("others_cores", float("nan"))
    return f"Other processes used {used:.2f} cores on average meanwhile."


def plot(path: str, panels: int, draw: Callable[[Any, int], None], width: float = 5.5) -> bool:
    """A PNG of ``panels`` axes side by side, each drawn by ``draw(ax, i)``.

    Returns:
        False when matplotlib (extra ``bench``) is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, panels, figsize=(width * panels, 4.5), squeeze=False)
    for i, ax in enumerate(axes[0]):
        draw(ax, i)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
