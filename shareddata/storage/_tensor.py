"""SharedTensor: the tensor type over shareddata's memory, and how it crosses processes.

Note [Tensors over our memory cross by handle]
----------------------------------------------
``ForkingPickler`` (what a DataLoader's queues, ``torch.multiprocessing`` and
``multiprocessing`` pools pickle with) hands a plain tensor to torch's reducer, which
moves its whole storage into a new shared segment and sends that segment's
descriptor. For memory that is shareddata's own that is a copy too many: a view of a
dataset's column has the whole column as its storage, and a worker's batch already
lives in shared memory (a memfd) that the main process can map. So tensors over our
memory are instances of our own type, :class:`SharedTensor`, and only that type gets
a reducer of ours; torch's own types keep torch's reducers, untouched.

A :class:`SharedTensor` carries a *reference* to the memory its storage covers
(``_shared``): a :class:`SegmentRef` for a segment (a ``SharedArray``, a dataset's
column) or a worker's batch reference (``crossing/_transport.py``). It pickles as that
reference plus its dtype, offset, shape and stride: any view, slice or
non-contiguous view crosses with its layout, and the reference is pickled once per
message however many tensors share it (the pickler's memo), so a batch's samples
cross as one handle. The reference unpickles into a storage over the same pages:
a writable ``SharedArray``'s pages are shared (a write reaches every process);
a read-only segment's range gets a copy-on-write mapping of its own, so a receiver
that writes to what it received never changes the data. What a process receives is
a plain ``torch.Tensor``.

Operations keep the type where they make a view of our memory (indexing, slicing,
``view``, ``unbind``, ``t()``...): every other result is a plain tensor, so a model
that receives one never runs Python code per operation. Plain ``pickle`` and
``torch.save`` see a :class:`SharedTensor` as a plain tensor, by value, and
``copy.deepcopy`` copies it into private memory. A ``SharedTensor`` that cannot
cross by handle (``requires_grad`` set, a conjugate view) crosses as torch crosses a
copy of it. A failure inside these reducers (the tensor's and its reference's) never raises in
the sender (a DataLoader worker's queue feeder would drop the batch and the main
process would wait forever): it unpickles as :class:`~shareddata.errors.BatchSendError`,
raised in the main process where the batch was expected.
"""

from __future__ import annotations

import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import numpy as np
import torch

from .._compat import (
    DisableTorchFunctionSubclass,
    coo_parts,
    make_subclass,
    retype_new_views,
    torch_reduce_tensor,
    view_base,
)
from ..errors import BatchSendError
from ._capacity import named_os_errors
from ._linux import array_at, map_fd, page_floor, unmap
from ._segment import Segment, attach

__all__ = ["MemoryRef", "SegmentRef", "SharedTensor", "rebuild_tensor", "shared_tensor"]


class MemoryRef(Protocol):
    """What a :class:`SharedTensor` views: pickles as something that unpickles to a storage."""

    address: int
    """Where the storage of the tensors over this memory starts, in this process."""
    nbytes: int
    """Bytes of that storage."""

    def __reduce__(self) -> tuple[Any, ...]: ...


class SharedTensor(torch.Tensor):
    """A tensor over shareddata's shared memory; it crosses processes by handle, not by copy.

    ``SharedArray.torch()`` returns one, and so do the batches shareddata makes in a
    DataLoader worker (before they cross: the main process receives plain tensors over
    the same pages). Views of it (indexing, slicing, ``view``, ``unbind``, ``t()``...)
    are ``SharedTensor`` s too; any other result is a plain tensor, so a model never
    runs Python code per operation because of it. Sent through ``multiprocessing``
    (a DataLoader's queues, a pool, ``torch.multiprocessing``), it crosses as the
    handle of its memory: no copy, and a writable ``SharedArray``'s pages stay shared.
    Plain ``pickle`` and ``torch.save`` store it by value, as a plain tensor;
    ``copy.deepcopy`` copies it into private memory. Only this type has a reducer of
    shareddata's: torch's own types keep torch's. Note [Tensors over our memory cross
    by handle].

    Example:
        >>> import shareddata as sd
        >>> t = sd.SharedArray.from_array(np.arange(6.0)).torch()
        >>> type(t).__name__, type(t[2:]).__name__, type(t * 2).__name__
        ('SharedTensor', 'SharedTensor', 'Tensor')
        >>> t[2:]
        SharedTensor([2., 3., 4., 5.], dtype=torch.float64)
    """

    _shared: MemoryRef

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _SHARE_MEMORY:  # it is shared memory: torch would move it out, in place
            return args[0]
        with DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            if type(out) is torch.Tensor:
                return _keep_views(out, (out,), args)
            if type(out) in (tuple, list) and out and type(out[0]) is torch.Tensor:
                return _keep_views(out, out, args, func in _NEW_VIEWS)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        # plain pickle and torch.save: an ordinary tensor, by value
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).__deepcopy__(memo)


