"""What a dataset holds, found by walking its objects: its size, arrays, segments and pickle.

One bounded walk counts each object once: numpy arrays by their owner's ``nbytes``,
tensors by their storage, shareddata datasets by ``nbytes`` (and their segments), the
rest by ``sys.getsizeof``; classes, modules and functions are code, not data; a large
container's sampled elements are extrapolated to its length.
"""

from __future__ import annotations

import functools
import mmap
import pickle
import sys
import types
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

_MAX_DEPTH = 8
_MAX_OBJECTS = 100_000
_SAMPLE = 256  # elements looked at per container; the rest is extrapolated
_CODE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None))
_STORAGES = (torch.UntypedStorage, torch.storage.TypedStorage)


def _integer(value: Any) -> int | None:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    return int(value) if ok else None


def shared_nbytes(obj: Any) -> int | None:
    """``obj.nbytes`` when ``obj`` is a shareddata dataset (it has ``segment_identity()``)."""
    if isinstance(obj, type):
        return None
    try:
        identity, nbytes = getattr(obj, "segment_identity", None), getattr(obj, "nbytes", None)
    except Exception:
        return None
    return _integer(nbytes) if callable(identity) else None


class Holdings:
    """What a walk found (:func:`holdings`).

    ``nbytes`` (the estimate); the shareddata datasets' ``shared_bytes``, ``segments``
    and ``count``; the ``(address, nbytes)`` of other numpy and CPU torch ``buffers``;
    the classes and functions met (``code``); the torch ``datasets``, outermost first.
    """

    def __init__(self) -> None:
        self.nbytes = self.shared_bytes = self.count = 0
        self.segments: set[tuple[int, int]] = set()
        self.buffers: list[tuple[int, int]] = []
        self.code: dict[int, Any] = {}
        self.datasets: list[Any] = []
        self._seen: set[int] = set()
        self._storages: set[tuple[str, int]] = set()
        self._budget = _MAX_OBJECTS

    def _size(self, obj: Any, depth: int) -> float:
        if id(obj) in self._seen:
            return 0.0
        self._seen.add(id(obj))
        self._budget -= 1
        if isinstance(obj, _CODE):
            self.code.setdefault(id(obj), obj)
            return 0.0
        self.code.setdefault(id(type(obj)), type(obj))
        if isinstance(obj, Dataset):
            self.datasets.append(obj)
        shared = shared_nbytes(obj)
        if shared is not None:  # its segments, not the mmap objects over them
            self.segments |= set(obj.segment_identity())
            self.shared_bytes += shared
            self.count += 1
            return float(shared)
        if isinstance(obj, np.ndarray):
            return self._array(obj, depth)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, mmap.mmap):
            return 0.0 if obj.closed else float(len(obj))
        try:
            own = float(sys.getsizeof(obj))
        except TypeError:
            own = 0.0
        if depth >= _MAX_DEPTH or self._budget <= 0 or isinstance(obj, _LEAVES):
            return own
        if isinstance(obj, dict):
            return own + self._sample(obj.keys(), depth) + self._sample(obj.values(), depth)
        if isinstance(obj, (list, tuple, set, frozenset)):
            return own + self._sample(obj, depth)
        d = getattr(obj, "__dict__", None)  # not a level of its own
        return own + sum(self._size(c, depth + (c is not d)) for c in _attributes(obj))

    def _sample(self, items: Any, depth: int) -> float:
        n = len(items)
        if n <= _SAMPLE:
            picked: Sequence[Any] | Iterator[Any] = iter(items)
        elif isinstance(items, (Sequence, np.ndarray)):  # spread over it
            picked = [items[int(i * n / _SAMPLE)] for i in range(_SAMPLE)]
        else:
            picked = islice(items, _SAMPLE)
        sizes = [self._size(item, depth + 1) for item in picked]
        return sum(sizes) * n / len(sizes) if sizes else 0.0

    def _array(self, arr: np.ndarray, depth: int) -> float:
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root is not arr:
            if id(root) in self._seen:
                return 0.0
            self._seen.add(id(root))
        if root.dtype != object:
            if root.nbytes:
                self.buffers.append((int(root.__array_interface__["data"][0]), int(root.nbytes)))
            return float(root.nbytes)
        return root.nbytes + (self._sample(root.reshape(-1), depth) if depth < _MAX_DEPTH else 0.0)

    def _tensor(self, tensor: torch.Tensor) -> float:
        try:
            storage = tensor.untyped_storage()
            key, nbytes = (str(storage.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            key, nbytes = ("tensor", id(tensor)), tensor.element_size() * tensor.nelement()
        if key in self._storages:
            return 0.0
        self._storages.add(key)
        if key[0] == "cpu" and nbytes and key[1]:
            self.buffers.append((key[1], int(nbytes)))
        return float(nbytes)


def _attributes(obj: Any) -> list[Any]:
    """What an object holds: its ``__dict__``, ``__slots__``, a bound method's ``__self__``."""
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, functools.partial):
        return [obj.func, obj.args, obj.keywords]
    d = getattr(obj, "__dict__", None)
    values: list[Any] = [d] if isinstance(d, dict) else []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                values.append(getattr(obj, name))
    return values


def holdings(obj: Any) -> Holdings:
    """Walk ``obj`` (a dataset, or a loader to find its dataset in) and say what it holds.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> from torch.utils.data import ConcatDataset
        >>> a = sd.NumpyDataset(np.zeros((4, 2), np.float32))
        >>> found = holdings(ConcatDataset([a, a]))
        >>> found.shared_bytes, found.count, len(found.segments) >= 1
        (32, 1, True)
    """
    found = Holdings()
    found.nbytes = int(found._size(obj, 0))
    return found


def dataset_nbytes(dataset: Any, found: Holdings | None = None) -> int:
    """The dataset's ``nbytes`` when it is an integer, else the estimate of its walk.

    ``found``: its :func:`holdings`, if walked already.

    Example:
        >>> dataset_nbytes({"x": np.zeros(1000, np.float64)}) >= 8000
        True
    """
    nbytes = _integer(getattr(dataset, "nbytes", None))
    return (found or holdings(dataset)).nbytes if nbytes is None else nbytes


def pickled_nbytes(dataset: Any) -> int | None:
    """Bytes of ``dataset`` a ``spawn``/``forkserver`` worker receives by value.

    Pickled into a counter: numpy arrays by ``nbytes``; tensors, storages and
    shareddata datasets go by handle (not counted). ``None`` if it does not pickle.

    Example:
        >>> pickled_nbytes({"x": np.zeros(1 << 20, np.uint8)}) >= 1 << 20
        True
        >>> pickled_nbytes({"x": torch.zeros(1 << 20, dtype=torch.uint8)}) < 1024
        True
    """
    counter = _Counter()
    pickler = _CountingPickler(counter)
    try:
        pickler.dump(dataset)
    except Exception:
        return None
    return counter.nbytes + pickler.by_value


class _Counter:
    """A file that only counts what is written to it."""

    nbytes = 0

    def write(self, data: Any) -> None:
        self.nbytes += memoryview(data).nbytes


def _elsewhere() -> None:
    """What the count puts in place of data counted apart (or sent by handle)."""


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
