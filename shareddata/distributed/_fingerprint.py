"""Fingerprints: the same dataset arguments on every local rank give the same string."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["describe", "fingerprint"]


_SAMPLE_ELEMENTS = 4096


def _digest(obj: Any, h: Any, depth: int = 0) -> None:
    if depth > 6:
        h.update(b"...")
        return
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
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
        h.update(b"[")
        for v in obj:
            _digest(v, h, depth + 1)
        h.update(b"]")
    else:  # anything else: its type (its repr may hold an address)
        h.update(f"<{type(obj).__module__}.{type(obj).__qualname__}>".encode())


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
