"""`verify`: run a loader, measure all its processes, say how often the dataset is held.

Note [How duplication is measured]
----------------------------------
Every process of the loader (the main process, its workers, the forkserver) is
measured from the kernel (``_process``) before the workers start and after the last
batch. PSS is the one figure that sums over processes: a page mapped by five
processes counts 1/5 in each. File pages are left out (a copy of data is never
file-backed; libraries are). The copies beyond one copy of the dataset are:

- **exact**, for a shareddata dataset: its segments are found in each process's
  ``/proc/<pid>/smaps`` by device and inode; the ``Anonymous`` pages of those
  mappings are private copies made by writes (``data_copied``);
- **exact**, for a plain dataset's arrays: what ``spawn``/``forkserver`` workers
  receive by value (its pickle, counted without keeping it), and under ``fork`` the
  pages of its numpy/torch buffers a worker holds alone (``/proc/<pid>/pagemap``);
- **estimated** for the rest (Python objects, anything found by no walk): the growth
  of the processes' working memory beyond one worker baseline each (a probe worker
  with no data), counted when it exceeds the resolution (4 MiB per process and the
  batches in flight), and at most one copy per process of that rest.

A copy decides only above its resolution: ``EXACT_FLOOR`` per process for exact
counts, the estimate's resolution for the estimate. Three answers: ``"duplicated"``
(copies so measured exceed the limit); ``"ok"`` (within it, and no copy could have
escaped); otherwise ``"inconclusive"``, never a pass. The parent's heap is frozen
(``gc.freeze()``) while fork workers run: their first full collection would otherwise
copy every container page they inherit, which is not the dataset. Across local
ranks, local rank 0 measures every process of the node at the same two moments
(``_node``). Measured cases and the mechanisms' details: ``docs/internals.md#smaps``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing
import os
import warnings
from collections.abc import Iterator
from typing import Any

import psutil
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .._compat import (
    dataloader_progress,
    dataloader_worker_pids,
    shutdown_dataloader_iterator,
    stop_dataloader_workers,
)
from ..errors import ArgumentTypeError, DuplicationError, InconclusiveError, InvalidArgumentError
from ._account import account, batch_nbytes, judge, resolution
from ._baseline import probe_baseline, probe_references
from ._dataset import dataset_nbytes, holdings, pickled_nbytes
from ._node import node_verifier
from ._process import Pages, ProcessMemory, copied_pages, measure_all, private_pages
from ._report import MemoryReport, duplication_message


def verify(
    loader: Any,
    *,
    batches: int | None = None,
    max_duplication: float | None = 1.10,
    dataset_bytes: int | None = None,
    across_ranks: bool | None = None,
) -> MemoryReport:
    """Run ``loader``, measure all its processes, and check the dataset is held once.

    ``loader``: a ``DataLoader`` (any dataset, workers or not, persistent or not, every
    start method), or any other iterable loader whose workers are child processes of
    this one (``torchdata.nodes.Loader``, ``StatefulDataLoader``, Lightning's): its
    workers are the processes that appear while it iterates, its dataset the first
    ``Dataset`` it holds. The loader is left usable. ``batches``: batches before
    measuring (``None``: one epoch, the cap). ``max_duplication``: the limit (``None``
    only measures). ``dataset_bytes``: the dataset's size, by default its ``nbytes``
    or an estimate. ``across_ranks``: measure every process of the node, on every
    local rank (the default under ``torchrun`` with several local ranks). See Note
    [How duplication is measured].

    Raises:
        DuplicationError: copies measured above their resolution exceed the limit.
        InconclusiveError: cannot tell (not a pass); the message says what would decide.
        ValueError: ``batches`` is not positive, or the loader yields no batch.
        TypeError: ``loader`` is a ``Dataset`` or not iterable.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.zeros(64, 4)), batch_size=16)
        >>> report = verify(loader, max_duplication=None)
        >>> report.num_workers, [p.role for p in report.processes]
        (0, ['main'])
    """
    if isinstance(loader, Dataset) or not hasattr(loader, "__iter__"):
        raise ArgumentTypeError(
            f"verify() takes a torch.utils.data.DataLoader or another iterable loader, got "
            f"{type(loader)!r}: pass the DataLoader you train with, e.g. DataLoader(dataset, "
            "num_workers=4)"
        )
    if batches is not None and int(batches) < 1:
        raise InvalidArgumentError(
            f"batches must be a positive number of batches or None, got {batches!r}"
        )
    torch_loader = isinstance(loader, DataLoader)
    dataset = loader.dataset if torch_loader else _dataset_of(loader)
    found = holdings(dataset)
    nbytes = dataset_nbytes(dataset) if dataset_bytes is None else int(dataset_bytes)
    if nbytes < 0:
        raise InvalidArgumentError(f"dataset_bytes must be >= 0, got {dataset_bytes!r}")
    plain = max(nbytes - found.shared_bytes, 0)
    callables = (getattr(loader, "collate_fn", None), getattr(loader, "worker_init_fn", None))
    refs = probe_references(list(found.code.values())[:200], *callables)
    method = _start_method(loader) if torch_loader else None
    if torch_loader:
        _stop_persistent_workers(loader)
    node = node_verifier(across_ranks, found.segments)
    alone = functools.partial(measure_all, segments=found.segments)
    measure_before = node.measurer("before") if node else alone
    measure_after = node.measurer("after") if node else alone
    pages = private_pages(found.buffers) if plain and method in ("fork", None) else ()
    with _frozen_heap(method == "fork" or not torch_loader):
        has_workers = torch_loader and loader.num_workers > 0
        baseline = probe_baseline(loader.multiprocessing_context, refs) if has_workers else 0
        server = _forkserver_pid() if method == "forkserver" else None
        gc.collect()
        before = measure_before([(os.getpid(), "main"), (server, "forkserver")])
        run = _Run(loader, None if batches is None else int(batches), server, measure_after)
        run.iterate(pages, getattr(measure_after, "node_wide", False))
        rows, n_workers = run.rows, sum(1 for p in run.rows if p.role.startswith("worker"))
        if not torch_loader:  # what its workers showed; a forkserver it started is no copy
            method = run.method
            baseline = probe_baseline(method, refs) if n_workers else 0
            before += [p for p in rows if p.role == "forkserver" and p.pid != server]
    num_workers = loader.num_workers if torch_loader else n_workers
    received = pickled_nbytes(dataset) if method in ("spawn", "forkserver") and plain else None
    buffer_bytes = min(sum(e - f for f, e in pages) * os.sysconf("SC_PAGE_SIZE"), plain)
    buffer_bytes = buffer_bytes if run.copies is not None and method == "fork" else 0
    by_value = min(received or 0, plain)
    counted = n_workers * by_value + (run.copies or 0 if buffer_bytes else 0)
    exact = min(found.shared_bytes + by_value + buffer_bytes, nbytes)
    prefetch = getattr(loader, "prefetch_factor", None) or 2 if num_workers else None
    tolerance = resolution(n_workers, run.batch_bytes, prefetch)
    got = account(before, rows, n_workers * baseline, tolerance, nbytes - exact, counted)
    duplication = 1.0 + got.attributed / nbytes if nbytes > 0 else 1.0
    verdict = judge(
        dataset_bytes=nbytes,
        exact_bytes=exact,
        resolution=tolerance,
        processes=len(rows),
        duplication=duplication,
        limit=max_duplication,
        workers_missing=num_workers > 0 and n_workers == 0,
        found=got,
    )
    report = MemoryReport(
        dataset_bytes=nbytes,
        total_pss=sum(p.pss for p in rows),
        duplication=duplication,
        processes=rows,
        baseline_bytes=baseline,
        start_method=method if num_workers else None,
        num_workers=num_workers,
        pss_before=sum(p.pss for p in before),
        extra_bytes=got.attributed,
        batches=run.received,
        max_duplication=max_duplication,
        shared_bytes=min(found.shared_bytes, nbytes),
        copied_bytes=got.copies,
        working_bytes=got.excess,
        resolution=tolerance,
        batch_bytes=run.batch_bytes,
        received_bytes=received,
        buffer_bytes=buffer_bytes,
        counted_bytes=counted,
        conclusive=verdict.conclusive,
        unresolved_bytes=verdict.unresolved,
        needed_bytes=verdict.needed,
        array_bytes=sum(n for _, n in found.buffers) + found.shared_bytes,
    )
    if node is not None:
        report = node.combine(report, dataset)
    if report.status == "duplicated":
        raise DuplicationError(duplication_message(report), report)
    if report.status == "inconclusive" and max_duplication is not None:
        raise InconclusiveError(duplication_message(report), report)
    return report


_END = object()


class _Run:
    """One pass over a loader, measured after its last batch (every batch if not known)."""

    def __init__(self, loader: Any, batches: int | None, server: int | None, measurer: Any):
        self.loader, self.server, self.measurer = loader, server, measurer
        try:
            length: int | None = len(loader)
        except TypeError:
            length = None
        self.target = batches if length is None else min(batches or length, length)
        self.rows: list[ProcessMemory] = []
        self.received = self.batch_bytes = 0
        self.copies: int | None = None
        self.method: str | None = None

    def iterate(self, pages: Pages, node_wide: bool) -> None:
        loader, torch_loader = self.loader, isinstance(self.loader, DataLoader)
        every = self.target is None or isinstance(getattr(loader, "dataset", None), IterableDataset)
        if node_wide and self.target is None:  # one meeting, at a last batch known ahead
            raise InvalidArgumentError(
                "verify() across local ranks needs batches= for a loader without len()"
            )
        self.before = {p.pid for p in _children()}
        iterator = iter(loader)
        try:
            while self.target is None or self.received < self.target:
                batch = next(iterator, _END)
                if batch is _END:
                    break
                self.received += 1
                self.batch_bytes = max(self.batch_bytes, batch_nbytes(batch))
                if (every and not node_wide) or self.received == self.target:
                    self._measure(iterator, pages, torch_loader)
                del batch
        finally:
            if torch_loader and not (loader.persistent_workers and loader.num_workers):
                shutdown_dataloader_iterator(iterator)
            del iterator
        if not self.rows:
            raise InvalidArgumentError(
                "the DataLoader yielded no batch: there is nothing to measure (an empty "
                "dataset, or a sampler with no indices); verify a loader that yields at least "
                "one batch"
            )

    def _measure(self, iterator: Any, pages: Pages, torch_loader: bool) -> None:
        server = self.server or (None if torch_loader else _forkserver_pid())
        pids = dataloader_worker_pids(iterator)
        if pids is None:  # a loader that does not expose its workers: the new children
            new = [p for p in _children() if p.pid not in self.before and p.pid != server]
            pids = sorted(p.pid for p in new)
            with contextlib.suppress(psutil.Error, IndexError):
                spawned = "spawn_main" in " ".join(new[0].cmdline())
                forked = "forkserver" if server and new[0].ppid() == server else "fork"
                self.method = "spawn" if spawned else forked
        procs = [(os.getpid(), "main"), (server, "forkserver")]
        self.rows = self.measurer(procs + [(pid, f"worker {i}") for i, pid in enumerate(pids)])
        workers = [p.pid for p in self.rows if p.role.startswith("worker")]
        if pages and workers and self.method in ("fork", None):
            counts = [copied_pages(pid, pages) for pid in workers]
            self.copies = None if None in counts else sum(c or 0 for c in counts)


def _children() -> list[psutil.Process]:
    """This process's descendants but the resource tracker and torch's shm manager."""
    found = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(child.cmdline())
                if "resource_tracker" not in cmd and "torch_shm_manager" not in cmd:
                    found.append(child)
    return found


def _dataset_of(loader: Any) -> Any:
    """A loader's dataset: its ``dataset`` attribute, or the first ``Dataset`` it holds."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        datasets = holdings(loader).datasets
        dataset = datasets[0] if datasets else loader
    return dataset


