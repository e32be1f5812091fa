"""What ``ds[indices]`` means: one meaning for every dataset kind.

Note [A batch by index]
=======================
``ds[i]`` for an int is one sample. Any other index selects several rows, the same
way for every kind:

* a list, a slice, a 1-D array or tensor of ints: the batch the default collate
  makes of those samples (after the ``transform``), except that a field it cannot
  collate (rows of different lengths, an unknown type) stays the list of its rows.
  ``SharedList`` gives the list of its items;
* no row (``ds[[]]``, ``ds[5:5]``): an empty batch of the same structure (tensors
  with 0 rows, empty lists), taken from the column kinds or from a batch of the
  first, middle and last rows cut to no row;
* an n-D array, tensor or nested list of ints: as numpy, the index's shape leads
  (``ds[np.array([[1, 2], [3, 4]])]`` gives ``(2, 2, *row)`` tensors and nested
  lists); a ragged nested list is refused.

Booleans and floats are ``IndexTypeError``, an index beyond the rows
``IndexOutOfRangeError``. In a worker the batch is made in one memfd (Note
[Collating into one memfd] in ``crossing/_collate.py``).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .._compat import collate, default_collate_fn_map
from ..crossing._collate import collate_in_one_memfd, stacking, through
from ..errors import IndexOutOfRangeError, IndexTypeError
from ..storage import SharedTensor

__all__ = [
    "index_shape", "index_tensor", "is_int", "lenient_collate", "nest_rows", "out_of_range",
    "rows_by_index",
]  # fmt: skip

_NO_MASKS = "boolean masks are not supported as indices; use mask.nonzero()"


def index_shape(indices: Any) -> tuple[int, ...] | None:
    """The shape of an n-D index; ``None`` for a slice or a 1-D index (cheap for those).

    Example:
        >>> index_shape([1, 2]), index_shape(np.zeros((2, 3), int)), index_shape([[1], [2]])
        (None, (2, 3), (2, 1))
    """
    if isinstance(indices, (torch.Tensor, np.ndarray)):
        return None if indices.ndim == 1 else tuple(indices.shape)
    if not isinstance(indices, (list, tuple)) or not indices:
        return None
    if not isinstance(indices[0], (list, tuple, np.ndarray, torch.Tensor)):
        return None
    try:
        return tuple(np.shape(indices))
    except ValueError:
        raise IndexTypeError(
            f"indices {_short(indices)} are nested lists of different lengths; an index of "
            "several dimensions must be rectangular (as for numpy): pass rows of one length, "
            "or flatten it."
        ) from None


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


def index_tensor(indices: Any, n: int, label: str, check: bool = True) -> torch.Tensor:
    """``indices`` flattened to an int64 tensor in ``[0, n)``: negatives wrap, others raise.

    One bounds check on a numpy view; ``check=False`` skips it (and the wrapping)
    for a gather that checks the bounds itself.

    Example:
        >>> index_tensor([3, -1], 5, "x").tolist(), index_tensor(slice(1, 3), 5, "x").tolist()
        ([3, 4], [1, 2])
    """
    if isinstance(indices, slice):
        return torch.arange(*indices.indices(n), dtype=torch.int64)
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool:
            raise IndexTypeError(_NO_MASKS)
        if indices.is_floating_point() or indices.is_complex():
            raise IndexTypeError(f"indices must be integers, got dtype {indices.dtype}")
        idx = indices.reshape(-1)
        if idx.dtype != torch.int64 or idx.device.type != "cpu":
            idx = idx.to(device="cpu", dtype=torch.int64)
        if not check:
            return idx
        array = idx.numpy()
    else:
        if isinstance(indices, (list, tuple)) and len(indices) == 0:
            return torch.empty(0, dtype=torch.int64)
        try:
            array = np.asarray(indices)
        except ValueError:  # nested lists of different lengths
            index_shape(indices)
            raise
        if array.size == 0 and isinstance(indices, (list, tuple)):
            array = array.astype(np.int64)  # np.asarray([[]]) is float: no value to check
        if array.dtype == np.bool_:
            raise IndexTypeError(_NO_MASKS)
        if array.dtype.kind not in "iu":
            flat = array.reshape(-1)
            if array.dtype.hasobject and flat.size and all(map(is_int, flat)):
                raise out_of_range(max(flat, key=abs), n, label)  # ints beyond int64
            raise IndexTypeError(f"indices must be integers, got dtype {array.dtype}")
        array = array.reshape(-1)
        if array.dtype != np.int64:
            if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
                raise out_of_range(array.max(), n, label)
            array = array.astype(np.int64)
        idx = torch.from_numpy(array)
        if not check:
            return idx
    if array.size:
        lo, hi = int(array.min()), int(array.max())
        if lo < -n or hi >= n:
            raise out_of_range(lo if lo < -n else hi, n, label)
        if lo < 0:
            idx = torch.where(idx < 0, idx + n, idx)
    return idx


def out_of_range(index: Any, n: int, label: str) -> IndexOutOfRangeError:
    """The error for ``index`` beyond the ``n`` rows of ``label``."""
    return IndexOutOfRangeError(f"index {index} is out of range for {label} of {n} rows")


def is_int(index: Any) -> bool:
    """Whether ``index`` is one integer (a Python or numpy int, a 0-d integer tensor or array)."""
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return True
    if not isinstance(index, (torch.Tensor, np.ndarray)) or index.ndim:
        return False
    if isinstance(index, torch.Tensor):
        return not index.dtype.is_floating_point
    return np.issubdtype(index.dtype, np.integer)


# -- collating what the default collate cannot: Note [A batch by index] ---------------------


def lenient_collate(samples: Sequence[Any]) -> Any:
    """``default_collate(samples)``, but a field it cannot collate is the list of its rows.

    Example:
        >>> rows = [{"a": torch.zeros(2), "b": torch.ones(1)},
        ...         {"a": torch.ones(2), "b": torch.ones(3)}]
        >>> out = lenient_collate(rows)
        >>> out["a"].shape, [t.shape for t in out["b"]]
        (torch.Size([2, 2]), [torch.Size([1]), torch.Size([3])])
    """
    collate_map = dict(default_collate_fn_map)
    collate_map[torch.Tensor] = _tensors
    collate_map[SharedTensor] = _tensors  # (registered for its own type: lenient too)
    collate_map[np.ndarray] = _arrays
    collate_map[Mapping] = _mappings  # (torch's own branches, but lenient inside)
    collate_map[Sequence] = _sequences
    collate_map[object] = _rows  # last: any type the default collate does not know
    if get_worker_info() is not None:  # leaving a worker: Note [Collating into one memfd]
        return collate_in_one_memfd(lambda m, _: collate(samples, collate_fn_map=m), collate_map)
    return collate(samples, collate_fn_map=collate_map)


@through
def _rows(batch: Sequence[Any], *, collate_fn_map: Any = None) -> list[Any]:
    return list(batch)


@functools.partial(stacking, lenient=True)
def _tensors(batch: Sequence[torch.Tensor], *, collate_fn_map: Any) -> Any:
    shape = batch[0].shape
    if any(t.shape != shape for t in batch):
        return list(batch)
    fn = default_collate_fn_map.get(type(batch[0]), default_collate_fn_map[torch.Tensor])
    return fn(batch, collate_fn_map=collate_fn_map)


@through
def _arrays(batch: Sequence[np.ndarray], *, collate_fn_map: Any) -> Any:
    first = batch[0]
    if first.dtype.kind in "OSUV" or any(a.shape != first.shape for a in batch):
        return list(batch)
    return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)


@through
def _mappings(batch: Sequence[Mapping[Any, Any]], *, collate_fn_map: Any) -> Any:
    elem = batch[0]
    keys = elem.keys()
    if any(d.keys() != keys for d in batch):
        return list(batch)
    values = {k: collate([d[k] for d in batch], collate_fn_map=collate_fn_map) for k in elem}
    try:  # the sample's own mapping type, as the default collate keeps it
        if isinstance(elem, MutableMapping):
            clone = copy.copy(elem)
            clone.update(values)
            return clone
        return type(elem)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


@through
def _sequences(batch: Sequence[Sequence[Any]], *, collate_fn_map: Any) -> Any:
    elem = batch[0]
    if any(len(s) != len(elem) for s in batch):
        return list(batch)  # rows of different lengths
    columns = [collate(list(c), collate_fn_map=collate_fn_map) for c in zip(*batch)]
    if isinstance(elem, tuple):
        return type(elem)(*columns) if hasattr(elem, "_fields") else columns
    try:
        if isinstance(elem, MutableSequence):
            clone = copy.copy(elem)
            for k, column in enumerate(columns):
                clone[k] = column
            return clone
        return type(elem)(columns)  # type: ignore[call-arg]
    except TypeError:
        return columns


# -- n-D and empty indices -----------------------------------------------------------------


def rows_by_index(
    getitems: Callable[[list[int]], Sequence[Any]],
    idx: torch.Tensor,
    shape: tuple[int, ...],
    n: int,
) -> Any:
    """The batch of the checked rows ``idx`` laid out in ``shape`` (Note [A batch by index]).

    ``getitems`` is the dataset's ``__getitems__``; ``n`` its length.
    """
    if idx.numel():
        samples = list(getitems(idx.tolist()))
    elif n:  # the structure of a batch of a few rows, cut to no row below
        samples = list(getitems(sorted({0, n // 2, n - 1})))
    else:
        return []
    return _shaped(samples, lenient_collate(samples), shape)


def _shaped(rows: Sequence[Any], batch: Any, shape: tuple[int, ...]) -> Any:
    """``batch``, collated from ``rows``, with its rows laid out in ``shape``."""
    count = math.prod(shape)
    if isinstance(batch, torch.Tensor):
        return batch[:count].reshape(*shape, *batch.shape[1:])
    first = rows[0]
    if isinstance(first, Mapping) and isinstance(batch, Mapping):
        values = {k: _shaped([r[k] for r in rows], v, shape) for k, v in batch.items()}
        if type(batch) is dict:
            return values
        clone = copy.copy(batch)
        clone.update(values)  # type: ignore[attr-defined]
        return clone
    per_field = (
        isinstance(first, Sequence)
        and not isinstance(first, (str, bytes))
        and isinstance(batch, Sequence)
        and not (len(batch) == len(rows) and all(b is r for b, r in zip(batch, rows)))
    )
    if per_field:  # collated position by position (tuple and list samples)
        columns = [_shaped([r[k] for r in rows], b, shape) for k, b in enumerate(batch)]
        if hasattr(batch, "_fields"):
            return type(batch)(*columns)
        return tuple(columns) if isinstance(batch, tuple) else columns
    return nest_rows(list(batch)[:count], shape, tuple if isinstance(batch, tuple) else list)


def nest_rows(rows: list[Any], shape: tuple[int, ...], kind: type = list) -> Any:
    """``rows`` as nested lists of ``shape`` (the innermost of type ``kind``).

    Example:
        >>> nest_rows(list("abcdef"), (2, 3)), nest_rows([], (2, 0))
        ([['a', 'b', 'c'], ['d', 'e', 'f']], [[], []])
    """
    if len(shape) == 1:
        return kind(rows)
    step = math.prod(shape[1:])
    return [nest_rows(rows[k * step : (k + 1) * step], shape[1:], kind) for k in range(shape[0])]
