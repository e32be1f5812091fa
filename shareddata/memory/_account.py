"""From two measurements of a loader's processes to the copies of its dataset.

The copies of the dataset's pages in shareddata's segments are counted exactly; the
rest is estimated from the growth of the processes' working memory, with a stated
resolution below which the estimate cannot tell data from working memory (Note [How
duplication is measured] in ``_verify.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._process import MIB, ProcessMemory

#: Working memory a process may gain while iterating that is not data: allocator
#: arenas, interpreter caches, the DataLoader's own queues and threads.
WORKING_FLOOR = 4 * MIB
#: Batches a worker may hold resident at once (the items, the collated batch, the
#: freed memory of the previous batch kept by the allocator).
BATCHES_PER_WORKER = 3


@dataclass(frozen=True)
class Account:
    """Where the memory beyond one copy of the dataset went.

    Attributes:
        copies: private copies of the dataset's pages in shareddata's segments
            (copy-on-write), counted exactly from ``/proc/<pid>/smaps``.
        excess: growth of the processes' working memory (outside the dataset's
            segments, file pages and batches in flight) beyond each worker's
            baseline: an estimate.
        resolution: the working memory the estimate cannot tell from a copy of the
            data; an ``excess`` within it is not counted as duplication.
        attributed: bytes counted as copies of the dataset: ``copies``, plus
            ``excess`` when it exceeds ``resolution``, up to one copy per process of
            the part of the dataset outside shareddata's segments.
    """

    copies: int
    excess: int
    resolution: int
    attributed: int


def resolution(n_workers: int, batch_bytes: int, prefetch_factor: int | None) -> int:
    """Working memory that iterating may add without any copy of the data.

    Each worker: :data:`WORKING_FLOOR` plus :data:`BATCHES_PER_WORKER` batches; the
    main process: :data:`WORKING_FLOOR` plus the batches that may wait for it
    (``prefetch_factor`` per worker) and the one it holds.

    Example:
        >>> resolution(2, 1 << 20, 2) // (1 << 20)
        23
    """
    waiting = (prefetch_factor or 0) * n_workers + 1
    workers = n_workers * (WORKING_FLOOR + BATCHES_PER_WORKER * batch_bytes)
    return WORKING_FLOOR + waiting * batch_bytes + workers


def account(
    before: Sequence[ProcessMemory],
    after: Sequence[ProcessMemory],
    baselines: int,
    tolerance: int,
    plain_bytes: int,
) -> Account:
    """The copies of the dataset between two measurements of the same processes.

    Args:
        before: the main process (and forkserver) before the workers started.
        after: every process of the loader after its last batch.
        baselines: the summed baselines of the workers in ``after``.
        tolerance: the :func:`resolution` of the estimate, in bytes.
        plain_bytes: the part of the dataset outside shareddata's segments: working
            memory can hold at most one copy of it per process (0 for a dataset that
            is all in segments, whose copies are all counted exactly).

    Example:
        >>> row = ProcessMemory(pid=1, role="main", rss=0, uss=0, pss=10, shared=0)
        >>> grown = ProcessMemory(pid=2, role="worker 0", rss=0, uss=0, pss=100, shared=0)
        >>> account([row], [row, grown], baselines=10, tolerance=50, plain_bytes=1000)
        Account(copies=0, excess=90, resolution=50, attributed=90)
        >>> account([row], [row, grown], baselines=10, tolerance=50, plain_bytes=0).attributed
        0
    """
    copies = max(sum(p.data_copied for p in after) - sum(p.data_copied for p in before), 0)
    excess = sum(p.working for p in after) - sum(p.working for p in before) - baselines
    estimated = min(excess, plain_bytes * len(after)) if excess > tolerance else 0
    attributed = copies + max(estimated, 0)
    return Account(copies=copies, excess=excess, resolution=tolerance, attributed=attributed)


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
    if depth <= 0:
        return 0
    if isinstance(batch, dict):
        return sum(batch_nbytes(v, depth - 1) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(v, depth - 1) for v in batch[:4096])
    return 0
