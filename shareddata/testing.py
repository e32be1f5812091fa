"""Keep "no duplication" as a test in your own project.

Example:
    >>> import numpy as np, shareddata as sd
    >>> from shareddata.testing import assert_shared
    >>> from torch.utils.data import DataLoader
    >>> ds = sd.NumpyDataset(np.zeros((65536, 256), np.float32))  # 64 MiB
    >>> assert_shared(DataLoader(ds, batch_size=256), batches=8).duplication < 1.10
    True

In a pytest suite::

    def test_my_loader_shares_its_data():
        assert_shared(make_loader(num_workers=4), max_duplication=1.10)
"""

from __future__ import annotations

from torch.utils.data import DataLoader

from .memory import MemoryReport, verify

__all__ = ["assert_shared"]


def assert_shared(
    loader: DataLoader,
    *,
    max_duplication: float = 1.10,
    batches: int | None = None,
    dataset_bytes: int | None = None,
) -> MemoryReport:
    """Fail (``AssertionError``) when ``loader``'s processes hold the dataset more than once.

    A thin wrapper of :func:`shareddata.verify` for tests: the error raised,
    :class:`shareddata.DuplicationError`, is an ``AssertionError`` whose message
    carries the whole per-process table, so pytest shows what was measured.

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
