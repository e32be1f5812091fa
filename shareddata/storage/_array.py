"""SharedArray: an n-dimensional array over a segment, pickled by handle, never by value.

Also the helpers that lay arrays out in one segment (:func:`allocate`,
:func:`aligned`), fill them (:func:`copy_chunked`) and seal them read-only once
loaded (:func:`seal`), and the dtype mapping every column uses (:func:`to_numpy_dtype`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from ..errors import (
    AttachError,
    SharedDataError,
    SharedMemoryFullError,
    TooManyOpenFilesError,
    UnsupportedDtypeError,
)
from ._pages import ready
from ._segment import Segment, attach
from ._tensor import SegmentRef, shared_tensor

__all__ = ["SharedArray", "aligned", "allocate", "copy_chunked", "seal", "to_numpy_dtype"]

_ALIGN = 64  # bytes; every array in a segment starts on a cache line

_TORCH_TO_NUMPY = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _TORCH_TO_NUMPY[getattr(torch, _name)] = getattr(np, _name)


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """Normalise a numpy or torch dtype (or anything ``np.dtype`` takes) to ``np.dtype``.

    Example:
        >>> to_numpy_dtype(torch.int32), to_numpy_dtype("float32")
        (dtype('int32'), dtype('float32'))
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NUMPY:
            raise UnsupportedDtypeError(
                f"torch dtype {dtype} has no numpy equivalent and cannot be stored; "
                "convert it first (e.g. bfloat16 -> float32 or view it as int16)."
            )
        return np.dtype(_TORCH_TO_NUMPY[dtype])
    return np.dtype(dtype)


