"""From two measurements of a loader's processes to the copies of its dataset, and a verdict.

See Note [How duplication is measured] in ``_verify.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._process import KIB, MIB, ProcessMemory

#: Working memory a process may gain while iterating that is not data (allocator
#: arenas, interpreter caches, the loader's queues and threads).
WORKING_FLOOR = 4 * MIB
#: Batches a worker may hold at once (its items, the collated batch, the previous one).
BATCHES_PER_WORKER = 3
#: Copies counted exactly decide only above this many bytes per process measured:
#: below it a "copy" is a dataset object's few attributes, not data.
EXACT_FLOOR = 64 * KIB
#: The limit :func:`judge` decides against when ``verify`` is given none.
DEFAULT_LIMIT = 1.10


@dataclass(frozen=True)
class Account:
    """Where the memory beyond one copy of the dataset went, in bytes.

    Attributes:
        copies: private copies of the pages of shareddata's segments (exact).
        excess: growth of working memory beyond the workers' baselines.
        resolution: the growth the estimate cannot tell from working memory.
        attributed: ``copies + counted + estimated``: bytes counted as copies.
        counted: copies outside the segments counted exactly (what ``spawn``
            workers received by value, pages ``fork`` workers copied of arrays);
            part of ``excess``.
        estimated: the rest of ``excess``, when it exceeds ``resolution``, up to
            one copy per process of the part of the dataset not counted exactly.
    """

    copies: int
    excess: int
    resolution: int
    attributed: int
    counted: int = 0
    estimated: int = 0


def resolution(n_workers: int, batch_bytes: int, prefetch_factor: int | None) -> int:
    """Working memory that iterating may add without any copy of the data.

    Example:
        >>> resolution(2, 1 << 20, 2) // (1 << 20)
        23
    """
    waiting = (prefetch_factor or 0) * n_workers + 1  # batches waiting for the main process
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
        tolerance: the estimate's :func:`resolution`.
        plain_bytes: the part of the dataset whose copies are not counted exactly:
            working memory holds at most one copy of it per process.
        counted: copies outside the segments counted exactly.

    Example:
        >>> row = ProcessMemory(pid=1, role="main", rss=0, uss=0, pss=10, shared=0)
        >>> grown = ProcessMemory(pid=2, role="worker 0", rss=0, uss=0, pss=100, shared=0)
        >>> account([row], [row, grown], 10, 50, plain_bytes=1000).attributed
        90
        >>> account([row], [row, grown], 10, 50, plain_bytes=20).attributed  # 1 copy/process
        40
        >>> account([row], [row, grown], 10, 100, plain_bytes=99, counted=80).attributed
        80
    """
    copies = max(sum(p.data_copied for p in after) - sum(p.data_copied for p in before), 0)
    excess = sum(p.working for p in after) - sum(p.working for p in before) - baselines
    rest = excess - counted  # the counted copies are part of the growth
    estimated = max(min(rest, plain_bytes * len(after)), 0) if rest > tolerance else 0
    return Account(copies, excess, tolerance, copies + counted + estimated, counted, estimated)


@dataclass(frozen=True)
class Judgement:
    """Whether a measurement decides, and if not, what would.

    Attributes:
        conclusive: the copies measured exceed the limit, each above its
            resolution; or none could have escaped (the part not counted exactly
            is larger than the resolution, so a copy of it would show, or so small
            that a copy in every process stays within the limit). Never when the
            loader has workers and none was measured, or when the duplication
            exceeds the limit only by copies within their resolution.
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
    found: Account | None = None,
) -> Judgement:
    """Decide whether ``duplication`` answers the question, or the answer is "cannot tell".

    Args:
        dataset_bytes: the dataset's size.
        exact_bytes: the part of it whose copies are counted exactly.
        resolution: the estimate's resolution.
        processes: how many processes were measured.
        duplication: the duplication measured.
        limit: ``max_duplication``; ``None`` decides against :data:`DEFAULT_LIMIT`.
        workers_missing: the loader has workers but none was measured.
        found: the account; a copy decides only above its resolution (the
            estimate's, or :data:`EXACT_FLOOR` per process for exact counts).

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
    if duplication > bound:
        decided = (duplication - 1.0) * dataset_bytes
        if found is not None:
            exact = found.copies + found.counted
            decided = exact if exact > EXACT_FLOOR * processes else 0
            decided += found.estimated if found.estimated > found.resolution else 0
        return Judgement(bound < 1.0 or 1.0 + decided / dataset_bytes > bound, unresolved)
    if workers_missing:
        return Judgement(False, unresolved)
    if unresolved > resolution or unresolved * processes <= (bound - 1.0) * dataset_bytes:
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
    if isinstance(batch, dict) and depth > 0:
        return sum(batch_nbytes(v, depth - 1) for v in batch.values())
    if isinstance(batch, (list, tuple)) and depth > 0:
        return sum(batch_nbytes(v, depth - 1) for v in batch[:4096])
    return 0
