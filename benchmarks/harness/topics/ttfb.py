"""Spawn time to first batch: from ``iter(DataLoader(...))`` to its first batch.

``DataLoader(ds, batch_size=256, num_workers=2, multiprocessing_context="spawn")``
over 1 MiB, 256 MiB and 2 GiB datasets; one fresh interpreter per (case, size)
builds the dataset, then starts ``reps`` epochs (new workers each, as without
``persistent_workers``). ``limit`` is a dataset of nothing: the workers' start alone.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from typing import Any

from torch.utils.data import DataLoader

from harness import cases
from harness.machine import GIB, MIB, CpuMonitor, median
from harness.render import fx, plot, table, verdict

CASES = ["limit", "shareddata", "numpy array", "TensorDataset", "share_memory_()"]
CASES += ["h5py lazy", "HF datasets", "tensordict shared", "tensordict memmap"]
GOAL = 1.2  # largest / smallest dataset, at most


def first_batch(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Child: build each job's case, then time ``reps`` first batches with 2 spawn workers."""
    warnings.filterwarnings("ignore", message=".*This DataLoader will create.*")
    out: dict[str, Any] = {}
    for job in jobs:
        try:
            files = cases.Files(**job["files"])
            t0 = time.perf_counter()
            ds = cases.build(job["case"], files)
            build_s, times = time.perf_counter() - t0, []
            kw = cases.loader_kwargs(job["case"], ds, 256)
            for _ in range(job["reps"]):
                it = iter(DataLoader(ds, num_workers=2, multiprocessing_context="spawn", **kw))
                t0 = time.perf_counter()
                next(it)
                times.append(time.perf_counter() - t0)
                it._shutdown_workers()  # type: ignore[attr-defined]
                del it
            out[job["id"]] = {"build_s": build_s, "runs": times}
            del ds
        except Exception as e:
            out[job["id"]] = {"error": f"{type(e).__name__}: {e}"}
    return out


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """Every (case, size) in a fresh interpreter (all in one for a smoke run)."""
    sizes = [MIB, 4 * MIB] if quick else [MIB, 256 * MIB, 2 * GIB]
    names = ["limit", "shareddata"] if quick else CASES
    names = [c for c in names if c == "limit" or cases.available(opts.status, c)]
    mon = CpuMonitor()
    with tempfile.TemporaryDirectory(prefix="sd-ttfb-", dir=opts.tmp_dir) as tmp:
        files = [cases.peer_files(tmp, f"ttfb-{s}", s, 4096, opts.status) for s in sizes]
        jobs = [
            {"id": f"{c}|{f.nbytes}", "case": c, "files": vars(f), "reps": opts.reps}
            for f in files
            for c in names
        ]
        got = opts.runner.jobs("harness.topics.ttfb", "first_batch", jobs, quick)
    by_case: dict[str, dict[str, Any]] = {}
    for key, r in got.items():
        case, size = key.split("|")
        if "runs" in r:
            r["median_s"] = median(r["runs"])
        by_case.setdefault(case, {})[size] = r
    return {"by_case": by_case, "cpu": mon.result()}


def targets(r: dict[str, Any]) -> list[list[str]]:
    """Ours: the largest dataset's time over the smallest's."""
    ours = {s: v for s, v in r["by_case"].get("shareddata", {}).items() if "median_s" in v}
    if len(ours) < 2:
        return []
    small, big = min(ours, key=int), max(ours, key=int)
    v = ours[big]["median_s"] / ours[small]["median_s"]
    lim = next((x for x in r["by_case"].get("limit", {}).values() if "median_s" in x), None)
    return [
        [
            f"spawn time to first batch, {int(big) / MIB:.0f} MiB / {int(small) / MIB:.0f} MiB",
            fx(v),
            f"<= {GOAL}x",
            verdict(v, GOAL, False),
            f"workers' start alone: {lim['median_s']:.2f} s" if lim else "",
        ]
    ]


def render(r: dict[str, Any]) -> str:
    """Seconds per case and size: median of the epochs, the first in brackets."""
    sizes = sorted({s for by in r["by_case"].values() for s in by}, key=int)
    rows = []
    for case in CASES:
        by = r["by_case"].get(case)
        if by:
            cells = [by.get(s, {}) for s in sizes]
            rows.append(
                [case]
                + [
                    f"failed: {c['error'][:60]}"
                    if "error" in c
                    else f"{c['median_s']:.2f} (first {c['runs'][0]:.2f})"
                    if c
                    else "-"
                    for c in cells
                ]
            )
    return "\n".join(
        [
            "## Spawn time to first batch",
            "",
            "Seconds from `iter(DataLoader(ds, batch_size=256, num_workers=2, "
            "multiprocessing_context='spawn'))` to its first batch: median of the epochs "
            "(each starts new workers), the first epoch in brackets. `limit` = a dataset of "
            "nothing (the workers' start alone).",
            "",
            table(["case", *[f"{int(s) / MIB:.0f} MiB" for s in sizes]], rows),
            "",
        ]
    )


def plot_png(r: dict[str, Any], img_dir: str) -> dict[str, str]:
    """Seconds to the first batch against dataset size."""

    def draw(ax: Any, i: int) -> None:
        for case, by in r["by_case"].items():
            pts = sorted((int(s) / MIB, v["median_s"]) for s, v in by.items() if "median_s" in v)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=case)
        ax.set(xscale="log", yscale="log", xlabel="dataset MiB", ylabel="s to first batch")

    path = os.path.join(img_dir, "bench-ttfb.png")
    title = "spawn time to first batch against dataset size"
    return {title: path} if plot(path, 1, draw, 6) else {}
