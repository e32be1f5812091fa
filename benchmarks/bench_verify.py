"""What ``sd.verify`` reads on small datasets: correct loaders vs duplicating ones.

One run, side by side, 2 workers, one epoch each: an 18 MiB ``SharedDataset`` of
uint8 images (held once: its pages are counted exactly), the same images as a plain
numpy ``Dataset`` (fork: shared copy-on-write pages, held once; spawn: one copy per
worker) and a Python list of tuples under fork (copied as the workers read it).
Before ``verify`` told the dataset's pages apart (commit fd93927), the SharedDataset
read 1.08-1.10x (fork) and 1.01x (spawn) on this script and 1.59x/1.28x in the run
issue 15 reports; with working memory still counted as copies (its segments already
told apart), every kind plus these images (33 MiB) read 6.29x under fork in a pytest
session. Now 1.00x in all of them.

Run: ``python benchmarks/bench_verify.py`` (about 1 min on 2 cores).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd

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


def main() -> None:
    images = np.random.default_rng(0).integers(0, 255, (1536, 64, 64, 3), dtype=np.uint8)
    cases = [
        ("SharedDataset, 18 MiB uint8", "fork", sd.SharedDataset(images), "1x"),
        ("SharedDataset, 18 MiB uint8", "spawn", sd.SharedDataset(images), "1x"),
        ("plain numpy Dataset", "fork", PlainImages(images), "1x"),
        ("plain numpy Dataset", "spawn", PlainImages(images), "3x"),
        ("Python list of tuples", "fork", PythonRows(60_000), "> 1.1x"),
    ]
    print(f"{'dataset':<30}{'start':<7}{'expected':>9}{'read':>8}{'resolution':>12}  verdict")
    for name, method, dataset, expected in cases:
        loader = DataLoader(
            dataset, batch_size=32, num_workers=2, multiprocessing_context=method, timeout=120
        )
        t0 = time.perf_counter()
        try:
            report = sd.verify(loader)
        except sd.DuplicationError as e:
            report = e.report
        wall = time.perf_counter() - t0
        res = f"{report.resolution / MIB:.0f} MiB"
        print(
            f"{name:<30}{method:<7}{expected:>9}{report.duplication:>7.2f}x{res:>12}  "
            f"{report.verdict_line()[:60]} ({wall:.0f} s)"
        )


if __name__ == "__main__":
    main()
