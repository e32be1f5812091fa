"""Per-process memory accounting: :func:`verify`, :class:`MemoryReport`, :func:`measure`.

:func:`verify` runs a ``DataLoader`` for (part of) an epoch and measures every
process of it with the kernel's own accounting, then says how many times the
dataset is held in RAM. It works on any ``torch.utils.data.DataLoader``, not only on
shareddata's datasets, so users can check their own loaders.

Note [How duplication is measured]
----------------------------------
Each process is read from ``/proc/<pid>/smaps_rollup`` (``psutil`` as a fallback):

- ``rss``: resident pages, each counted in full in every process that maps it;
- ``uss``: ``Private_Clean + Private_Dirty``, pages only this process maps;
- ``pss``: ``Pss``, each resident page divided by the number of processes mapping it;
- ``shared``: ``Shared_Clean + Shared_Dirty``, pages some other process maps too;
- ``pss_file``: ``Pss_File``, the part of ``pss`` backed by files (code, libraries,
  memory-mapped files), as opposed to anonymous memory and shared memory.

PSS is the only figure that can be summed over processes: a page mapped by the
parent and four workers counts 1/5 in each, so it counts once in the sum, while a
page copied into every worker counts once per copy. Summing RSS would count one
shared copy five times; summing USS would not count it at all.

The dataset's share of the sum is what is left once the processes' own costs are
taken out::

    duplication = 1 + (data_pss_after - data_pss_before - n_workers * baseline)
                      / dataset_bytes

- ``data_pss_after``: sum of ``pss - pss_file`` over the main process and every
  worker, measured right after the last batch arrives (workers of a non-persistent
  loader exit at ``StopIteration``, so this is the last moment they all exist);
- ``data_pss_before``: the same for the main process before the workers start; it
  holds the one copy of the dataset that is not duplication;
- ``baseline``: the private dirty memory of a worker that holds no data, measured
  on a probe ``DataLoader`` with the same start method, one worker and a two-item
  dataset whose pickle carries (by reference) the classes and functions the real
  workers import, once that worker has served its batches and is idle, as the real
  ones are when they are measured. A ``spawn`` worker holds ~145 MiB of interpreter
  and ``torch`` with no data at all (~8 MiB under ``fork``); without this
  subtraction four workers over a 100 MiB dataset would read as ~7x even when the
  data is perfectly shared.

File-backed pages are left out because a copy of the data is never file-backed: a
worker's private copy (an unpickled array, a copied-on-write page, a Python object)
is anonymous memory, a shared tensor is shared memory, and a memory-mapped data file
is one copy in the page cache however many processes map it. File pages are mostly
``libtorch`` and friends, also mapped by processes outside the loader (the
forkserver, other ranks, other jobs), whose share of each page moves into the sum as
workers map it: with another ``torch`` process running, 4 ``spawn`` workers over a
128 MiB shared tensor read 1.26x on the full PSS and 1.0x without file pages. Where
the kernel does not report ``Pss_File`` (older kernels, or the ``psutil`` fallback),
``pss_file`` is 0 and the full PSS is used.

Under ``forkserver`` the server process is measured too (a ``"forkserver"`` row,
before and after): workers are forked from it and share its pages (``torch``, when
preloaded), which would otherwise move from the uncounted server into the sum and
read as ~0.8x of a 128 MiB dataset that is not there.

A dataset shared by every worker therefore reads as ~1.0; one that is pickled into
each of four ``spawn`` workers reads as ~5. What remains is noise: batches in
flight, allocator arenas and the workers' working memory (a few MiB per worker).
For a dataset of a few MiB that noise dominates the ratio; pass ``dataset_bytes=``
or ``max_duplication=None`` there. A ratio slightly below 1 is noise too. Processes
outside the loader that map the same shared data (other ``torchrun`` ranks) are not
measured: their share of it moves into the sum as well.

Across the local ranks of a node (``verify`` called on every local rank, under
``torchrun``), local rank 0 measures every process of the node at the same two
moments (all main processes before any worker starts; every process after each
rank's last batch; ``distributed.NodeVerify``), and the node's figure is::

    duplication = copies + (node_data_pss_after - node_data_pss_before
                            - sum over ranks of n_workers * baseline) / dataset_bytes

``copies`` is the number of distinct copies the ranks' main processes hold: ranks
whose shareddata datasets map the same segments (compared by device and inode)
hold one; any other dataset counts as its own copy in every rank (the delta above
cannot see what the main processes held before ``verify`` was called).

``dataset_bytes`` is, in order: the argument; ``loader.dataset.nbytes`` when it is
an integer (every shareddata dataset); an estimate that walks the dataset's object
graph (numpy ``nbytes``, torch storage bytes, ``sys.getsizeof`` for the rest; depth
and object count are bounded, large containers are sampled and extrapolated).
"""

