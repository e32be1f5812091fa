"""From the measurements to the copies and a verdict: :class:`MemoryReport`.

See Note [How duplication is measured] in ``_verify.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .._text import format_bytes
from ._process import KIB, MIB, ProcessMemory

WORKING_FLOOR = 4 * MIB  # what a process's working memory may gain: arenas, caches, queues
BATCHES_PER_WORKER = 3  # its items, the collated batch, the previous one
EXACT_FLOOR = 64 * KIB  # exact counts decide above this a process: less is a few attributes
DEFAULT_LIMIT = 1.10  # what conclude() decides against when verify() is given no limit


def resolution(n_workers: int, batch_bytes: int, prefetch_factor: int | None) -> int:
    """Working memory that iterating may add without any copy of the data.

    Example:
        >>> resolution(2, 1 << 20, 2) // (1 << 20)
        23
    """
    waiting = (prefetch_factor or 0) * n_workers + 1  # batches waiting for the main process
    workers = n_workers * (WORKING_FLOOR + BATCHES_PER_WORKER * batch_bytes)
    return WORKING_FLOOR + waiting * batch_bytes + workers


@dataclass(frozen=True)
class Measured:
    """What ``verify`` measured on one local rank, for :func:`conclude`, in bytes.

    ``num_workers``: the loader's workers, ``workers``: those measured after the last
    batch; ``resolution``: of the rank's estimate; ``received_bytes``: what each
    ``spawn``/``forkserver`` worker received by value (``None``: not counted);
    ``buffer_bytes``: under ``fork``, the arrays' pages checked in every worker,
    ``page_copies``: those the workers copied; ``identity``: the segments the rank's
    dataset maps (``None``: a dataset of its own, a copy).
    """

    dataset_bytes: int
    shared_bytes: int
    start_method: str | None
    num_workers: int
    workers: int
    resolution: int
    baseline_bytes: int
    array_bytes: int = 0
    batches: int = 0
    batch_bytes: int = 0
    received_bytes: int | None = None
    buffer_bytes: int = 0
    page_copies: int = 0
    identity: frozenset[tuple[int, int]] | None = None


def conclude(
    before: Sequence[ProcessMemory],
    after: Sequence[ProcessMemory],
    ranks: Sequence[Measured],
    max_duplication: float | None,
) -> MemoryReport:
    """The report of two measurements: the copies, ``duplication`` and the verdict.

    ``before``: the main processes (and forkserver) before the workers started;
    ``after``: every process after the last batch; ``ranks``: what each local rank
    measured (one alone); ``max_duplication``: the limit.

    The copies are the segments' private pages (exact), what the workers received by
    value and the arrays' pages they copied (exact), one whole copy per local rank
    that holds a dataset of its own, and the estimate: the growth of working memory
    beyond the workers' baselines and the counted copies, if above the resolution,
    at most one copy a process of what is not counted exactly. Over the limit, it
    decides when the copies are above their resolution (:data:`EXACT_FLOOR` a
    process for exact counts, ``resolution`` for the estimate). Within it, when no
    copy could have escaped: the part not counted exactly is above the resolution
    or so small that a copy in every process stays within the limit. An empty
    dataset is held once.

    Example:
        >>> main = ProcessMemory(pid=1, role="main", rss=0, uss=0, pss=10, shared=0)
        >>> grown = ProcessMemory(pid=2, role="worker 0", rss=0, uss=0, pss=100, shared=0)
        >>> def report(shared=0, received=None, resolution=50, nbytes=1000, limit=None):
        ...     rank = Measured(dataset_bytes=nbytes, shared_bytes=shared, start_method="spawn",
        ...                     num_workers=1, workers=1, resolution=resolution,
        ...                     baseline_bytes=10, received_bytes=received)
        ...     return conclude([main], [main, grown], [rank], limit)
        >>> report().extra_bytes, report(shared=980).extra_bytes  # 1 copy/process
        (90, 40)
        >>> report(received=80, resolution=100).extra_bytes
        80
        >>> r = report(nbytes=4 * MIB, resolution=15 * MIB, limit=1.1)
        >>> r.status, r.unresolved_bytes, r.needed_bytes
        ('inconclusive', 4194304, 15728641)
        >>> report(shared=2048, received=2048, resolution=MIB, nbytes=4096, limit=1.1).status
        'inconclusive'
    """
    first, processes = ranks[0], len(after)
    nbytes = first.dataset_bytes
    shared = min(first.shared_bytes, nbytes)
    plain, counted, exact = nbytes - shared, 0, nbytes
    for rank in ranks:  # what each rank's workers copied of a plain dataset, counted
        by_value, buffers = min(rank.received_bytes or 0, plain), min(rank.buffer_bytes, plain)
        counted += rank.workers * by_value + (rank.page_copies if buffers else 0)
        exact = min(exact, shared + by_value + buffers)
    identities = [rank.identity for rank in ranks]
    copies = len({i for i in identities if i is not None}) + identities.count(None)
    tolerance = sum(rank.resolution for rank in ranks)
    baselines = sum(rank.workers * rank.baseline_bytes for rank in ranks)
    copied = max(sum(p.data_copied for p in after) - sum(p.data_copied for p in before), 0)
    excess = sum(p.working for p in after) - sum(p.working for p in before) - baselines
    unresolved = nbytes - exact
    rest = excess - counted  # the counted copies are part of the growth
    estimated = max(min(rest, unresolved * processes), 0) if rest > tolerance else 0
    attributed = copied + counted + estimated
    # an empty dataset is held once however many ranks hold it: no copy of it is possible
    duplication = copies + attributed / nbytes if nbytes > 0 else 1.0
    bound = DEFAULT_LIMIT if max_duplication is None else max_duplication
    needed = 0
    if not nbytes:
        conclusive = True
    elif duplication > bound:  # copies within their resolution do not decide (ranks' do)
        within = copied + counted if copied + counted <= EXACT_FLOOR * processes else 0
        within += estimated if estimated <= tolerance else 0
        conclusive = bound < 1.0 or duplication - within / nbytes > bound
    elif any(rank.num_workers and not rank.workers for rank in ranks):  # none measured
        conclusive = False
    else:
        conclusive = unresolved > tolerance or unresolved * processes <= (bound - 1.0) * nbytes
        if not conclusive and unresolved:  # the unresolved part grows, the resolution does not
            needed = nbytes * tolerance // unresolved + 1
    return MemoryReport(
        dataset_bytes=nbytes,
        total_pss=sum(p.pss for p in after),
        duplication=duplication,
        processes=list(after),
        baseline_bytes=round(sum(rank.baseline_bytes for rank in ranks) / len(ranks)),
        start_method=first.start_method,
        num_workers=sum(rank.num_workers for rank in ranks),
        pss_before=sum(p.pss for p in before),
        extra_bytes=(copies - 1) * nbytes + attributed,
        batches=first.batches,
        max_duplication=max_duplication,
        local_ranks=len(ranks),
        rank_copies=copies,
        shared_bytes=shared,
        copied_bytes=copied,
        working_bytes=excess,
        resolution=tolerance,
        batch_bytes=max(rank.batch_bytes for rank in ranks),
        received_bytes=first.received_bytes,
        buffer_bytes=min(first.buffer_bytes, plain),
        counted_bytes=counted,
        conclusive=conclusive,
        unresolved_bytes=unresolved,
        needed_bytes=needed,
        array_bytes=first.array_bytes,
    )


_SHARED = "sd.NumpyDataset, sd.HDF5Dataset, sd.ParquetDataset, sd.ArrowDataset"


@dataclass
class MemoryReport:
    """What :func:`verify` measured (see Note [How duplication is measured]), in bytes.

    Attributes:
        dataset_bytes: the dataset's size, which the ratio is relative to.
        total_pss: PSS summed over :attr:`processes` after the last batch.
        duplication: how many times the dataset is held, as far as measured.
        processes: one :class:`ProcessMemory` per process, main process first.
        baseline_bytes: private memory of one worker holding no data (a probe's).
        start_method: ``"fork"``, ``"spawn"``, ``"forkserver"``; ``None`` without workers.
        num_workers: the loader's workers (for another loader: the workers found).
        pss_before: PSS of the main process (and forkserver) before the workers started.
        extra_bytes: bytes counted as copies beyond one copy.
        batches: batches iterated; ``max_duplication``: the limit (``None``: none).
        local_ranks: local ranks measured together; ``rank_copies``: the copies their
            main processes hold.
        shared_bytes: the dataset's bytes in shareddata's segments; ``copied_bytes``:
            private copies of their pages (exact).
        working_bytes: growth of working memory beyond the baselines (the estimate);
            ``resolution``: the growth it cannot tell from a copy.
        batch_bytes: the largest batch.
        received_bytes: what each ``spawn``/``forkserver`` worker received by value
            (``None``: not counted); ``buffer_bytes``: under ``fork``, the arrays whose
            pages were checked in every worker; ``counted_bytes``: the copies these
            two counted exactly.
        conclusive: whether it decides (:attr:`status`); ``unresolved_bytes``: the part
            only estimated; ``needed_bytes``: the dataset size from which a copy of it
            would show.
        array_bytes: arrays and shareddata datasets found (0 for a dataset that makes
            its items on the fly).
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
    shared_bytes: int = 0
    copied_bytes: int = 0
    working_bytes: int = 0
    resolution: int = 0
    batch_bytes: int = 0
    received_bytes: int | None = None
    buffer_bytes: int = 0
    counted_bytes: int = 0
    conclusive: bool = True
    unresolved_bytes: int = 0
    needed_bytes: int = 0
    array_bytes: int = 0

    @property
    def passed(self) -> bool:
        """Whether the dataset is held once: :attr:`status` is ``"ok"`` (or there is no limit)."""
        return self.max_duplication is None or self.status == "ok"

    @property
    def status(self) -> str:
        """``"ok"``, ``"duplicated"`` or ``"inconclusive"`` (cannot tell, never a pass)."""
        if not self.conclusive:
            return "inconclusive"
        limit = self.max_duplication
        return "duplicated" if limit is not None and self.duplication > limit else "ok"

    @property
    def resolution_fraction(self) -> float:
        """:attr:`resolution` as a fraction of the dataset (``inf`` for an empty one)."""
        return self.resolution / self.dataset_bytes if self.dataset_bytes else float("inf")

    def _limit(self) -> str:
        return "no limit" if self.max_duplication is None else f"limit {self.max_duplication:.2f}"

    def _workers(self) -> int:
        return sum(1 for p in self.processes if "worker" in p.role.split())

    def verdict(self) -> str:
        """Return the short verdict, e.g. ``"dataset held 1.02x (limit 1.10)"``."""
        unsure = " as far as measured, cannot tell" if self.status == "inconclusive" else ""
        return f"dataset held {self.duplication:.2f}x{unsure} ({self._limit()})"

    def verdict_line(self) -> str:
        """Return the verdict in words: ``OK: ...``, ``FAIL: ...`` or ``CANNOT TELL: ...``.

        Example:
            >>> r = MemoryReport(dataset_bytes=100, total_pss=0, duplication=3.0, processes=[],
            ...                  baseline_bytes=0, start_method="spawn", num_workers=3,
            ...                  max_duplication=1.1)
            >>> r.verdict_line().split(":")[:2]
            ['FAIL', ' the dataset is duplicated 3.00x across 3 workers (limit 1.10)']
            >>> r.duplication = 1.01
            >>> r.verdict_line()
            'OK: the dataset is held 1.01x (limit 1.10)'
        """
        if self.status == "inconclusive":
            return f"CANNOT TELL: {self._undecided()}"
        if self.passed and not self.dataset_bytes:
            return f"OK: the dataset is empty (0 B): no copy of it is possible ({self._limit()})"
        if self.passed:
            return f"OK: the dataset is held {self.duplication:.2f}x ({self._limit()})"
        workers = f"{self.num_workers} worker{'s' if self.num_workers != 1 else ''}"
        where = f"across {workers}" if self.num_workers else "in the main process"
        if self.local_ranks > 1:
            where = f"across {self.local_ranks} local ranks and {workers}"
        return (
            f"FAIL: the dataset is duplicated {self.duplication:.2f}x {where} "
            f"({self._limit()}): {self.fix()}"
        )

    def _undecided(self) -> str:
        """Why the measurement does not decide, and what would."""
        measured = f"held {self.duplication:.2f}x as far as measured ({self._limit()})"
        if self.num_workers and not self._workers():
            return (
                f"the DataLoader has num_workers={self.num_workers} but no worker was alive "
                f"when measured, after the last batch; {measured}. To decide, verify it with "
                "batches= within the epoch, or an iterable dataset whose workers all yield "
                "until its end"
            )
        floor = format_bytes(EXACT_FLOOR * len(self.processes))
        if not self.array_bytes and self.dataset_bytes <= EXACT_FLOOR:
            return (
                f"the dataset holds {format_bytes(self.dataset_bytes)} and no arrays, too "
                f"little for a copy of it to be measured (exact counts decide above {floor} "
                f"here, the estimate above {format_bytes(self.resolution)}); {measured}. A "
                "dataset that makes its items on the fly has no data to share and needs no "
                "change. If its workers load data (files they open, arrays they build), give "
                "its size as dataset_bytes= (--dataset-size) so that a copy of it would show"
            )
        bound = DEFAULT_LIMIT if self.max_duplication is None else self.max_duplication
        if self.duplication > bound:
            exact = self.copied_bytes + self.counted_bytes
            return (
                f"the copies measured, {format_bytes(self.extra_bytes)} beyond one copy "
                f"({format_bytes(exact)} counted exactly, decisive above {floor}; "
                f"{format_bytes(self.extra_bytes - exact)} estimated, decisive above "
                f"{format_bytes(self.resolution)}), are within their resolution; {measured}. "
                "To decide, verify over more rows (the same batch_size) or with "
                "dataset_bytes= if the dataset loads more than it holds here"
            )
        needed = -(-self.needed_bytes // MIB) * MIB
        size = f"a dataset of at least {format_bytes(needed)}" if needed else "a larger dataset"
        text = (
            f"{format_bytes(self.unresolved_bytes)} of the dataset's "
            f"{format_bytes(self.dataset_bytes)} is not counted exactly, and a copy of it "
            f"would be within the resolution of the estimate "
            f"({format_bytes(self.resolution)}); {measured}. To decide, verify over {size} "
            f"(more rows, the same batch_size), or load it with a shareddata dataset ({_SHARED}, "
            "or sd.SharedDataset(dataset)), whose copies are counted exactly at any size"
        )
        if not self.num_workers:
            text += (
                "; with num_workers=0 only the main process is measured: verify the "
                "DataLoader with the num_workers and start method you train with"
            )
        return text

    def fix(self) -> str:
        """The fix for a duplicated dataset, in words, for what was measured."""
        if self.local_ranks > 1 and self.rank_copies > 1:
            return (
                f"the {self.local_ranks} local ranks hold {self.rank_copies} copies; build the "
                "dataset with a shareddata dataset and share='node' so that local rank 0 loads "
                "it and the other ranks attach to its segments"
            )
        written = self.copied_bytes + (self.counted_bytes if self.buffer_bytes else 0)
        if written > max(self.extra_bytes - written, 0):
            return (
                "the workers write into the dataset's shared pages, and each write copies "
                "a page into the writing process; do not modify items in place (copy an "
                "item before changing it, e.g. np.array(item))"
            )
        how = (
            "the workers copy Python objects (lists, dicts, strings) as they read them, "
            "because reading one writes its reference count"
            if self.start_method == "fork"
            else "each worker unpickles its own copy of the dataset"
            if self.num_workers
            else "the main process holds it more than once"
        )
        return (
            f"{how}; load the data with a shareddata dataset ({_SHARED}) or wrap the dataset "
            "in sd.SharedDataset(dataset), so that every worker indexes one copy"
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the report as a JSON-serialisable dict (rows as dicts)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "processes"}
        out["duplication"] = float(self.duplication)
        out.update(
            passed=self.passed,
            status=self.status,
            resolution_fraction=float(self.resolution_fraction),
            verdict=self.verdict_line(),
            processes=[p.to_dict() for p in self.processes],
        )
        return out

    def to_json(self, **kwargs: Any) -> str:
        """Return :meth:`to_dict` as a JSON string (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.to_dict(), **kwargs)

    def plot(self, path: str | os.PathLike[str], *, title: str = "") -> pathlib.Path:
        """Write a PNG bar chart of private (USS) and shared memory per process to ``path``.

        A dashed line marks the dataset's size: a copy in a worker is a private bar
        that high. Needs matplotlib (``MissingDependencyError`` naming
        ``pip install 'torch-shareddata[plot]'`` without it).

        Example:
            >>> import os, tempfile, torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from shareddata import verify
            >>> report = verify(DataLoader(TensorDataset(torch.zeros(64, 4))), max_duplication=None)
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     report.plot(os.path.join(tmp, "memory.png")).read_bytes()[1:4]
            b'PNG'
        """
        from ._plot import save

        return save([(title, self)], path)

    def __str__(self) -> str:
        def mib(n: float) -> str:
            return f"{n / MIB:.1f}"

        who = f"{self.num_workers} {self.start_method} workers"
        who = who if self.num_workers else "no workers (num_workers=0)"
        who = f"{self.local_ranks} local ranks, {who}" if self.local_ranks > 1 else who
        heads = ("RSS MiB", "USS MiB", "PSS MiB", "shared MiB", "file MiB", "data MiB", "work MiB")
        names = ("rss", "uss", "pss", "shared", "pss_file", "data_pss", "working")
        cells: list[tuple[str, Any, list[int]]] = [
            (p.role, p.pid, [getattr(p, n) for n in names]) for p in self.processes
        ]
        cells.append(("total", "", [sum(getattr(p, n) for p in self.processes) for n in names]))
        lines = [
            f"memory of the DataLoader: {who}, measured after {self.batches} batches",
            f"{'process':<12}{'pid':>9}" + "".join(f"{h:>11}" for h in heads),
            *(f"{r:<12}{pid:>9}" + "".join(f"{mib(v):>11}" for v in vs) for r, pid, vs in cells),
            "  PSS: each page divided among the processes mapping it (sums to the real total); "
            "file: code, libraries, mapped files; data: the dataset's shared segments; "
            "work: the rest (anonymous and shared memory, batches in flight left out)",
            f"dataset {mib(self.dataset_bytes)} MiB, {mib(self.shared_bytes)} MiB of it in "
            f"shareddata segments: private copies of their pages {mib(self.copied_bytes)} MiB "
            "(exact)",
        ]
        if self.received_bytes is not None:
            lines.append(
                f"each worker received {mib(self.received_bytes)} MiB of it by value (pickled "
                f"when it started): {mib(self.counted_bytes)} MiB of copies in "
                f"{self._workers()} worker(s) (exact)"
            )
        if self.buffer_bytes:
            lines.append(
                f"{mib(self.buffer_bytes)} MiB of it in numpy/torch arrays: pages the workers "
                f"copied {mib(self.counted_bytes)} MiB (exact, from /proc/<pid>/pagemap)"
            )
        exact = self.copied_bytes + self.counted_bytes
        held = (
            "counted as copies"
            if self.extra_bytes > exact
            else "it holds the copies counted above"
            if self.counted_bytes
            else "working memory, not the dataset"
        )
        lines.append(
            f"working memory grew {mib(self.working_bytes)} MiB beyond {self._workers()} worker "
            f"baseline(s) of {mib(self.baseline_bytes)} MiB (estimate; resolution "
            f"{mib(self.resolution)} MiB = {self.resolution_fraction:.2f}x the dataset): {held}"
        )
        if self.local_ranks > 1:
            lines.append(
                f"copies in the {self.local_ranks} ranks' main processes: {self.rank_copies}"
            )
        lines += [
            f"{self.verdict()}: beyond one copy {mib(self.extra_bytes)} MiB ({mib(exact)} MiB "
            f"counted, {mib(max(self.extra_bytes - exact, 0))} MiB estimated)",
            self.verdict_line(),
        ]
        return "\n".join(lines)