_SHARE_MEMORY = torch.Tensor.share_memory_


# Functions whose every result is a new view (never an argument itself): their results
# are retyped in place (:func:`retype_new_views`), not aliased by ``as_subclass``.
_NEW_VIEWS = frozenset(
    f
    for name in ("unbind", "split", "chunk", "tensor_split", "unsafe_split")
    for f in (getattr(torch.Tensor, name, None), getattr(torch, name, None))
    if f is not None
)


def _keep_views(out: Any, tensors: Any, args: Any, new: bool = False) -> Any:
    """``out`` with ``tensors`` (its tensors) as SharedTensors if they view an argument's memory.

    Called with torch functions disabled (attribute reads are then plain C calls). A
    sequence (``unbind``, ``split``, ``chunk``) is checked at its first and last
    element: view functions return views only. ``new``: ``out`` is a sequence of new
    views, made by one of ``_NEW_VIEWS``.
    """
    ref = None
    for arg in args:
        if isinstance(arg, SharedTensor):
            ref = memory_ref(arg)
            break
    if ref is None:
        return out
    ends = (tensors[0], tensors[-1])
    if any(t.layout is not torch.strided for t in ends):  # sparse results hold new tensors
        return out
    if not all(t.untyped_storage().data_ptr() == ref.address for t in ends):
        return out
    if type(out) is torch.Tensor:
        return shared_tensor(out, ref)
    if not new:
        return type(out)(shared_tensor(t, ref) if type(t) is torch.Tensor else t for t in out)
    # a view per row of a batch (``unbind``): the loop a worker's samples pay for, per
    # row (Note [Samples made when first used] in crossing/_collate.py). The rows share
    # one base; when that base holds ``ref`` they hold none of their own (a dict each)
    views = retype_new_views(list(tensors), SharedTensor)
    base = view_base(views[0])
    if base is None or base.__dict__.get("_shared") is not ref:
        for view in views:
            view._shared = ref
    return type(out)(views)


def memory_ref(tensor: SharedTensor) -> MemoryRef | None:
    """The reference to the memory under ``tensor``: its own, else its base's.

    A new view made by ``unbind``/``split`` of a tensor that holds its reference has
    none of its own: the base it views (which the view keeps alive) holds it. Called
    with torch functions disabled (``_base`` is then a plain attribute read).

    Example:
        >>> import numpy as np, shareddata as sd
        >>> batch = sd.SharedArray.from_array(np.zeros((4, 2))).torch()
        >>> row = batch.unbind(0)[1]
        >>> with DisableTorchFunctionSubclass():
        ...     memory_ref(row) is memory_ref(batch) is not None
        True
    """
    ref = tensor.__dict__.get("_shared")
    if ref is None:
        base = view_base(tensor)
        if base is not None:
            ref = base.__dict__.get("_shared")
    return ref


def shared_tensor(tensor: torch.Tensor, ref: MemoryRef, *, new: bool = False) -> SharedTensor:
    """``tensor`` (whose storage is the memory of ``ref``) as a :class:`SharedTensor`.

    A sparse tensor (whose indices and values are the memory of ``ref``) too. ``new``:
    ``tensor`` was just made and nothing else holds it: it becomes the SharedTensor
    itself (no alias), so views of it find ``ref`` at their base (:func:`memory_ref`).
    """
    if tensor.layout is not torch.strided:
        shared = make_subclass(SharedTensor, tensor)
    elif new:
        shared = retype_new_views([tensor], SharedTensor)[0]
    else:
        shared = tensor.as_subclass(SharedTensor)
    shared._shared = ref
    return shared