from __future__ import annotations

import gc
import inspect
import json
import mmap
import multiprocessing
import os
import pathlib
import pickle
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from shareddata.errors import DuplicationError

__all__ = ["MemoryReport", "ProcessMemory", "measure", "verify"]

_MIB = 1024 * 1024
_KIB = 1024


@dataclass(frozen=True)
class ProcessMemory:
    """Memory of one process, in bytes (see Note [How duplication is measured]).

    Attributes:
        pid: process id.
        role: ``"main"``, ``"worker 0"``, ``"worker 1"``, ...
        rss: resident set size (shared pages counted in full).
        uss: unique set size (pages no other process maps).
        pss: proportional set size (shared pages divided among their users).
        shared: resident pages that another process maps too.
        pss_file: the part of ``pss`` backed by files (code, libraries, mapped
            files); 0 where the kernel does not report it.
    """

    pid: int
    role: str
    rss: int
    uss: int
    pss: int
    shared: int
    pss_file: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Return the row as a JSON-serialisable dict."""
        return asdict(self)


def measure(pid: int | None = None, role: str = "") -> ProcessMemory:
    """Measure one process from ``/proc/<pid>/smaps_rollup``, or psutil where absent.

    Args:
        pid: the process to measure; ``None`` is the calling process.
        role: a label kept in the row (``"main"``, ``"worker 0"``, ...).

    Returns:
        The process's RSS, USS, PSS and shared bytes.

    Raises:
        ProcessLookupError: the process does not exist (any more).
        PermissionError: the process belongs to another user.

    Example:
        >>> row = measure(role="main")
        >>> 0 < row.uss <= row.rss
        True
    """
    pid = os.getpid() if pid is None else int(pid)
    fields = _read_smaps_rollup(pid)
    if fields is not None and "Pss" in fields:
        return ProcessMemory(
            pid=pid,
            role=role,
            rss=fields.get("Rss", 0),
            uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
            pss=fields["Pss"],
            shared=fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0),
            pss_file=fields.get("Pss_File", 0),
        )
    if fields is not None and not os.path.exists(f"/proc/{pid}/exe"):
        # A zombie: smaps_rollup reads empty, the process holds no memory any more.
        return ProcessMemory(pid=pid, role=role, rss=0, uss=0, pss=0, shared=0)
    return _measure_psutil(pid, role)


def _read_smaps_rollup(pid: int) -> dict[str, int] | None:
    """The fields of ``/proc/<pid>/smaps_rollup`` in bytes; ``None`` where unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            return _parse_smaps(f.read())
    except OSError:
        return None