def aligned(offset: int) -> int:
    """Round ``offset`` up to the alignment of arrays inside a segment."""
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedArray:
    """An n-dimensional array in shared memory, pickled by handle, never by value.

    Every process that unpickles it maps the same pages, under ``fork``,
    ``spawn`` and ``forkserver`` alike, including DataLoader workers and
    ``multiprocessing`` pools, and back: an array a pool worker creates and
    returns reaches the parent by handle, even if the worker exits right after
    (Note [Handing a segment over]); if it cannot be attached, its first use raises
    :class:`~shareddata.AttachError`. It is writable, so processes can build
    results in place; concurrent writes are the caller's to coordinate (a
    ``multiprocessing.Lock``, disjoint slices per process, or accepted races for
    statistics that tolerate them).

    Args:
        segment: the segment holding the data.
        offset: byte offset of the first element in the segment.
        shape: the array's shape.
        dtype: numpy dtype.
        writable: ``False`` for read-only views (dataset columns).

    Example:
        >>> a = SharedArray.empty((2, 3), "float32")
        >>> a.numpy()[:] = 1.5
        >>> a.torch().sum().item()
        9.0
        >>> b = SharedArray.from_array(np.arange(4))
        >>> b.shape, b.dtype, b.nbytes
        ((4,), dtype('int64'), 32)
    """

    __slots__ = ("_array", "_error", "_tensor", "dtype", "offset", "segment", "shape", "writable")

    def __init__(
        self,
        segment: Segment,
        offset: int,
        shape: Sequence[int],
        dtype: Any,
        writable: bool = True,
    ) -> None:
        self.segment = segment
        self.offset = int(offset)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = to_numpy_dtype(dtype)
        self.writable = writable
        count = math.prod(self.shape)
        if self.offset + count * self.dtype.itemsize > segment.size:
            raise ValueError(
                f"array of shape {self.shape} and dtype {self.dtype} at offset {offset} "
                f"does not fit in a segment of {segment.size} bytes"
            )
        # Every view of this array (a numpy slice, a torch tensor over it) holds the
        # segment (Segment.view): it lives as long as any of them, so a view of
        # ``torch()`` still crosses by handle after the array itself is dropped (a pool
        # worker returning a slice of its own SharedArray; Note [Tensors over our memory
        # cross by handle] in ``_tensor.py``).
        raw = segment.view(self.offset, count * self.dtype.itemsize).view(self.dtype)
        array = raw.reshape(self.shape)
        if not writable:
            array.flags.writeable = False
        self._array: np.ndarray | None = array
        self._tensor: torch.Tensor | None = None
        self._error: SharedDataError | None = None

    @classmethod
    def _unattached(
        cls, error: SharedDataError, shape: Sequence[int], dtype: Any, writable: bool
    ) -> SharedArray:
        """An array whose segment could not be attached: raises ``error`` on first use."""
        self = cls.__new__(cls)
        self.segment = None  # type: ignore[assignment]
        self.offset, self.shape = 0, tuple(int(s) for s in shape)
        self.dtype, self.writable = to_numpy_dtype(dtype), writable
        self._array, self._tensor, self._error = None, None, error
        return self

    def _data(self) -> np.ndarray:
        if self._array is None:
            error = self._error
            raise type(error)(*error.args) if error is not None else AttachError("not attached")
        return self._array

    @classmethod
    def empty(
        cls,
        shape: int | Sequence[int],
        dtype: Any,
        *,
        storage_dir: str | os.PathLike[str] | None = None,
    ) -> SharedArray:
        """Allocate an uninitialised (zero-filled) shared array.

        Args:
            shape: the shape.
            dtype: a numpy or torch dtype.
            storage_dir: ``None`` for RAM; a directory for a file-backed array.

        Raises:
            SharedMemoryFullError: when there is no room, before anything is written.
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = to_numpy_dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        segment = Segment.create(nbytes, storage_dir, what=f"SharedArray{shape} {dtype}")
        segment.seal(write=False)  # writable everywhere, resized nowhere: Note [Sealed segments]
        return cls(segment, 0, shape, dtype)

    @classmethod
    def from_array(
        cls, array: Any, *, storage_dir: str | os.PathLike[str] | None = None
    ) -> SharedArray:
        """Copy a numpy array or CPU tensor into a new shared array.

        The values are kept; a big-endian array (``>i4``, ``>f8``) is stored in native
        byte order: a shared array is the memory of a tensor too (:meth:`torch`), and
        torch holds native byte order only. ``np.memmap`` and other ndarray subclasses
        are copied as plain arrays.

        Args:
            array: anything ``np.asarray`` takes, or a ``torch.Tensor``.
            storage_dir: ``None`` for RAM; a directory for a file-backed array.

        Example:
            >>> a = SharedArray.from_array(np.arange(3, dtype=">i4"))
            >>> a.dtype, a.numpy().tolist()
            (dtype('int32'), [0, 1, 2])
        """
        if isinstance(array, torch.Tensor):
            try:
                array = array.detach().cpu().numpy()
            except TypeError as e:  # a dtype numpy lacks: bfloat16, float8, complex32
                raise UnsupportedDtypeError(
                    f"SharedArray.from_array got a {array.dtype} tensor, which numpy (what a "
                    f"SharedArray holds) has no dtype for ({e}). Store its bits and view them "
                    "back: SharedArray.from_array(t.view(torch.int16)).torch().view(t.dtype) "
                    "(int8 for float8, int32 for complex32), or convert it (t.float())."
                ) from e
        array = np.asarray(array)
        if array.dtype.hasobject:
            raise UnsupportedDtypeError(
                "SharedArray.from_array got an object array; shared memory holds fixed-size "
                "numeric data. Convert it to a numeric dtype (or use a SharedList)."
            )
        out = cls.empty(array.shape, array.dtype.newbyteorder("="), storage_dir=storage_dir)
        copy_chunked(out.numpy(), array)
        return out

    def numpy(self) -> np.ndarray:
        """A zero-copy numpy view (read-only if the array is).

        Raises:
            AttachError: the array was received from a process that no longer held it.
        """
        return self._data()

    def torch(self) -> torch.Tensor:
        """A zero-copy tensor view (do not write to it if the array is read-only).

        It is a :class:`~shareddata.storage.SharedTensor` (a ``torch.Tensor``), and so
        are its views: sent to another process through ``multiprocessing`` (a
        DataLoader's queues, a pool), it crosses as this array's handle, not as a copy.
        """
        if self._tensor is None:
            import warnings

            array = self._data()
            with warnings.catch_warnings():  # torch warns that a read-only buffer is read-only
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(array)
            if tensor.numel():
                address = tensor.untyped_storage().data_ptr()
                ref = SegmentRef(self.segment, self.offset, self.nbytes, address, self.writable)
                tensor = shared_tensor(tensor, ref, new=True)  # from_numpy made it: no alias
            self._tensor = tensor
        return self._tensor

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d SharedArray")
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self._data()
        return array if dtype is None else array.astype(dtype)

    def readonly(self) -> SharedArray:
        """A read-only view of the same memory (what datasets hand to workers)."""
        self._data()
        return SharedArray(self.segment, self.offset, self.shape, self.dtype, writable=False)

    def __copy__(self) -> SharedArray:
        """Another ``SharedArray`` over the same memory (a write to one shows in the other)."""
        if self._array is None:
            return self
        return SharedArray(self.segment, self.offset, self.shape, self.dtype, self.writable)

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedArray:
        """A new ``SharedArray`` holding a copy of the data (writable, in RAM).

        A read-only array (a dataset's column) cannot change, so its deep copy is the
        array itself, as for other immutable objects: ``copy.deepcopy(dataset)`` holds
        no second copy of the data.

        Example:
            >>> import copy
            >>> a = SharedArray.from_array(np.arange(3))
            >>> b = copy.deepcopy(a); b.numpy()[0] = 9
            >>> a.numpy().tolist(), b.numpy().tolist()
            ([0, 1, 2], [9, 1, 2])
        """
        if not self.writable or self._array is None:
            return self
        return SharedArray.from_array(self._array)

    def __reduce__(self) -> tuple[Any, ...]:
        return self._reduce(ticket=False)

    def _reduce(self, ticket: bool) -> tuple[Any, ...]:
        # Receivers of read-only arrays map copy-on-write: Note [How shared segments ...].
        self._data()
        handle = (*self.segment.handle(ticket), self.writable)
        return (_rebuild, (handle, self.offset, self.shape, self.dtype.str, self.writable))

    def __repr__(self) -> str:
        flag = "" if self.writable else ", read-only"
        flag += "" if self._error is None else ", not attached"
        return f"SharedArray(shape={self.shape}, dtype={self.dtype}{flag})"


def seal(arrays: Sequence[SharedArray]) -> list[SharedArray]:
    """Read-only views of ``arrays``, whose segments are sealed against any change.

    What the loader hands out once it has filled ``arrays``, for every dataset kind:
    no process can write, grow or shrink their files, and this process maps them
    copy-on-write (Note [Sealed segments]).

    Example:
        >>> a, b = allocate([((3,), "int64"), ((2,), "float32")])
        >>> a.numpy()[:] = 7
        >>> ro, _ = seal([a, b])
        >>> ro.numpy().tolist(), ro.writable
        ([7, 7, 7], False)
    """
    for segment in {id(a.segment): a.segment for a in arrays}.values():
        segment.seal()
    return [a.readonly() for a in arrays]


def _rebuild(
    handle: tuple[Any, ...], offset: int, shape: tuple[int, ...], dtype: str, writable: bool
) -> SharedArray:
    # never raises: unpickling may run in a pool's result thread, whose death hangs the
    # pool; the error is raised where the array is used (Note [Handing a segment over])
    try:
        segment = attach(*handle)
    except (AttachError, SharedMemoryFullError, TooManyOpenFilesError) as e:
        return SharedArray._unattached(e, shape, dtype, writable)
    return SharedArray(segment, offset, shape, dtype, writable)


# multiprocessing's pickler (every queue, pipe, pool and process argument, torch's and
# the DataLoader's included) draws a ticket: Note [Handing a segment over].
ForkingPickler.register(SharedArray, functools.partial(SharedArray._reduce, ticket=True))


def allocate(
    layouts: Sequence[tuple[Sequence[int], Any]],
    storage_dir: str | os.PathLike[str] | None = None,
    what: str = "this dataset",
    reserve: bool = True,
    ahead: bool = False,
) -> list[SharedArray]:
    """Allocate several arrays in ONE segment (one descriptor, one capacity check).

    Args:
        layouts: ``(shape, dtype)`` of each array.
        storage_dir: ``None`` for RAM; a directory for file-backed arrays.
        what: how to name the allocation in errors.
        reserve: see :meth:`Segment.create`.
        ahead: see :meth:`Segment.create`: write only after :func:`ready`.

    Returns:
        The arrays, writable, in the order given.
    """
    offsets, end = [], 0
    norm = []
    for shape, dtype in layouts:
        shape, dtype = tuple(int(s) for s in shape), to_numpy_dtype(dtype)
        end = aligned(end)
        offsets.append(end)
        end += math.prod(shape) * dtype.itemsize
        norm.append((shape, dtype))
    ahead = ahead and end > 0  # nothing to fill: nothing to wait for
    segment = Segment.create(end, storage_dir, what=what, reserve=reserve, ahead=ahead)
    return [SharedArray(segment, o, s, d) for o, (s, d) in zip(offsets, norm)]


_CHUNK = 64 << 20


def copy_chunked(dest: np.ndarray, src: np.ndarray, progress: Any = None) -> None:
    """Copy ``src`` into ``dest`` row block by row block (no full temporary)."""
    if dest.shape != src.shape:
        raise ValueError(f"shape mismatch: {src.shape} into {dest.shape}")
    if dest.ndim == 0 or dest.shape[0] == 0:
        ready(dest)
        dest[...] = src
        return
    row_bytes = max(1, dest.nbytes // dest.shape[0])
    step = max(1, _CHUNK // row_bytes)
    for start in range(0, dest.shape[0], step):
        stop = min(start + step, dest.shape[0])
        ready(dest[:stop])  # a segment still being allocated: Note [Filling while ...]
        dest[start:stop] = src[start:stop]
        if progress is not None:
            progress((stop - start) * row_bytes)
