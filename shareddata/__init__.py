"""shareddata: load a dataset once into shared memory for every DataLoader worker and rank.

Example:
    >>> import numpy as np, shareddata as sd
    >>> ds = sd.NumpyDataset(np.arange(12, dtype=np.float32).reshape(6, 2))
    >>> ds[0]
    {'data': tensor([0., 1.])}
"""

from .crossing import IndexBatchSampler
from .datasets import (
    ArrowDataset,
    HDF5Dataset,
    NumpyDataset,
    ParquetDataset,
    SharedDataset,
    SharedList,
)
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
    TooManyOpenFilesError,
    UnpicklableItemError,
    UnsupportedDtypeError,
)
from .memory import MemoryReport, ProcessMemory, verify
from .storage import SharedArray, SharedTensor

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
    "SharedTensor",
    "SourceReadError",
    "TooManyOpenFilesError",
    "UnpicklableItemError",
    "UnsupportedDtypeError",
    "__version__",
    "verify",
]
