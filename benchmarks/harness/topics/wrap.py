"""Wrapping a Dataset: ``sd.SharedDataset`` time against iterating it, and memory after an epoch.

Side by side in one fresh interpreter (medians of the repetitions, the order of the
methods alternating): materialisation at each size, ``sd.SharedDataset(ds)`` (and
with ``num_workers=2``) against iterating ``ds`` once (the target's baseline) and
collecting its items into a list; wall time, this process's CPU time (the writer
thread included), the main thread's, and the cores other processes used. Items are
(float32 [3, 32, 32], int, str) computed per item (~10 us). Then a dataset whose
items wait 0.5 ms (I/O), and memory after an epoch with 4 spawn workers
(``sd.verify``): the original (a Python list), detectron2-style serialisation (every
sample pickled into one numpy buffer) and ``sd.SharedDataset``.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import shareddata as sd
from harness.machine import CpuMonitor, machine_info

TARGET_RATIO = 1.2  # materialisation time / iterating once, at most


class Generated(Dataset):
    """(float32 tensor [3, 32, 32], int label, str caption), computed per item."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, 32, 32, generator=g), i % 10, f"picture number {i}"


class Waiting(Generated):
    """The same items, each after a 0.5 ms wait: a dataset that reads files or a network."""

    def __getitem__(self, i: int):
        time.sleep(0.0005)
        return super().__getitem__(i)


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


def _iterate(ds: Dataset) -> None:
    for i in range(len(ds)):
        ds[i]


def _collect(ds: Dataset) -> None:
    items = [ds[i] for i in range(len(ds))]
    del items


def _pages_only(ds: Dataset) -> None:
    """The kernel's part alone: fill and map fresh shared pages for ``ds``'s images.

    What SharedDataset's writer thread does, without any dataset: ``pwrite`` blocks of
    4 MiB into a new memfd, each mapped with ``MADV_POPULATE_READ``.
    """
    size = len(ds) * 3 * 32 * 32 * 4
    block = np.zeros(4 << 20, np.uint8)
    fd = os.memfd_create("bench-wrap", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mapped:
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
            for offset in range(0, size, block.nbytes):
                n = os.pwrite(fd, block[: size - offset], offset)
                LIBC.madvise(address + offset, n, 22)  # MADV_POPULATE_READ
    finally:
        os.close(fd)


def _shared_without_pages(ds: Dataset) -> None:
    """A diagnostic, not a way to load: SharedDataset with its writer thread idle.

    The writer's ``pwrite`` and mapping are patched out (the rows are never written),
    so the main thread does all its own work (checking items, collecting values,
    handing blocks over) with no kernel page work on the other core. Its main-thread
    CPU next to ``shared``'s shows what that page work costs the iteration itself.
    """
    from shareddata.datasets._materialise import _writer

    write, populate = _writer.BlockWriter.write, _writer.Writer._map
    _writer.BlockWriter.write = lambda self, *args: None  # type: ignore[method-assign]
    _writer.Writer._map = lambda self, *args: None  # type: ignore[method-assign]
    try:
        sd.SharedDataset(ds, progress=False)
    finally:
        _writer.BlockWriter.write, _writer.Writer._map = write, populate


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _methods(workers: bool) -> dict[str, Callable[[Dataset], Any]]:
    methods: dict[str, Callable[[Dataset], Any]] = {
        "iterate": _iterate,
        "collect": _collect,
        "pages_only": _pages_only,
        "shared": lambda ds: sd.SharedDataset(ds, progress=False),
        "shared_without_pages": _shared_without_pages,
    }
    if workers:
        methods["shared_2_workers"] = lambda ds: sd.SharedDataset(ds, num_workers=2, progress=False)
    return methods


def _measure(fn: Callable[[], Any]) -> dict[str, float]:
    mon = CpuMonitor()
    main0, cpu0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
    result = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    main = time.thread_time() - main0
    cores = mon.result()
    del result
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "main_cpu_s": main,
        "others_cores": cores["others_cores"],
        "steal_cores": cores["steal_cores"],
    }


def time_materialisation(
    n: int, repeats: int, workers: bool, wait_idle: float, max_others: float
) -> dict:
    """Each method ``repeats`` times, interleaved; medians and every repetition.

    A repetition of 0.25 s or more during which other processes used more than
    ``max_others`` cores is measured again (up to 3 times); the disturbed ones are
    kept under ``"disturbed"``.
    """
    src = Generated(n)
    methods = _methods(workers)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
    disturbed: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
    for rep in range(repeats):
        order = list(methods) if rep % 2 == 0 else list(reversed(methods))
        for name in order:
            for _attempt in range(4):
                gc.collect()
                if wait_idle:
                    wait_idle(wait_idle)
                run = _measure(lambda name=name: methods[name](src))
                # /proc/stat counts in 10 ms ticks: too coarse to judge shorter runs
                if run["others_cores"] <= max_others or run["wall_s"] < 0.25:
                    break
                disturbed[name].append(run)
            runs[name].append(run)
    med = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    return {
        "items": n,
        "median_wall_s": med,
        "median_cpu_s": {
            name: statistics.median(r["cpu_s"] for r in rs) for name, rs in runs.items()
        },
        "median_main_cpu_s": {
            name: statistics.median(r["main_cpu_s"] for r in rs) for name, rs in runs.items()
        },
        "ratio_to_iterate": {name: med[name] / med["iterate"] for name in med},
        "ratio_to_collect": {name: med[name] / med["collect"] for name in med},
        "runs": runs,
        "disturbed": disturbed,
    }


