"""`verify`: run a loader, measure all its processes, say how often the dataset is held.

Note [How duplication is measured]
----------------------------------
Every process of the loader (main, workers, forkserver) is measured from the kernel
(``_process``) before the workers start and after the last batch, by PSS without
file pages (a copy of data is never file-backed). The copies beyond one are counted
**exactly** where they can be: a shareddata dataset's segments, found in each
``/proc/<pid>/smaps`` by device and inode (their ``Anonymous`` pages are copies
writes made); what ``spawn``/``forkserver`` workers receive by value (the dataset's
pickle, counted); under ``fork``, the pages of a plain dataset's arrays a worker
holds alone (``/proc/<pid>/pagemap``). The rest is **estimated**: the growth of
working memory beyond one worker baseline each (a probe worker with no data), above
its resolution, at most one copy a process. A copy decides only above its
resolution (``EXACT_FLOOR`` a process for exact counts); three answers: duplicated,
ok (no copy could have escaped), or inconclusive, never a pass. The parent's heap is
``gc.freeze()``-d while fork workers run (their first collection would copy every
inherited container page). Across local ranks, local rank 0 measures every process
of the node at the same two moments. Measured cases: ``docs/internals.md#smaps``.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import multiprocessing
import os
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from .._compat import (
    dataloader_progress,
    dataloader_worker_pids,
    shutdown_dataloader_iterator,
    stop_dataloader_workers,
)
from ..distributed import exchange, node_context, resolve_timeout, socket_name
from ..errors import ArgumentTypeError, DuplicationError, InconclusiveError, InvalidArgumentError
from ._dataset import dataset_nbytes, holdings, pickled_nbytes
from ._process import (
    KIB,
    PAGE,
    Pages,
    ProcessMemory,
    Segments,
    copied_pages,
    measure,
    measure_all,
    private_pages,
    read_smaps_rollup,
)
from ._report import Measured, MemoryReport, conclude, resolution


def verify(
    loader: Any,
    *,
    batches: int | None = None,
    max_duplication: float | None = 1.10,
    dataset_bytes: int | None = None,
    across_ranks: bool | None = None,
) -> MemoryReport:
    """Run ``loader``, measure all its processes, and check the dataset is held once.

    Args:
        loader: a ``DataLoader`` (any dataset, workers, start method, persistent or
            not), or another iterable loader whose workers are child processes of this
            one (``torchdata.nodes.Loader``, ``StatefulDataLoader``, Lightning's): its
            workers are the processes that appear while it iterates, its dataset the
            first ``Dataset`` it holds. It is left usable.
        batches: batches before measuring (``None``: one epoch, the cap).
        max_duplication: the limit (``None`` only measures).
        dataset_bytes: the dataset's size; by default its ``nbytes`` or an estimate.
        across_ranks: measure every process of the node, on every local rank (the
            default under ``torchrun`` with several local ranks).

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
    nbytes = dataset_nbytes(dataset, found) if dataset_bytes is None else int(dataset_bytes)
    if nbytes < 0:
        raise InvalidArgumentError(f"dataset_bytes must be >= 0, got {dataset_bytes!r}")
    plain = max(nbytes - found.shared_bytes, 0)
    callables = (getattr(loader, "collate_fn", None), getattr(loader, "worker_init_fn", None))
    refs = probe_references(list(found.code.values())[:200], *callables)
    method = _start_method(loader) if torch_loader else None
    if torch_loader:
        _stop_persistent_workers(loader)
    node = NodeVerify(across_ranks, found.segments)
    pages = private_pages(found.buffers) if plain and method in ("fork", None) else ()
    with _frozen_heap(method == "fork" or not torch_loader):
        has_workers = torch_loader and loader.num_workers > 0
        baseline = probe_baseline(loader.multiprocessing_context, refs) if has_workers else 0
        server = _forkserver_pid() if method == "forkserver" else None
        gc.collect()
        before = node.measure("before", [(os.getpid(), "main"), (server, "forkserver")])
        run = _Run(loader, None if batches is None else int(batches), server, node)
        run.iterate(pages)
        rows, n_workers = run.rows, sum(1 for p in run.rows if p.role.startswith("worker"))
        if not torch_loader:  # what its workers showed; a forkserver it started is no copy
            method = run.method
            baseline = probe_baseline(method, refs) if n_workers else 0
            before += [p for p in rows if p.role == "forkserver" and p.pid != server]
    num_workers = loader.num_workers if torch_loader else n_workers
    spawned = method in ("spawn", "forkserver") and plain
    checked = method == "fork" and run.copies is not None  # the arrays' pages, in every worker
    prefetch = getattr(loader, "prefetch_factor", None) or 2 if num_workers else None
    measured = Measured(
        dataset_bytes=nbytes,
        shared_bytes=found.shared_bytes,
        start_method=method if num_workers else None,
        num_workers=num_workers,
        workers=n_workers,
        resolution=resolution(n_workers, run.batch_bytes, prefetch),
        baseline_bytes=baseline,
        array_bytes=sum(n for _, n in found.buffers) + found.shared_bytes,
        batches=run.received,
        batch_bytes=run.batch_bytes,
        received_bytes=pickled_nbytes(dataset) if spawned else None,
        buffer_bytes=sum(e - f for f, e in pages) * PAGE if checked else 0,
        page_copies=run.copies or 0,
        identity=frozenset(found.segments) if found.count else None,
    )
    report = node.conclude(before, rows, measured, max_duplication)
    if report.status != "ok" and max_duplication is not None:  # no limit: only measured
        error = DuplicationError if report.status == "duplicated" else InconclusiveError
        raise error(f"{report.verdict_line()}\n{report}", report)
    return report


_END = object()


class _Run:
    """One pass over a loader, measured after its last batch (every batch if not known)."""

    def __init__(self, loader: Any, batches: int | None, server: int | None, node: NodeVerify):
        self.loader, self.server, self.node = loader, server, node
        try:
            length: int | None = len(loader)
        except TypeError:
            length = None
        self.target = batches if length is None else min(batches or length, length)
        self.rows: list[ProcessMemory] = []
        self.received = self.batch_bytes = 0
        self.copies: int | None = None
        self.method: str | None = None

    def iterate(self, pages: Pages) -> None:
        loader, torch_loader = self.loader, isinstance(self.loader, DataLoader)
        node_wide = self.node.ctx is not None
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
        procs += [(pid, f"worker {i}") for i, pid in enumerate(pids)]
        self.rows = self.node.measure("after", procs)
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


def probe_baseline(context: Any, refs: tuple[Any, ...]) -> int:
    """Private dirty bytes of an idle one-worker probe loader's worker, under ``context``.

    Its dataset carries ``refs`` (pickled by reference): the worker imports what the
    real ones do. Under fork it runs twice: a process's first DataLoader initialises
    state in the parent that makes more of a worker's pages private.
    """
    baseline = 0
    for _ in range(2 if _method(context) == "fork" else 1):
        try:
            baseline = _run_probe(context, refs)
        except Exception:
            if not refs:
                raise
            # a reference that imports here but not in a fresh worker: measure without
            refs = ()
            baseline = _run_probe(context, refs)
    return baseline


def _method(context: Any) -> str | None:
    return context if context is None or isinstance(context, str) else context.get_start_method()


def _run_probe(context: Any, refs: tuple[Any, ...]) -> int:
    dataset = TensorDataset(torch.arange(2))
    dataset.shareddataprobe_references = refs  # type: ignore[attr-defined]
    probe = DataLoader(dataset, batch_size=1, num_workers=1, multiprocessing_context=context)
    iterator = iter(probe)
    try:
        next(iterator)
        next(iterator)  # both batches received: idle, as the real workers are when measured
        pids = dataloader_worker_pids(iterator)
        if not pids:
            return 0
        pid = pids[0]
        fields = read_smaps_rollup(pid)
        return fields["Private_Dirty"] if fields and "Private_Dirty" in fields else measure(pid).uss
    finally:
        shutdown_dataloader_iterator(iterator)
        del iterator


def probe_references(code: Iterable[Any], *callables: Any) -> tuple[Any, ...]:
    """The classes and functions among ``code`` and ``callables`` that pickle by reference.

    A bound method gives its class and function, never the object bound; anything
    that does not pickle in under 4 KiB (a local class, a lambda) is left out.
    """
    candidates = list(code)
    for fn in callables:
        if inspect.ismethod(fn):
            candidates += [type(fn.__self__), fn.__func__]
        elif callable(getattr(fn, "func", None)):  # functools.partial
            candidates += [type(fn), fn.func]
        elif fn is not None:
            candidates.append(fn if isinstance(fn, type) or inspect.isroutine(fn) else type(fn))
    refs: dict[int, Any] = {}
    for obj in candidates:
        if getattr(obj, "__module__", None) in (None, "builtins") or id(obj) in refs:
            continue
        if not (isinstance(obj, type) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        try:
            if len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) <= 4 * KIB:
                refs[id(obj)] = obj
        except Exception:
            continue
    return tuple(refs.values())


def batch_nbytes(batch: Any, depth: int = 4) -> int:
    """Bytes of the tensors and arrays in a collated batch (nested tuples, lists, dicts).

    Example:
        >>> batch_nbytes({"x": torch.zeros(4, 2), "y": [np.zeros(3, np.uint8)]})
        35
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.element_size() * batch.nelement())
    if isinstance(batch, np.ndarray):
        return int(batch.nbytes)
    if isinstance(batch, (bytes, bytearray, str)):
        return len(batch)
    if isinstance(batch, dict) and depth > 0:
        return sum(batch_nbytes(v, depth - 1) for v in batch.values())
    if isinstance(batch, (list, tuple)) and depth > 0:
        return sum(batch_nbytes(v, depth - 1) for v in batch[:4096])
    return 0


_ROUNDS = itertools.count()


class NodeVerify:
    """How ``verify`` measures: this process alone, or every local rank of the node at once.

    Across local ranks (over ``distributed.exchange``), each :meth:`measure` is a
    node-wide barrier at which local rank 0 measures the processes of every local rank;
    :meth:`conclude` turns the ranks' measurements into the node's report, on every rank.
    """

    def __init__(self, across_ranks: bool | None, segments: Segments = ()) -> None:
        ctx = node_context() if across_ranks is not False else None
        self.ctx = ctx if ctx is not None and ctx.local_world_size > 1 else None
        self.segments = sorted(segments)
        self.rows: dict[str, list[ProcessMemory]] = {}
        if self.ctx is not None:
            self.timeout, self.number = resolve_timeout(), next(_ROUNDS)

    def _exchange(self, phase: str, value: Any, respond: Callable[[list[Any]], list[Any]]) -> Any:
        assert self.ctx is not None
        name = socket_name(self.ctx, f"verify{phase}", self.number)
        return exchange(self.ctx, name, value, respond, self.timeout, "sd.verify()")

    def measure(self, phase: str, procs: list[tuple[int | None, str]]) -> list[ProcessMemory]:
        """Measure each ``(pid, role)`` of this rank (across ranks: at ``phase``, node-wide)."""
        if self.ctx is None:
            return measure_all(procs, self.segments)

        def respond(per_rank: list[tuple[list[Any], list[Any]]]) -> list[Any]:
            owner: dict[int, tuple[int, str]] = {}
            segments: set[tuple[int, int]] = set()
            for rank, (rank_procs, rank_segments) in enumerate(per_rank):
                segments |= {(int(d), int(i)) for d, i in rank_segments}
                owner.update({pid: (rank, role) for pid, role in rank_procs if pid is not None})
            flat = [(pid, f"r{rank} {role}") for pid, (rank, role) in owner.items()]
            self.rows[phase] = rows = measure_all(flat, segments)
            mine: list[list[ProcessMemory]] = [[] for _ in per_rank]
            for row in rows:
                rank, role = owner[row.pid]
                mine[rank].append(replace(row, role=role))
            return mine

        return self._exchange(phase, (procs, self.segments), respond)  # type: ignore[no-any-return]

    def conclude(
        self,
        before: list[ProcessMemory],
        after: list[ProcessMemory],
        measured: Measured,
        max_duplication: float | None,
    ) -> MemoryReport:
        """The report of this rank's measurements, or across ranks the node's, on every rank."""
        if self.ctx is None:
            return conclude(before, after, [measured], max_duplication)

        def respond(infos: list[dict[str, Any]]) -> list[MemoryReport]:
            ranks, rows = [Measured(**info) for info in infos], self.rows
            return [conclude(rows["before"], rows["after"], ranks, max_duplication)] * len(ranks)

        # as a dict: the ranks accept builtins only (Note [Framing on the node socket])
        return self._exchange("combine", asdict(measured), respond)  # type: ignore[no-any-return]