def _parse_smaps(text: str) -> dict[str, int]:
    """Parse ``Name:  123 kB`` lines of an smaps file into bytes."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name] = int(parts[0]) * _KIB
    return fields


def _measure_psutil(pid: int, role: str) -> ProcessMemory:
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.NoSuchProcess as err:
        raise ProcessLookupError(f"process {pid} does not exist") from err
    except psutil.AccessDenied as err:
        raise PermissionError(f"cannot read the memory of process {pid}: {err}") from err
    uss = int(getattr(info, "uss", info.rss))
    return ProcessMemory(
        pid=pid,
        role=role,
        rss=int(info.rss),
        uss=uss,
        pss=int(getattr(info, "pss", uss)),
        shared=max(int(info.rss) - uss, 0),
    )


@dataclass
class MemoryReport:
    """What :func:`verify` measured (see Note [How duplication is measured]).

    Attributes:
        dataset_bytes: size of the dataset the ratio is relative to.
        total_pss: sum of PSS over :attr:`processes`, after the last batch.
        duplication: how many times the dataset is held, net of baselines.
        processes: one :class:`ProcessMemory` per process, main process first.
        baseline_bytes: private memory of one worker holding no data, from a probe
            worker (0 without workers).
        start_method: ``"fork"``, ``"spawn"``, ``"forkserver"``; ``None`` without workers.
        num_workers: the loader's ``num_workers``.
        pss_before: PSS of the main process (and the forkserver) before the workers
            started.
        extra_bytes: anonymous and shared memory beyond one copy of the dataset and
            the workers' baselines (``(duplication - 1) * dataset_bytes``).
        batches: number of batches iterated before measuring.
        max_duplication: the limit checked against, ``None`` for no check.
        local_ranks: local ranks measured together (1: this process alone).
        rank_copies: copies held by those ranks' main processes (see the Note).
    """

    dataset_bytes: int
    total_pss: int
    duplication: float
    processes: list[ProcessMemory]
    baseline_bytes: int
    start_method: str | None
    num_workers: int
    pss_before: int = 0
    extra_bytes: int = 0
    batches: int = 0
    max_duplication: float | None = None
    local_ranks: int = 1
    rank_copies: int = 1

    def _workers(self) -> int:
        return sum(1 for p in self.processes if "worker" in p.role.split())

    def _who(self) -> str:
        ranks = f"{self.local_ranks} local ranks, " if self.local_ranks > 1 else ""
        if not self.num_workers:
            return ranks + "no workers (num_workers=0)"
        return ranks + f"{self.num_workers} {self.start_method} workers"

    @property
    def passed(self) -> bool:
        """Whether :attr:`duplication` is within :attr:`max_duplication` (or no limit)."""
        return self.max_duplication is None or self.duplication <= self.max_duplication

    def verdict(self) -> str:
        """Return the one-line verdict, e.g. ``"dataset held 1.02x (limit 1.10)"``."""
        limit = "no limit" if self.max_duplication is None else f"limit {self.max_duplication:.2f}"
        return f"dataset held {self.duplication:.2f}x ({limit})"

    def to_dict(self) -> dict[str, Any]:
        """Return the report as a JSON-serialisable dict (rows as dicts)."""
        return {
            "duplication": float(self.duplication),
            "dataset_bytes": int(self.dataset_bytes),
            "total_pss": int(self.total_pss),
            "baseline_bytes": int(self.baseline_bytes),
            "pss_before": int(self.pss_before),
            "extra_bytes": int(self.extra_bytes),
            "start_method": self.start_method,
            "num_workers": int(self.num_workers),
            "batches": int(self.batches),
            "max_duplication": self.max_duplication,
            "local_ranks": int(self.local_ranks),
            "rank_copies": int(self.rank_copies),
            "passed": self.passed,
            "processes": [p.to_dict() for p in self.processes],
        }

    def to_json(self, **kwargs: Any) -> str:
        """Return :meth:`to_dict` as a JSON string (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.to_dict(), **kwargs)

    def plot(self, path: str | os.PathLike[str], *, title: str = "") -> pathlib.Path:
        """Write a PNG bar chart of private vs shared memory per process.

        One stacked bar per process: its private memory (USS) below, the memory it
        shares with other processes above (the rest of its RSS), in MiB; a dashed
        line marks the dataset's size. A copy of the data in a worker shows up as a
        private bar the height of that line. Drawn with matplotlib's Agg canvas
        (no display needed; pyplot's state is left alone).

        Args:
            path: the PNG file to write.
            title: a title above the chart (default: the verdict only).

        Returns:
            ``path``, as a ``pathlib.Path``.

        Raises:
            MissingDependencyError: matplotlib is not installed; the message says
                ``pip install 'shareddata[plot]'``.

        Example:
            >>> import os, tempfile, torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> loader = DataLoader(TensorDataset(torch.zeros(64, 4)), batch_size=16)
            >>> report = verify(loader, max_duplication=None)
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     png = report.plot(os.path.join(tmp, "memory.png"))
            ...     png.read_bytes()[1:4]
            b'PNG'
        """
        from ._plot import save

        return save([(title, self)], path)

    def __str__(self) -> str:
        def mib(n: int) -> str:
            return f"{n / _MIB:11.1f}"

        lines = [
            f"memory of the DataLoader: {self._who()}, measured after {self.batches} batches",
            f"{'process':<12}{'pid':>9}"
            + "".join(
                f"{h:>11}" for h in ("RSS MiB", "USS MiB", "PSS MiB", "shared MiB", "file MiB")
            ),
        ]
        rows = self.processes
        for p in rows:
            values = (p.rss, p.uss, p.pss, p.shared, p.pss_file)
            lines.append(f"{p.role:<12}{p.pid:>9}" + "".join(mib(v) for v in values))
        totals = [sum(getattr(p, name) for p in rows) for name in ("rss", "uss")]
        totals += [self.total_pss] + [
            sum(getattr(p, n) for p in rows) for n in ("shared", "pss_file")
        ]
        lines.append(f"{'total':<12}{'':>9}" + "".join(mib(v) for v in totals))
        lines.append(
            f"dataset {self.dataset_bytes / _MIB:.1f} MiB; PSS before iterating "
            f"{self.pss_before / _MIB:.1f} MiB; worker baseline {self.baseline_bytes / _MIB:.1f}"
            f" MiB x {self._workers()}; beyond one copy {self.extra_bytes / _MIB:.1f} MiB "
            "(file pages left out)"
        )
        if self.local_ranks > 1:
            lines.append(
                f"copies in the {self.local_ranks} ranks' main processes: {self.rank_copies}"
            )
        lines.append(self.verdict())
        return "\n".join(lines)


