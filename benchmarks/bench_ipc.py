"""Per-batch cost of a batch leaving a DataLoader worker, before and after, in one run.

    python benchmarks/bench_ipc.py                 # ~1 min on 2 cores; writes results/ipc.md
    python benchmarks/bench_ipc.py --rounds 5 --batches 400

Every case is a DataLoader with 2 persistent fork workers, batches of 256 rows of
1 KiB (float32 x 256). The main process only receives: the time per batch is the
cost of carrying a batch out of a worker (issue 14: goal <= 150 us).

IPC floor (workers return a new batch without reading anything):

- ``no data``: workers return an int, the DataLoader's own cost per batch (its
  queues, pipes and bookkeeping), which no transport can go below;
- ``torch /dev/shm``: the batch is a tensor in torch's shared memory, as the
  default collate makes it in a worker; torch passes a descriptor that the main
  process fetches from the worker over a socket;
- ``memfd, fresh each batch`` (before): shareddata's worker batch with its pool
  off, a new memfd per batch (the kernel zeroes every page at first touch);
- ``memfd, reused`` (after): a batch memfd is reused once nothing maps it
  (Note [Reusing a batch's pages] in ``shareddata/_transport.py``);
- ``samples, identity collate``: ``collate_fn=lambda b: b`` over a NumpyDataset:
  256 sample views of one memfd, which cross as one handle (Note [Tensors over our
  memory cross by handle] in ``shareddata/_reduce.py``).

Loaders (samples/s): ``sd.NumpyDataset`` with the default collate and with the
``IndexBatchSampler`` fast path, against Hugging Face ``datasets``
(``Dataset.from_file(arrow).with_format("torch")``) if it is installed, all with 2
workers, same rows. Rounds interleave the cases; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd
from shareddata import _transport
from shareddata._columns import shared_empty

ROWS, FLOATS = 256, 256  # a batch: 256 rows x 1 KiB


class NewBatches(Dataset):
    """Item ``i`` is a new, unread batch made the way ``how`` makes it in a worker."""

    def __init__(self, n: int, how: str) -> None:
        self.n, self.how = n, how

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.how == "none":
            return i
        if self.how == "torch":
            batch = shared_empty((ROWS, FLOATS), torch.float32)
        else:
            batch = _transport.worker_empty((ROWS, FLOATS), torch.float32)
        return batch.fill_(i)  # written, as a gather writes it (a fresh page is zeroed first)


def _pool_off(worker_id: int) -> None:
    _transport.POOL = 0  # every batch gets a fresh memfd: the path before the pool


def identity(batch: Any) -> Any:
    """``collate_fn=lambda b: b``."""
    return batch


def ipc_loaders(data: sd.NumpyDataset, n: int) -> dict[str, DataLoader]:
    """The IPC-floor loaders, each with 2 persistent fork workers."""
    kw: dict[str, Any] = {
        "num_workers": 2,
        "persistent_workers": True,
        "multiprocessing_context": "fork",
        "timeout": 60,
    }
    return {
        "no data (an int): the DataLoader's own cost": DataLoader(
            NewBatches(n, "none"), batch_size=None, **kw
        ),
        "torch /dev/shm": DataLoader(NewBatches(n, "torch"), batch_size=None, **kw),
        "memfd, fresh each batch (before)": DataLoader(
            NewBatches(n, "memfd"), batch_size=None, worker_init_fn=_pool_off, **kw
        ),
        "memfd, reused (after)": DataLoader(NewBatches(n, "memfd"), batch_size=None, **kw),
        "samples, identity collate": DataLoader(
            data,
            batch_size=ROWS,
            sampler=range(min(n * ROWS, len(data))),
            collate_fn=identity,
            **kw,
        ),
    }


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) that processes ``pids`` have used."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def per_batch_us(loader: DataLoader, warmup: int = 4) -> tuple[float, float, float]:
    """Per batch received, over one epoch after ``warmup`` batches: microseconds of
    wall time, of the main process's CPU and of the workers' CPU.

    CPU time is what a batch costs whatever else the machine runs; wall time is
    what a loader delivers here and now.
    """
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    workers = [w.pid for w in getattr(it, "_workers", [])]
    t0, c0, w0, k = time.perf_counter(), time.process_time(), _cpu_s(workers), 0
    for batch in it:
        del batch
        k += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall / k * 1e6, cpu / k * 1e6, (_cpu_s(workers) - w0) / k * 1e6


def samples_per_s(loader: DataLoader, warmup: int = 2) -> float:
    """Samples per second over one epoch after ``warmup`` batches."""
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    t0, n = time.perf_counter(), 0
    for batch in it:
        x = batch["data"] if isinstance(batch, dict) else batch
        n += len(x)
    return n / (time.perf_counter() - t0)


def real_loaders(data: sd.NumpyDataset, array: np.ndarray, tmp: str) -> dict[str, DataLoader]:
    """shareddata and (if installed) HF datasets over the same rows, 2 workers each."""
    kw: dict[str, Any] = {
        "num_workers": 2,
        "persistent_workers": True,
        "multiprocessing_context": "fork",
        "timeout": 60,
    }
    out = {
        "shareddata, default collate": DataLoader(data, batch_size=ROWS, shuffle=True, **kw),
        "shareddata, IndexBatchSampler": DataLoader(
            data, sampler=sd.IndexBatchSampler(data, ROWS, shuffle=True), batch_size=None, **kw
        ),
    }
    try:
        import datasets
        import pyarrow as pa
    except ImportError:
        print("HF datasets is not installed: pip install datasets (skipped)")
        return out
    datasets.disable_progress_bars()
    path = os.path.join(tmp, "rows.arrow")
    schema = pa.schema([("data", pa.list_(pa.float32(), FLOATS))])
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        values = pa.array(array.reshape(-1))
        column = pa.FixedSizeListArray.from_arrays(values, FLOATS)
        writer.write_batch(pa.record_batch([column], schema=schema))
    hf = datasets.Dataset.from_file(path).with_format("torch")
    out["HF datasets"] = DataLoader(hf, batch_size=ROWS, shuffle=True, **kw)
    return out


def measure(loaders: dict[str, DataLoader], rounds: int, fn: Callable[[DataLoader], Any]) -> Any:
    """Median of ``fn`` (a number or a tuple of them) per loader, rounds interleaving loaders."""
    runs: dict[str, list[Any]] = {name: [] for name in loaders}
    for _ in range(rounds):
        for name, loader in loaders.items():
            runs[name].append(fn(loader))
    out: dict[str, Any] = {}
    for name, values in runs.items():
        if isinstance(values[0], tuple):
            out[name] = tuple(statistics.median(v) for v in zip(*values))
        else:
            out[name] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every case and print (and write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=200, help="batches per IPC epoch")
    parser.add_argument("--rows", type=int, default=64 * 1024, help="rows of the loaders")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)

    array = np.random.default_rng(0).random((args.rows, FLOATS), dtype=np.float32)
    lines = [
        f"# Leaving a DataLoader worker: batches of {ROWS} x 1 KiB, 2 fork workers",
        "",
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, medians of {args.rounds} rounds.",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        data = sd.NumpyDataset({"data": array})
        ipc = measure(ipc_loaders(data, args.batches), args.rounds, per_batch_us)
        base = ipc["torch /dev/shm"]
        lines += [
            "| IPC floor | wall us/batch | vs torch | main CPU us/batch | workers' CPU us/batch |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {k} | {v[0]:.0f} | {base[0] / v[0]:.2f}x | {v[1]:.0f} | {v[2]:.0f} |"
            for k, v in ipc.items()
        ]
        real = measure(real_loaders(data, array, tmp), args.rounds, samples_per_s)
        ours = max(v for k, v in real.items() if k.startswith("shareddata"))
        hf = real.get("HF datasets")
        lines += [
            "",
            "| loader | samples/s | us per batch | vs HF datasets |",
            "|---|---:|---:|---:|",
        ]
        for k, v in real.items():
            ratio = f"{v / hf:.1f}x" if hf else "n/a"
            lines.append(f"| {k} | {v:,.0f} | {ROWS / v * 1e6:.0f} | {ratio} |")
        del data
    after, before = ipc["memfd, reused (after)"], ipc["memfd, fresh each batch (before)"]
    load = os.getloadavg()[0]
    lines += [
        "",
        f"After/before: {after[0]:.0f} us per batch against {before[0]:.0f} us (fresh memfd) and "
        f"{base[0]:.0f} us (torch): {before[0] / after[0]:.2f}x and {base[0] / after[0]:.2f}x; "
        f"CPU per batch (main + workers) {sum(after[1:]):.0f} us against {sum(before[1:]):.0f} us "
        f"and {sum(base[1:]):.0f} us. Goal <= 150 us per batch: "
        f"{'met' if after[0] <= 150 else 'not met'} here (load average {load:.1f} on "
        f"{os.cpu_count()} CPUs)."
        + (f" Best loader / HF datasets: {ours / hf:.1f}x (goal >= 8x)." if hf else ""),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ipc.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
