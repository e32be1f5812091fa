"""The default collate in a DataLoader worker, into one batch memfd.

Note [Collating into one memfd]
-------------------------------
In a worker, torch's default collate puts each tensor it stacks in a ``/dev/shm``
segment of its own (``collate_tensor_fn`` allocates it shared), and a tensor it makes
of numbers (``torch.tensor(labels)``) crosses the same way when it is pickled: a dict
batch of images and labels leaves as two torch segments, each fetched over a socket
(Note [How a batch leaves a worker] in ``_outbox.py``). Where the default collate
reaches one of shareddata's types whose columns cannot simply be taken (samples
changed before the collate, ``SharedList`` items, a list of ``SharedTensor`` s, a
column of rows), it collates in two passes of torch's own ``collate``. The first
runs with the registry's tensor and number functions replaced by ones that note the
shape and dtype of what each would make (numbers are made then: they are small);
one memfd is allocated for all of them (:func:`~._outbox.worker_buffers`); the
second pass, the same traversal, stacks and copies into it, with ``out=`` as torch
stacks in a worker. Everything else is torch's, run as it is: the containers,
``str``, numpy arrays (their tensors come back to the replaced function), the
errors; an entry of the registry that is not torch's own (the user's) runs once,
with the registry as given, and its result is kept, unless it says what it does:
:func:`through` (it only collates what it holds, with the registry it is given) or
:func:`stacking` (it stacks as torch does; ``lenient``: rows of different shapes
stay the list of them, copied into the same memfd: what ``ds[indices]`` gives,
Note [A batch by index] in ``datasets/_indexing.py``). A tensor that torch would not
stack into plain memory of ours (a subclass, another device, a nested tensor) goes
through torch's function, with its result or its error. The batch is the one
``default_collate`` makes, its tensors views of one memfd. When only some columns
of a gathered batch need collating (a column of rows beside columns gathered into a
memfd already), the gathered ones are copied into the same new memfd if it is made
at all (:func:`collate_beside`): a copy costs less than a second descriptor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._compat import (
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
)
from ..storage import SharedTensor
from ._outbox import worker_buffers

__all__ = ["collate_beside", "collate_in_one_memfd", "stacking", "through"]

_STACKING: dict[Callable[..., Any], bool] = {collate_tensor_fn: False}
"""Registry functions that stack tensors as torch's does (-> whether rows of different
shapes are left as the list of them instead): replaced in a worker's two passes."""
_NUMBERS = (collate_numpy_scalar_fn, collate_float_fn, collate_int_fn)
_AS_THEY_ARE: set[Callable[..., Any]] = {collate_numpy_array_fn, collate_str_fn}
"""Registry functions run in both passes as they are: they make no tensor themselves and
collate what they hold with the registry they are given."""
_OURS = (torch.Tensor, SharedTensor)


def stacking(fn: Callable[..., Any], lenient: bool = False) -> Callable[..., Any]:
    """Mark a registry function that stacks tensors as ``collate_tensor_fn`` does.

    ``lenient``: rows of different shapes give the list of them.
    """
    _STACKING[fn] = lenient
    return fn


