"""``python -m shareddata demo``: the same data and workers, a naive Dataset vs shareddata.

The demo writes a synthetic ``.npy`` file, then runs one DataLoader over it twice
under :func:`shareddata.verify`: first over :class:`NaiveDataset` (the array held
as an attribute, which ``spawn``/``forkserver`` pickle into every worker), then over
:class:`shareddata.NumpyDataset`. It prints how many times each holds the data, the
memory saved and the time to the first batch, and explains every column it prints.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ._text import format_bytes, plural
from .memory import MemoryReport, verify

__all__ = ["DemoOptions", "NaiveDataset", "run_demo"]

ROW_FLOATS = 1024  # one sample: 1024 float32, 4 KiB


class NaiveDataset(Dataset[torch.Tensor]):
    """What most training code does: a numpy array held as an attribute.

    Under ``spawn``/``forkserver`` the DataLoader pickles it, array and all, into
    every worker: each worker holds its own copy.

    Args:
        path: a ``.npy`` file, read whole into this process's memory.
    """

    def __init__(self, path: str) -> None:
        self.data = np.load(path)

    @property
    def nbytes(self) -> int:
        """The array's size (what :func:`~shareddata.verify` compares against)."""
        return int(self.data.nbytes)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.data[i])


class _TimedLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader that notes how long its first batch took after ``iter()``."""

    first_batch_s: float | None = None

    def __iter__(self) -> Any:
        t0 = time.perf_counter()
        return _TimedIterator(super().__iter__(), self, t0)


class _TimedIterator:
    """Passes batches (and every attribute verify() looks at) through, timing the first."""

    def __init__(self, inner: Any, loader: _TimedLoader, t0: float) -> None:
        self._inner = inner
        self._loader = loader
        self._t0 = t0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        if self._loader.first_batch_s is None:
            self._loader.first_batch_s = time.perf_counter() - self._t0
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(frozen=True)
class DemoOptions:
    """The demo's knobs (the command line's flags)."""

    size: int
    workers: int
    start_method: str
    batch_size: int
    batches: int | None
    plot: str | None = None


@dataclass
class _Run:
    label: str
    report: MemoryReport
    load_s: float
    first_batch_s: float
    wall_s: float


def run_demo(options: DemoOptions) -> int:
    """Run the demo, printing as it goes; returns the exit code (0).

    Raises:
        MissingDependencyError: ``plot`` is set and matplotlib is not installed.
    """
    if options.plot:  # fail now, not after the runs, when matplotlib is missing
        from .memory._plot import figure_class

        figure_class()
    rows = max(1, options.size // (ROW_FLOATS * 4))
    nbytes = rows * ROW_FLOATS * 4
    who = f"{plural(options.workers, options.start_method + ' worker')}"
    intro = (
        f"One {format_bytes(nbytes)} dataset ({rows:,} rows of {ROW_FLOATS} float32), read by "
        f"{who}: first as a plain numpy Dataset, then as shareddata.NumpyDataset."
    )
    print(textwrap.fill(intro, width=88))
    if options.start_method == "forkserver":
        _start_forkserver()
    seen: set[str] = set()
    tmp = tempfile.mkdtemp(prefix="shareddata-demo-")
    try:
        path = os.path.join(tmp, "features.npy")
        _write(path, rows)
        naive = _run(options, "[1/2] naive numpy Dataset", lambda: NaiveDataset(path), seen)
        from .datasets import NumpyDataset

        shared = _run(options, "[2/2] shareddata.NumpyDataset", lambda: NumpyDataset(path), seen)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    _print_processes(naive.report, shared.report)
    print()
    _print_summary(naive, shared)
    print()
    _print_verdict(options, nbytes, naive, shared)
    if options.plot:
        from .memory._plot import save

        panels = [
            (f"naive numpy Dataset, {who}", naive.report),
            (f"shareddata, {who}", shared.report),
        ]
        print(f"chart written to {save(panels, options.plot)}")
    return 0


def _start_forkserver() -> None:
    """Start the forkserver now: set-up, not charged to the first run's workers.

    As in a training script, whose ``__main__`` (which the forkserver preloads) imports
    torch, the workers fork from a server that has imported it once.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "shareddata"])
    t0 = time.perf_counter()
    probe = context.Process(target=time.sleep, args=(0,))
    probe.start()  # returns once the server, torch imported, has forked it
    probe.join(timeout=120)
    print(f"started the forkserver (it imports torch once) in {time.perf_counter() - t0:.1f} s")


def _write(path: str, rows: int) -> None:
    t0 = time.perf_counter()
    data = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, ROW_FLOATS))
    for start in range(0, rows, 16384):
        data[start : start + 16384] = np.float32(start)
    data.flush()
    del data
    print(f"wrote the file in {time.perf_counter() - t0:.1f} s")


