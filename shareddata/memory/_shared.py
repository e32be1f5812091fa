"""Which of a dataset's bytes live in shareddata's segments, and which segments those are.

``verify`` counts the copies of those pages exactly, mapping by mapping
(Note [How duplication is measured] in ``_verify.py``); only the rest of the
dataset is estimated from the processes' memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any

from ._size import children_of, shared_nbytes

_MAX_DEPTH = 6
_MAX_OBJECTS = 10_000
_PER_OBJECT = 64  # children looked at per object (a list dataset's first items)


@dataclass(frozen=True)
class SharedParts:
    """The shareddata datasets found in a dataset.

    Attributes:
        segments: ``(st_dev, st_ino)`` of every segment they map.
        nbytes: their bytes (each dataset counted once).
        count: how many distinct shareddata datasets were found.
    """

    segments: frozenset[tuple[int, int]] = frozenset()
    nbytes: int = 0
    count: int = 0


def shared_parts(dataset: Any) -> SharedParts:
    """Find the shareddata datasets in ``dataset``, to a bounded depth.

    ``dataset`` itself, a ``Subset``, a ``ConcatDataset``, a wrapper holding one as
    an attribute, ... are looked into.

    A shareddata dataset is recognised by its ``segment_identity()`` method and its
    integer ``nbytes``.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> from torch.utils.data import ConcatDataset
        >>> a = sd.NumpyDataset(np.zeros((4, 2), np.float32))
        >>> parts = shared_parts(ConcatDataset([a, a]))
        >>> parts.nbytes, parts.count, len(parts.segments) >= 1
        (32, 1, True)
    """
    segments: set[tuple[int, int]] = set()
    nbytes = count = 0
    seen: set[int] = set()
    level = [dataset]
    budget = _MAX_OBJECTS
    for _ in range(_MAX_DEPTH):
        nxt: list[Any] = []
        for obj in level:
            if id(obj) in seen or budget <= 0:
                continue
            seen.add(id(obj))
            budget -= 1
            shared = shared_nbytes(obj)
            if shared is not None:
                segments |= frozenset(obj.segment_identity())
                nbytes += shared
                count += 1
                continue
            if _is_leaf(obj):
                continue
            nxt.extend(islice(children_of(obj), _PER_OBJECT))
        level = nxt
        if not level:
            break
    return SharedParts(frozenset(segments), nbytes, count)


def dataset_identity(dataset: Any) -> frozenset[tuple[int, int]] | None:
    """The (device, inode) of every segment the dataset's shareddata parts map; None if none.

    Two datasets with equal identities hold one copy of the data (e.g. two local
    ranks of a node, one attached to the other's columns).
    """
    parts = shared_parts(dataset)
    return parts.segments if parts.count else None


def _is_leaf(obj: Any) -> bool:
    import numpy as np
    import torch

    return isinstance(obj, (str, bytes, bytearray, int, float, np.ndarray, torch.Tensor))
