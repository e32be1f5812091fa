"""How many bytes a dataset holds: ``nbytes``, or an estimate from its object graph."""

from __future__ import annotations

import mmap
import sys
import types
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

import numpy as np
import torch

_MAX_DEPTH = 8
_MAX_OBJECTS = 100_000
_SAMPLE = 256  # elements looked at per container; the rest is extrapolated
_CODE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def shared_nbytes(obj: Any) -> int | None:
    """``obj.nbytes`` when ``obj`` is a shareddata dataset; ``None`` for anything else.

    A shareddata dataset has a ``segment_identity()`` method and an integer ``nbytes``.
    """
    if isinstance(obj, type):
        return None
    try:
        identity = getattr(obj, "segment_identity", None)
        nbytes = getattr(obj, "nbytes", None)
    except Exception:
        return None
    if not callable(identity) or isinstance(nbytes, bool):
        return None
    if isinstance(nbytes, (int, np.integer)):
        return int(nbytes)
    return None


def dataset_nbytes(dataset: Any) -> int:
    """The dataset's ``nbytes`` when it is an integer, else :func:`estimate_nbytes`."""
    try:
        nbytes = getattr(dataset, "nbytes", None)
    except Exception:
        nbytes = None
    if isinstance(nbytes, (int, np.integer)) and not isinstance(nbytes, bool):
        return int(nbytes)
    return estimate_nbytes(dataset)


def estimate_nbytes(obj: Any) -> int:
    """Estimate the bytes an object graph holds (arrays, tensors and Python objects).

    Walks ``vars()``, ``__slots__``, dicts, lists, tuples and sets, counting each
    object once: numpy arrays by the ``nbytes`` of the array that owns the buffer,
    torch tensors by their storage's bytes, anything else by ``sys.getsizeof``.
    Classes, modules and functions are code, not data, and are not counted. Depth,
    object count and elements per container are bounded; a large container's sampled
    elements are extrapolated to its length.

    Args:
        obj: a dataset or any object.

    Returns:
        The estimate in bytes.

    Example:
        >>> import numpy as np
        >>> estimate_nbytes({"x": np.zeros(1000, np.float64)}) >= 8000
        True
    """
    return int(_Sizer().size(obj, 0))


def array_buffers(obj: Any) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of the numpy and CPU torch buffers :func:`estimate_nbytes` finds.

    Walked as :func:`estimate_nbytes` walks (each buffer once; large containers
    sampled, so a buffer may be missed but none is invented); object arrays hold
    pointers, not data, and are left out, as are shareddata datasets.

    Example:
        >>> import numpy as np
        >>> a = np.zeros(1000)
        >>> array_buffers({"a": a, "view": a[10:]}) == [(a.ctypes.data, 8000)]
        True
    """
    sizer = _Sizer()
    sizer.size(obj, 0)
    return sizer.buffers


class _Sizer:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.storages: set[tuple[str, int]] = set()
        self.budget = _MAX_OBJECTS
        self.buffers: list[tuple[int, int]] = []

    def size(self, obj: Any, depth: int) -> float:
        if id(obj) in self.seen or isinstance(obj, _CODE):
            return 0.0
        self.seen.add(id(obj))
        self.budget -= 1
        shared = shared_nbytes(obj)
        if shared is not None:  # its segments, not the mmap objects over them
            return float(shared)
        if isinstance(obj, np.ndarray):
            return self._array(obj, depth)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, mmap.mmap):
            return float(len(obj)) if not obj.closed else 0.0
        try:
            own = float(sys.getsizeof(obj))
        except TypeError:
            own = 0.0
        if depth >= _MAX_DEPTH or self.budget <= 0 or isinstance(obj, (str, bytes, bytearray)):
            return own
        if isinstance(obj, dict):
            return (
                own
                + self._sample(obj.keys(), len(obj), depth)
                + self._sample(obj.values(), len(obj), depth)
            )
        if isinstance(obj, (list, tuple, set, frozenset)):
            return own + self._sample(obj, len(obj), depth)
        return own + sum(self.size(child, depth + 1) for child in _attributes(obj))

    def _sample(self, items: Any, n: int, depth: int) -> float:
        if n == 0:
            return 0.0
        if n <= _SAMPLE:
            picked: Sequence[Any] | Iterator[Any] = iter(items)
        elif isinstance(items, Sequence):
            step = n / _SAMPLE
            picked = [items[int(i * step)] for i in range(_SAMPLE)]
        else:
            picked = islice(items, _SAMPLE)
        total, count = 0.0, 0
        for item in picked:
            total += self.size(item, depth + 1)
            count += 1
        return total * n / count if count else 0.0

    def _array(self, arr: np.ndarray, depth: int) -> float:
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root is not arr:
            if id(root) in self.seen:
                return 0.0
            self.seen.add(id(root))
        total = float(root.nbytes)
        if root.dtype != object and root.nbytes:
            self.buffers.append((int(root.__array_interface__["data"][0]), int(root.nbytes)))
        if root.dtype == object and root.size and depth < _MAX_DEPTH:
            n = root.size
            step = max(n / _SAMPLE, 1.0)
            picked = [root.flat[int(i * step)] for i in range(min(n, _SAMPLE))]
            total += sum(self.size(x, depth + 1) for x in picked) * n / len(picked)
        return total

    def _tensor(self, tensor: torch.Tensor) -> float:
        try:
            storage = tensor.untyped_storage()
            key = (str(storage.device), storage.data_ptr() or id(storage))
            nbytes = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            key = ("tensor", id(tensor))
            nbytes = tensor.element_size() * tensor.nelement()
        if key in self.storages:
            return 0.0
        self.storages.add(key)
        if key[0] == "cpu" and nbytes and key[1] != id(storage):
            self.buffers.append((key[1], int(nbytes)))
        return float(nbytes)


def _attributes(obj: Any) -> list[Any]:
    """Values of an object's ``__dict__`` (the dict itself) and ``__slots__``."""
    values: list[Any] = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        values.append(d)
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                try:
                    values.append(getattr(obj, name))
                except AttributeError:
                    continue
    return values


def children_of(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif not isinstance(obj, (str, bytes, bytearray, np.ndarray, torch.Tensor, *_CODE)):
        for value in _attributes(obj):
            if isinstance(value, dict):
                yield from value.values()
            else:
                yield value
