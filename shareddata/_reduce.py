"""How any tensor over shareddata's memory crosses a process boundary, and send failures.

Note [Tensors over our memory cross by handle]
----------------------------------------------
``ForkingPickler`` (what a DataLoader's queues, ``torch.multiprocessing`` and
``multiprocessing`` pools pickle with) hands a tensor to torch's reducer, which
pickles its *storage* by moving it into a new shared segment (``share_memory_``:
the whole storage is copied and swapped in place) and passing a descriptor of it.
For memory that is ours that is wrong twice over: a view of a dataset column has
the whole column as its storage (every sample of a ``batch_size=None`` loader
would copy the column), and a view of a worker's batch lives in a memfd whose
descriptor torch does not have (``reduce_storage`` -> ``DupFd`` fails with
``EBADF`` in the worker's queue feeder thread, and the loader waits forever).

So this module registers its own reducers for ``torch.UntypedStorage`` and
``torch.Tensor`` with ``ForkingPickler`` (after torch's own, which it replaces and
calls for everything that is not ours). A storage is *ours* when its bytes lie
inside

* a segment of ``_storage`` (a dataset's columns, a ``SharedArray``): it crosses
  as the segment's handle (with a ticket: a pool worker may return a view of its
  ``SharedArray`` and exit, Note [Handing a segment over] in ``_handoff.py``) plus
  the byte range, **no copy at all**; a view keeps its segment alive (through its
  numpy base), so it crosses this way even after its ``SharedArray`` is dropped; the receiver
  maps the segment once (``_storage.attach``) -- copy-on-write for a dataset's
  read-only segments, even in the process that loaded it, so a receiver writing
  to a sample never changes the data; shared for a writable ``SharedArray``;
* a batch memfd of a DataLoader worker (``_transport``): it crosses as the
  memfd's handle plus the byte range, and the batch is *pinned* -- never reused --
  until every mapping of it in the receiver is gone (Note [Reusing a batch's
  pages] in ``_transport.py``).

A tensor over our memory pickles as (storage, dtype, offset, shape, stride): any
view, slice or non-contiguous view crosses with its layout, and the storage
itself is pickled once per message however many tensors share it (the pickler's
memo), so ``lambda batch: batch`` sends one handle for the whole batch, not one
segment per sample. Which torch sharing strategy is set (``file_descriptor`` or
``file_system``) does not matter for our memory; other storages go to torch.

Why the worker's batches are pinned and not copied into the transport: a copy
costs a second pass over the data and a new segment per message (torch's own
path: ~0.8 ms for 256 KiB on the 2-core VM), while the handle costs one
``/proc`` open and one ``mmap`` in the receiver whatever the size
(``benchmarks/bench_ipc.py`` measures both).

Note [A batch that cannot be sent]
----------------------------------
A DataLoader worker puts each batch in a ``multiprocessing.Queue``, whose feeder
thread pickles it later; if pickling raises (a ``collate_fn`` that returns a
lambda, a lock, an open file; or a storage that cannot be shared), the standard
library prints the traceback in the worker and drops the batch, and the main
process waits for it forever. When shareddata first gathers in a worker it finds
the worker's data queue (the ``data_queue`` of torch's ``_worker_loop`` frame,
which calls us) and, before the queue's feeder thread starts, replaces that
queue's ``_on_queue_feeder_error`` hook: the failure is sent instead of the batch,
as torch's own ``ExceptionWrapper`` of a :class:`~shareddata.errors.BatchSendError`,
which the DataLoader raises in the main process for that batch ("in DataLoader
worker process N"). A failure inside this module's own reducers (where no queue is
known) pickles as an object whose unpickling raises the same error.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.multiprocessing import reductions as _torch

from . import _storage
from ._linux import PROT_READ_WRITE, address_of, libc_mmap
from .errors import BatchSendError

__all__ = ["guard_worker_sends", "reduce_storage", "reduce_tensor", "register_memory"]

_FINDERS: list[Callable[[torch.UntypedStorage, int, int], Any]] = []
_OWNS: list[Callable[[int, int], bool]] = []
_torch_reduce_storage = _torch.reduce_storage
_torch_reduce_tensor = _torch.reduce_tensor


def register_memory(
    find: Callable[[torch.UntypedStorage, int, int], Any], owns: Callable[[int, int], bool]
) -> None:
    """Add memory of ours besides the segments (``_transport`` registers worker batches).

    Args:
        find: ``find(storage, address, nbytes)``: the reduction (``(rebuild, args)``)
            of the storage if its range is ours, else None; called once per storage
            sent, so it may record the send.
        owns: the same test without side effects.
    """
    _FINDERS.append(find)
    _OWNS.append(owns)


# -- segments (datasets, SharedArrays) ---------------------------------------------------
_ADDRESSES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _segment_at(address: int, nbytes: int) -> tuple[Any, int] | None:
    """The registered segment holding ``[address, address + nbytes)``, and the offset."""
    for segment in _storage.attached_segments():
        start = _ADDRESSES.get(segment)
        if start is None:
            try:
                start = address_of(segment.mmap)
            except (ValueError, TypeError):  # closed meanwhile
                continue
            _ADDRESSES[segment] = start
        if start <= address and address + nbytes <= start + segment.size:
            return segment, address - start
    return None


def _find(storage: torch.UntypedStorage) -> Any:
    if storage.device.type != "cpu":
        return None
    nbytes = storage.nbytes()
    if nbytes == 0:
        return None
    address = storage.data_ptr()
    for finder in _FINDERS:
        found = finder(storage, address, nbytes)
        if found is not None:
            return found
    located = _segment_at(address, nbytes)
    if located is None:
        return None
    segment, offset = located
    # a dataset's (sealed or read-only) segment crosses copy-on-write; a SharedArray shared
    writable = segment.writable and not segment.sealed
    # a ticket: the sender keeps the file until the receiver has it, even if the
    # sender drops the tensor or exits right after (Note [Handing a segment over])
    handle = segment.handle(ticket=True)
    return (_rebuild_segment_storage, ((*handle, writable), offset, nbytes))


def _rebuild_segment_storage(
    handle: tuple[Any, ...], offset: int, nbytes: int
) -> torch.UntypedStorage:
    """The storage over ``nbytes`` at ``offset`` of the segment ``handle`` (unpickling).

    A read-only segment's range gets a copy-on-write mapping of its own: a receiver
    that writes to what it received changes neither the data nor another sample
    it received (the pages stay shared until written).
    """
    writable = handle[-1]
    segment = _storage.attach(*handle)
    if writable:
        array = np.frombuffer(segment.mmap, np.uint8, nbytes, offset)
        weakref.finalize(array, _keep, segment)  # the segment lives as long as the array
    else:
        array = private_mapping(segment.fd, offset, nbytes)
    return torch.from_numpy(array).untyped_storage()


def _keep(segment: Any) -> None:
    """Nothing: a finalizer's argument is held until the object it watches is gone."""


