"""The report :func:`~shareddata.verify` returns: :class:`MemoryReport`, its table and verdict.

A verdict is one of three answers (:attr:`MemoryReport.status`): ``"ok"`` (held
once), ``"duplicated"`` (above the limit) or ``"inconclusive"`` (cannot tell: a copy
could hide within the measurement's resolution, or no worker was measured).
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from .._text import format_bytes
from ._process import MIB, ProcessMemory


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
        extra_bytes: bytes counted as copies beyond the one copy of the dataset
            (``(duplication - 1) * dataset_bytes``): :attr:`copied_bytes` plus
            :attr:`working_bytes` when that exceeds :attr:`resolution`.
        batches: number of batches iterated before measuring.
        max_duplication: the limit checked against, ``None`` for no check.
        local_ranks: local ranks measured together (1: this process alone).
        rank_copies: copies held by those ranks' main processes (see the Note).
        shared_bytes: the part of the dataset in shareddata's segments, whose pages
            are counted exactly (0 for a dataset of other kinds).
        copied_bytes: private copies of those pages (copy-on-write), exact.
        working_bytes: growth of the processes' memory outside the dataset's
            segments, file pages and batches in flight, beyond the workers'
            baselines: an estimate, where copies of other datasets show up.
        resolution: the working memory iterating may add without copying data
            (per process and per batch in flight); a :attr:`working_bytes` within
            it is not counted as a copy.
        batch_bytes: bytes of the largest batch received.
        received_bytes: under ``spawn``/``forkserver``, the bytes of the dataset each
            worker received by value when it started (its pickle; each worker holds
            them); ``None`` when not counted (``fork``, no workers, or a dataset
            only ``multiprocessing``'s pickler can send).
        buffer_bytes: under ``fork``, the bytes of the dataset's numpy and torch
            arrays in private memory whose pages were checked in every worker.
        counted_bytes: copies outside shareddata's segments counted exactly: the
            workers' :attr:`received_bytes` or the pages of :attr:`buffer_bytes`
            they copied (they are in :attr:`working_bytes` too).
        conclusive: whether the measurement decides (see :attr:`status`).
        unresolved_bytes: the part of the dataset whose copies are not counted
            exactly, only estimated.
        needed_bytes: when inconclusive, the dataset size from which the
            estimate would see a copy (0 when no size would do).
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

    def _workers(self) -> int:
        return sum(1 for p in self.processes if "worker" in p.role.split())

    def _who(self) -> str:
        ranks = f"{self.local_ranks} local ranks, " if self.local_ranks > 1 else ""
        if not self.num_workers:
            return ranks + "no workers (num_workers=0)"
        return ranks + f"{self.num_workers} {self.start_method} workers"

    @property
    def passed(self) -> bool:
        """Whether the dataset is held once: :attr:`status` is ``"ok"`` (or there is no limit)."""
        return self.max_duplication is None or self.status == "ok"

    @property
    def status(self) -> str:
        """The answer: ``"ok"``, ``"duplicated"`` or ``"inconclusive"``.

        ``"duplicated"``: :attr:`duplication` exceeds :attr:`max_duplication`.
        ``"inconclusive"`` (cannot tell, never a pass): a copy of the
        :attr:`unresolved_bytes` would be within :attr:`resolution`, or the loader
        has workers and none was measured; :meth:`verdict_line` says what would
        decide. ``"ok"``: held within the limit, and any copy would have shown.
        """
        limit = self.max_duplication
        if limit is not None and self.duplication > limit:
            return "duplicated"
        return "ok" if self.conclusive else "inconclusive"

    @property
    def resolution_fraction(self) -> float:
        """:attr:`resolution` as a fraction of the dataset (``inf`` for an empty one)."""
        return self.resolution / self.dataset_bytes if self.dataset_bytes else float("inf")

    def _limit(self) -> str:
        return "no limit" if self.max_duplication is None else f"limit {self.max_duplication:.2f}"

    def verdict(self) -> str:
        """Return the short verdict, e.g. ``"dataset held 1.02x (limit 1.10)"``."""
        if self.status == "inconclusive":
            return (
                f"dataset held {self.duplication:.2f}x as far as measured, cannot tell "
                f"({self._limit()})"
            )
        return f"dataset held {self.duplication:.2f}x ({self._limit()})"

    def verdict_line(self) -> str:
        """Return the verdict in words: ``OK: ...`` or ``FAIL: ...`` with the fix.

        ``CANNOT TELL: ...`` when :attr:`status` is ``"inconclusive"``, with what
        would decide.

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
        if self.passed:
            return f"OK: the dataset is held {self.duplication:.2f}x ({self._limit()})"
        return (
            f"FAIL: the dataset is duplicated {self.duplication:.2f}x {self._across()} "
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
        needed = -(-self.needed_bytes // MIB) * MIB
        size = f"a dataset of at least {format_bytes(needed)}" if needed else "a larger dataset"
        text = (
            f"{format_bytes(self.unresolved_bytes)} of the dataset's "
            f"{format_bytes(self.dataset_bytes)} is not counted exactly, and a copy of it "
            f"would be within the resolution of the estimate "
            f"({format_bytes(self.resolution)}); {measured}. To decide, verify over {size} "
            "(more rows, the same batch_size), or load it with a shareddata dataset "
            "(sd.NumpyDataset, sd.HDF5Dataset, sd.ParquetDataset, sd.ArrowDataset, or "
            "sd.SharedDataset(dataset)), whose copies are counted exactly at any size"
        )
        if not self.num_workers:
            text += (
                "; with num_workers=0 only the main process is measured: verify the "
                "DataLoader with the num_workers and start method you train with"
            )
        return text

    def _across(self) -> str:
        workers = f"{self.num_workers} worker{'s' if self.num_workers != 1 else ''}"
        if self.local_ranks > 1:
            return f"across {self.local_ranks} local ranks and {workers}"
        return f"across {workers}" if self.num_workers else "in the main process"

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
            f"{how}; load the data with a shareddata dataset (sd.NumpyDataset, "
            "sd.HDF5Dataset, sd.ParquetDataset, sd.ArrowDataset) or wrap the dataset in "
            "sd.SharedDataset(dataset), so that every worker indexes one copy"
        )

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
            "status": self.status,
            "conclusive": bool(self.conclusive),
            "unresolved_bytes": int(self.unresolved_bytes),
            "needed_bytes": int(self.needed_bytes),
            "received_bytes": self.received_bytes,
            "buffer_bytes": int(self.buffer_bytes),
            "counted_bytes": int(self.counted_bytes),
            "shared_bytes": int(self.shared_bytes),
            "copied_bytes": int(self.copied_bytes),
            "working_bytes": int(self.working_bytes),
            "resolution": int(self.resolution),
            "resolution_fraction": float(self.resolution_fraction),
            "batch_bytes": int(self.batch_bytes),
            "verdict": self.verdict_line(),
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
                ``pip install 'torch-shareddata[plot]'``.

        Example:
            >>> import os, tempfile, torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from shareddata import verify
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
            return f"{n / MIB:11.1f}"

        heads = ("RSS MiB", "USS MiB", "PSS MiB", "shared MiB", "file MiB", "data MiB", "work MiB")
        lines = [
            f"memory of the DataLoader: {self._who()}, measured after {self.batches} batches",
            f"{'process':<12}{'pid':>9}" + "".join(f"{h:>11}" for h in heads),
        ]
        names = ("rss", "uss", "pss", "shared", "pss_file", "data_pss", "working")
        rows = self.processes
        for p in rows:
            lines.append(f"{p.role:<12}{p.pid:>9}" + "".join(mib(getattr(p, n)) for n in names))
        totals = [sum(getattr(p, n) for p in rows) for n in names]
        lines.append(f"{'total':<12}{'':>9}" + "".join(mib(v) for v in totals))
        lines.append(
            "  PSS: each page divided among the processes mapping it (sums to the real total); "
            "file: code, libraries, mapped files; data: the dataset's shared segments; "
            "work: the rest (anonymous and shared memory, batches in flight left out)"
        )
        size = self.dataset_bytes
        lines.append(
            f"dataset {size / MIB:.1f} MiB, {self.shared_bytes / MIB:.1f} MiB of it in "
            f"shareddata segments: private copies of their pages {self.copied_bytes / MIB:.1f} "
            "MiB (exact)"
        )
        workers = self._workers()
        if self.received_bytes is not None:
            lines.append(
                f"each worker received {self.received_bytes / MIB:.1f} MiB of it by value "
                f"(pickled when it started): {self.counted_bytes / MIB:.1f} MiB of copies in "
                f"{workers} worker(s) (exact)"
            )
        if self.buffer_bytes:
            lines.append(
                f"{self.buffer_bytes / MIB:.1f} MiB of it in numpy/torch arrays: pages the "
                f"workers copied {self.counted_bytes / MIB:.1f} MiB (exact, from "
                "/proc/<pid>/pagemap)"
            )
        exact = self.copied_bytes + self.counted_bytes
        counted = (
            "counted as copies"
            if self.extra_bytes > exact
            else "it holds the copies counted above"
            if self.counted_bytes
            else "working memory, not the dataset"
        )
        lines.append(
            f"working memory grew {self.working_bytes / MIB:.1f} MiB beyond "
            f"{workers} worker baseline(s) of {self.baseline_bytes / MIB:.1f} MiB "
            f"(estimate; resolution {self.resolution / MIB:.1f} MiB = "
            f"{self.resolution_fraction:.2f}x the dataset): {counted}"
        )
        if self.local_ranks > 1:
            lines.append(
                f"copies in the {self.local_ranks} ranks' main processes: {self.rank_copies}"
            )
        estimated = max(self.extra_bytes - exact, 0)
        lines.append(
            f"{self.verdict()}: beyond one copy {self.extra_bytes / MIB:.1f} MiB "
            f"({exact / MIB:.1f} MiB counted, {estimated / MIB:.1f} MiB estimated)"
        )
        lines.append(self.verdict_line())
        return "\n".join(lines)


def duplication_message(report: MemoryReport) -> str:
    """The message of the :class:`~shareddata.DuplicationError` for ``report``."""
    return f"{report.verdict_line()}\n{report}"
