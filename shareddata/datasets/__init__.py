"""The Dataset classes, and the one loading path they all take (``_load``)."""

from ._formats import ArrowDataset, HDF5Dataset, NumpyDataset, ParquetDataset
from ._list import SharedList
from ._wrap import SharedDataset

__all__ = [
    "ArrowDataset",
    "HDF5Dataset",
    "NumpyDataset",
    "ParquetDataset",
    "SharedDataset",
    "SharedList",
]
