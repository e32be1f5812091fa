"""The default collate of shareddata's batches: its shortcut, and into one memfd in a worker.

Note [The default collate's shortcut]
-------------------------------------
``ColumnDataset.__getitems__`` gathers each column once and returns :class:`Row` (a
``dict``), :class:`RowTuple` or :class:`RowList` samples in a :class:`Samples` list
that keeps the gathered columns; these types are registered in torch's
``default_collate_fn_map`` (the documented way). When ``default_collate`` meets them,
:func:`collate_rows` checks that the batch is still exactly the list ``__getitems__``
made (same length, same sample objects, each with the same value objects, nested
ones leaf by leaf): then the gathered columns ARE the collated batch (in a worker,
already in shared memory), returned with ``default_collate``'s structure. Otherwise
(a ``collate_fn`` that filtered, reordered, replaced or added values, samples mixed
from several batches) it collates as ``default_collate`` does for plain dicts and
tuples. Values changed in place are views of the gathered batch, so the batch has the
change either way. A column whose batch is not what ``default_collate`` makes of its
values (rows of varying length, Note [What comes back] in ``columns/_items.py``) has
its rows collated.

Note [Samples made when first used]
-----------------------------------
Cutting a batch into per-row views and ``Row`` dicts costs several times the gather,
and with the default collate nobody looks at them. So a :class:`Samples` list starts
empty: ``default_collate`` reads ``batch[0]`` and ``len(batch)``, and the first sample
is made alone and kept; any other use (every ``list`` method is wrapped) makes all of
them first, so a ``collate_fn`` sees the list ``__getitems__`` always returned. A list
nobody looked at pickles as its gathered columns (a few tensors, not one per row and
column); any other as the plain list. C code that reads a ``list`` subclass's items
directly (``[x] + samples``) is covered by ``__radd__`` and by making the other
operand's samples; CPython's other fast paths take exact lists only.

Note [Collating into one memfd]
-------------------------------
In a worker torch's default collate puts each tensor it stacks or makes in a
``/dev/shm`` segment of its own. Where it reaches shareddata's types whose columns
cannot simply be taken, :func:`collate_in_one_memfd` runs torch's own ``collate``
twice: first with the registry's tensor and number functions replaced by ones that
note the shape and dtype of what each would make, then, after one memfd is allocated
for all (``worker_buffers``), filling it with ``out=`` as torch stacks in a worker.
Everything else is torch's, run as it is (containers, ``str``, numpy arrays, the
errors); an entry that is not torch's (the user's) runs once, with the registry given,
and its result is kept, unless marked :func:`through` (it only collates what it holds)
or :func:`stacking` (it stacks as torch does; ``lenient``: rows of different shapes
stay their list, copied into the same memfd). A tensor torch would not stack into
plain memory (a subclass, another device, nested) goes through torch's function.
Gathered columns beside collated ones are copied into the same memfd (``keep(tensor,
beside=True)``): a copy costs less than a second descriptor. A ``SharedList`` batch's
tensors go the same way (:func:`into_one_batch`: its items walked twice, each tensor
kept).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.data import get_worker_info

from .._compat import (
    collate,
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
    default_collate_fn_map,
)
from ..columns._columns import as_is
from ..columns._items import rebuild, unbind_rows, unnest
from ..storage import SharedTensor
from ._transport import worker_buffers, worker_empty

__all__ = [
    "Row", "RowList", "RowTuple", "Samples", "collate_columns", "collate_in_one_memfd",
    "collate_rows", "collate_shared", "into_one_batch", "schema_of", "stacking", "through",
]  # fmt: skip

FnMap = dict[Any, Callable[..., Any]]
Keep = Callable[..., torch.Tensor]

# -- Note [Collating into one memfd] ----------------------------------------------------
# registry functions that stack as torch's does (-> lenient), replaced in both passes;
# those that make numbers; those run as they are (they make no tensor themselves)
_STACKING: dict[Callable[..., Any], bool] = {collate_tensor_fn: False}
_NUMBERS = (collate_numpy_scalar_fn, collate_float_fn, collate_int_fn)
_AS_THEY_ARE: set[Callable[..., Any]] = {collate_numpy_array_fn, collate_str_fn}
_OURS = (torch.Tensor, SharedTensor)


def _plain_cpu(elem: Any) -> bool:
    """Whether torch would stack tensors like ``elem`` into plain CPU memory of ours."""
    return elem.layout is torch.strided and elem.device.type == "cpu" and not elem.is_nested


def stacking(fn: Callable[..., Any], lenient: bool = False) -> Callable[..., Any]:
    """Mark a registry function that stacks as ``collate_tensor_fn`` (``lenient``: see Note)."""
    _STACKING[fn] = lenient
    return fn


def through(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a registry function that only collates what it holds with the registry given."""
    _AS_THEY_ARE.add(fn)
    return fn


