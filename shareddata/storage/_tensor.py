"""SharedTensor: the tensor type over shareddata's memory, and how it crosses processes.

Note [Tensors over our memory cross by handle]
----------------------------------------------
``ForkingPickler`` hands a plain tensor to torch's reducer, which copies its whole
storage into a new segment: a copy too many for memory already shared (a view of a
column has the whole column as storage). So tensors over our memory are
:class:`SharedTensor` s, the only type with a reducer of ours. One carries a
reference (``_shared``: a :class:`SegmentRef`, or a worker's batch reference in
``crossing/_transport.py``) and pickles as it plus dtype, offset, shape and stride;
the pickler's memo sends a shared reference once per message. A writable
``SharedArray``'s pages stay shared; a read-only range gets a copy-on-write mapping
of its own. Receivers get plain tensors. Views keep the type, other results are
plain; ``pickle``, ``torch.save`` and ``deepcopy`` see a plain tensor. A tensor that
cannot cross by handle (``requires_grad``, conjugate) crosses as torch's copy. A
reducer failure never raises in the sender (a queue feeder would drop the batch): it
unpickles as :class:`~shareddata.errors.BatchSendError`.
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

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
from ._segment import Segment, attach


class MemoryRef(Protocol):
    """What a :class:`SharedTensor` views: pickles as something that unpickles to a storage."""

    address: int  # where the storage starts in this process
    nbytes: int

    def __reduce__(self) -> tuple[Any, ...]: ...


class SharedTensor(torch.Tensor):
    """A tensor over shareddata's shared memory, crossing processes by handle.

    Views stay ``SharedTensor`` s, other results are plain (Note [Tensors over our
    memory cross by handle]).

    Example:
        >>> import numpy as np, shareddata as sd
        >>> t = sd.SharedArray.from_array(np.arange(6.0)).torch()
        >>> type(t).__name__, type(t[2:]).__name__, type(t * 2).__name__
        ('SharedTensor', 'SharedTensor', 'Tensor')
        >>> t[2:]
        SharedTensor([2., 3., 4., 5.], dtype=torch.float64)
    """

    _shared: MemoryRef

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _SHARE_MEMORY:  # already shared: torch would move it out
            return args[0]
        with DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            if type(out) is torch.Tensor:
                return _keep_views(out, (out,), args)
            if type(out) in (tuple, list) and out and type(out[0]) is torch.Tensor:
                return _keep_views(out, out, args, func in _NEW_VIEWS)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).__deepcopy__(memo)


_SHARE_MEMORY = torch.Tensor.share_memory_


# functions whose results are all new views: retyped in place, not aliased
_NEW_VIEWS = frozenset(
    f
    for name in ("unbind", "split", "chunk", "tensor_split", "unsafe_split")
    for f in (getattr(torch.Tensor, name, None), getattr(torch, name, None))
    if f is not None
)


def _keep_views(out: Any, tensors: Any, args: Any, new: bool = False) -> Any:
    """``out`` with its ``tensors`` as SharedTensors if they view an argument's memory."""
    ref = None
    for arg in args:
        if isinstance(arg, SharedTensor):
            ref = memory_ref(arg)
            break
    if ref is None:
        return out
    ends = (tensors[0], tensors[-1])
    if any(t.layout is not torch.strided for t in ends):
        return out
    if not all(t.untyped_storage().data_ptr() == ref.address for t in ends):
        return out
    if type(out) is torch.Tensor:
        return shared_tensor(out, ref)
    if not new:
        return type(out)(shared_tensor(t, ref) if type(t) is torch.Tensor else t for t in out)
    # rows of a batch (Note [Samples made when first used] in crossing/_collate.py):
    # when their base holds ``ref`` they hold none of their own
    views = retype_new_views(list(tensors), SharedTensor)
    base = view_base(views[0])
    if base is None or base.__dict__.get("_shared") is not ref:
        for view in views:
            view._shared = ref
    return type(out)(views)


def memory_ref(tensor: SharedTensor) -> MemoryRef | None:
    """The reference to the memory under ``tensor``: its own, else its base's.

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
    """``tensor`` over ``ref``'s memory as a SharedTensor; ``new``: retyped itself, no alias."""
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
        with DisableTorchFunctionSubclass():
            ref = memory_ref(tensor)
            if ref is not None and tensor.layout is torch.sparse_coo and not tensor.requires_grad:
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
            # a copy (torch would move a SharedArray's storage out of the segment)
            plain = tensor.as_subclass(torch.Tensor)
            copy = plain.detach().clone().requires_grad_(plain.requires_grad)
        return torch_reduce_tensor(copy)
    except Exception as e:
        return raise_send_error, (describe_failure(e, "a tensor over shared memory"),)


# a dtype crosses as its name in ``torch`` (cheaper to pickle)
DTYPE_NAMES = {
    dtype: name
    for name in dir(torch)
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


def _rebuild_coo(
    indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...], coalesced: bool
) -> torch.Tensor:
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
    empty = torch.empty(0, dtype=getattr(torch, dtype))
    return empty.set_(storage, offset, shape, stride)  # type: ignore[call-overload]


def raise_send_error(message: str) -> Any:
    raise BatchSendError(message)


def describe_failure(error: BaseException, what: str) -> str:
    return f"{what} could not be pickled for another process: {type(error).__name__}: {error}"


ForkingPickler.register(SharedTensor, reduce_shared_tensor)


class SegmentRef:
    """A range of a segment; pickled with a ticket (Note [Handing a segment over])."""

    __slots__ = ("address", "nbytes", "offset", "segment", "writable")

    def __init__(self, segment: Segment, offset: int, nbytes: int, address: int, writable: bool):
        self.segment, self.offset, self.nbytes = segment, offset, nbytes
        self.address, self.writable = address, writable

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            writable = self.writable and self.segment.writable
            handle = (*self.segment.handle(ticket=True), writable)
        except Exception as e:  # never raise in a queue's feeder thread
            return raise_send_error, (describe_failure(e, "a SharedArray's memory"),)
        return _rebuild_segment_storage, (handle, self.offset, self.nbytes)


def _rebuild_segment_storage(
    handle: tuple[Any, ...], offset: int, nbytes: int
) -> torch.UntypedStorage:
    segment = attach(*handle)
    writable = handle[-1]  # else a range of its own: a receiver's writes stay its own
    array = segment.view(offset, nbytes) if writable else segment.private_view(offset, nbytes)
    return torch.from_numpy(array).untyped_storage()