_PAGE = os.sysconf("SC_PAGE_SIZE")
_MAP_PRIVATE = 0x02
MAP_FAILED = 2**64 - 1  # (void *) -1 as ctypes returns it


def private_mapping(fd: int, offset: int, nbytes: int) -> np.ndarray:
    """A copy-on-write mapping of ``nbytes`` at ``offset`` of ``fd``, unmapped when garbage.

    Keeps no descriptor (``mmap.mmap`` would keep one per mapping).
    """
    start = offset - offset % _PAGE
    length = offset + nbytes - start
    address = libc_mmap()(None, length, PROT_READ_WRITE, _MAP_PRIVATE, fd, start)
    if address in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap of a shared segment failed")
    mapped = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))
    weakref.finalize(mapped, munmap, address, length).atexit = False
    return mapped[offset - start : offset - start + nbytes]


@functools.lru_cache(maxsize=1)
def _libc_munmap() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    return libc.munmap


def munmap(address: int, length: int) -> None:
    """Unmap ``[address, address + length)``."""
    _libc_munmap()(address, length)


# -- the reducers ----------------------------------------------------------------------
def reduce_storage(storage: torch.UntypedStorage) -> Any:
    """``ForkingPickler``'s reducer of ``torch.UntypedStorage``: ours by handle, else torch's."""
    try:
        found = _find(storage)
    except Exception as e:  # never let the feeder thread drop a batch silently
        return (_raise_send_error, (_describe_failure(e, "a tensor's storage"),))
    if found is None:
        return _torch_reduce_storage(storage)
    return found


def reduce_tensor(tensor: torch.Tensor, ours: bool = False) -> Any:
    """``ForkingPickler``'s reducer of tensors: a view of our memory keeps its layout.

    A sparse COO tensor crosses as its indices and values (by handle when they
    are ours: a worker's sparse batch). Anything else (other storages,
    ``requires_grad``, other sparse layouts, quantized, a ``Parameter``) goes to
    torch's ``reduce_tensor``. ``ours``: the tensor is a
    worker's batch (a ``WorkerBatch``, strided on the CPU by construction), so its
    storage is not looked up here; :func:`reduce_storage` still sends a storage
    that is not ours the way torch does.
    """
    if ours:
        if not tensor.requires_grad:
            return (
                _rebuild_tensor,
                (
                    tensor.untyped_storage(),
                    _DTYPE_NAMES[tensor.dtype],
                    tensor.storage_offset(),
                    tuple(tensor.shape),
                    tensor.stride(),
                ),
            )
        tensor = tensor.as_subclass(torch.Tensor)
    plain = tensor.as_subclass(torch.Tensor) if type(tensor) is not torch.Tensor else tensor
    if (
        plain.layout is torch.strided
        and plain.device.type == "cpu"
        and not plain.requires_grad
        and not plain.is_quantized
        and not plain.is_conj()
        and not plain.is_neg()
    ):
        storage = plain.untyped_storage()
        if _owned(storage):
            shape, stride = tuple(plain.shape), plain.stride()
            name = _DTYPE_NAMES[plain.dtype]
            return (_rebuild_tensor, (storage, name, plain.storage_offset(), shape, stride))
    if plain.layout is torch.sparse_coo and not plain.requires_grad:
        # its indices and values are pickled as tensors again: by handle if ours
        coalesced = plain.is_coalesced()
        return (_rebuild_coo, (plain._indices(), plain._values(), tuple(plain.shape), coalesced))
    return _torch_reduce_tensor(plain)


