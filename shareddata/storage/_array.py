"""SharedArray, an array over a segment pickled by handle; laying out, filling, sealing."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from ..errors import AttachError, SharedDataError, UnsupportedDtypeError
from ._segment import Segment, attach, ready
from ._tensor import SegmentRef, shared_tensor

_ALIGN = 64  # bytes; every array in a segment starts on a cache line

_TORCH_TO_NUMPY = {torch.bool: np.bool_} | {
    getattr(torch, n): getattr(np, n)
    for n in ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
    + ("complex64", "complex128", "uint16", "uint32", "uint64")
    if hasattr(torch, n)
}


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """A numpy or torch dtype (or anything ``np.dtype`` takes) as ``np.dtype``.

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
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedArray:
    """An n-dimensional array in shared memory, pickled by handle, never by value.

    Every process that unpickles it (any start method, pools, DataLoader workers, and
    back) maps the same pages (Note [Handing a segment over]); one that cannot be
    attached raises :class:`~shareddata.AttachError` on first use. Writable;
    concurrent writes are the caller's to coordinate.

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
        # every view holds the segment (Note [Tensors over our memory cross by handle])
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
        """A zero-filled shared array; SharedMemoryFullError, before writing, if no room."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = to_numpy_dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        segment = Segment.create(nbytes, storage_dir, what=f"SharedArray{shape} {dtype}")
        segment.seal(write=False)  # Note [Sealed segments]
        return cls(segment, 0, shape, dtype)

    @classmethod
    def from_array(
        cls, array: Any, *, storage_dir: str | os.PathLike[str] | None = None
    ) -> SharedArray:
        """Copy anything ``np.asarray`` takes, or a CPU tensor, into a new shared array.

        Stored in native byte order (torch holds no other).

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
        """A zero-copy numpy view (read-only if the array is)."""
        return self._data()

    def torch(self) -> torch.Tensor:
        """A zero-copy :class:`~shareddata.storage.SharedTensor` view, crossing by handle."""
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
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d SharedArray")
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self._data()
        return array if dtype is None else array.astype(dtype)

    def readonly(self) -> SharedArray:
        """A read-only view of the same memory."""
        self._data()
        return SharedArray(self.segment, self.offset, self.shape, self.dtype, writable=False)

    def __copy__(self) -> SharedArray:
        if self._array is None:
            return self
        return SharedArray(self.segment, self.offset, self.shape, self.dtype, self.writable)

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedArray:
        """A writable copy in RAM; a read-only array is its own deep copy.

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
        self._data()
        handle = (*self.segment.handle(ticket), self.writable)
        return (_rebuild, (handle, self.offset, self.shape, self.dtype.str, self.writable))

    def __repr__(self) -> str:
        flag = "" if self.writable else ", read-only"
        flag += "" if self._error is None else ", not attached"
        return f"SharedArray(shape={self.shape}, dtype={self.dtype}{flag})"


def seal(arrays: Sequence[SharedArray]) -> list[SharedArray]:
    """Read-only views of ``arrays``, their segments sealed (Note [Sealed segments]).

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
    # never raises (a pool's result thread would die): the error comes on first use
    try:
        segment = attach(*handle)
    except SharedDataError as e:  # AttachError, TooManyOpenFilesError, SharedMemoryFullError
        return SharedArray._unattached(e, shape, dtype, writable)
    return SharedArray(segment, offset, shape, dtype, writable)


# multiprocessing's pickler draws a ticket: Note [Handing a segment over]
ForkingPickler.register(SharedArray, functools.partial(SharedArray._reduce, ticket=True))


def allocate(
    layouts: Sequence[tuple[Sequence[int], Any]],
    storage_dir: str | os.PathLike[str] | None = None,
    what: str = "this dataset",
    reserve: bool = True,
    ahead: bool = False,
) -> list[SharedArray]:
    """Writable arrays of ``layouts`` ``(shape, dtype)`` in one segment (:meth:`Segment.create`)."""
    offsets, end = [], 0
    norm = []
    for shape, dtype in layouts:
        shape, dtype = tuple(int(s) for s in shape), to_numpy_dtype(dtype)
        end = aligned(end)
        offsets.append(end)
        end += math.prod(shape) * dtype.itemsize
        norm.append((shape, dtype))
    ahead = ahead and end > 0
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
        ready(dest[:stop])  # Note [Filling while the pages are allocated]
        dest[start:stop] = src[start:stop]
        if progress is not None:
            progress((stop - start) * row_bytes)