def verify(
    loader: DataLoader,
    *,
    batches: int | None = None,
    max_duplication: float | None = 1.10,
    dataset_bytes: int | None = None,
    across_ranks: bool | None = None,
) -> MemoryReport:
    """Run ``loader``, measure all its processes, and check the dataset is held once.

    Works on any ``DataLoader`` (any map-style or iterable dataset), with or without
    workers, persistent or not, under every start method. The loader is left usable:
    a non-persistent loader's workers are shut down; a persistent loader keeps the
    workers started here (workers it already had are restarted first, so that the
    main process can be measured alone). See Note [How duplication is measured].

    Args:
        loader: the DataLoader to check, as the training code builds it.
        batches: how many batches to iterate before measuring; ``None`` is one full
            epoch (``len(loader)``); capped at one epoch.
        max_duplication: the largest acceptable :attr:`MemoryReport.duplication`;
            ``None`` only measures.
        dataset_bytes: the dataset's size; by default ``loader.dataset.nbytes`` or an
            estimate from the dataset's object graph.
        across_ranks: measure every process of the node (each local rank and its
            workers) and return the node's report on every rank; then ``verify``
            must be called on every local rank. The default does so under
            ``torchrun`` with several local ranks; ``False`` measures this process
            and its workers alone.

    Returns:
        The :class:`MemoryReport`.

    Raises:
        DuplicationError: ``duplication`` exceeds ``max_duplication``; ``.report``
            holds the report.
        ValueError: ``batches`` is not positive, or the loader yields no batch.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.zeros(64, 4)), batch_size=16)
        >>> report = verify(loader, max_duplication=None)
        >>> report.num_workers, [p.role for p in report.processes]
        (0, ['main'])
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"verify() takes a torch.utils.data.DataLoader, got {type(loader)!r}")
    if batches is not None and int(batches) < 1:
        raise ValueError(f"batches must be a positive number of batches or None, got {batches!r}")
    nbytes = _dataset_nbytes(loader.dataset) if dataset_bytes is None else int(dataset_bytes)
    if nbytes < 0:
        raise ValueError(f"dataset_bytes must be >= 0, got {dataset_bytes!r}")
    num_workers = int(loader.num_workers)

    start_method = _start_method(loader)

    _stop_persistent_workers(loader)
    baseline = _probe_baseline(loader, start_method) if num_workers > 0 else 0
    # The forkserver (started by the probe at the latest) is the workers' template.
    server = _forkserver_pid() if start_method == "forkserver" else None
    gc.collect()
    from .distributed import node_verifier  # every local rank meets rank 0 at each measure

    node = node_verifier(across_ranks)
    measure_before = _measure_all if node is None else node.measurer("before")
    measure_after = None if node is None else node.measurer("after")
    before = measure_before([(os.getpid(), "main"), (server, "forkserver")])
    rows, received = _run_and_measure(
        loader, None if batches is None else int(batches), server, measure_after
    )

    n_workers = sum(1 for p in rows if p.role.startswith("worker"))
    extra = _data_pss(rows) - _data_pss(before) - n_workers * baseline
    report = MemoryReport(
        dataset_bytes=nbytes,
        total_pss=sum(p.pss for p in rows),
        duplication=1.0 + extra / nbytes if nbytes > 0 else 1.0,
        processes=rows,
        baseline_bytes=baseline,
        start_method=start_method,
        num_workers=num_workers,
        pss_before=sum(p.pss for p in before),
        extra_bytes=extra,
        batches=received,
        max_duplication=max_duplication,
    )
    if node is not None:
        report = node.combine(report, loader.dataset)
    if not report.passed:
        raise DuplicationError(_duplication_message(report), report)
    return report


def _data_pss(rows: list[ProcessMemory]) -> int:
    """Anonymous + shared-memory PSS: where copies of data live (file pages left out)."""
    return sum(p.pss - p.pss_file for p in rows)


def _duplication_message(report: MemoryReport) -> str:
    return (
        f"{report.verdict()}: the DataLoader's {len(report.processes)} "
        f"process{'es' if len(report.processes) != 1 else ''} ({report._who()}) "
        f"hold {report.total_pss / _MIB:.1f} MiB (sum of PSS after {report.batches} batches), "
        f"{report.pss_before / _MIB:.1f} MiB before iterating. Net of code and libraries "
        f"and of {report.baseline_bytes / _MIB:.1f} MiB per worker without data, "
        f"{report.extra_bytes / _MIB:.1f} MiB remain beyond one copy of the "
        f"{report.dataset_bytes / _MIB:.1f} MiB dataset: the data is held more than once.\n"
        "Fixes: load the data with a shareddata dataset (sd.NumpyDataset, sd.HDF5Dataset, "
        "sd.ParquetDataset, sd.ArrowDataset) or wrap the dataset in sd.SharedDataset(dataset). "
        "Under spawn/forkserver a plain numpy array or Python object is pickled by value into "
        "every worker; under fork Python objects (lists, dicts) are copied as workers read "
        "them (pytorch/pytorch#13246). If the excess is working memory rather than data "
        "(a dataset of a few MiB, large batches), pass dataset_bytes= or a larger "
        "max_duplication.\n" + str(report)
    )


def _start_method(loader: DataLoader) -> str | None:
    if loader.num_workers == 0:
        return None
    ctx = loader.multiprocessing_context
    if ctx is not None:
        return str(ctx.get_start_method())
    # get_start_method(allow_none=False) would fix the global default: ask without it.
    return (
        multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_all_start_methods()[0]
    )


def _stop_persistent_workers(loader: DataLoader) -> None:
    """Shut down workers a persistent loader kept, so the main process is measured alone."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and getattr(iterator, "_workers", None):
        done = getattr(iterator, "_num_yielded", 0)
        if 0 < done < len(iterator):
            import warnings

            warnings.warn(
                f"verify() restarts the workers of this persistent DataLoader, which is "
                f"{done} batches into an epoch of {len(iterator)}: a loop still iterating it "
                "(e.g. a Lightning fit loop) ends without an error. Call verify() between "
                "epochs, or on a separate DataLoader built the same way.",
                RuntimeWarning,
                stacklevel=3,
            )
        iterator._shutdown_workers()
        loader._iterator = None