def reduce_shared_tensor(tensor: SharedTensor) -> Any:
    """``ForkingPickler``'s reducer of :class:`SharedTensor`: by handle, else a copy by torch."""
    try:
        with DisableTorchFunctionSubclass():  # plain attribute reads, no Python dispatch
            ref = memory_ref(tensor)
            if ref is not None and tensor.layout is torch.sparse_coo and not tensor.requires_grad:
                # a sparse batch: its indices and values, views of the memory, cross by handle
                parts = [shared_tensor(p, ref) for p in coo_parts(tensor)]
                return _rebuild_coo, (*parts, tuple(tensor.shape), tensor.is_coalesced())
            if (
                ref is not None
                and not tensor.requires_grad
                and not tensor.is_conj()
                and not tensor.is_neg()
                and tensor.untyped_storage().data_ptr() == ref.address
            ):
                layout = (tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
                return rebuild_tensor, (ref, DTYPE_NAMES[tensor.dtype], *layout)
            # not ours to send by handle: a copy, the way torch sends any tensor (never
            # the original: torch would move a SharedArray's storage out of the segment)
            plain = tensor.as_subclass(torch.Tensor)
            copy = plain.detach().clone().requires_grad_(plain.requires_grad)
        return torch_reduce_tensor(copy)
    except Exception as e:  # never let a queue's feeder thread drop a batch silently
        return raise_send_error, (describe_failure(e, "a tensor over shared memory"),)


# a dtype crosses as its name in ``torch``: cheaper to pickle and to unpickle than itself
DTYPE_NAMES = {
    dtype: name
    for name in dir(torch)
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


def _rebuild_coo(
    indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...], coalesced: bool
) -> torch.Tensor:
    """Unpickle a sparse COO tensor from its indices and values (checked when made)."""
    return torch.sparse_coo_tensor(
        indices, values, shape, is_coalesced=coalesced, check_invariants=False
    )


def rebuild_tensor(
    storage: torch.UntypedStorage,
    dtype: str,
    offset: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    """Unpickle a tensor: ``storage`` (what its reference unpickled into) with its layout."""
    empty = torch.empty(0, dtype=getattr(torch, dtype))
    return empty.set_(storage, offset, shape, stride)  # type: ignore[call-overload]


def raise_send_error(message: str) -> Any:
    """Unpickle a failure of the sender's reducer: raise it where the data was expected."""
    raise BatchSendError(message)


def describe_failure(error: BaseException, what: str) -> str:
    """What :func:`raise_send_error` says of ``error``."""
    return f"{what} could not be pickled for another process: {type(error).__name__}: {error}"


ForkingPickler.register(SharedTensor, reduce_shared_tensor)


class SegmentRef:
    """The memory of a ``SharedArray``: ``nbytes`` at ``offset`` of a segment.

    Pickled by ``multiprocessing`` with a ticket (the sender keeps the segment until
    the receiver holds it: Note [Handing a segment over] in ``_handoff.py``).
    """

    __slots__ = ("address", "nbytes", "offset", "segment", "writable")

    def __init__(self, segment: Segment, offset: int, nbytes: int, address: int, writable: bool):
        self.segment, self.offset, self.nbytes = segment, offset, nbytes
        self.address, self.writable = address, writable

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            # a read-only (or sealed) segment crosses copy-on-write; a SharedArray shared
            writable = self.writable and self.segment.writable
            handle = (*self.segment.handle(ticket=True), writable)
        except Exception as e:  # never raise in a queue's feeder thread (see the Note)
            return raise_send_error, (describe_failure(e, "a SharedArray's memory"),)
        return _rebuild_segment_storage, (handle, self.offset, self.nbytes)


def _rebuild_segment_storage(
    handle: tuple[Any, ...], offset: int, nbytes: int
) -> torch.UntypedStorage:
    """The storage over ``nbytes`` at ``offset`` of the segment ``handle`` (unpickling).

    A read-only segment's range gets a copy-on-write mapping of its own: a receiver
    that writes to what it received changes neither the data nor another sample
    it received (the pages stay shared until written).
    """
    writable = handle[-1]
    segment = attach(*handle)
    if writable:
        array = segment.view(offset, nbytes)  # the segment lives as long as the array
    else:
        array = _private_mapping(segment.fd, offset, nbytes)
    return torch.from_numpy(array).untyped_storage()


def _private_mapping(fd: int, offset: int, nbytes: int) -> np.ndarray:
    """A copy-on-write mapping of ``nbytes`` at ``offset`` of ``fd``, unmapped when garbage."""
    start = page_floor(offset)
    length = offset + nbytes - start
    with named_os_errors("a tensor received from another process", length):
        mapped = array_at(map_fd(fd, length, start, private=True), length)
    address = mapped.ctypes.data
    weakref.finalize(mapped, unmap, address, length).atexit = False
    return mapped[offset - start : offset - start + nbytes]
