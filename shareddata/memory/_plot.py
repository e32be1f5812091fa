"""Bar charts of :class:`~shareddata.MemoryReport`: private vs shared memory per process.

matplotlib is an optional extra (``pip install 'torch-shareddata[plot]'``). Figures are
drawn on matplotlib's ``Agg`` canvas directly (``matplotlib.figure.Figure``, never
``pyplot``), so plotting needs no display and leaves the user's global backend and
open figures alone.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any

from ..errors import MissingDependencyError

_MIB = 1024 * 1024
PRIVATE_COLOR = "#d62728"
SHARED_COLOR = "#1f77b4"


def figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError(
            "plotting a memory report needs matplotlib, which is not installed. "
            "Install it with: pip install 'torch-shareddata[plot]'"
        ) from e
    return Figure


def figure(panels: Sequence[tuple[str, Any]]) -> Any:
    """A ``matplotlib.figure.Figure`` with one panel per ``(title, report)``, left to right.

    A stacked bar per process: its USS (pages only it maps: a copy of the data shows
    here) below, the rest of its RSS (shared pages) above; the panels share the y
    axis; a dashed line marks the dataset's size.
    """
    if not panels:
        raise ValueError("figure() needs at least one (title, report) pair")
    new_figure = figure_class()
    widest = max(len(report.processes) for _, report in panels)
    fig = new_figure(
        figsize=(max(4.0, 0.9 * widest + 2.0) * len(panels), 5.0), layout="constrained"
    )
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (title, report) in zip(axes, panels):
        roles = [p.role for p in report.processes]
        private = [p.uss / _MIB for p in report.processes]
        shared = [p.shared / _MIB for p in report.processes]
        ax.bar(roles, private, color=PRIVATE_COLOR, label="private (USS)")
        ax.bar(roles, shared, bottom=private, color=SHARED_COLOR, label="shared with others")
        ax.axhline(
            report.dataset_bytes / _MIB, color="black", linestyle="--", linewidth=1, label="dataset"
        )
        ax.set_title(
            f"{title}\nheld {report.duplication:.2f}x, total PSS {report.total_pss / _MIB:.0f} MiB"
            if title
            else f"dataset held {report.duplication:.2f}x, "
            f"total PSS {report.total_pss / _MIB:.0f} MiB",
            fontsize=10,
        )
        ax.tick_params(axis="x", labelrotation=45 if len(roles) > 5 else 0)
    axes[0].set_ylabel("MiB per process")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3)
    return fig


def save(panels: Sequence[tuple[str, Any]], path: str | os.PathLike[str]) -> pathlib.Path:
    """Write :func:`figure` of ``panels`` to ``path`` as a PNG; returns the path."""
    fig = figure(panels)
    out = pathlib.Path(path)
    fig.savefig(out, format="png", dpi=100)
    return out