@contextlib.contextmanager
def _frozen_heap(freeze: bool) -> Iterator[None]:
    """``gc.freeze()`` the parent's heap while fork workers run; as it was if frozen already."""
    if not freeze or gc.get_freeze_count() > 0:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _start_method(loader: DataLoader) -> str | None:
    if loader.num_workers == 0:
        return None
    if loader.multiprocessing_context is not None:
        return str(loader.multiprocessing_context.get_start_method())
    # get_start_method(allow_none=False) would fix the global default: ask without it.
    return (
        multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_all_start_methods()[0]
    )


def _stop_persistent_workers(loader: DataLoader) -> None:
    """Shut down workers a persistent loader kept, so the main process is measured alone."""
    progress = dataloader_progress(loader)
    if progress is None:
        return
    done, epoch = progress
    if 0 < done < epoch:
        warnings.warn(
            f"verify() restarts the workers of this persistent DataLoader, which is {done} "
            f"batches into an epoch of {epoch}: a loop still iterating it (e.g. a Lightning "
            "fit loop) ends without an error. Call verify() between epochs, or on a separate "
            "DataLoader built the same way.",
            RuntimeWarning,
            stacklevel=3,
        )
    stop_dataloader_workers(loader)


def _forkserver_pid() -> int | None:
    """The pid of this process's multiprocessing forkserver, if one is running."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) and psutil.pid_exists(pid) else None
