"""A wrapped dataset's leaves given back as its items had them: one row, or a batch's rows.

Note [What comes back]
======================
``SharedDataset`` stores each leaf of an item in a column (``_items.py``) and gives
back what the item had, not what the column holds:

* a tensor comes back as its class: ``torch.Tensor``, ``nn.Parameter`` or another
  subclass (rebuilt with ``as_subclass`` from its data), with its ``requires_grad``
  (a leaf tensor: the graph that made it is not kept). A subclass that cannot be
  rebuilt from its data (its instances carry attributes, or it wraps other tensors:
  its own ``__torch_dispatch__``) is kept whole, pickled. Attributes set on a plain
  ``torch.Tensor`` are not kept;
* a numpy array comes back as an ``ndarray`` of its own dtype, byte order included
  (``>i4`` stays big-endian; the column holds native values, torch cannot); an
  ``np.memmap`` comes back as an ``ndarray`` of its dtype, in memory;
* a dict comes back with item 0's keys in item 0's order, whatever the order of
  each item's keys (the default collate takes item 0's order too).

A batch is what the default collate makes of those items. Where a column's
gathered batch IS that (a fixed-shape tensor, a native array, Python and numpy
numbers), the shortcut takes it as gathered (Note [The default collate's shortcut]
in ``crossing/_batch.py``) and each row is made from it only when someone looks;
every other leaf gives its rows, which the default collate collates as it would
collate the original values (a ``Parameter`` requiring grad, a big-endian array:
whatever ``default_collate`` does with them, errors included).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..storage import SharedTensor
from ._items import Leaf

__all__ = ["LeafType", "leaf_batches", "restore"]


@dataclass(frozen=True)
class LeafType:
    """What a leaf's values were in the items, and how its column's values become them.

    Attributes:
        kind: ``tensor``, ``bfloat16`` (a tensor stored as its bits), ``ndarray``,
            ``npscalar``, ``int``, ``float``, ``bool``, ``intlist``, ``floatlist``,
            ``str``, ``bytes`` or ``pickle``.
        ragged: the shapes vary: a values column, then a ``.shape`` column.
        cls: a tensor's class where it is not ``torch.Tensor``.
        requires_grad: a tensor's ``requires_grad``.
        dtype: an array's own dtype where it is not native (``>i4``).
        collated: the column's gathered batch is what the default collate makes of
            the values (Note [What comes back]).
    """

    kind: str
    ragged: bool = False
    cls: type | None = None
    requires_grad: bool = False
    dtype: np.dtype | None = None
    collated: bool = False

    @classmethod
    def of(cls, leaf: Leaf) -> LeafType:
        """The type of ``leaf``'s values, once every item is read."""
        kind = "bfloat16" if leaf.torch_dtype is torch.bfloat16 else leaf.kind
        plain = leaf.tensor_type is None and not leaf.requires_grad
        if leaf.ragged:
            collated = False
        elif kind in ("tensor", "bfloat16"):
            collated = plain
        elif kind == "ndarray":
            collated = leaf.array_dtype is None
        elif kind == "npscalar":
            collated = _scalars_collate(leaf.dtype)
        else:
            collated = kind in ("int", "float", "bool")
        return cls(
            kind, leaf.ragged, leaf.tensor_type, leaf.requires_grad, leaf.array_dtype, collated
        )


def _scalars_collate(dtype: np.dtype) -> bool:
    """Whether the default collate makes a tensor of ``dtype`` of numpy scalars of it."""
    try:
        got = torch.as_tensor([dtype.type(0)])
    except (TypeError, RuntimeError):  # np.uint64: "an integer is required"
        return False
    return got.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype


def restore(t: LeafType, value: Any) -> Any:
    """A leaf value as the item had it, from what its column gives (a row, or a view of one).

    Example:
        >>> p = restore(LeafType("tensor", cls=torch.nn.Parameter), torch.ones(2))
        >>> type(p).__name__, p.requires_grad
        ('Parameter', False)
        >>> restore(LeafType("ndarray", dtype=np.dtype(">i4")), torch.arange(2)).dtype.str
        '>i4'
    """
    kind = t.kind
    if kind == "tensor" or kind == "bfloat16":
        if kind == "bfloat16":  # stored as its bits (int16)
            value = value.view(torch.bfloat16)
        if t.cls is None and not t.requires_grad:
            return value
        if type(value) is SharedTensor:
            # a view of a worker's batch: torch would send a Parameter or a subclass
            # over it by moving its storage into a segment of torch's, in place, from
            # under the batch's memfd (Note [Reusing a batch's pages]): a copy of its own
            value = value.as_subclass(torch.Tensor).clone()
        if t.cls is not None:
            value = value.as_subclass(t.cls)
        return value.requires_grad_() if t.requires_grad else value  # a leaf tensor
    if kind == "ndarray":
        array = value.numpy()
        return array if t.dtype is None else array.astype(t.dtype)
    if kind == "npscalar":
        return value.numpy()[()]
    if kind in ("int", "float", "bool"):
        return value.item()
    if kind in ("intlist", "floatlist"):
        return value.tolist()
    if kind == "pickle":
        return pickle.loads(value)
    return value  # str, bytes


