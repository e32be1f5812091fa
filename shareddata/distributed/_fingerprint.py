"""Fingerprints: the same dataset arguments on every local rank give the same string."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from collections.abc import Callable, Iterator, Mapping, Set
from typing import Any

import numpy as np
import torch

__all__ = ["describe", "fingerprint", "sample_digest"]


_SAMPLE_ELEMENTS = 4096
SAMPLE_ITEMS = 16
"""Items of a wrapped dataset or list that :func:`sample_digest` reads on every local rank."""


def _digest(obj: Any, h: Any, depth: int = 0) -> None:
    if depth > 8:
        h.update(b"...")
        return
    if isinstance(obj, (bytes, bytearray, memoryview)):
        data = memoryview(obj).cast("B")
        h.update(b"bytes%d:" % data.nbytes)
        h.update(data)
    elif obj is None or isinstance(obj, (bool, int, float, complex, str)):
        h.update(repr(obj).encode())
    elif isinstance(obj, os.PathLike):
        h.update(b"path:" + os.fsencode(os.fspath(obj)))
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        _digest_array(t.numpy(), h, f"tensor{tuple(obj.shape)}{obj.dtype}")
    elif isinstance(obj, np.ndarray):
        _digest_array(obj, h, f"ndarray{obj.shape}{obj.dtype}")
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for k, v in obj.items():
            _digest(k, h, depth + 1)
            _digest(v, h, depth + 1)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__qualname__}[".encode())
        for v in obj:
            _digest(v, h, depth + 1)
        h.update(b"]")
    elif isinstance(obj, Set):  # in no order: a set's order differs with the hash seed
        h.update(b"set{" + b"".join(sorted(_sub(v, depth) for v in obj)) + b"}")
    else:  # its type and what pickling it saves (a repr may hold an address)
        h.update(f"<{type(obj).__module__}.{type(obj).__qualname__}>".encode())
        try:
            reduced = obj.__reduce_ex__(4)
        except Exception:
            return
        if isinstance(reduced, tuple):
            _digest(reduced[1:3], h, depth + 1)  # the arguments and the state


def _sub(obj: Any, depth: int) -> bytes:
    h = hashlib.sha1(usedforsecurity=False)
    _digest(obj, h, depth + 1)
    return h.digest()


def _digest_array(array: np.ndarray, h: Any, header: str) -> None:
    h.update(header.encode())
    if array.size == 0 or array.dtype.hasobject:
        return
    idx = np.linspace(0, array.size - 1, min(array.size, _SAMPLE_ELEMENTS)).astype(np.int64)
    h.update(np.ascontiguousarray(array.flat[idx]).tobytes())  # copies only the sample


def fingerprint(key: Any) -> str:
    """A short hash of a dataset's arguments (paths, names, shapes, a sample of arrays).

    Example:
        >>> fingerprint(("a.npy", None)) == fingerprint(("a.npy", None))
        True
        >>> fingerprint(np.zeros(3)) == fingerprint(np.ones(3))
        False
    """
    h = hashlib.sha1(usedforsecurity=False)
    _digest(key, h)
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _fixed_random_state() -> Iterator[None]:
    """The global random states (torch CPU, numpy, Python) seeded, then put back."""
    state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(0)
            random.seed(0)
            np.random.seed(0)
            yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


def sample_digest(get: Callable[[int], Any], length: int, count: int = SAMPLE_ITEMS) -> str:
    """A hash of ``count`` items spread over ``range(length)``, first and last included.

    Read with torch's, numpy's and Python's random state seeded (then restored), so
    that an augmenting ``__getitem__`` gives the same sample on every rank.

    Example:
        >>> sample_digest([1, 2, 3].__getitem__, 3) == sample_digest([1, 2, 4].__getitem__, 3)
        False
        >>> sample_digest(lambda i: torch.rand(2) + i, 10) == sample_digest(
        ...     lambda i: torch.rand(2) + i, 10)
        True
    """
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"%d:" % length)
    if length > 0:
        rows = sorted({round(k * (length - 1) / max(count - 1, 1)) for k in range(count)})
        with _fixed_random_state():
            for i in rows:
                _digest(get(i), h)
    return h.hexdigest()[:16]


def describe(key: Any, limit: int = 160) -> str:
    """A short human description of a dataset's arguments, for messages."""

    def short(obj: Any, depth: int = 0) -> str:
        if isinstance(obj, (np.ndarray, torch.Tensor)):
            return f"{type(obj).__name__}(shape={tuple(obj.shape)}, dtype={obj.dtype})"
        if isinstance(obj, os.PathLike):
            return repr(os.fspath(obj))
        if isinstance(obj, Mapping) and depth < 3:
            return "{" + ", ".join(f"{k!r}: {short(v, depth + 1)}" for k, v in obj.items()) + "}"
        if isinstance(obj, (list, tuple)) and depth < 3:
            inner = ", ".join(short(v, depth + 1) for v in obj)
            return f"[{inner}]" if isinstance(obj, list) else f"({inner})"
        return repr(obj) if isinstance(obj, (str, int, float, type(None))) else type(obj).__name__

    if isinstance(key, tuple) and key and isinstance(key[0], str):  # ("NumpyDataset", ...)
        text = f"{key[0]}({', '.join(short(v, 1) for v in key[1:])})"
    else:
        text = short(key)
    return text if len(text) <= limit else text[: limit - 3] + "..."
