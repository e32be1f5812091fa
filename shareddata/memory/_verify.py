"""`verify`: run a ``DataLoader``, measure all its processes, say how often the dataset is held.

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

The pages of a shareddata dataset are told apart: its segments are memfds named
``shareddata`` (``/memfd:shareddata (deleted)`` in ``/proc/<pid>/smaps``) or
``O_TMPFILE`` files in ``storage_dir``, and ``verify`` finds every mapping of them
by the device and inode ``segment_identity()`` gives (``_shared.shared_parts`` looks
into ``Subset``, ``ConcatDataset`` and wrappers). Per process and mapping:

- ``data_pss``: the process's share of the segments' pages; summed over the
  processes it is at most one copy, however many map them;
- ``data_copied``: the ``Anonymous`` pages of those mappings: private copies made by
  writing to a copy-on-write mapping, each one a copy of a page of the dataset.
  These are counted exactly.

Batches in flight in shareddata's transport (memfds named ``shareddata-batch``) are
neither data nor working memory and are left out. Everything else outside file pages
is the process's *working* memory (``ProcessMemory.working``), where a copy of a
dataset that is not in shareddata's segments lives (an unpickled array, Python
objects copied on write). Two mechanisms of copying it are counted exactly:

- ``spawn``/``forkserver``: each worker unpickles the dataset when it starts and
  holds what the pickle carried by value (``_received``: numpy arrays by value,
  tensors and shareddata datasets by handle); ``counted = workers * min(received,
  plain_bytes)``;
- ``fork``: a worker's page of the parent's numpy or torch buffer that is present
  and *exclusively mapped* in ``/proc/<pid>/pagemap`` is a private copy of it
  (``_buffers``); ``counted`` is the sum over the workers.

The rest of working memory can only be estimated, from its growth::

    excess = working_after - working_before - n_workers * baseline
    duplication = 1 + (copied + counted + estimated) / dataset_bytes
    estimated = min(rest, plain_bytes * processes - counted) if rest > resolution else 0
    rest = excess - counted  # the counted copies are part of the growth

- ``working_after``: summed over the main process and every worker, measured right
  after the last batch arrives (workers of a non-persistent loader exit at
  ``StopIteration``, so this is the last moment they all exist);
- ``working_before``: the same for the main process before the workers start; it
  holds the one copy of the dataset that is not duplication;
- ``baseline``: the private dirty memory of a worker that holds no data, measured
  on a probe ``DataLoader`` with the same start method, one worker and a two-item
  dataset whose pickle carries (by reference) the classes and functions the real
  workers import, once that worker has served its batches and is idle, as the real
  ones are when they are measured. A ``spawn`` worker holds the interpreter and
  ``torch`` with no data at all, often more than the dataset: without this
  subtraction a perfectly shared dataset would read as several copies;
- ``resolution`` (``_account.resolution``): what iterating adds to working memory
  without copying any data: 4 MiB per process (allocator arenas, caches, the
  loader's queues and threads), 3 batches per worker (items, the collated batch,
  the previous one kept by the allocator) and the batches that may wait for the
  main process (``prefetch_factor`` per worker). An excess within it cannot be told
  from working memory and is not counted; the report states it
  (``report.resolution``, ``report.resolution_fraction``);
- ``plain_bytes``: the part of the dataset outside shareddata's segments
  (``dataset_bytes`` less the ``nbytes`` of the shareddata datasets found in it).
  Working memory can hold at most one copy of it per process, so no more of the
  excess is counted; a dataset all in segments is judged exactly, at any size, and
  the growth of working memory is reported (``report.working_bytes``) but is not
  the dataset.

Three answers (``_account.judge``, ``report.status``): ``"duplicated"`` when the
duplication exceeds the limit; ``"ok"`` when it does not and no copy could have
escaped: the part of the dataset not counted exactly (``unresolved``: outside the
segments, not received by value, not in checked buffers) is larger than the
resolution, so a copy of it in any process would show, or so small that a copy of
it in every process would stay within the limit; otherwise ``"inconclusive"``
(``InconclusiveError``: cannot tell, never a pass), as also when the loader has
workers and none could be measured. A plain 4 MiB array under ``spawn`` is counted
(3x with 2 workers), under ``fork`` checked page by page (1x); a 4 MiB Python list
under ``fork`` or with ``num_workers=0`` cannot be told from working memory.

Under ``fork`` the parent's heap is frozen (``gc.freeze()``) while the probe and the
workers run, and unfrozen afterwards. A worker inherits every Python object of the
parent, and its first full garbage collection writes to the header of each container
among them, copying their pages, which a probe that never collects does not see
(figures in ``docs/internals.md#smaps``). It is the worker's working memory, not
the dataset (the copies of a Python-object
dataset that reading it makes, by writing reference counts, are still made and
counted); ``gc.freeze()`` before starting fork workers avoids it in training too.

File-backed pages are left out because a copy of the data is never file-backed: a
worker's private copy (an unpickled array, a copied-on-write page, a Python object)
is anonymous memory, a shared tensor is shared memory, and a memory-mapped data file
is one copy in the page cache however many processes map it. File pages are mostly
``libtorch`` and friends, also mapped by processes outside the loader (the
forkserver, other ranks, other jobs), whose share of each page moves into the sum as
workers map it, and would read as duplication. Where
the kernel does not report ``Pss_File`` (older kernels, or the ``psutil`` fallback),
``pss_file`` is 0 and the full PSS is used.

Under ``forkserver`` the server process is measured too (a ``"forkserver"`` row,
before and after): workers are forked from it and share its pages (``torch``, when
preloaded), which would otherwise move from the uncounted server into the sum and
read as a copy of a dataset that is not there.

A dataset shared by every worker therefore reads as 1.0; one that is pickled into
each of four ``spawn`` workers reads as ~5 (measured cases:
``docs/internals.md#smaps``). Torch's own shared
memory (``share_memory_()`` tensors, ``/dev/shm/torch_*``) is not told apart from
working memory: a dataset of shared tensors is judged by the estimate. Processes
outside the loader that map the same shared data (other ``torchrun`` ranks) are not
measured: their share of it moves into the sum as well.

Across the local ranks of a node (``verify`` called on every local rank, under
``torchrun``), local rank 0 measures every process of the node at the same two
moments (all main processes before any worker starts; every process after each
rank's last batch; ``distributed.NodeVerify``), and the node's figure is::

    duplication = copies + (copied + (excess if excess > resolution else 0))
                           / dataset_bytes

with ``copied``, ``excess`` and ``resolution`` summed over the node's processes and
ranks, and the segments of every rank's dataset told apart.

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

import contextlib
import gc
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import psutil
from torch.utils.data import DataLoader, IterableDataset

from .._compat import (
    dataloader_progress,
    dataloader_worker_pids,
    shutdown_dataloader_iterator,
    stop_dataloader_workers,
)
from ..errors import (
    ArgumentTypeError,
    DuplicationError,
    InconclusiveError,
    InvalidArgumentError,
)
from ._account import account, batch_nbytes, judge, resolution
from ._baseline import probe_baseline
from ._buffers import Buffers, copied_bytes, private_buffers
from ._node import node_verifier
from ._process import ProcessMemory, Segments, measure_all
from ._received import pickled_nbytes
from ._report import MemoryReport, duplication_message
from ._shared import shared_parts
from ._size import array_buffers, dataset_nbytes


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
        The :class:`MemoryReport`; its :attr:`~MemoryReport.status` is ``"ok"``
        unless ``max_duplication`` is ``None``.

    Raises:
        DuplicationError: ``duplication`` exceeds ``max_duplication``; ``.report``
            holds the report.
        InconclusiveError: cannot tell (not a pass): a copy of the part of the
            dataset that is not counted exactly would be within the estimate's
            resolution, or no worker could be measured; the message says what would
            decide (a larger dataset, workers, a shareddata dataset); ``.report``
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
        raise ArgumentTypeError(
            f"verify() takes a torch.utils.data.DataLoader, got {type(loader)!r}"
        )
    if batches is not None and int(batches) < 1:
        raise InvalidArgumentError(
            f"batches must be a positive number of batches or None, got {batches!r}"
        )
    nbytes = dataset_nbytes(loader.dataset) if dataset_bytes is None else int(dataset_bytes)
    if nbytes < 0:
        raise InvalidArgumentError(f"dataset_bytes must be >= 0, got {dataset_bytes!r}")
    num_workers = int(loader.num_workers)

    start_method = _start_method(loader)

    _stop_persistent_workers(loader)
    parts = shared_parts(loader.dataset)
    plain = max(nbytes - parts.nbytes, 0)
    node = node_verifier(across_ranks, parts.segments)
    measure_before = _measurer(parts.segments) if node is None else node.measurer("before")
    measure_after = _measurer(parts.segments) if node is None else node.measurer("after")
    forked = start_method == "fork" and plain > 0
    buffers = private_buffers(array_buffers(loader.dataset)) if forked else Buffers()
    with _frozen_heap(start_method == "fork"):
        baseline = probe_baseline(loader, start_method) if num_workers > 0 else 0
        # The forkserver (started by the probe at the latest) is the workers' template.
        server = _forkserver_pid() if start_method == "forkserver" else None
        gc.collect()
        before = measure_before([(os.getpid(), "main"), (server, "forkserver")])
        rows, batches_seen, batch_bytes, page_copies = _run_and_measure(
            loader, None if batches is None else int(batches), server, measure_after, buffers
        )

    n_workers = sum(1 for p in rows if p.role.startswith("worker"))
    # Exact counts outside the segments: what spawn workers received, pages fork workers copied.
    received = pickled_nbytes(loader.dataset) if start_method in _PICKLED and plain else None
    buffer_bytes = min(buffers.nbytes, plain) if page_copies is not None else 0
    by_value = min(received or 0, plain)
    counted = n_workers * by_value + (page_copies or 0)
    prefetch = loader.prefetch_factor if num_workers > 0 else None
    found = account(
        before,
        rows,
        n_workers * baseline,
        resolution(n_workers, batch_bytes, prefetch),
        plain,
        counted,
    )
    duplication = 1.0 + found.attributed / nbytes if nbytes > 0 else 1.0
    verdict = judge(
        dataset_bytes=nbytes,
        exact_bytes=min(parts.nbytes + by_value + buffer_bytes, nbytes),
        resolution=found.resolution,
        processes=len(rows),
        duplication=duplication,
        limit=max_duplication,
        workers_missing=num_workers > 0 and n_workers == 0,
    )
    report = MemoryReport(
        dataset_bytes=nbytes,
        total_pss=sum(p.pss for p in rows),
        duplication=duplication,
        processes=rows,
        baseline_bytes=baseline,
        start_method=start_method,
        num_workers=num_workers,
        pss_before=sum(p.pss for p in before),
        extra_bytes=found.attributed,
        batches=batches_seen,
        max_duplication=max_duplication,
        shared_bytes=min(parts.nbytes, nbytes),
        copied_bytes=found.copies,
        working_bytes=found.excess,
        resolution=found.resolution,
        batch_bytes=batch_bytes,
        received_bytes=received,
        buffer_bytes=buffer_bytes,
        counted_bytes=counted,
        conclusive=verdict.conclusive,
        unresolved_bytes=verdict.unresolved,
        needed_bytes=verdict.needed,
    )
    if node is not None:
        report = node.combine(report, loader.dataset)
    if report.status == "duplicated":
        raise DuplicationError(duplication_message(report), report)
    if report.status == "inconclusive" and max_duplication is not None:
        raise InconclusiveError(duplication_message(report), report)
    return report


_PICKLED = ("spawn", "forkserver")  # start methods that pickle the dataset into each worker


@contextlib.contextmanager
def _frozen_heap(freeze: bool) -> Iterator[None]:
    """``gc.freeze()`` the parent's heap while fork workers run (Note [How duplication ...]).

    Left as it was when the caller froze it already.
    """
    if not freeze or gc.get_freeze_count() > 0:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _measurer(segments: Segments) -> Any:
    def measure(procs: list[tuple[int | None, str]]) -> list[ProcessMemory]:
        return measure_all(procs, segments)

    return measure


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
    progress = dataloader_progress(loader)
    if progress is not None:
        done, epoch = progress
        if 0 < done < epoch:
            import warnings

            warnings.warn(
                f"verify() restarts the workers of this persistent DataLoader, which is "
                f"{done} batches into an epoch of {epoch}: a loop still iterating it "
                "(e.g. a Lightning fit loop) ends without an error. Call verify() between "
                "epochs, or on a separate DataLoader built the same way.",
                RuntimeWarning,
                stacklevel=3,
            )
        stop_dataloader_workers(loader)


def _run_and_measure(
    loader: DataLoader, batches: int | None, server: int | None, measurer: Any, buffers: Buffers
) -> tuple[list[ProcessMemory], int, int, int | None]:
    """Iterate ``loader`` and measure its processes right after the last batch.

    Returns the rows, the number of batches received, the bytes of the largest, and
    the bytes of ``buffers``' pages the workers copied (``None`` when not checked).
    """
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    target = batches if length is None else length if batches is None else min(batches, length)
    # An iterable dataset's len() may be wrong, and an unknown length gives no "last
    # batch" to wait for: measure after every batch and keep the latest figures.
    every = target is None or isinstance(loader.dataset, IterableDataset)
    if getattr(measurer, "node_wide", False):  # one meeting, at a last batch known ahead
        if target is None:
            raise InvalidArgumentError(
                "verify() across local ranks needs batches= for a loader without len()"
            )
        every = False
    before = _children() if loader.num_workers > 0 else set()
    rows: list[ProcessMemory] = []
    received = batch_bytes = 0
    copies: int | None = None
    iterator = iter(loader)
    try:
        while target is None or received < target:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            received += 1
            batch_bytes = max(batch_bytes, batch_nbytes(batch))
            if every or received == target:
                rows = _measure_loader(iterator, loader.num_workers, before, server, measurer)
                copies = _page_copies(rows, buffers)
            del batch
    finally:
        if not (loader.persistent_workers and loader.num_workers > 0):
            shutdown_dataloader_iterator(iterator)
        # A persistent loader keeps its workers; the next iter(loader) resets them.
        del iterator
    if not rows:
        raise InvalidArgumentError(
            "the DataLoader yielded no batch: there is nothing to measure (an empty dataset, "
            "or a sampler with no indices); verify a loader that yields at least one batch"
        )
    return rows, received, batch_bytes, copies


def _page_copies(rows: list[ProcessMemory], buffers: Buffers) -> int | None:
    """Bytes of ``buffers``' pages the workers among ``rows`` copied; ``None`` if unread."""
    workers = [p.pid for p in rows if p.role.startswith("worker")]
    if not buffers.pages or not workers:
        return None
    counts = [copied_bytes(pid, buffers) for pid in workers]
    return None if None in counts else sum(c or 0 for c in counts)


def _children() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _measure_loader(
    iterator: Any, num_workers: int, before: set[int], server: int | None, measurer: Any
) -> list[ProcessMemory]:
    procs: list[tuple[int | None, str]] = [(os.getpid(), "main"), (server, "forkserver")]
    workers = dataloader_worker_pids(iterator)
    if workers is not None:
        procs += [(pid, f"worker {i}") for i, pid in enumerate(workers)]
    elif num_workers > 0:  # an iterator that does not expose its workers
        new = sorted(_children() - before - {server})
        procs += [(pid, f"worker {i}") for i, pid in enumerate(new)]
    return measurer(procs)  # type: ignore[no-any-return]


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