def _run_and_measure(
    loader: DataLoader, batches: int | None, server: int | None, measure_all: Any = None
) -> tuple[list[ProcessMemory], int]:
    """Iterate ``loader`` and measure its processes right after the last batch."""
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    target = batches if length is None else length if batches is None else min(batches, length)
    # An iterable dataset's len() may be wrong, and an unknown length gives no "last
    # batch" to wait for: measure after every batch and keep the latest figures.
    every = target is None or isinstance(loader.dataset, IterableDataset)
    if measure_all is not None:  # across ranks: one meeting, at a last batch known ahead
        if target is None:
            raise ValueError(
                "verify() across local ranks needs batches= for a loader without len()"
            )
        every = False
    before = _children() if loader.num_workers > 0 else set()
    rows: list[ProcessMemory] = []
    received = 0
    iterator = iter(loader)
    try:
        while target is None or received < target:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            received += 1
            if every or received == target:
                rows = _measure_loader(iterator, loader.num_workers, before, server, measure_all)
            del batch
    finally:
        if not (loader.persistent_workers and loader.num_workers > 0):
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        # A persistent loader keeps its workers; the next iter(loader) resets them.
        del iterator
    if not rows:
        raise ValueError("the DataLoader yielded no batch: there is nothing to measure")
    return rows, received


