"""What ``sd.verify`` reads on small datasets: correct loaders against duplicating ones.

One fresh interpreter, 2 workers, one epoch each: an 18 MiB ``SharedDataset`` of
uint8 images (held once: its pages are counted exactly), the same images as a plain
numpy ``Dataset`` (fork: shared copy-on-write pages, held once; spawn: one copy per
worker) and a Python list of tuples under fork (copied as the workers read it);
then below the estimate's resolution: 4 MiB of those images in a plain ``Dataset``
(spawn: counted from what the workers receive, 3x; fork: page by page, 1x) and a
4 MiB Python list under fork, which ``verify`` cannot tell (before the three
answers, the 4 MiB spawn case read 1.00x and passed).
Before ``verify`` told the dataset's pages apart (commit fd93927), the SharedDataset
read 1.08-1.10x (fork) and 1.01x (spawn) here; with working memory still counted as
copies, every kind plus these images read 6.29x under fork in a pytest session.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd
from harness.render import table

MIB = 1 << 20


class PlainImages(Dataset):
    """A user's dataset over an in-memory numpy array."""

    def __init__(self, images: np.ndarray) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.images[i])


class PythonRows(Dataset):
    """A user's dataset of Python tuples (reading one writes its reference counts)."""

    def __init__(self, rows: int) -> None:
        self.rows = [tuple(float(i + j) for j in range(16)) for i in range(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(self.rows[i])


def measure(images: int, rows: int) -> dict[str, Any]:
    """Child: verify every case; its reading, resolution and verdict."""
    data = np.random.default_rng(0).integers(0, 255, (images, 64, 64, 3), dtype=np.uint8)
    label = f"SharedDataset, {data.nbytes / MIB:.0f} MiB uint8"
    small = data[: 4 * MIB // data[0].nbytes].copy()  # its own array, not a view of data
    cases = [
        (label, "fork", sd.SharedDataset(data), "1x"),
        (label, "spawn", sd.SharedDataset(data), "1x"),
        ("plain numpy Dataset", "fork", PlainImages(data), "1x"),
        ("plain numpy Dataset", "spawn", PlainImages(data), "3x"),
        ("Python list of tuples", "fork", PythonRows(rows), "> 1.1x"),
        ("plain numpy Dataset, 4 MiB", "spawn", PlainImages(small), "3x"),
        ("plain numpy Dataset, 4 MiB", "fork", PlainImages(small), "1x"),
        ("Python list of tuples, 4 MiB", "fork", PythonRows(7000), "cannot tell"),
    ]
    out = []
    for name, method, dataset, expected in cases:
        loader = DataLoader(
            dataset, batch_size=32, num_workers=2, multiprocessing_context=method, timeout=120
        )
        t0 = time.perf_counter()
        try:
            report = sd.verify(loader)
        except (sd.DuplicationError, sd.InconclusiveError) as e:
            report = e.report
        out.append(
            [name, method, expected, f"{report.duplication:.2f}x", report.status]
            + [f"{report.resolution / MIB:.0f} MiB", report.verdict_line()[:60]]
            + [f"{time.perf_counter() - t0:.0f}"]
        )
    return {"rows": out}


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """The cases in one new interpreter (smaller in a quick run)."""
    size = (256, 10_000) if quick else (1536, 60_000)
    return opts.runner.run(
        "harness.topics.verify", "measure", interpreter=True, images=size[0], rows=size[1]
    )


def render(r: dict[str, Any]) -> str:
    """One row per case."""
    header = ["dataset", "start", "expected", "read", "answer", "resolution", "verdict", "s"]
    return "\n".join(["## What verify reads on small datasets", "", table(header, r["rows"]), ""])
