"""Keep "no duplication" as a test in your own project, with :func:`shareddata.verify`.

:func:`assert_shared` works in any test runner; the pytest fixture
``shared_memory_check`` does the same and also puts every measured table in pytest's
report (shown for a failing test, and for passing ones with ``pytest -rP``). Enable it
in your ``conftest.py``::

    pytest_plugins = ["shareddata.testing"]

(or ``from shareddata.testing import shared_memory_check`` in a test module), then::

    def test_my_loader_shares_its_data(shared_memory_check):
        report = shared_memory_check(make_loader(num_workers=4), batches=20)
        assert report.num_workers == 4

Example:
    >>> import numpy as np, shareddata as sd
    >>> from shareddata.testing import assert_shared
    >>> from torch.utils.data import DataLoader
    >>> ds = sd.NumpyDataset(np.zeros((65536, 256), np.float32))  # 64 MiB
    >>> assert_shared(DataLoader(ds, batch_size=256), batches=8).duplication < 1.10
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from .errors import DuplicationError, InconclusiveError
from .memory import MemoryReport, verify

__all__ = ["SharedMemoryCheck", "assert_shared"]


def assert_shared(
    loader: DataLoader,
    *,
    max_duplication: float = 1.10,
    batches: int | None = None,
    dataset_bytes: int | None = None,
) -> MemoryReport:
    """Fail when ``loader``'s processes hold the dataset more than ``max_duplication`` times.

    :func:`shareddata.verify` for tests: it raises :class:`shareddata.DuplicationError`,
    or :class:`shareddata.InconclusiveError` when the measurement cannot tell (never a
    pass), both ``AssertionError``: the message, the verdict in words then the whole
    per-process table, is what pytest shows.

    Args:
        loader: the DataLoader your training code builds (with its workers).
        max_duplication: the largest acceptable number of copies.
        batches: batches to iterate before measuring (default: one epoch).
        dataset_bytes: the dataset's size, if it cannot be worked out.

    Returns:
        The report, for further assertions.
    """
    return verify(
        loader, batches=batches, max_duplication=max_duplication, dataset_bytes=dataset_bytes
    )


class SharedMemoryCheck:
    """:func:`assert_shared` that records each report: what ``shared_memory_check`` gives.

    Args:
        add_section: called as ``add_section(title, text)`` with each measured table
            (the fixture passes pytest's ``item.add_report_section``).
        max_duplication: the default limit of every call.

    Attributes:
        reports: every report measured so far, failed ones included.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> check = SharedMemoryCheck(add_section=lambda title, text: print(title))
        >>> report = check(DataLoader(TensorDataset(torch.zeros(64, 4)), batch_size=16),
        ...                dataset_bytes=64 << 20)
        shareddata: memory of DataLoader 1
        >>> len(check.reports), report.passed
        (1, True)
    """

    def __init__(
        self,
        add_section: Callable[[str, str], None] | None = None,
        max_duplication: float = 1.10,
    ) -> None:
        self.add_section = add_section
        self.max_duplication = max_duplication
        self.reports: list[MemoryReport] = []

    def __call__(
        self,
        loader: DataLoader,
        *,
        max_duplication: float | None = None,
        batches: int | None = None,
        dataset_bytes: int | None = None,
    ) -> MemoryReport:
        """Measure ``loader`` like :func:`assert_shared` (limit: this check's by default).

        Raises:
            DuplicationError: the dataset is held more often than the limit.
            InconclusiveError: the measurement cannot tell.
        """
        limit = self.max_duplication if max_duplication is None else max_duplication
        try:
            report = assert_shared(
                loader, max_duplication=limit, batches=batches, dataset_bytes=dataset_bytes
            )
        except (DuplicationError, InconclusiveError) as e:
            if isinstance(e.report, MemoryReport):
                self._record(e.report)
            raise
        self._record(report)
        return report

    def _record(self, report: MemoryReport) -> None:
        self.reports.append(report)
        if self.add_section is not None:
            self.add_section(f"shareddata: memory of DataLoader {len(self.reports)}", str(report))


def _fixture(request: Any) -> SharedMemoryCheck:
    return SharedMemoryCheck(
        lambda title, text: request.node.add_report_section("call", title, text)
    )


try:
    import pytest
except ImportError:  # assert_shared works without pytest; only the fixture needs it
    pass
else:
    #: The pytest fixture: a :class:`SharedMemoryCheck` that puts each table in the report.
    shared_memory_check = pytest.fixture(_fixture, name="shared_memory_check")
    __all__ += ["shared_memory_check"]
