"""``NumpyDataset``: arrays, ``.npy``/``.npz`` files or a folder of them, as columns."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..sources.npy import NumpySource
from ._dataset import ColumnDataset, Output
from ._load import LoadOptions

__all__ = ["NumpyDataset"]


class NumpyDataset(ColumnDataset):
    """A dataset of NumPy arrays, loaded once into shared memory.

    Args:
        source: a ``.npy`` or ``.npz`` path, a folder of ``.npy`` files (one column
            per file, named by its stem, in sorted order), a numpy array or tensor
            (column ``"data"``), or a mapping ``{column: array | tensor | path}``.
        columns: names of the columns to load, in sample order (default: all).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: tensor}``) or ``"tuple"`` (column order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared (for a small RAM or memory limit).
        progress: show a progress bar for loads longer than ~2 s.
        share: under torchrun, ``"node"`` (the default there) loads once per node
            and the other local ranks attach; ``"process"`` loads in every process.
        shard: ``"node"`` loads only this node's contiguous share of the rows
            (``ds.node_shard`` says which; sample with ``sd.NodeShardSampler``).
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).

    Raises:
        FileNotFoundError: a path does not exist.
        KeyError: a requested column does not exist (the message lists those that do).
        ValueError: columns have different lengths.
        TypeError: a column's dtype cannot be stored (object, structured, strings).
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> ds = sd.NumpyDataset({"x": np.ones((4, 3), np.float32), "y": np.arange(4)},
        ...                      output="tuple")
        >>> len(ds), ds.columns
        (4, ['x', 'y'])
        >>> x, y = ds[-1]
        >>> x.shape, int(y)
        (torch.Size([3]), 3)
    """

    def __init__(
        self,
        source: Any,
        *,
        columns: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        output: Output = "dict",
        storage_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
        share: Literal["node", "process"] | None = None,
        shard: Literal["node"] | None = None,
        timeout: float | None = None,
    ) -> None:
        options = LoadOptions(storage_dir, progress, share, shard, timeout)
        super().__init__(
            # the source is made only where the data is loaded (local rank 0)
            options.loader(lambda: NumpySource(source, columns), ("NumpyDataset", source, columns)),
            transform=transform,
            output=output,
        )