def collate_in_one_memfd(top: Callable[[FnMap, Keep], Any], fn_map: FnMap) -> Any:
    """``top(map, keep)`` run twice: the tensors it makes with ``map`` go into one memfd.

    So do those it passes to ``keep``: ``keep(tensor)`` is ``tensor`` in the first
    pass, its copy in the second; ``keep(tensor, beside=True)`` copies it only if the
    batch gets a memfd anyway.

    Example:
        >>> from shareddata._compat import collate, default_collate_fn_map
        >>> batch = [{"x": torch.ones(2), "y": 1}, {"x": torch.zeros(2), "y": 2}]
        >>> out = collate_in_one_memfd(lambda m, keep: collate(batch, collate_fn_map=m),
        ...                            default_collate_fn_map)
        >>> out["y"], type(out["x"]).__name__
        (SharedTensor([1, 2]), 'SharedTensor')
        >>> out["x"].untyped_storage().data_ptr() == out["y"].untyped_storage().data_ptr()
        True
    """
    plan = _Plan(fn_map)
    made = top(plan.registry(filling=False), plan.keep)
    if len(plan.parts) == plan.beside:  # nothing to copy or stack: the first pass made it
        return made
    del made
    plan.buffers = worker_buffers(plan.parts)
    return top(plan.registry(filling=True), plan.kept)


def into_one_batch(items: list[Any]) -> list[Any]:
    """``items`` with every plain CPU tensor in them moved into one batch memfd.

    For values made afresh per row (``SharedList`` unpickles each item), whose tensors
    would each leave the worker in a segment of their own. Tensors in dicts, lists,
    tuples and namedtuples are copied side by side and replaced by views; other
    objects, and tensors torch must send itself (``requires_grad``, sparse, a
    subclass, not on the CPU), are kept.

    Example:
        >>> rows = [{"a": torch.arange(3), "b": (torch.ones(2), "x")}, [torch.zeros(1)]]
        >>> out = into_one_batch(rows)  # outside a worker there is one memfd too
        >>> out[0]["b"], len({t.untyped_storage().data_ptr() for t in (out[0]["a"], out[1][0])})
        ((SharedTensor([1., 1.]), 'x'), 1)
    """
    return collate_in_one_memfd(lambda fns, keep: _replace(items, keep), {})  # type: ignore[no-any-return]


def _replace(obj: Any, keep: Keep) -> Any:
    if (
        type(obj) is torch.Tensor
        and _plain_cpu(obj)
        and not (obj.requires_grad or obj.is_quantized)
        and obj.numel() > 0
    ):
        return keep(obj)
    if type(obj) is dict:
        return {key: _replace(value, keep) for key, value in obj.items()}
    if type(obj) is list:
        return [_replace(value, keep) for value in obj]
    if type(obj) is tuple:
        return tuple(_replace(value, keep) for value in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_replace(value, keep) for value in obj))
    return obj


