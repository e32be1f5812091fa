"""From two measurements of a loader's processes to the copies of its dataset, and a verdict.

The copies of the dataset's pages in shareddata's segments are counted exactly, and
so are the copies ``spawn`` workers receive and the pages ``fork`` workers copy of
its arrays; the rest is estimated from the growth of the processes' working memory,
with a stated resolution below which the estimate cannot tell data from working
memory. :func:`judge` says whether the measurement decides at all (Note [How
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
#: The limit :func:`judge` decides against when ``verify`` is given none.
DEFAULT_LIMIT = 1.10


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
        attributed: bytes counted as copies of the dataset: ``copies`` and
            ``counted``, plus the rest of ``excess`` when that exceeds ``resolution``
            (up to one copy per process of the part of the dataset outside
            shareddata's segments).
        counted: copies outside shareddata's segments counted exactly: what
            ``spawn``/``forkserver`` workers received by value, or the pages of the
            dataset's arrays ``fork`` workers copied. They live in working memory,
            so ``excess`` includes them.
    """

    copies: int
    excess: int
    resolution: int
    attributed: int
    counted: int = 0


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
    counted: int = 0,
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
        counted: copies outside the segments counted exactly (:attr:`Account.counted`).

    Example:
        >>> row = ProcessMemory(pid=1, role="main", rss=0, uss=0, pss=10, shared=0)
        >>> grown = ProcessMemory(pid=2, role="worker 0", rss=0, uss=0, pss=100, shared=0)
        >>> account([row], [row, grown], baselines=10, tolerance=50, plain_bytes=1000)
        Account(copies=0, excess=90, resolution=50, attributed=90, counted=0)
        >>> account([row], [row, grown], baselines=10, tolerance=50, plain_bytes=0).attributed
        0
        >>> account([row], [row, grown], baselines=10, tolerance=100, plain_bytes=99,
        ...         counted=80).attributed
        80
        >>> account([row], [row, grown], baselines=10, tolerance=5, plain_bytes=99,
        ...         counted=80).attributed  # 10 more than counted, beyond the resolution
        90
    """
    copies = max(sum(p.data_copied for p in after) - sum(p.data_copied for p in before), 0)
    excess = sum(p.working for p in after) - sum(p.working for p in before) - baselines
    # the counted copies explain part of the growth: only the rest is an estimate
    rest = excess - counted
    estimated = min(rest, plain_bytes * len(after) - counted) if rest > tolerance else 0
    attributed = copies + counted + max(estimated, 0)
    return Account(
        copies=copies, excess=excess, resolution=tolerance, attributed=attributed, counted=counted
    )


@dataclass(frozen=True)
class Judgement:
    """Whether a measurement decides, and if not, what would.

    Attributes:
        conclusive: the duplication is above the limit (counted or estimated), or
            no copy of the dataset could have escaped the count: the part of the
            dataset not counted exactly (``unresolved``) is larger than the
            estimate's resolution, so a copy of it would show, or so small that a
            copy of it in every process would stay within the limit. Never
            conclusive when the loader has workers and none was measured.
        unresolved: bytes of the dataset whose copies are not counted exactly.
        needed: the dataset size from which the estimate would resolve a copy (0
            when conclusive, or when no size would do).
    """

    conclusive: bool
    unresolved: int
    needed: int = 0


def judge(
    *,
    dataset_bytes: int,
    exact_bytes: int,
    resolution: int,
    processes: int,
    duplication: float,
    limit: float | None,
    workers_missing: bool = False,
) -> Judgement:
    """Decide whether ``duplication`` answers the question, or the answer is "cannot tell".

    Args:
        dataset_bytes: the dataset's size.
        exact_bytes: the part of it whose copies are counted exactly (in shareddata's
            segments, received by value by ``spawn`` workers, or in arrays whose
            pages ``fork`` workers were checked for copies).
        resolution: the estimate's resolution (:func:`resolution`).
        processes: how many processes were measured.
        duplication: the duplication measured.
        limit: ``max_duplication``; ``None`` decides against :data:`DEFAULT_LIMIT`.
        workers_missing: the loader has workers but none was measured.

    Example:
        >>> MIB = 1 << 20
        >>> judge(dataset_bytes=4 * MIB, exact_bytes=0, resolution=15 * MIB, processes=3,
        ...       duplication=1.0, limit=1.1)
        Judgement(conclusive=False, unresolved=4194304, needed=15728641)
        >>> judge(dataset_bytes=4 * MIB, exact_bytes=4 * MIB, resolution=15 * MIB,
        ...       processes=3, duplication=1.0, limit=1.1).conclusive
        True
    """
    bound = DEFAULT_LIMIT if limit is None else limit
    unresolved = max(dataset_bytes - exact_bytes, 0)
    if limit is not None and duplication > limit:
        return Judgement(True, unresolved)
    if workers_missing:
        return Judgement(False, unresolved)
    within = unresolved * processes <= max(bound - 1.0, 0.0) * dataset_bytes
    if unresolved > resolution or within:
        return Judgement(True, unresolved)
    # The unresolved part grows with the dataset; the resolution does not.
    needed = dataset_bytes * resolution // unresolved + 1 if unresolved else 0
    return Judgement(False, unresolved, needed)


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