def through(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a registry function that only collates what it holds with the registry given."""
    _AS_THEY_ARE.add(fn)
    return fn


def collate_in_one_memfd(
    top: Callable[[dict[Any, Callable[..., Any]]], Any], fn_map: dict[Any, Callable[..., Any]]
) -> Any:
    """``top(map)`` run twice: the tensors it makes with ``map`` go into one memfd.

    ``top`` collates a batch calling torch's ``collate`` with the registry it is given
    (``fn_map`` with its tensor and number functions replaced): Note [Collating into
    one memfd].

    Example:
        >>> from shareddata._compat import collate, default_collate_fn_map
        >>> batch = [{"x": torch.ones(2), "y": 1}, {"x": torch.zeros(2), "y": 2}]
        >>> out = collate_in_one_memfd(lambda m: collate(batch, collate_fn_map=m),
        ...                            default_collate_fn_map)
        >>> out["y"], type(out["x"]).__name__
        (SharedTensor([1, 2]), 'SharedTensor')
        >>> out["x"].untyped_storage().data_ptr() == out["y"].untyped_storage().data_ptr()
        True
    """
    return collate_beside(top, fn_map, [])[0]


def collate_beside(
    top: Callable[[dict[Any, Callable[..., Any]]], Any],
    fn_map: dict[Any, Callable[..., Any]],
    tensors: list[torch.Tensor],
) -> tuple[Any, list[torch.Tensor]]:
    """:func:`collate_in_one_memfd`, and ``tensors`` copied into the same memfd if it makes one.

    For a batch whose columns were gathered into a memfd of their own, and whose
    other columns make tensors when collated: one memfd for the batch, not two
    (a copy of the gathered columns costs less than a second descriptor to fetch).
    """
    plan = _Plan(fn_map)
    made = top(plan.registry(filling=False))
    if not plan.parts:  # no tensor: the first pass made the batch
        return made, tensors
    del made
    n = len(plan.parts)
    buffers = worker_buffers(plan.parts + [(tuple(t.shape), t.dtype) for t in tensors])
    plan.buffers, plan.at = buffers[:n], 0
    for out, tensor in zip(buffers[n:], tensors):
        out.as_subclass(torch.Tensor).copy_(tensor)
    return top(plan.registry(filling=True)), buffers[n:]


def _stack(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """``torch.stack``: for tensors of different shapes, the error the default collate raises."""
    return torch.stack(batch, 0)


class _Plan:
    """The tensors of one batch: noted by the first pass, made by the second."""

    def __init__(self, fn_map: dict[Any, Callable[..., Any]]) -> None:
        self.fn_map = fn_map
        self.parts: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.entries: list[Any] = []  # per call of a replaced function, in call order
        self.buffers: list[torch.Tensor] = []
        self.at = 0

    def registry(self, filling: bool) -> dict[Any, Callable[..., Any]]:
        """``fn_map`` (same keys, same order) with the functions this pass replaces."""
        out: dict[Any, Callable[..., Any]] = {}
        for key, fn in self.fn_map.items():
            if fn in _STACKING:
                out[key] = self._fill_tensors if filling else self._noting(_STACKING[fn])
            elif fn in _NUMBERS:
                out[key] = self._fill_numbers if filling else self._numbers(fn)
            elif fn in _AS_THEY_ARE:
                out[key] = fn
            else:
                out[key] = self._replayed if filling else self._kept(fn)
        return out

    def _next(self) -> Any:
        entry = self.entries[self.at]
        self.at += 1
        return entry

    # first pass ---------------------------------------------------------------------
    def _noting(self, lenient: bool) -> Callable[..., Any]:
        def note(batch: Any, *, collate_fn_map: Any = None) -> Any:
            return self._note_tensors(batch, collate_fn_map, lenient)

        return note

    def _note_tensors(self, batch: Any, collate_fn_map: Any, lenient: bool) -> Any:
        elem = batch[0]
        if (
            type(elem) in _OURS
            and elem.layout is torch.strided
            and elem.device.type == "cpu"
            and not elem.is_nested
        ):
            shape = elem.shape
            if any(t.shape != shape for t in batch):
                if not lenient:  # torch's error, with nothing allocated
                    return self._call(_stack, batch, collate_fn_map)
                # the list of the rows, copied into the batch's memfd with the rest
                self.entries.append(["rows", len(self.parts)])
                self.parts.extend((tuple(t.shape), t.dtype) for t in batch)
                return list(batch)
            self.entries.append(len(self.parts))
            self.parts.append(((len(batch), *shape), elem.dtype))
            return None  # made by the second pass
        return self._call(collate_tensor_fn, batch, collate_fn_map)

    def _numbers(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def note(batch: Any, *, collate_fn_map: Any = None) -> Any:
            entry: list[Any] = ["raised", fn, collate_fn_map]  # until it returns
            self.entries.append(entry)
            made = fn(batch, collate_fn_map=collate_fn_map)
            if type(made) is torch.Tensor and made.numel():
                entry[:] = ["copy", len(self.parts), made]
                self.parts.append((tuple(made.shape), made.dtype))
            else:
                entry[:] = ["made", made]
            return made

        return note

    def _kept(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def keep(batch: Any, *, collate_fn_map: Any = None) -> Any:
            return self._call(fn, batch, self.fn_map)

        return keep

    def _call(self, fn: Callable[..., Any], batch: Any, fn_map: Any) -> Any:
        entry: list[Any] = ["raised", fn, fn_map]  # until it returns
        self.entries.append(entry)
        made = fn(batch, collate_fn_map=fn_map)
        entry[:] = ["made", made]
        return made

    # second pass --------------------------------------------------------------------
    def _fill_tensors(self, batch: Any, *, collate_fn_map: Any = None) -> Any:
        entry = self._next()
        if type(entry) is int:
            out = self.buffers[entry]
            torch.stack(batch, 0, out=out.as_subclass(torch.Tensor))  # as torch does in a worker
            return out
        if entry[0] == "rows":
            rows = self.buffers[entry[1] : entry[1] + len(batch)]
            for out, row in zip(rows, batch):
                out.as_subclass(torch.Tensor).copy_(row)
            return rows
        return self._replay(entry, batch)

    def _fill_numbers(self, batch: Any, *, collate_fn_map: Any = None) -> Any:
        entry = self._next()
        if entry[0] == "copy":
            out = self.buffers[entry[1]]
            out.as_subclass(torch.Tensor).copy_(entry[2])
            return out
        return self._replay(entry, batch)

    def _replayed(self, batch: Any, *, collate_fn_map: Any = None) -> Any:
        return self._replay(self._next(), batch)

    @staticmethod
    def _replay(entry: list[Any], batch: Any) -> Any:
        if entry[0] == "made":
            return entry[1]
        # it raised in the first pass (a caller went on: a lenient collate): again
        _, fn, fn_map = entry
        return fn(batch, collate_fn_map=fn_map)