def _stack(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """``torch.stack``: for tensors of different shapes, the error the default collate raises."""
    return torch.stack(batch, 0)


class _Plan:
    """The tensors of one batch: noted by the first pass, made by the second."""

    def __init__(self, fn_map: FnMap) -> None:
        self.fn_map = fn_map
        self.parts: list[tuple[tuple[int, ...], torch.dtype]] = []
        # per call of a replaced function, in call order: what the second pass returns
        self.replays: list[Callable[[Any], Any]] = []
        self.buffers: list[torch.Tensor] = []
        self.at = 0
        self.beside = 0  # parts kept ``beside``: no reason for a memfd of their own

    def registry(self, filling: bool) -> FnMap:
        """``fn_map`` (same keys, same order) with the functions this pass replaces."""
        out: FnMap = {}
        for key, fn in self.fn_map.items():
            if fn in _AS_THEY_ARE:
                out[key] = fn
            elif filling:  # the second pass replays the first's calls, in order
                out[key] = self._fill
            elif fn in _STACKING:
                out[key] = self._noting(_STACKING[fn])
            else:  # torch's number functions, and the user's (run with their registry)
                out[key] = partial(self._call, fn, fn in _NUMBERS)
        return out

    # first pass
    def _noting(self, lenient: bool) -> Callable[..., Any]:
        def note(batch: Any, *, collate_fn_map: Any = None) -> Any:
            elem = batch[0]
            if not (type(elem) in _OURS and _plain_cpu(elem)):
                return self._call(collate_tensor_fn, False, batch)
            shape = elem.shape
            if any(t.shape != shape for t in batch):
                if not lenient:  # torch's error, with nothing allocated
                    return self._call(_stack, False, batch)
                # the list of the rows, each kept (copied into the batch's memfd)
                self.replays.append(lambda batch: [self.kept(t) for t in batch])
                return [self.keep(t) for t in batch]
            self.replays.append(partial(self._stack_into, len(self.parts)))
            self.parts.append(((len(batch), *shape), elem.dtype))
            return None  # made by the second pass

        return note

    def _call(
        self, fn: Callable[..., Any], numbers: bool, batch: Any, *, collate_fn_map: Any = None
    ) -> Any:
        """``fn``'s result, kept for the second pass (a tensor of ``numbers``: its copy).

        ``fn`` is given the registry the caller gave (torch's functions that this pass
        calls read none).
        """
        at = len(self.replays)
        # until it returns: a caller that goes on (a lenient collate) has it run again
        self.replays.append(partial(fn, collate_fn_map=self.fn_map))
        made = fn(batch, collate_fn_map=self.fn_map)
        if numbers and type(made) is torch.Tensor and made.numel():
            self.replays[at] = self._copying(made)
        else:
            self.replays[at] = lambda batch: made
        return made

    def keep(self, tensor: torch.Tensor, beside: bool = False) -> torch.Tensor:
        """``tensor``, noted: the second pass's ``keep`` gives its copy in the memfd."""
        self.beside += beside
        self.replays.append(self._copying(tensor))
        return tensor

    def _copying(self, tensor: torch.Tensor) -> Callable[[Any], torch.Tensor]:
        k = len(self.parts)
        self.parts.append((tuple(tensor.shape), tensor.dtype))
        return lambda batch: self._copy(k, tensor)

    # second pass
    def _fill(self, batch: Any, *, collate_fn_map: Any = None) -> Any:
        self.at += 1
        return self.replays[self.at - 1](batch)

    def kept(self, tensor: torch.Tensor, beside: bool = False) -> torch.Tensor:
        return self._fill(tensor)  # type: ignore[no-any-return]

    def _stack_into(self, k: int, batch: Any) -> torch.Tensor:
        out = self.buffers[k]
        torch.stack(batch, 0, out=out.as_subclass(torch.Tensor))  # as torch does in a worker
        return out

    def _copy(self, k: int, tensor: torch.Tensor) -> torch.Tensor:
        out = self.buffers[k]
        out.as_subclass(torch.Tensor).copy_(tensor)  # plain: no Python dispatch per copy
        return out


# -- Note [The default collate's shortcut] ----------------------------------------------
class Row(dict):  # type: ignore[type-arg]
    """One sample of a gathered batch, ``{column: value}``: a plain ``dict`` to its user."""

    __slots__ = ()


class RowTuple(tuple):  # type: ignore[type-arg]
    """One sample of a gathered batch, values in column order: a ``tuple`` to its user."""

    __slots__ = ()


class RowList(list):  # type: ignore[type-arg]
    """One sample of a gathered batch whose items are lists: a ``list`` to its user."""

    __slots__ = ()


def schema_of(nesting: Any, tuples: bool) -> Any:
    """The schema samples are made from (None: flat); with ``tuples`` a dict's values."""
    if nesting is not None and tuples and nesting[0] == "dict":
        return ("tuple", [child for _, child in nesting[1]])
    return nesting


class Samples(list):  # type: ignore[type-arg]
    """The samples of one batch, made at their first use from the gathered columns.

    A plain list of ``Row`` (``RowTuple`` if ``tuples``) to its users (Note [Samples
    made when first used]).

    Args:
        names: column names, in sample order.
        batched: per column, the gathered batch.
        stacked: per column, whether ``batched`` is what the default collate makes.
        splits: per column, what cuts its batch into one value per row.
        n: the number of rows (used when there are no columns).
        nesting: nested samples' schema (Note [Nested items] in ``columns/_items.py``).
        tuples: ``RowTuple`` samples rather than ``Row``.
        firsts: per column, what makes row 0's value alone (None: ``batched[k][0]``).
        portable: ``splits`` and ``firsts`` are module-level: pickled with the columns.

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
                    b[0] if first is None else first(b) for first, b in zip(firsts, self.batched)
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
            # are made where they are first used (Note [Samples made when first used]);
            # splits that are columns' methods cross as the module-level ones they stand for
            splits, firsts = self._splits, self._firsts
            if not self._portable:
                splits, firsts = [unbind_rows if s else as_is for s in self.stacked], None
            args = (self.names, self.batched, self.stacked, splits, self._n, self.nesting)
            return Samples, (*args, self._tuples, firsts, True)
        return list, (list(self),)

    def collated(self, collate_fn_map: FnMap | None) -> Any:
        """What ``default_collate`` makes of these samples (:func:`collate_columns`)."""
        args = (self.names, self.batched, self.stacked, self.nesting, self._tuples)
        return collate_columns(*args, collate_fn_map)

    def intact(self) -> bool:
        """Whether this list still holds exactly the samples it made, as they were made."""
        if self._pending:  # nothing but the first sample was handed out
            if self._first is None:
                return True
            rows: Sequence[Any] = (self._first,)
            values: Sequence[Sequence[Any]] = [[v] for v in self._first_values]
        else:
            rows, values = self._rows, self._values
            if list.__len__(self) != len(rows) or not all(map(operator.is_, self, rows)):
                return False
        if self.nesting is not None:
            out: list[Any] = [None] * len(self.names)
            return all(
                unnest(row, self.nesting, out) and all(o is v[j] for o, v in zip(out, values))
                for j, row in enumerate(rows)
            )
        if rows and isinstance(rows[0], Row):  # (RowTuple samples are immutable)
            if not all(len(r) == len(self.names) for r in rows):
                return False
            try:  # KeyError: a sample lost a key
                return all(
                    all(map(operator.is_, map(operator.itemgetter(name), rows), column))
                    for name, column in zip(self.names, values)
                )
            except KeyError:
                return False
        return True


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


def collate_rows(batch: Sequence[Any], *, collate_fn_map: FnMap | None = None) -> Any:
    """``default_collate`` for :class:`Row` / :class:`RowTuple` / :class:`RowList` samples."""
    if isinstance(batch, Samples) and batch.intact():
        return batch.collated(collate_fn_map)
    if collate_fn_map is None:
        collate_fn_map = default_collate_fn_map
    if get_worker_info() is not None:  # leaving a worker: Note [Collating into one memfd]
        return collate_in_one_memfd(lambda fns, _: _collate_samples(batch, fns), collate_fn_map)
    return _collate_samples(batch, collate_fn_map)


def _collate_samples(batch: Sequence[Any], collate_fn_map: FnMap) -> Any:
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
def collate_shared(batch: Sequence[Any], *, collate_fn_map: FnMap | None = None) -> Any:
    """``default_collate`` for :class:`SharedTensor` s (a worker's views of its batch).

    The gathered column for an intact :class:`Samples` of tensors alone; in a worker,
    the tensors stacked into one memfd; elsewhere torch's own stack.
    """
    if isinstance(batch, Samples) and batch.stacked[0] and batch.intact():
        return batch.batched[0]  # (only items that are a tensor alone make tensor samples)
    elem = batch[0]
    if get_worker_info() is not None and _plain_cpu(elem):
        # stacked as torch stacks in a worker (its errors too), into a memfd of ours
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
    collate_fn_map: FnMap | None = None,
    lenient: bool = False,
) -> Any:
    """What ``default_collate`` makes of samples, from their columns as gathered.

    A stacked column is taken as it is; the others' rows are collated (from a tuple or
    list sample as a tuple, from a dict as a list). ``lenient``: a column that
    ``default_collate`` cannot collate stays the list of its rows.
    """
    schema = schema_of(nesting, tuples)
    columns = list(batched)
    if not all(stacked):
        in_sequence = _in_sequence(names, schema, tuples)
        rows = {
            k: (tuple if k in in_sequence else list)(b)
            for k, (b, done) in enumerate(zip(batched, stacked))
            if not done
        }

        def collate_rows_of(fns: FnMap) -> None:
            for k, column in rows.items():
                try:
                    columns[k] = collate(column, collate_fn_map=fns)
                except (RuntimeError, TypeError):
                    if not lenient:
                        raise
                    columns[k] = list(column)

        fns = default_collate_fn_map if collate_fn_map is None else collate_fn_map
        if get_worker_info() is None:
            collate_rows_of(fns)
        else:  # leaving a worker: one memfd in all, with the gathered columns

            def in_one_memfd(fns: FnMap, keep: Keep) -> None:
                collate_rows_of(fns)
                for k in (k for k, done in enumerate(stacked) if done):
                    columns[k] = keep(batched[k], beside=True)

            collate_in_one_memfd(in_one_memfd, fns)
    if schema is not None:
        return rebuild(schema, columns, batch=True)
    return columns if tuples else dict(zip(names, columns))


def _in_sequence(names: Sequence[str], schema: Any, tuples: bool) -> set[int] | range:
    """The columns whose values sit in a tuple or list of the samples (not in a dict)."""
    if schema is None:
        return range(len(names)) if tuples else set()

    def visit(node: Any, in_sequence: bool) -> set[int]:
        tag, body = node
        if tag == "leaf":
            return {body} if in_sequence else set()
        children = [child for _, child in body] if tag == "dict" else body
        return set().union(*(visit(child, tag != "dict") for child in children))

    return visit(schema, False)


default_collate_fn_map[Row] = collate_rows
default_collate_fn_map[RowTuple] = collate_rows
default_collate_fn_map[RowList] = collate_rows
default_collate_fn_map[SharedTensor] = collate_shared