def _run(options: DemoOptions, label: str, make: Any, seen: set[str]) -> _Run:
    print(f"{label}: loading, starting {plural(options.workers, 'worker')} ...", flush=True)
    # torch warns of too many workers when the loader is made and at every iter():
    # record the warnings and show each once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        dataset = make()
        load_s = time.perf_counter() - t0
        loader = _TimedLoader(
            dataset,
            batch_size=options.batch_size,
            shuffle=True,
            num_workers=options.workers,
            multiprocessing_context=options.start_method if options.workers else None,
        )
        report = verify(loader, batches=options.batches, max_duplication=None)
    for w in caught:
        text = str(w.message).strip()
        if text not in seen:
            seen.add(text)
            print(f"  warning ({w.category.__name__}): {text}")
    first_batch_s = load_s + (loader.first_batch_s or 0.0)
    del loader, dataset
    gc.collect()
    wall_s = time.perf_counter() - t0
    print(f"  held {report.duplication:.2f}x; measured in {wall_s:.1f} s", flush=True)
    return _Run(label.split("] ", 1)[-1], report, load_s, first_batch_s, wall_s)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f}"


def _print_processes(naive: MemoryReport, shared: MemoryReport) -> None:
    """Both runs' processes side by side, matched by role."""
    roles = list(dict.fromkeys([p.role for p in naive.processes + shared.processes]))
    by_role = [{p.role: p for p in r.processes} for r in (naive, shared)]
    cells = ("private", "shared", "PSS")
    print("memory per process, in MiB:")
    print(f"{'':<12}{'naive numpy Dataset':>27}{'shareddata':>27}")
    print(f"{'process':<12}" + "".join(f"{c:>9}" for c in cells) * 2)
    for role in roles:
        line = f"{role:<12}"
        for rows in by_role:
            p = rows.get(role)
            values = ("-", "-", "-") if p is None else (_mib(p.uss), _mib(p.shared), _mib(p.pss))
            line += "".join(f"{v:>9}" for v in values)
        print(line)
    totals = [
        v
        for r in (naive, shared)
        for v in (
            _mib(sum(p.uss for p in r.processes)),
            _mib(sum(p.shared for p in r.processes)),
            _mib(r.total_pss),
        )
    ]
    print(f"{'total':<12}" + "".join(f"{v:>9}" for v in totals))
    print("  private: pages only this process maps (USS): a copy of the data, or pages of the")
    print("           shared copy that no other process has read yet")
    print("  shared:  pages it maps together with other processes: the one shared copy, libraries")
    print("  PSS:     private pages plus its share of each shared page (1/n of a page n map);")
    print("           summed over the processes, every page counts once")


def _print_summary(naive: _Run, shared: _Run) -> None:
    print(f"{'':<22}{'naive Dataset':>15}{'shareddata':>15}")
    pairs = [
        ("dataset held", f"{naive.report.duplication:.2f}x", f"{shared.report.duplication:.2f}x"),
        (
            "total memory (PSS)",
            format_bytes(naive.report.total_pss),
            format_bytes(shared.report.total_pss),
        ),
        ("first batch after", f"{naive.first_batch_s:.1f} s", f"{shared.first_batch_s:.1f} s"),
    ]
    for name, a, b in pairs:
        print(f"{name:<22}{a:>15}{b:>15}")
    print("  dataset held: copies of the data in RAM over all processes, net of code, libraries")
    print("                and each worker's memory without data (1.00x = one copy)")
    print("  total memory: the sum of the PSS column above")
    print("  first batch:  from loading the file to the first batch in the main process")


def _print_verdict(options: DemoOptions, nbytes: int, naive: _Run, shared: _Run) -> None:
    saved = naive.report.total_pss - shared.report.total_pss
    ratio = naive.report.total_pss / max(shared.report.total_pss, 1)
    verdict = (
        f"Verdict: with {plural(options.workers, options.start_method + ' worker')}, the naive "
        f"Dataset holds the {format_bytes(nbytes)} dataset {naive.report.duplication:.2f}x "
        f"(the main process and every worker have a copy); shareddata holds it "
        f"{shared.report.duplication:.2f}x. Memory saved: {format_bytes(saved)} "
        f"({format_bytes(naive.report.total_pss)} -> {format_bytes(shared.report.total_pss)}, "
        f"{ratio:.2f}x less). First batch after {naive.first_batch_s:.1f} s vs "
        f"{shared.first_batch_s:.1f} s."
    )
    print(textwrap.fill(verdict, width=88))
