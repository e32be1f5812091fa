"""shareddata: load a dataset once into shared memory for every DataLoader worker and rank.

Example:
    >>> import numpy as np, shareddata as sd
    >>> ds = sd.NumpyDataset(np.arange(12, dtype=np.float32).reshape(6, 2))
    >>> ds[0]
    {'data': tensor([0., 1.])}
"""

from ._sampler import IndexBatchSampler
from ._storage import SharedArray
from ._wrap import SharedDataset, SharedList
from .distributed import NodeShardSampler
from .errors import (
    ArgumentTypeError,
    AttachError,
    BatchSendError,
    ColumnLengthError,
    DuplicationError,
    EmptySelectionError,
    InconclusiveError,
    IndexOutOfRangeError,
    IndexTypeError,
    InvalidArgumentError,
    ItemMismatchError,
    ItemValueError,
    LocalRankError,
    LocalRankTimeoutError,
    MissingColumnError,
    MissingDependencyError,
    MissingFileError,
    NullValuesError,
    ShardingNotSupportedError,
    SharedDataError,
    SharedMemoryFullError,
    SourceReadError,
    UnpicklableItemError,
    UnsupportedDtypeError,
)
from .memory import MemoryReport, ProcessMemory, verify
from .sources.arrow import ArrowDataset
from .sources.hdf5 import HDF5Dataset
from .sources.npy import NumpyDataset
from .sources.parquet import ParquetDataset

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "ArrowDataset",
    "AttachError",
    "BatchSendError",
    "ColumnLengthError",
    "DuplicationError",
    "EmptySelectionError",
    "HDF5Dataset",
    "InconclusiveError",
    "IndexBatchSampler",
    "IndexOutOfRangeError",
    "IndexTypeError",
    "InvalidArgumentError",
    "ItemMismatchError",
    "ItemValueError",
    "LocalRankError",
    "LocalRankTimeoutError",
    "MemoryReport",
    "MissingColumnError",
    "MissingDependencyError",
    "MissingFileError",
    "NodeShardSampler",
    "NullValuesError",
    "NumpyDataset",
    "ParquetDataset",
    "ProcessMemory",
    "ShardingNotSupportedError",
    "SharedArray",
    "SharedDataError",
    "SharedDataset",
    "SharedList",
    "SharedMemoryFullError",
    "SourceReadError",
    "UnpicklableItemError",
    "UnsupportedDtypeError",
    "__version__",
    "verify",
]
