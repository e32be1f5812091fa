"""SharedDataset benchmark: materialisation rate, and memory after an epoch with 4 workers.

Compares, side by side in one run (medians of --repeats):

* materialisation: ``sd.SharedDataset(ds)`` vs simply iterating ``ds`` once;
* memory after an epoch with 4 spawn workers (``sd.verify``): the original dataset
  (a Python list of samples, as users often keep them), detectron2-style
  serialisation (every sample pickled into one numpy byte buffer + offsets), and
  ``sd.SharedDataset``.

Run: python benchmarks/bench_wrap.py [--items N] [--repeats R] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd

RESULTS = os.path.join(os.path.dirname(__file__), "results")


class Generated(Dataset):
    """(float32 tensor [3, 32, 32], int label, str caption), computed per item."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, 32, 32, generator=g), i % 10, f"picture number {i}"


class InMemory(Dataset):
    """The same samples held as a Python list (numpy images), as user code often does."""

    def __init__(self, n: int) -> None:
        src = Generated(n)
        self.items = [(x.numpy(), y, c) for x, y, c in (src[i] for i in range(n))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class Serialized(Dataset):
    """detectron2's trick: pickle every item into one numpy buffer (no per-item objects)."""

    def __init__(self, items: list) -> None:
        blobs = [np.frombuffer(pickle.dumps(it, protocol=-1), np.uint8) for it in items]
        self.addr = np.cumsum([len(b) for b in blobs])
        self.data = np.concatenate(blobs)

    def __len__(self) -> int:
        return len(self.addr)

    def __getitem__(self, i: int):
        start = 0 if i == 0 else self.addr[i - 1]
        return pickle.loads(memoryview(self.data[start : self.addr[i]]))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.addr.nbytes)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=32768)  # ~384 MiB of images
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.items, args.repeats = 4096, 1

    src = Generated(args.items)
    iterate = _median_time(lambda: [src[i] for i in range(len(src))], args.repeats)
    build = _median_time(lambda: sd.SharedDataset(src, progress=False), args.repeats)
    rate = args.items / build

    in_memory = InMemory(args.items)
    shared = sd.SharedDataset(src, progress=False)
    serialized = Serialized(in_memory.items)
    rows = []
    for label, ds, nbytes in [
        ("original (Python list)", in_memory, shared.nbytes),
        ("detectron2-style serialized", serialized, serialized.nbytes),
        ("sd.SharedDataset", shared, shared.nbytes),
    ]:
        loader = DataLoader(ds, batch_size=128, num_workers=4, multiprocessing_context="spawn")
        report = sd.verify(loader, max_duplication=None, dataset_bytes=nbytes)
        rows.append((label, report.duplication, report.total_pss))
    out = {
        "items": args.items,
        "iterate_s": iterate,
        "materialise_s": build,
        "materialise_ratio": build / iterate,
        "items_per_s": rate,
        "memory": [{"dataset": r[0], "held": r[1], "total_pss": r[2]} for r in rows],
    }
    lines = [
        f"# SharedDataset benchmark ({args.items} items of 12 KiB image + int + str)",
        "",
        f"Materialisation: {build:.2f} s ({rate:,.0f} items/s) vs iterating the original once "
        f"{iterate:.2f} s: **{build / iterate:.2f}x** its time (target <= 1.2x).",
        "",
        "Memory after an epoch, 4 spawn workers (`sd.verify`):",
        "",
        "| dataset | held (x the data) | total PSS MiB |",
        "|---|---:|---:|",
        *[f"| {n} | {d:.2f} | {p / 2**20:.0f} |" for n, d, p in rows],
    ]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "wrap.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, "wrap.json"), "w") as f:
        json.dump(out, f, indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
