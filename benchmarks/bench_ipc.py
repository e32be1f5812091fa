"""Per-batch cost of a batch leaving a DataLoader worker, before and after, in one run.

    python benchmarks/bench_ipc.py                 # ~1 min on 2 cores; writes results/ipc.md
    python benchmarks/bench_ipc.py --rounds 5 --batches 400
    python benchmarks/bench_ipc.py --baseline HEAD~1    # before/after, A B A B (~3 min)

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
  (Note [Reusing a batch's pages] in ``shareddata/crossing/_transport.py``);
- ``samples, identity collate``: ``collate_fn=lambda b: b`` over a NumpyDataset:
  the list of 256 samples, never looked at in the worker, crosses as its gathered
  columns and is made into samples in the main process (Note [Samples made when
  first used] in ``shareddata/crossing/_collate.py``; before, 512 tensor views of one memfd,
  each pickled: Note [Tensors over our memory cross by handle] in
  ``shareddata/storage/_tensor.py``);
- ``samples, tuple(zip(*batch))``: torchvision detection's collate: two tuples of
  256 views of one memfd.

Loaders (samples/s): ``sd.NumpyDataset`` with the default collate and with the
``IndexBatchSampler`` fast path, against Hugging Face ``datasets``
(``Dataset.from_file(arrow).with_format("torch")``) if it is installed, all with 2
workers, same rows. Rounds interleave the cases; medians are reported.

``--baseline REV``: the same cases for the code at ``REV`` (a ``git worktree`` of it,
removed afterwards) and for this tree, each round a fresh process per tree,
alternated (before, after, HF datasets, before, after, ...), so both see the same
load; the table gives medians and every repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from harness.transport import shared_empty, transport
from torch.utils.data import DataLoader, Dataset

import shareddata as sd

_transport = transport()  # the worker-batch module of whichever tree is imported

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


def zipped(batch: Any) -> Any:
    """``collate_fn=lambda b: tuple(zip(*b))`` (torchvision's detection references)."""
    return tuple(zip(*batch))


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
        "samples, tuple(zip(*batch))": DataLoader(
            data,
            batch_size=ROWS,
            sampler=range(min(n * ROWS, len(data))),
            collate_fn=zipped,
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


AB_IPC = (
    "no data (an int): the DataLoader's own cost",
    "memfd, reused (after)",
    "samples, identity collate",
    "samples, tuple(zip(*batch))",
)
AB_LOADERS = ("shareddata, default collate", "shareddata, IndexBatchSampler")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One round of the A/B cases in this process (the tree on ``PYTHONPATH``)."""
    array = np.random.default_rng(0).random((args.rows, FLOATS), dtype=np.float32)
    out: dict[str, Any] = {"tree": os.path.dirname(os.path.dirname(sd.__file__))}
    with tempfile.TemporaryDirectory() as tmp:
        data = sd.NumpyDataset({"data": array})
        if args.child == "hf":
            loaders = real_loaders(data, array, tmp)
            out["HF datasets"] = samples_per_s(loaders["HF datasets"])
            return out
        ipc = ipc_loaders(data, args.batches)
        for name in AB_IPC:
            out[name] = per_batch_us(ipc[name])
        del ipc
        real = real_loaders(data, array, tmp)
        for name in AB_LOADERS:
            out[name] = samples_per_s(real[name])
        del real, data
    return out


def ab(args: argparse.Namespace) -> list[str]:
    """Before (``args.baseline``) and after (this tree), alternated in fresh processes."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rev = subprocess.run(
        ["git", "-C", repo, "rev-parse", "--short", args.baseline],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    head = subprocess.run(
        ["git", "-C", repo, "rev-parse", "--short", "HEAD"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    base = tempfile.mkdtemp(prefix="bench-ipc-baseline-")
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", base, rev], check=True)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": [], "hf": []}
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        for _ in range(args.rounds):
            for which, tree, mode in (("before", base, "ours"), ("after", repo, "ours"),
                                      ("hf", repo, "hf")):  # fmt: skip
                env = dict(os.environ, PYTHONPATH=tree)
                cmd = [sys.executable, os.path.abspath(__file__), "--child", mode,
                       "--batches", str(args.batches), "--rows", str(args.rows)]  # fmt: skip
                done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if os.path.realpath(result.pop("tree")) != os.path.realpath(tree):
                    raise RuntimeError(f"the {which} process did not import {tree}")
                runs[which].append(result)
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", base], check=False)
        shutil.rmtree(base, ignore_errors=True)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    hf = statistics.median(r["HF datasets"] for r in runs["hf"])

    def med(which: str, key: str, i: int | None = None) -> float:
        return statistics.median(r[key] if i is None else r[key][i] for r in runs[which])

    def reps(which: str, key: str, i: int | None = None) -> str:
        return "/".join(f"{r[key] if i is None else r[key][i]:.0f}" for r in runs[which])

    lines = [
        f"## Before ({rev}) / after (this tree, HEAD {head}), alternated",
        "",
        f"{args.rounds} rounds, each a fresh process per tree in turn (before, after, HF "
        f"datasets); load average {load_before} before and {load_after} "
        f"after, on {os.cpu_count()} CPUs shared with other work. Medians; every "
        "repetition in brackets.",
        "",
        "| per batch (us) | before | after | after/before |",
        "|---|---:|---:|---:|",
    ]
    for name in AB_IPC:
        for i, what in enumerate(("wall", "main CPU", "workers' CPU")):
            b, a = med("before", name, i), med("after", name, i)
            lines.append(
                f"| {name.split(' (')[0]}: {what} | {b:.0f} ({reps('before', name, i)}) "
                f"| {a:.0f} ({reps('after', name, i)}) | {a / b if b else float('nan'):.2f} |"
            )
    lines += ["", "| loader, samples/s | before | after | before / HF | after / HF |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name in AB_LOADERS:
        b, a = med("before", name), med("after", name)
        lines.append(
            f"| {name} | {b:,.0f} ({reps('before', name)}) | {a:,.0f} ({reps('after', name)}) "
            f"| {b / hf:.1f}x | {a / hf:.1f}x |"
        )
    lines.append(f"| HF datasets | {hf:,.0f} ({reps('hf', 'HF datasets')}) | | | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run every case and print (and write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=200, help="batches per IPC epoch")
    parser.add_argument("--rows", type=int, default=64 * 1024, help="rows of the loaders")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--baseline", help="also run the A/B cases against this git revision")
    parser.add_argument("--child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

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
    if args.baseline:
        lines += ["", *ab(args)]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ipc.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