def _children() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _measure_loader(
    iterator: Any, num_workers: int, before: set[int], server: int | None, measure_all: Any = None
) -> list[ProcessMemory]:
    procs: list[tuple[int | None, str]] = [(os.getpid(), "main"), (server, "forkserver")]
    workers = getattr(iterator, "_workers", None)
    if workers is not None:
        procs += [(w.pid, f"worker {i}") for i, w in enumerate(workers)]
    elif num_workers > 0:  # an iterator that does not expose its workers
        new = sorted(_children() - before - {server})
        procs += [(pid, f"worker {i}") for i, pid in enumerate(new)]
    return (measure_all or _measure_all)(procs)


def _measure_all(procs: list[tuple[int | None, str]]) -> list[ProcessMemory]:
    rows = []
    for pid, role in procs:
        if pid is None:
            continue
        try:
            rows.append(measure(pid, role))
        except ProcessLookupError:  # gone: it holds nothing any more
            continue
    return rows


def _forkserver_pid() -> int | None:
    """The pid of this process's multiprocessing forkserver, if one is running."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if isinstance(pid, int) and psutil.pid_exists(pid):
        return pid
    try:  # the private attribute moved: find the server among our children
        for child in psutil.Process().children():
            if "multiprocessing.forkserver" in " ".join(child.cmdline()):
                return child.pid
    except psutil.Error:
        pass
    return None


# --------------------------------------------------------------------------------------
# The per-worker baseline


def _probe_baseline(loader: DataLoader, start_method: str | None) -> int:
    """Private dirty bytes of one of ``loader``'s workers that holds no data."""
    refs = _probe_references(loader)
    # Under fork the first DataLoader of a process initialises state in the parent
    # after forking, which makes more of the worker's pages private: probe twice.
    runs = 2 if start_method == "fork" else 1
    baseline = 0
    for _ in range(runs):
        try:
            baseline = _run_probe(loader.multiprocessing_context, refs)
        except Exception:
            if not refs:
                raise
            # A reference that imports in the parent but not in a fresh worker (the
            # user's own loader would fail there as well): measure without them.
            refs = ()
            baseline = _run_probe(loader.multiprocessing_context, refs)
    return baseline


