"""From two measurements to the copies of the dataset, and whether they decide.

See Note [How duplication is measured] in ``_verify.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._process import KIB, MIB, ProcessMemory

WORKING_FLOOR = 4 * MIB  # what a process's working memory may gain: arenas, caches, queues
BATCHES_PER_WORKER = 3  # its items, the collated batch, the previous one
EXACT_FLOOR = 64 * KIB  # exact counts decide above this a process: less is a few attributes
DEFAULT_LIMIT = 1.10  # what judge() decides against when verify() is given no limit


@dataclass(frozen=True)
class Account:
    """Where the memory beyond one copy of the dataset went, in bytes.

    ``copies`` of the segments' pages (exact); ``excess``, the growth of working
    memory beyond the baselines, which holds ``counted`` (copies outside the segments
    counted exactly) and ``estimated`` (the rest, above ``resolution``, at most one
    copy a process of what is not counted exactly); ``attributed``, their sum.
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
    """The copies of the dataset between ``before`` (main process) and ``after`` (all).

    ``baselines``: the workers' summed baselines; ``tolerance``: the estimate's
    resolution; ``plain_bytes``: the part of the dataset not counted exactly.

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
    """Whether a measurement decides, the bytes not counted exactly, the size that would."""

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
    """Whether ``duplication`` answers the question against ``limit``, or "cannot tell".

    Over the limit, it decides when the copies ``found`` are above their resolution
    (:data:`EXACT_FLOOR` a process for exact counts, ``resolution`` for the estimate).
    Within it, when no copy could have escaped: the part not counted exactly is above
    the resolution (a copy would show) or so small that a copy in every process stays
    within the limit; never when ``workers_missing``.

    Example:
        >>> MIB = 1 << 20
        >>> judge(dataset_bytes=4 * MIB, exact_bytes=0, resolution=15 * MIB, processes=3,
        ...       duplication=1.0, limit=1.1)
        Judgement(conclusive=False, unresolved=4194304, needed=15728641)
        >>> judge(dataset_bytes=4 * MIB, exact_bytes=4 * MIB, resolution=15 * MIB,
        ...       processes=3, duplication=1.0, limit=1.1).conclusive
        True
        >>> pickles = Account(copies=0, excess=0, resolution=MIB, attributed=2048, counted=2048)
        >>> judge(dataset_bytes=4096, exact_bytes=4096, resolution=MIB, processes=3,
        ...       duplication=1.5, limit=1.1, found=pickles).conclusive  # 2 KiB: cannot tell
        False
        >>> none = Account(copies=0, excess=0, resolution=MIB, attributed=0)
        >>> judge(dataset_bytes=MIB, exact_bytes=MIB, resolution=MIB, processes=6,
        ...       duplication=2.0, limit=1.1, found=none).conclusive  # two ranks' copies
        True
    """
    bound = DEFAULT_LIMIT if limit is None else limit
    unresolved = max(dataset_bytes - exact_bytes, 0)
    if duplication > bound:
        within = 0  # copies within their resolution do not decide (copies of ranks do)
        if found is not None:
            exact = found.copies + found.counted
            within = exact if exact <= EXACT_FLOOR * processes else 0
            within += found.estimated if found.estimated <= found.resolution else 0
        decided = duplication - within / dataset_bytes > bound
        return Judgement(bound < 1.0 or decided, unresolved)
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
