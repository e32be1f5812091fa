"""Bar charts of :class:`~shareddata.MemoryReport`: private vs shared memory per process.

Drawn on a ``matplotlib.figure.Figure`` (never ``pyplot``): no display needed, and the
user's backend and figures are left alone. matplotlib is the ``[plot]`` extra.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any

from ..errors import MissingDependencyError
from ._process import MIB

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
    """A figure with one panel per ``(title, report)``: per process, USS below, shared above.

    A dashed line marks the dataset's size; the panels share the y axis.
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
        private = [p.uss / MIB for p in report.processes]
        shared = [p.shared / MIB for p in report.processes]
        ax.bar(roles, private, color=PRIVATE_COLOR, label="private (USS)")
        ax.bar(roles, shared, bottom=private, color=SHARED_COLOR, label="shared with others")
        ax.axhline(
            report.dataset_bytes / MIB, color="black", linestyle="--", linewidth=1, label="dataset"
        )
        held = f"held {report.duplication:.2f}x, total PSS {report.total_pss / MIB:.0f} MiB"
        ax.set_title(f"{title}\n{held}" if title else f"dataset {held}", fontsize=10)
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
