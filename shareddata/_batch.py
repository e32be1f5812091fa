"""Samples of a gathered batch, and the default collate's shortcut for them.

``ColumnDataset.__getitems__`` gathers each column of a batch once, then hands
the DataLoader one sample per row, as its API requires. Left to itself, the
default collate would then stack those per-row views into a new batch: a second
copy of the data, in a second shared segment when it runs in a worker. Note
[The default collate's shortcut] explains how it is skipped.

Note [The default collate's shortcut]
-------------------------------------
The samples that ``__getitems__`` returns are :class:`Row` (a ``dict``) or
:class:`RowTuple` (a ``tuple``) objects, in a :class:`Samples` list that keeps the
gathered columns. Both types are registered in torch's
``default_collate_fn_map``, the documented way to teach ``default_collate`` a
type ("Option 2" in its docstring). When ``default_collate`` meets a batch of
them, :func:`collate_rows` checks that the batch is still exactly the list that
``__getitems__`` made (same length, same sample objects, each holding the same
value objects): then the gathered columns ARE the collated batch, and are
returned as they are (in a worker they were gathered straight into shared memory,
so the batch travels to the main process without another copy). In every other
case (a custom ``collate_fn`` that filtered, reordered, replaced or added values,
or samples mixed from several batches) it collates the generic way, exactly as
``default_collate`` does for plain dicts and tuples. Values changed in place
(``sample["x"] += 1``) are views of the gathered batch, so the batch has the
change either way.

The result has the structure ``default_collate`` gives for plain samples: a
``dict`` {column: batch} for dict samples, a ``list`` of column batches for tuple
samples; fixed-shape columns give one stacked tensor, string and bytes columns a
list, variable-length columns whatever ``default_collate`` does with their rows.
Nested samples (Note [Nested items] in ``_items.py``) are checked leaf by leaf (each
dict still has exactly its keys, each leaf the same object), and the gathered
columns are returned nested the same way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data._utils.collate import collate, default_collate_fn_map

from ._items import rebuild, unnest

__all__ = ["Row", "RowTuple", "Samples", "collate_rows", "make_samples", "make_tuple_samples"]


class Row(dict):  # type: ignore[type-arg]
    """One sample of a gathered batch, ``{column: value}``: a plain ``dict`` to its user."""

    __slots__ = ()


class RowTuple(tuple):  # type: ignore[type-arg]
    """One sample of a gathered batch, values in column order: a plain ``tuple`` to its user."""

    __slots__ = ()


class Samples(list):  # type: ignore[type-arg]
    """The samples of one batch, remembering the gathered columns they were cut from.

    Attributes:
        names: column names, in sample order.
        batched: per column, the gathered batch (a tensor for fixed-shape columns,
            a list of values otherwise).
        stacked: per column, whether ``batched`` is a tensor that the default
            collate would build by stacking the rows.
        values: per column, the row values placed in the samples (to detect a
            sample whose value was replaced).
        nesting: for nested samples, their schema (Note [Nested items] in
            ``_items.py``); None for flat ones.
    """

    __slots__ = ("batched", "names", "nesting", "stacked", "values", "rows")

    names: list[str]
    batched: list[Any]
    stacked: list[bool]
    values: Sequence[Sequence[Any]]
    rows: tuple[Any, ...]
    nesting: Any  # the item schema of nested samples (Note [Nested items]), or None

    def intact(self) -> bool:
        """Whether this list still holds exactly the samples ``make_samples`` put in it."""
        if len(self) != len(self.rows) or not all(map(operator.is_, self, self.rows)):
            return False
        if self.nesting is not None:
            return self._intact_nested(self.nesting)
        width = len(self.names)
        if self.rows and isinstance(self.rows[0], Row):
            if not all(len(r) == width for r in self.rows):
                return False
            for name, values in zip(self.names, self.values):
                get = operator.itemgetter(name)
                try:
                    if not all(map(operator.is_, map(get, self.rows), values)):
                        return False
                except KeyError:  # a sample lost a key
                    return False
        # RowTuple samples are immutable: the identity check above covers them.
        return True

    def _intact_nested(self, nesting: Any) -> bool:
        """:meth:`intact` for nested samples (Note [Nested items] in ``_items.py``)."""
        out: list[Any] = [None] * len(self.names)
        _, body = nesting
        for j, row in enumerate(self.rows):
            if isinstance(row, Row):
                ok = unnest(row, nesting, out)
            else:  # a tuple of the top-level values, in order
                ok = len(row) == len(body)
                ok = ok and all(unnest(v, child, out) for v, (_, child) in zip(row, body))
            if not ok or not all(o is v[j] for o, v in zip(out, self.values)):
                return False
        return True


def make_samples(
    names: list[str],
    batched: list[Any],
    stacked: list[bool],
    values: Sequence[Sequence[Any]],
    n: int,
    nesting: Any = None,
) -> Samples:
    """The samples of a gathered batch, as ``Row`` dicts (one column or more).

    Args:
        names: column names.
        batched: per column, the gathered batch.
        stacked: per column, whether ``batched`` is a stacked tensor.
        values: per column, one value per row (views of ``batched`` for tensors).
        n: the number of rows (used when there are no columns).
        nesting: the item schema of nested samples (Note [Nested items] in
            ``_items.py``), or None for flat ones.

    Example:
        >>> import torch
        >>> b = torch.arange(6).reshape(3, 2)
        >>> s = make_samples(["x"], [b], [True], [b.unbind(0)], 3)
        >>> s[1], type(s[1]).__name__
        ({'x': tensor([2, 3])}, 'Row')
        >>> from torch.utils.data import default_collate
        >>> default_collate(s)["x"] is b
        True
    """
    if nesting is not None:
        rows = [Row(rebuild(nesting, r)) for r in zip(*values)]
    elif len(names) == 1:
        name = names[0]
        rows = [Row({name: v}) for v in values[0]]
    elif names:
        rows = [Row(zip(names, r)) for r in zip(*values)]
    else:
        rows = [Row() for _ in range(n)]
    return _wrap(rows, names, batched, stacked, values, nesting)


def make_tuple_samples(
    names: list[str],
    batched: list[Any],
    stacked: list[bool],
    values: Sequence[Sequence[Any]],
    n: int,
    nesting: Any = None,
) -> Samples:
    """The samples of a gathered batch, as ``RowTuple`` tuples in column order.

    Nested samples (``nesting``) are tuples of the item's top-level values.
    """
    if nesting is not None:
        rows = [RowTuple(rebuild(nesting, r).values()) for r in zip(*values)]
    else:
        rows = list(map(RowTuple, zip(*values))) if names else [RowTuple() for _ in range(n)]
    return _wrap(rows, names, batched, stacked, values, nesting)


def _wrap(
    rows: list[Any],
    names: list[str],
    batched: list[Any],
    stacked: list[bool],
    values: Sequence[Sequence[Any]],
    nesting: Any,
) -> Samples:
    samples = Samples(rows)
    samples.nesting = nesting
    samples.rows = tuple(rows)
    samples.names = names
    samples.batched = batched
    samples.stacked = stacked
    samples.values = values
    return samples


def collate_rows(
    batch: Sequence[Any], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> Any:
    """``default_collate`` for :class:`Row` / :class:`RowTuple` samples.

    Returns the gathered columns when ``batch`` is an intact :class:`Samples`
    (Note [The default collate's shortcut]); otherwise collates as
    ``default_collate`` does for plain dicts and tuples.
    """
    if isinstance(batch, Samples) and batch.intact():
        columns = [
            b if stacked else collate(list(b), collate_fn_map=collate_fn_map)
            for b, stacked in zip(batch.batched, batch.stacked)
        ]
        if batch.nesting is not None:
            nested = rebuild(batch.nesting, columns)
            return nested if isinstance(batch.rows[0], Row) else list(nested.values())
        if isinstance(batch.rows[0], Row):
            return dict(zip(batch.names, columns))
        return columns
    elem = batch[0]
    if isinstance(elem, dict):
        return {
            key: collate([d[key] for d in batch], collate_fn_map=collate_fn_map) for key in elem
        }
    size = len(elem)
    if any(len(e) != size for e in batch):
        raise RuntimeError("each element in list of batch should be of equal size")
    return [collate(list(s), collate_fn_map=collate_fn_map) for s in zip(*batch)]


default_collate_fn_map[Row] = collate_rows
default_collate_fn_map[RowTuple] = collate_rows
