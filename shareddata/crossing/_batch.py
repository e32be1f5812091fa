"""Samples of a gathered batch, and the default collate's shortcut for them.

``ColumnDataset.__getitems__`` gathers each column of a batch once, then hands
the DataLoader one sample per row, as its API requires. Left to itself, the
default collate would then stack those per-row views into a new batch: a second
copy of the data, in a second shared segment when it runs in a worker. Note
[The default collate's shortcut] explains how it is skipped.

Note [The default collate's shortcut]
-------------------------------------
The samples that ``__getitems__`` returns are :class:`Row` (a ``dict``),
:class:`RowTuple` (a ``tuple``) or :class:`RowList` (a ``list``) objects, in a
:class:`Samples` list that keeps the gathered columns. These types are registered in torch's
``default_collate_fn_map``, the documented way to teach ``default_collate`` a
type ("Option 2" in its docstring). When ``default_collate`` meets a batch of
them, :func:`collate_rows` checks that the batch is still exactly the list that
``__getitems__`` made (same length, same sample objects, each holding the same
value objects): then the gathered columns ARE the collated batch, and are
returned as they are (in a worker they were gathered straight into shared memory,
so the batch travels to the main process without another copy). In every other
case (a custom ``collate_fn`` that filtered, reordered, replaced or added values,
or samples mixed from several batches) it collates the generic way, exactly as
``default_collate`` does for plain dicts and tuples (in a worker into one memfd:
Note [Collating into one memfd] in ``_collate.py``). Values changed in place
(``sample["x"] += 1``) are views of the gathered batch, so the batch has the
change either way.

The result has the structure ``default_collate`` gives for plain samples: a
``dict`` {column: batch} for dict samples, a ``list`` of column batches for tuple
samples; fixed-shape columns give one stacked tensor, string and bytes columns a
list, variable-length columns whatever ``default_collate`` does with their rows.
Nested samples (Note [Nested items] in ``columns/_items.py``; a ``SharedDataset``'s items,
whatever tree of tuples, lists and dicts they are) are checked leaf by leaf (each
dict still has exactly its keys, each tuple and list its length, each leaf the
same object), and the gathered columns are returned nested the same way, tuples
as lists (as ``default_collate`` gives them). A ``SharedDataset`` whose items are
a tensor alone gives the tensors themselves: in a worker they are views of the
batch's memfd, :class:`~shareddata.storage.SharedTensor` s, registered too. Where a
column's batch is not what ``default_collate`` makes of its values (rows of
varying length, a ``SharedDataset`` leaf of Note [What comes back] in
``columns/_restore.py``), its rows are collated as ``default_collate`` collates
them, in a worker into one memfd.

Note [Samples made when first used]
-----------------------------------
Cutting a batch of 256 rows into 256 tensor views (``unbind``) and 256 ``Row``
dicts costs ~120 us, five times the gather itself (measured in-process, 256 rows
of 1 KiB: ``__getitems__`` + ``default_collate`` 222 -> 42 us); with the default
collate nobody ever looks at them. So a :class:`Samples` list starts empty and
makes its samples at their first use. ``default_collate`` reads ``batch[0]`` (to
pick its collate function by type) and ``len(batch)``: the first sample is made
alone, from the first row of each column, and kept. Any other use (iterating,
indexing another row, slicing, comparing, changing: every ``list`` method is
wrapped) makes all samples first, the kept first one among them, so what a
``collate_fn`` sees is the list ``__getitems__`` always returned. Pickling a list
that nobody looked at (a ``collate_fn`` that returns it as it is) sends its
gathered columns, unpickled as a :class:`Samples` again whose samples are still to
be made: leaving a worker it costs a few tensors, not one per row and column
(``benchmarks/bench_ipc.py``, the identity collate); any other list pickles as the
plain list of its samples.
:meth:`Samples.intact` then holds for a list never made if its first sample (if
made) still holds its values. C code that reads a ``list`` subclass's items
without its methods (``list.__add__`` in ``[x] + samples`` or ``samples +
samples``) is covered by ``__radd__`` and by making the other operand's samples
too; CPython's other fast paths (``tuple()``, ``f(*samples)``, ``list.extend``,
``PySequence_Fast``) take exact lists only and iterate a subclass.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from .._compat import collate, collate_tensor_fn, default_collate_fn_map
from ..columns._items import rebuild, unnest
from ..storage import SharedTensor
from ._collate import collate_beside, collate_in_one_memfd, stacking
from ._outbox import worker_empty

__all__ = [
    "Row", "RowList", "RowTuple", "Samples",
    "collate_columns", "collate_rows", "collate_shared", "schema_of",
]  # fmt: skip


class Row(dict):  # type: ignore[type-arg]
    """One sample of a gathered batch, ``{column: value}``: a plain ``dict`` to its user."""

    __slots__ = ()


class RowTuple(tuple):  # type: ignore[type-arg]
    """One sample of a gathered batch, values in column order: a plain ``tuple`` to its user."""

    __slots__ = ()


class RowList(list):  # type: ignore[type-arg]
    """One sample of a gathered batch whose items are lists: a plain ``list`` to its user."""

    __slots__ = ()


def schema_of(nesting: Any, tuples: bool) -> Any:
    """The schema samples are made from (None for flat samples).

    ``nesting`` itself, except that with ``tuples`` (``output="tuple"``) a dict's
    values, in order, are a tuple.
    """
    if nesting is not None and tuples and nesting[0] == "dict":
        return ("tuple", [child for _, child in nesting[1]])
    return nesting


class Samples(list):  # type: ignore[type-arg]
    """The samples of one batch, remembering the gathered columns they were cut from.

    The samples are made at their first use (Note [Samples made when first used]):
    to the DataLoader and a ``collate_fn`` this is a plain list of ``Row`` dicts
    (``RowTuple`` tuples in column order if ``tuples``); pickled, a plain ``list``.

    Args:
        names: column names, in sample order.
        batched: per column, the gathered batch (a tensor for fixed-shape columns,
            a list of values otherwise).
        stacked: per column, whether ``batched`` is a tensor that the default
            collate would build by stacking the rows.
        splits: per column, the function that cuts its batch into one value per
            row (views of ``batched`` for tensors), called at the first use.
        n: the number of rows (used when there are no columns).
        nesting: for nested samples, their schema (Note [Nested items] in
            ``columns/_items.py``: a tree of tuples, lists and dicts); None for flat ones.
            With ``tuples``, a dict schema's samples hold its top-level values.
        tuples: ``RowTuple`` samples rather than ``Row``.
        firsts: per column, the function that makes row 0's value alone (None:
            ``batched[0]`` for a stacked column, ``split(batched)[0]`` otherwise).
        portable: ``splits`` and ``firsts`` are module-level functions: a list that
            crosses as its columns pickles them (else it remakes them from ``stacked``).

    Example:
        >>> import torch
        >>> b = torch.arange(6).reshape(3, 2)
        >>> s = Samples(["x"], [b], [True], [torch.unbind], 3)
        >>> s[1], type(s[1]).__name__
        ({'x': tensor([2, 3])}, 'Row')
        >>> from torch.utils.data import default_collate
        >>> default_collate(s)["x"] is b
        True
    """

    __slots__ = (
        "batched", "names", "nesting", "stacked", "_splits", "_firsts", "_portable",
        "_n", "_tuples", "_pending", "_first", "_first_values", "_values", "_rows",
    )  # fmt: skip

    names: list[str]
    batched: list[Any]
    stacked: list[bool]
    nesting: Any

    def __init__(
        self,
        names: list[str],
        batched: list[Any],
        stacked: list[bool],
        splits: Sequence[Callable[[Any], Sequence[Any]]],
        n: int,
        nesting: Any = None,
        tuples: bool = False,
        firsts: Sequence[Callable[[Any], Any] | None] | None = None,
        portable: bool = False,
    ) -> None:
        super().__init__()
        self.names, self.batched, self.stacked = names, batched, stacked
        self.nesting = schema_of(nesting, tuples)
        self._splits, self._n, self._tuples = splits, n, tuples
        self._firsts, self._portable = firsts, portable
        self._pending = True
        self._first: Any = None
        self._first_values: list[Any] = []
        self._values: list[list[Any]] = []
        self._rows: tuple[Any, ...] = ()

    # -- Note [Samples made when first used] ---------------------------------------
    def _make(self, per_row: Any) -> list[Any]:
        """Samples from per-row value tuples (one value per column, column order)."""
        nesting, names = self.nesting, self.names
        if nesting is not None:
            tag = nesting[0]
            if tag == "leaf":  # the items are values alone
                return [r[nesting[1]] for r in per_row]
            made = {"dict": Row, "tuple": RowTuple, "list": RowList}[tag]
            return [made(rebuild(nesting, r)) for r in per_row]
        if self._tuples:
            return list(map(RowTuple, per_row))
        if len(names) == 1:
            name = names[0]
            return [Row({name: r[0]}) for r in per_row]
        return [Row(zip(names, r)) for r in per_row]

    def _force(self) -> None:
        """Make every sample (once), keeping the first one if it was handed out."""
        if not self._pending:
            return
        self._pending = False
        values = [list(split(b)) for split, b in zip(self._splits, self.batched)]
        if self._first is not None:
            for column, value in zip(values, self._first_values):
                column[0] = value
        rows = self._make(zip(*values) if values else [()] * self._n)
        if self._first is not None:
            rows[0] = self._first
        self._values, self._rows = values, tuple(rows)
        list.extend(self, rows)

    def __len__(self) -> int:
        return self._n if self._pending else list.__len__(self)

    def __getitem__(self, index: Any) -> Any:
        if self._pending and type(index) is int and index == 0 and self._n:
            # what default_collate looks at first: the first sample alone
            if self._first is None:
                firsts = self._firsts or [None] * len(self.batched)
                self._first_values = [
                    first(b) if first is not None else b[0] if stacked else split(b)[0]
                    for split, first, b, stacked in zip(
                        self._splits, firsts, self.batched, self.stacked
                    )
                ]
                self._first = self._make([tuple(self._first_values)])[0]
            return self._first
        self._force()
        return list.__getitem__(self, index)

    def __radd__(self, other: Any) -> Any:
        # ``[x] + samples``: list's own concatenation would read the unmade samples
        self._force()
        return list.__add__(other, list(self)) if isinstance(other, list) else NotImplemented

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._pending and self._first is None:
            # never looked at (``collate_fn=lambda b: b``): cross as the gathered
            # columns, a few tensors instead of one per row and column; the samples
            # are made where they are first used (Note [Samples made when first used])
            portable = (self._splits, self._firsts) if self._portable else (None, None)
            args = (self.names, self.batched, self.stacked, self._n, self.nesting, self._tuples)
            return _from_columns, (*args, *portable)
        return list, (list(self),)

    def intact(self) -> bool:
        """Whether this list still holds exactly the samples it made, as they were made."""
        if self._pending:  # nothing but the first sample was handed out
            first = self._first
            return first is None or self._intact((first,), [[v] for v in self._first_values])
        rows = self._rows
        if list.__len__(self) != len(rows) or not all(map(operator.is_, self, rows)):
            return False
        return self._intact(rows, self._values)

    def _intact(self, rows: Sequence[Any], values: Sequence[Sequence[Any]]) -> bool:
        """Whether each of ``rows`` still holds the value objects ``values`` (per column)."""
        if self.nesting is not None:
            return self._intact_nested(self.nesting, rows, values)
        width = len(self.names)
        if rows and isinstance(rows[0], Row):
            if not all(len(r) == width for r in rows):
                return False
            for name, column in zip(self.names, values):
                get = operator.itemgetter(name)
                try:
                    if not all(map(operator.is_, map(get, rows), column)):
                        return False
                except KeyError:  # a sample lost a key
                    return False
        # RowTuple samples are immutable: the identity check covers them.
        return True

    def _intact_nested(
        self, nesting: Any, rows: Sequence[Any], values: Sequence[Sequence[Any]]
    ) -> bool:
        """:meth:`_intact` for nested samples (Note [Nested items] in ``columns/_items.py``)."""
        out: list[Any] = [None] * len(self.names)
        for j, row in enumerate(rows):
            if not unnest(row, nesting, out) or not all(o is v[j] for o, v in zip(out, values)):
                return False
        return True


def _from_columns(
    names: list[str],
    batched: list[Any],
    stacked: list[bool],
    n: int,
    nesting: Any,
    tuples: bool,
    splits: Any = None,
    firsts: Any = None,
) -> Samples:
    """Unpickle :class:`Samples` that crossed as their columns (still to be made)."""
    portable = splits is not None
    if splits is None:
        splits = [_unbind if s else _as_is for s in stacked]
    return Samples(names, batched, stacked, splits, n, nesting, tuples, firsts, portable)


def _unbind(batch: Any) -> list[Any]:
    return list(batch.unbind(0))


def _as_is(batch: Any) -> Any:
    return batch


def _forcing(name: str) -> Callable[..., Any]:
    method = getattr(list, name)

    def forced(self: Samples, *args: Any, **kwargs: Any) -> Any:
        self._force()
        for arg in args:  # ``samples + other_samples`` reads the other's items directly
            if isinstance(arg, Samples):
                arg._force()
        return method(self, *args, **kwargs)

    forced.__name__ = forced.__qualname__ = name
    return forced


# Every other list operation makes the samples first (Note [Samples made when first used]).
for _name in (
    "__iter__", "__reversed__", "__contains__", "__setitem__", "__delitem__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__add__", "__iadd__", "__mul__", "__rmul__", "__imul__", "__repr__",
    "append", "extend", "insert", "pop", "remove", "index", "count", "clear", "copy",
    "sort", "reverse",
):  # fmt: skip
    setattr(Samples, _name, _forcing(_name))


def collate_rows(
    batch: Sequence[Any], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> Any:
    """``default_collate`` for :class:`Row` / :class:`RowTuple` samples.

    Returns the gathered columns when ``batch`` is an intact :class:`Samples`
    (Note [The default collate's shortcut]); otherwise collates as
    ``default_collate`` does for plain dicts and tuples.
    """
    if isinstance(batch, Samples) and batch.intact():
        return collate_columns(
            batch.names, batch.batched, batch.stacked, batch.nesting, batch._tuples, collate_fn_map
        )
    if collate_fn_map is None:
        collate_fn_map = default_collate_fn_map
    if get_worker_info() is not None:  # leaving a worker: Note [Collating into one memfd]
        return collate_in_one_memfd(lambda fns: _collate_samples(batch, fns), collate_fn_map)
    return _collate_samples(batch, collate_fn_map)


def _collate_samples(batch: Sequence[Any], collate_fn_map: dict[Any, Callable[..., Any]]) -> Any:
    """``default_collate`` of samples that are dicts, tuples or lists."""
    elem = batch[0]
    if isinstance(elem, dict):
        return {
            key: collate([d[key] for d in batch], collate_fn_map=collate_fn_map) for key in elem
        }
    size = len(elem)
    if any(len(e) != size for e in batch):
        raise RuntimeError("each element in list of batch should be of equal size")
    return [collate(s, collate_fn_map=collate_fn_map) for s in zip(*batch)]


@stacking
def collate_shared(
    batch: Sequence[Any], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> Any:
    """``default_collate`` for :class:`SharedTensor` s (a worker's views of its batch).

    The gathered column when ``batch`` is an intact :class:`Samples` of items that
    are tensors alone; in a worker, the tensors stacked into one memfd (Note
    [Collating into one memfd] in ``_collate.py``); elsewhere torch's own stack.
    """
    if (
        isinstance(batch, Samples)
        and batch.nesting == ("leaf", 0)
        and batch.stacked[0]
        and batch.intact()
    ):
        return batch.batched[0]
    elem = batch[0]
    if (
        get_worker_info() is not None
        and elem.layout is torch.strided
        and elem.device.type == "cpu"
        and not elem.is_nested
    ):  # stacked as torch stacks in a worker (its errors too), into a memfd of ours
        out = worker_empty((len(batch), *elem.shape), elem.dtype)
        torch.stack(list(batch), 0, out=out.as_subclass(torch.Tensor))
        return out
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def collate_columns(
    names: Sequence[str],
    batched: Sequence[Any],
    stacked: Sequence[bool],
    nesting: Any,
    tuples: bool,
    collate_fn_map: dict[Any, Callable[..., Any]] | None = None,
    lenient: bool = False,
) -> Any:
    """What ``default_collate`` makes of samples, from their columns as gathered.

    A stacked column is taken as it is; the others (one value per row) are collated
    as ``default_collate`` collates them (in a worker into one memfd: Note
    [Collating into one memfd] in ``_collate.py``): from a tuple or list sample as a
    tuple (a str column comes out as a tuple of str), from a dict as a list; tensors
    of one shape are stacked. Samples of ``output="tuple"`` give a list of columns,
    as ``default_collate`` gives for tuples; nested samples the same tree, tuples as
    lists. ``lenient``: a column that ``default_collate`` cannot collate (rows of
    different lengths) stays the list of its rows instead of raising.
    """
    schema = schema_of(nesting, tuples)
    if schema is None and all(stacked):  # every column as gathered
        return list(batched) if tuples else dict(zip(names, batched))
    if collate_fn_map is None:
        collate_fn_map = default_collate_fn_map
    in_sequence = _in_sequence(names, schema, tuples)
    rows = {
        k: (tuple if k in in_sequence else list)(b)
        for k, (b, done) in enumerate(zip(batched, stacked))
        if not done
    }

    def collate_rows_of(fns: dict[Any, Callable[..., Any]]) -> dict[int, Any]:
        out = {}
        for k, column in rows.items():
            try:
                out[k] = collate(column, collate_fn_map=fns)
            except (RuntimeError, TypeError):
                if not lenient:
                    raise
                out[k] = list(column)
        return out

    columns = list(batched)
    if rows and get_worker_info() is not None:  # leaving a worker: one memfd in all
        done = [k for k, b in enumerate(batched) if k not in rows]
        collated, moved = collate_beside(
            collate_rows_of, collate_fn_map, [batched[k] for k in done]
        )
        for k, b in zip(done, moved):
            columns[k] = b
    else:
        collated = collate_rows_of(collate_fn_map)
    for k, b in collated.items():
        columns[k] = b
    if schema is not None:
        return rebuild(schema, columns, batch=True)
    return columns if tuples else dict(zip(names, columns))


def _in_sequence(names: Sequence[str], schema: Any, tuples: bool) -> set[int] | range:
    """The columns whose values sit in a tuple or list of the samples (not in a dict)."""
    if schema is None:
        return range(len(names)) if tuples else set()
    found: set[int] = set()

    def visit(node: Any, in_sequence: bool) -> None:
        tag, body = node
        if tag == "leaf":
            if in_sequence:
                found.add(body)
        elif tag == "dict":
            for _, child in body:
                visit(child, False)
        else:
            for child in body:
                visit(child, True)

    visit(schema, False)
    return found


default_collate_fn_map[Row] = collate_rows
default_collate_fn_map[RowTuple] = collate_rows
default_collate_fn_map[RowList] = collate_rows
default_collate_fn_map[SharedTensor] = collate_shared