def _rebuild_coo(
    indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...], coalesced: bool
) -> torch.Tensor:
    return torch.sparse_coo_tensor(
        indices, values, shape, is_coalesced=coalesced, check_invariants=False
    )


# a dtype crosses as its name in ``torch``: cheaper to pickle and to unpickle than itself
_DTYPE_NAMES = {
    dtype: name
    for name in dir(torch)
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


def _owned(storage: torch.UntypedStorage) -> bool:
    nbytes = storage.nbytes()
    if nbytes == 0 or storage.device.type != "cpu":
        return False
    address = storage.data_ptr()
    return any(owns(address, nbytes) for owns in _OWNS) or _segment_at(address, nbytes) is not None


def _rebuild_tensor(
    storage: torch.UntypedStorage,
    dtype: str,
    offset: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    empty = torch.empty(0, dtype=getattr(torch, dtype))
    return empty.set_(storage, offset, shape, stride)  # type: ignore[call-overload]


def _raise_send_error(message: str) -> Any:
    raise BatchSendError(message)


def _describe_failure(error: BaseException, what: str) -> str:
    return f"{what} could not be pickled for another process: {type(error).__name__}: {error}"


ForkingPickler.register(torch.UntypedStorage, reduce_storage)
ForkingPickler.register(torch.Tensor, reduce_tensor)


# -- Note [A batch that cannot be sent] -----------------------------------------------
_guarded = False


def _forget_guard() -> None:
    global _guarded
    _guarded = False


os.register_at_fork(after_in_child=_forget_guard)


def guard_worker_sends() -> None:
    """In a DataLoader worker, make a batch that fails to pickle an error in the main process.

    Cheap after the first call in a process (one flag). Note [A batch that cannot
    be sent].
    """
    global _guarded
    if _guarded:
        return
    _guarded = True
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return
    from torch.utils.data._utils import worker

    code = worker._worker_loop.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return
    queue = frame.f_locals.get("data_queue")
    if queue is None or getattr(queue, "_thread", None) is not None:
        return  # not a multiprocessing.Queue, or its feeder already runs with the old hook
    if not all(hasattr(queue, a) for a in ("_send_bytes", "_wlock", "_sem")):
        return
    queue._on_queue_feeder_error = functools.partial(_send_failure, weakref.ref(queue), info.id)


_SEND_LOCK = threading.Lock()


def _send_failure(queue_ref: Any, worker_id: int, error: BaseException, obj: Any) -> None:
    """The feeder thread's hook: send the failure in place of the batch ``obj``."""
    queue = queue_ref()
    try:
        if queue is None or not (isinstance(obj, tuple) and len(obj) == 2):
            raise error
        from torch._utils import ExceptionWrapper

        idx, data = obj
        message = (
            f"DataLoader worker process {worker_id} could not send batch {idx} to the main "
            f"process: pickling the {_shape_of(data)} that the dataset and collate_fn returned "
            f"raised {type(error).__name__}: {error}. Return tensors, numpy arrays, numbers, "
            "strings and lists/tuples/dicts of them; open files, locks, generators and "
            "lambdas cannot cross processes."
        )
        try:
            raise BatchSendError(message) from error
        except BatchSendError:
            wrapped = ExceptionWrapper(
                sys.exc_info(), where=f"in DataLoader worker process {worker_id}"
            )
        payload = ForkingPickler.dumps((idx, wrapped))
        with _SEND_LOCK:
            queue._sem.acquire()  # the feeder released it for the object it dropped
            if queue._wlock is None:
                queue._send_bytes(payload)
            else:
                with queue._wlock:
                    queue._send_bytes(payload)
    except Exception:
        traceback.print_exc()  # what the standard library does


def _shape_of(data: Any) -> str:
    if isinstance(data, dict):
        return f"dict with keys {list(data)[:8]}"
    if isinstance(data, (list, tuple)):
        inner = type(data[0]).__name__ if data else "nothing"
        return f"{type(data).__name__} of {len(data)} ({inner}, ...)"
    return type(data).__name__