def time_waiting(n: int, repeats: int) -> dict:
    """Materialising a dataset whose items wait (I/O): the case for ``num_workers``."""
    src = Waiting(n)
    methods: dict[str, Callable[[], Any]] = {
        "iterate": lambda: _iterate(src),
        "shared": lambda: sd.SharedDataset(src, progress=False),
        "shared_4_workers": lambda: sd.SharedDataset(src, num_workers=4, progress=False),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
    for rep in range(repeats):
        for name in list(methods) if rep % 2 == 0 else list(reversed(methods)):
            gc.collect()
            runs[name].append(_measure(methods[name]))
    med = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    return {
        "items": n,
        "median_wall_s": med,
        "ratio_to_iterate": {name: med[name] / med["iterate"] for name in med},
        "runs": runs,
    }


def measure_memory(n: int) -> list[dict]:
    src = Generated(n)
    in_memory = InMemory(n)
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
        rows.append({"dataset": label, "held": report.duplication, "total_pss": report.total_pss})
    return rows


def _report(
    info: dict, timing: list[dict], waiting: dict | None, memory: list[dict], memory_items: int
) -> list[str]:
    lines = [
        "# SharedDataset benchmark",
        "",
        "Items of (float32 tensor [3, 32, 32] (12 KiB), int label, str caption), computed per",
        "item (`Generated` in `harness/topics/wrap.py`). Machine: "
        f"{info.get('cores', '?')} cores, {info.get('cpu', '?')}, "
        f"Python {info.get('python', '?')}, torch {info.get('torch', '?')}, "
        f"commit {info.get('commit', '?')}.",
        "",
        "## Materialisation vs iterating the original once",
        "",
        f"Medians of {len(timing[0]['runs']['iterate'])} interleaved repetitions (range in "
        "brackets). `iterate`: `for i in range(len(ds)): ds[i]` (the baseline of the target, "
        f"<= {TARGET_RATIO}x); `collect`: `[ds[i] for i in range(len(ds))]`, which also pays "
        "for the memory the items take; `pages_only`: no dataset, only what SharedDataset's "
        "writer thread asks of the kernel for the images (fill fresh shared pages with "
        "`pwrite`, map them), the part that runs beside the iteration; "
        "`shared_without_pages`: a diagnostic, `shared` with the writer thread's `pwrite` "
        "and mapping patched out (nothing is written): the main thread's own work, with no "
        "page work on the other core. CPU: this process, "
        "every thread (DataLoader workers not counted); main: the calling thread alone. A "
        "repetition during which other processes used more than a few tenths of a core was "
        "measured again (`re-run`).",
        "",
        "| items | method | wall s | x iterate | x collect | CPU s | main CPU s | re-run |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for t in timing:
        for name in t["median_wall_s"]:
            walls = [r["wall_s"] for r in t["runs"][name]]
            lines.append(
                f"| {t['items']} | {name} | {t['median_wall_s'][name]:.3f} "
                f"({min(walls):.3f}-{max(walls):.3f}) | **{t['ratio_to_iterate'][name]:.2f}** | "
                f"{t['ratio_to_collect'][name]:.2f} | {t['median_cpu_s'][name]:.3f} | "
                f"{t['median_main_cpu_s'][name]:.3f} | {len(t['disturbed'][name])} |"
            )
    if waiting:
        lines += [
            "",
            f"## An I/O-bound dataset: {waiting['items']} items, each after a 0.5 ms wait",
            "",
            "`num_workers=4` reads the items in 4 DataLoader workers, which write the fixed-size",
            "fields straight into the shared columns (workers are started for the call).",
            "",
            "| method | wall s | x iterate |",
            "|---|---:|---:|",
            *[
                f"| {name} | {wall:.3f} | **{waiting['ratio_to_iterate'][name]:.2f}** |"
                for name, wall in waiting["median_wall_s"].items()
            ],
        ]
    if memory:
        lines += [
            "",
            f"## Memory after an epoch, 4 spawn workers (`sd.verify`), {memory_items} items",
            "",
            "| dataset | held (x the data) | total PSS MiB |",
            "|---|---:|---:|",
            *[
                f"| {m['dataset']} | {m['held']:.2f} | {m['total_pss'] / 2**20:.0f} |"
                for m in memory
            ],
        ]
    return lines


def measure(
    items: list[int], repeats: int, workers_at: list[int], waiting: int, memory: int
) -> dict[str, Any]:
    """Child: every timing, the I/O-bound dataset and the memory after an epoch."""
    return {
        "machine": machine_info(),
        "materialise": [time_materialisation(n, repeats, n in workers_at, 0.0, 0.3) for n in items],
        "waiting": time_waiting(waiting, repeats) if waiting else None,
        "memory": measure_memory(memory) if memory else [],
        "memory_items": memory,
    }


def run(quick: bool, opts: Any) -> dict[str, Any]:
    """4096, 16384 and 65536 items, 5 repetitions (quick: 2048 items, 1 repetition)."""
    items = opts.items or ([2048] if quick else [4096, 16384, 65536])
    return opts.runner.run(
        "harness.topics.wrap",
        "measure",
        interpreter=True,
        items=items,
        repeats=1 if quick else max(opts.reps, 5),
        workers_at=[2048 if quick else 16384],
        waiting=256 if quick else 2048,
        memory=2048 if quick else 16384,
    )


def render(r: dict[str, Any]) -> str:
    """The report (timing, I/O-bound dataset, memory)."""
    return "\n".join(
        _report(r["machine"], r["materialise"], r["waiting"], r["memory"], r["memory_items"])
    )
