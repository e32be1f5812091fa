"""shareddata: load a dataset once into shared memory for every DataLoader worker and rank.

Example:
    >>> import numpy as np, shareddata as sd
    >>> ds = sd.NumpyDataset(np.arange(12, dtype=np.float32).reshape(6, 2))
    >>> ds[0]
    {'data': tensor([0., 1.])}
"""

from . import errors
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
from .errors import *  # noqa: F403  (every exception class: the tree in errors.py)
from .memory import MemoryReport, ProcessMemory, verify
from .storage import SharedArray, SharedTensor

__version__ = "0.1.0"

__all__ = [
    "ArrowDataset",
    "HDF5Dataset",
    "IndexBatchSampler",
    "MemoryReport",
    "NodeShardSampler",
    "NumpyDataset",
    "ParquetDataset",
    "ProcessMemory",
    "SharedArray",
    "SharedDataset",
    "SharedList",
    "SharedTensor",
    "__version__",
    "verify",
]
__all__ += errors.__all__