# -- a batch's rows (Note [Samples made when first used] in crossing/_batch.py) -----------
# Module-level functions: a batch that crosses as its columns pickles them by name.


def unbind_rows(batch: torch.Tensor) -> list[Any]:
    """Views of each row of a batch tensor."""
    return list(batch.unbind(0))


def first_row(batch: torch.Tensor) -> Any:
    """Row 0 of a batch tensor."""
    return batch[0]


def item_rows(batch: torch.Tensor) -> list[Any]:
    """Python numbers: the rows of an int64 / float64 / bool batch."""
    return batch.tolist()  # type: ignore[no-any-return]


def first_item(batch: torch.Tensor) -> Any:
    """Row 0 of a batch as a Python number."""
    return batch[0].item()


def array_rows(batch: torch.Tensor) -> list[Any]:
    """The rows of a batch as ndarray views (0-d arrays for a batch of 0-d arrays)."""
    array = batch.numpy()
    return [array[i, ...] for i in range(len(array))]


def first_array(batch: torch.Tensor) -> Any:
    """Row 0 of a batch as an ndarray view."""
    return batch.numpy()[0, ...]


def scalar_rows(batch: torch.Tensor) -> list[Any]:
    """The rows of a batch of numpy scalars, as numpy scalars."""
    return list(batch.numpy())


def first_scalar(batch: torch.Tensor) -> Any:
    """Row 0 of a batch as a numpy scalar."""
    return batch.numpy()[0]


def as_is(batch: Any) -> Any:
    """A batch that is already the list of its rows."""
    return batch


_ROWS: dict[str, tuple[Callable[[Any], list[Any]], Callable[[Any], Any]]] = {
    "tensor": (unbind_rows, first_row),
    "bfloat16": (unbind_rows, first_row),
    "ndarray": (array_rows, first_array),
    "npscalar": (scalar_rows, first_scalar),
    "int": (item_rows, first_item),
    "float": (item_rows, first_item),
    "bool": (item_rows, first_item),
}


def leaf_batches(
    types: list[LeafType], batched: list[Any]
) -> tuple[list[Any], list[bool], list[Callable[[Any], Any]], list[Callable[[Any], Any] | None]]:
    """Each leaf's batch from its columns' gathered batches (in column order).

    Returns, per leaf: its batch (the gathered tensor where it is the default
    collate's result, otherwise the list of its restored rows), whether it is that
    tensor, the function that cuts it into rows and the one that makes row 0 alone
    (None: row 0 of the rows).

    Example:
        >>> types = [LeafType("int", collated=True), LeafType("str")]
        >>> batched = [torch.tensor([4, 2]), ["a", "b"]]
        >>> values, stacked, splits, firsts = leaf_batches(types, batched)
        >>> stacked, splits[0](values[0]), firsts[0](values[0]), splits[1](values[1])
        ([True, False], [4, 2], 4, ['a', 'b'])
    """
    values: list[Any] = []
    stacked: list[bool] = []
    splits: list[Callable[[Any], Any]] = []
    firsts: list[Callable[[Any], Any] | None] = []
    columns = iter(batched)
    for t in types:
        batch = next(columns)
        if t.collated:
            split, first = _ROWS[t.kind]
            values.append(batch.view(torch.bfloat16) if t.kind == "bfloat16" else batch)
            stacked.append(True)
            splits.append(split)
            firsts.append(first)
            continue
        if t.ragged:  # 1-D views of each row's values, and the rows' shapes
            shapes = next(columns).tolist()
            rows = [restore(t, v.reshape(s)) for v, s in zip(batch, shapes)]
        elif isinstance(batch, torch.Tensor):  # fixed rows the default collate takes one by one
            rows = [restore(t, v) for v in batch.unbind(0)]
        elif t.kind in ("str", "bytes"):
            rows = batch
        else:
            rows = [restore(t, v) for v in batch]
        values.append(rows)
        stacked.append(False)
        splits.append(as_is)
        firsts.append(None)
    return values, stacked, splits, firsts
