"""The report :func:`~shareddata.verify` returns: :class:`MemoryReport`, its table and verdict."""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

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
            return f"{n / MIB:11.1f}"

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
            f"dataset {self.dataset_bytes / MIB:.1f} MiB; PSS before iterating "
            f"{self.pss_before / MIB:.1f} MiB; worker baseline {self.baseline_bytes / MIB:.1f}"
            f" MiB x {self._workers()}; beyond one copy {self.extra_bytes / MIB:.1f} MiB "
            "(file pages left out)"
        )
        if self.local_ranks > 1:
            lines.append(
                f"copies in the {self.local_ranks} ranks' main processes: {self.rank_copies}"
            )
        lines.append(self.verdict())
        return "\n".join(lines)



def duplication_message(report: MemoryReport) -> str:
    return (
        f"{report.verdict()}: the DataLoader's {len(report.processes)} "
        f"process{'es' if len(report.processes) != 1 else ''} ({report._who()}) "
        f"hold {report.total_pss / MIB:.1f} MiB (sum of PSS after {report.batches} batches), "
        f"{report.pss_before / MIB:.1f} MiB before iterating. Net of code and libraries "
        f"and of {report.baseline_bytes / MIB:.1f} MiB per worker without data, "
        f"{report.extra_bytes / MIB:.1f} MiB remain beyond one copy of the "
        f"{report.dataset_bytes / MIB:.1f} MiB dataset: the data is held more than once.\n"
        "Fixes: load the data with a shareddata dataset (sd.NumpyDataset, sd.HDF5Dataset, "
        "sd.ParquetDataset, sd.ArrowDataset) or wrap the dataset in sd.SharedDataset(dataset). "
        "Under spawn/forkserver a plain numpy array or Python object is pickled by value into "
        "every worker; under fork Python objects (lists, dicts) are copied as workers read "
        "them (pytorch/pytorch#13246). If the excess is working memory rather than data "
        "(a dataset of a few MiB, large batches), pass dataset_bytes= or a larger "
        "max_duplication.\n" + str(report)
    )