def _run_probe(context: Any, refs: tuple[Any, ...]) -> int:
    """Run a one-worker probe loader; return its worker's private dirty bytes."""
    dataset = TensorDataset(torch.arange(2))
    # Pickled by reference with the dataset: the worker imports what the real ones do.
    dataset.shareddata_probe_references = refs  # type: ignore[attr-defined]
    probe = DataLoader(dataset, batch_size=1, num_workers=1, multiprocessing_context=context)
    iterator = iter(probe)
    try:
        # Both batches received: the worker is idle, as the real ones are when measured.
        next(iterator)
        next(iterator)
        workers = getattr(iterator, "_workers", None) or []
        pid = workers[0].pid if workers else None
        if pid is None:
            return 0
        fields = _read_smaps_rollup(pid)
        if fields is None or "Private_Dirty" not in fields:
            return measure(pid).uss
        return fields["Private_Dirty"]
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del iterator


def _probe_references(loader: DataLoader) -> tuple[Any, ...]:
    """Classes and functions of the dataset, its attributes, collate_fn and worker_init_fn.

    Only objects that pickle by reference (a module and a name, never data) are kept.
    """
    candidates: list[Any] = [type(loader.dataset)]
    candidates += _types_in(loader.dataset, depth=3)
    for fn in (loader.collate_fn, loader.worker_init_fn):
        candidates += _callable_references(fn)
    refs: list[Any] = []
    seen: set[int] = set()
    for obj in candidates:
        if id(obj) in seen or getattr(obj, "__module__", None) in (None, "builtins"):
            continue
        seen.add(id(obj))
        if not (isinstance(obj, type) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        try:
            if len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) > 4 * _KIB:
                continue
        except Exception:  # a local class, a lambda: nothing a worker could import
            continue
        refs.append(obj)
    return tuple(refs)


def _callable_references(fn: Any) -> list[Any]:
    if fn is None:
        return []
    if inspect.ismethod(fn):  # never the bound object: it may be the dataset itself
        return [type(fn.__self__), fn.__func__]
    func = getattr(fn, "func", None)  # functools.partial
    if func is not None and callable(func):
        return [type(fn), *_callable_references(func)]
    if isinstance(fn, type) or inspect.isfunction(fn) or inspect.isbuiltin(fn):
        return [fn]
    return [type(fn)]


def _types_in(obj: Any, depth: int, limit: int = 200) -> list[Any]:
    """Types (and classes/functions held as values) found walking ``obj`` to ``depth``."""
    found: list[Any] = []
    seen: set[int] = set()
    level = [obj]
    for _ in range(depth):
        nxt: list[Any] = []
        for o in level:
            for child in islice(_children_of(o), 32):
                if id(child) in seen:
                    continue
                seen.add(id(child))
                if isinstance(child, type) or (callable(child) and hasattr(child, "__code__")):
                    found.append(child)
                    continue
                found.append(type(child))
                nxt.append(child)
                if len(found) >= limit:
                    return found
        level = nxt
    return found


# --------------------------------------------------------------------------------------
# Estimating the dataset's size

_MAX_DEPTH = 8
_MAX_OBJECTS = 100_000
_SAMPLE = 256  # elements looked at per container; the rest is extrapolated
_CODE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _dataset_nbytes(dataset: Any) -> int:
    try:
        nbytes = getattr(dataset, "nbytes", None)
    except Exception:
        nbytes = None
    if isinstance(nbytes, (int, np.integer)) and not isinstance(nbytes, bool):
        return int(nbytes)
    return _estimate_nbytes(dataset)


