"""What a ``spawn`` or ``forkserver`` worker receives of the dataset by value.

Under ``spawn`` and ``forkserver`` the ``DataLoader`` pickles the dataset into every
worker when it starts; the worker unpickles it and holds what the pickle carried by
value for as long as it lives. Counting those bytes is counting, exactly, the copy
each worker starts with. The count pickles the dataset the way the workers receive
it, without keeping the bytes (protocol 5 into a counter; numpy arrays counted by
their ``nbytes`` and not serialised):

- numpy arrays (``np.memmap`` too) travel by value: their bytes count;
- torch tensors and storages travel by handle (the ``DataLoader``'s pickler moves
  them into shared memory): nothing counts;
- shareddata datasets travel by handle: nothing counts;
- anything else (lists, dicts, strings, objects) counts as pickled. The objects a
  worker rebuilds take at least that much memory (a float is 9 bytes of pickle and
  24 of memory), apart from non-ASCII text (up to 2 bytes of UTF-8 per 1-byte
  character); ``verify`` caps the count at the dataset's size per worker.

See Note [How duplication is measured] in ``_verify.py``.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from ._size import shared_nbytes

_STORAGES = (torch.UntypedStorage, torch.storage.TypedStorage)


def pickled_nbytes(dataset: Any) -> int | None:
    """Bytes of ``dataset`` that a ``spawn``/``forkserver`` worker receives by value.

    ``None`` when the dataset does not pickle with the standard pickler (a lock or a
    queue that only ``multiprocessing`` can send): then nothing is counted.

    Example:
        >>> import numpy as np, torch
        >>> pickled_nbytes({"x": np.zeros(1 << 20, np.uint8)}) >= 1 << 20
        True
        >>> pickled_nbytes({"x": torch.zeros(1 << 20, dtype=torch.uint8)}) < 1024
        True
    """
    counter = _Counter()
    pickler = _CountingPickler(counter)
    try:
        pickler.dump(dataset)
    except Exception:  # what the standard pickler cannot send: not counted
        return None
    return counter.nbytes + pickler.by_value


class _Counter:
    """A file that only counts what is written to it."""

    def __init__(self) -> None:
        self.nbytes = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.nbytes += n
        return n


def _elsewhere() -> None:
    """What the count puts in place of data it counted (or that travels by handle)."""
    return None


class _CountingPickler(pickle.Pickler):
    def __init__(self, file: _Counter) -> None:
        super().__init__(file, protocol=5)
        self.by_value = 0

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            self.by_value += int(obj.nbytes)
            return (_elsewhere, ())
        if isinstance(obj, (torch.Tensor, *_STORAGES)) or shared_nbytes(obj) is not None:
            return (_elsewhere, ())
        return NotImplemented
