"""The Dataset classes, and the one loading path they all take.

- ``_load``: size, check room, allocate, fill, seal, share on the node;
- ``_dataset``: ``ColumnDataset``, what every dataset kind is: len, items, batches, pickling;
- ``_wrap`` and ``_materialise/``: ``SharedDataset`` and ``SharedList``;
- ``_numpy``, ``_hdf5``, ``_parquet``, ``_arrow``: one Dataset class per source format.
"""

from ._arrow import ArrowDataset
from ._hdf5 import HDF5Dataset
from ._numpy import NumpyDataset
from ._parquet import ParquetDataset
from ._wrap import SharedDataset, SharedList

__all__ = [
    "ArrowDataset",
    "HDF5Dataset",
    "NumpyDataset",
    "ParquetDataset",
    "SharedDataset",
    "SharedList",
]
