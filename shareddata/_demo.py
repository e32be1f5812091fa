"""``python -m shareddata demo``: the same data and workers, a naive Dataset vs shareddata.

A synthetic ``.npy`` file is read by one DataLoader twice under
:func:`shareddata.verify`: over :class:`NaiveDataset` (the array held as an attribute,
which ``spawn``/``forkserver`` pickle into every worker), then over
:class:`shareddata.NumpyDataset`; the demo prints how many times each holds the data,
the memory saved and the time to the first batch, and explains every column.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ._text import format_bytes, plural
from .datasets import NumpyDataset
from .memory import MemoryReport, verify
from .memory._plot import figure_class, save

__all__ = ["NaiveDataset", "run_demo"]

ROW_FLOATS = 1024  # one sample: 1024 float32, 4 KiB


class NaiveDataset(Dataset[torch.Tensor]):
    """What most training code does: a numpy array (``np.load(path)``) held as an attribute.

    Under ``spawn``/``forkserver`` the DataLoader pickles it, array and all, into
    every worker: each worker holds its own copy.
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
        t0 = time.perf_counter()  # before iter(), which starts the workers
        return _TimedIterator(super().__iter__(), self, t0)


class _TimedIterator:
    """Passes batches (and every attribute verify() looks at) through, timing the first."""

    def __init__(self, inner: Any, loader: _TimedLoader, t0: float) -> None:
        self._inner, self._loader, self._t0 = inner, loader, t0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        if self._loader.first_batch_s is None:
            self._loader.first_batch_s = time.perf_counter() - self._t0
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def run_demo(options: argparse.Namespace) -> int:
    """Run the demo with the command line's options, printing as it goes; returns 0.

    Raises:
        MissingDependencyError: ``options.plot`` is set and matplotlib is not installed.
    """
    if options.plot:  # fail now, not after the runs, when matplotlib is missing
        figure_class()
    rows = max(1, options.size // (ROW_FLOATS * 4))
    nbytes = rows * ROW_FLOATS * 4
    who = plural(options.workers, options.start_method + " worker")
    _print_wrapped(
        f"One {format_bytes(nbytes)} dataset ({rows:,} rows of {ROW_FLOATS} float32), read by "
        f"{who}: first as a plain numpy Dataset, then as shareddata.NumpyDataset."
    )
    if options.start_method == "forkserver":
        _start_forkserver()
    seen: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="shareddata-demo-", ignore_cleanup_errors=True) as tmp:
        path = os.path.join(tmp, "features.npy")
        _write(path, rows)
        naive = _run(options, "[1/2] naive numpy Dataset", lambda: NaiveDataset(path), seen)
        shared = _run(options, "[2/2] shareddata.NumpyDataset", lambda: NumpyDataset(path), seen)
    print()
    _print_processes(naive[0], shared[0])
    print()
    _print_summary(naive, shared)
    print()
    (a, a_s), (b, b_s) = naive, shared
    _print_wrapped(
        f"Verdict: with {who}, the naive Dataset holds the {format_bytes(nbytes)} dataset "
        f"{a.duplication:.2f}x (the main process and every worker have a copy); shareddata "
        f"holds it {b.duplication:.2f}x. Memory saved: {format_bytes(a.total_pss - b.total_pss)} "
        f"({format_bytes(a.total_pss)} -> {format_bytes(b.total_pss)}, "
        f"{a.total_pss / max(b.total_pss, 1):.2f}x less). First batch after {a_s:.1f} s vs "
        f"{b_s:.1f} s."
    )
    if options.plot:
        panels = [(f"naive numpy Dataset, {who}", a), (f"shareddata, {who}", b)]
        print(f"chart written to {save(panels, options.plot)}")
    return 0


def _print_wrapped(text: str) -> None:
    print(textwrap.fill(text, width=88))


def _start_forkserver() -> None:
    """Start the forkserver, importing torch once, now: set-up, not charged to a run.

    As a training script's ``__main__`` (which the forkserver preloads) imports torch.
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


def _run(options: Any, label: str, make: Any, seen: set[str]) -> tuple[MemoryReport, float]:
    """One run: its report and the seconds from loading to the first batch."""
    print(f"{label}: loading, starting {plural(options.workers, 'worker')} ...", flush=True)
    # torch warns of too many workers at the loader and at every iter(): show each once
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
    print(
        f"  held {report.duplication:.2f}x; measured in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return report, first_batch_s


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f}"


def _print_processes(naive: MemoryReport, shared: MemoryReport) -> None:
    """Both runs' processes side by side, matched by role."""
    roles = dict.fromkeys(p.role for p in naive.processes + shared.processes)
    by_role = [{p.role: p for p in r.processes} for r in (naive, shared)]
    print("memory per process, in MiB:")
    print(f"{'':<12}{'naive numpy Dataset':>27}{'shareddata':>27}")
    print(f"{'process':<12}" + "".join(f"{c:>9}" for c in ("private", "shared", "PSS")) * 2)
    for role in roles:
        cells = [
            ("-", "-", "-") if p is None else (_mib(p.uss), _mib(p.shared), _mib(p.pss))
            for p in (rows.get(role) for rows in by_role)
        ]
        print(f"{role:<12}" + "".join(f"{v:>9}" for three in cells for v in three))
    totals = [
        (
            _mib(sum(p.uss for p in r.processes)),
            _mib(sum(p.shared for p in r.processes)),
            _mib(r.total_pss),
        )
        for r in (naive, shared)
    ]
    print(f"{'total':<12}" + "".join(f"{v:>9}" for three in totals for v in three))
    print("  private: pages only this process maps (USS): a copy of the data, or pages of the")
    print("           shared copy that no other process has read yet")
    print("  shared:  pages it maps together with other processes: the one shared copy, libraries")
    print("  PSS:     private pages plus its share of each shared page (1/n of a page n map);")
    print("           summed over the processes, every page counts once")


def _print_summary(naive: tuple[MemoryReport, float], shared: tuple[MemoryReport, float]) -> None:
    (a, a_s), (b, b_s) = naive, shared
    print(f"{'':<22}{'naive Dataset':>15}{'shareddata':>15}")
    for name, x, y in [
        ("dataset held", f"{a.duplication:.2f}x", f"{b.duplication:.2f}x"),
        ("total memory (PSS)", format_bytes(a.total_pss), format_bytes(b.total_pss)),
        ("first batch after", f"{a_s:.1f} s", f"{b_s:.1f} s"),
    ]:
        print(f"{name:<22}{x:>15}{y:>15}")
    print("  dataset held: copies of the data in RAM over all processes, net of code, libraries")
    print("                and each worker's memory without data (1.00x = one copy)")
    print("  total memory: the sum of the PSS column above")
    print("  first batch:  from loading the file to the first batch in the main process")