def _estimate_nbytes(obj: Any) -> int:
    """Estimate the bytes an object graph holds (arrays, tensors and Python objects).

    Walks ``vars()``, ``__slots__``, dicts, lists, tuples and sets, counting each
    object once: numpy arrays by the ``nbytes`` of the array that owns the buffer,
    torch tensors by their storage's bytes, anything else by ``sys.getsizeof``.
    Classes, modules and functions are code, not data, and are not counted. Depth,
    object count and elements per container are bounded; a large container's sampled
    elements are extrapolated to its length.

    Args:
        obj: a dataset or any object.

    Returns:
        The estimate in bytes.

    Example:
        >>> import numpy as np
        >>> _estimate_nbytes({"x": np.zeros(1000, np.float64)}) >= 8000
        True
    """
    return int(_Sizer().size(obj, 0))


class _Sizer:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.storages: set[tuple[str, int]] = set()
        self.budget = _MAX_OBJECTS

    def size(self, obj: Any, depth: int) -> float:
        if id(obj) in self.seen or isinstance(obj, _CODE):
            return 0.0
        self.seen.add(id(obj))
        self.budget -= 1
        if isinstance(obj, np.ndarray):
            return self._array(obj, depth)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, mmap.mmap):
            return float(len(obj)) if not obj.closed else 0.0
        try:
            own = float(sys.getsizeof(obj))
        except TypeError:
            own = 0.0
        if depth >= _MAX_DEPTH or self.budget <= 0 or isinstance(obj, (str, bytes, bytearray)):
            return own
        if isinstance(obj, dict):
            return (
                own
                + self._sample(obj.keys(), len(obj), depth)
                + self._sample(obj.values(), len(obj), depth)
            )
        if isinstance(obj, (list, tuple, set, frozenset)):
            return own + self._sample(obj, len(obj), depth)
        return own + sum(self.size(child, depth + 1) for child in _attributes(obj))

    def _sample(self, items: Any, n: int, depth: int) -> float:
        if n == 0:
            return 0.0
        if n <= _SAMPLE:
            picked: Sequence[Any] | Iterator[Any] = iter(items)
        elif isinstance(items, Sequence):
            step = n / _SAMPLE
            picked = [items[int(i * step)] for i in range(_SAMPLE)]
        else:
            picked = islice(items, _SAMPLE)
        total, count = 0.0, 0
        for item in picked:
            total += self.size(item, depth + 1)
            count += 1
        return total * n / count if count else 0.0

    def _array(self, arr: np.ndarray, depth: int) -> float:
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root is not arr:
            if id(root) in self.seen:
                return 0.0
            self.seen.add(id(root))
        total = float(root.nbytes)
        if root.dtype == object and root.size and depth < _MAX_DEPTH:
            n = root.size
            step = max(n / _SAMPLE, 1.0)
            picked = [root.flat[int(i * step)] for i in range(min(n, _SAMPLE))]
            total += sum(self.size(x, depth + 1) for x in picked) * n / len(picked)
        return total

    def _tensor(self, tensor: torch.Tensor) -> float:
        try:
            storage = tensor.untyped_storage()
            key = (str(storage.device), storage.data_ptr() or id(storage))
            nbytes = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            key = ("tensor", id(tensor))
            nbytes = tensor.element_size() * tensor.nelement()
        if key in self.storages:
            return 0.0
        self.storages.add(key)
        return float(nbytes)


def _attributes(obj: Any) -> list[Any]:
    """Values of an object's ``__dict__`` (the dict itself) and ``__slots__``."""
    values: list[Any] = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        values.append(d)
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                try:
                    values.append(getattr(obj, name))
                except AttributeError:
                    continue
    return values


def _children_of(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif not isinstance(obj, (str, bytes, bytearray, np.ndarray, torch.Tensor, *_CODE)):
        for value in _attributes(obj):
            if isinstance(value, dict):
                yield from value.values()
            else:
                yield value
