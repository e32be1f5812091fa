"""HDF5 source: datasets of an HDF5 file, read with h5py straight into shared memory.

Opening the file reads metadata only (shapes, types, filters). Fixed-shape numeric
datasets are then read straight into the shared buffer, so no private copy of the
data exists: contiguous, unfiltered ones with ``os.preadv`` from the dataset's
offset in the file; gzip-compressed ones chunk by chunk, decoded in several threads
(Note [Inflating chunks in threads]); all others with ``Dataset.read_direct`` in
bounded blocks of rows aligned to the dataset's chunks (FACTS.md: a chunk's worth
of temporary memory for compressed data). Variable-length datasets (strings,
``vlen`` sequences) are read twice in bounded blocks of rows: once to size the
``values`` buffer exactly, once to fill it; at most one block exists as Python
objects at any time.

How HDF5 types map to columns:

=========================================  ===========  ===========================
HDF5 / h5py dtype                          column kind  a sample's value
=========================================  ===========  ===========================
integer, float, complex (any byte order)   ``tensor``   tensor, native byte order
bool (h5py's ``FALSE``/``TRUE`` enum)      ``tensor``   bool tensor
array type (``H5T_ARRAY``)                 ``tensor``   its shape added to the row
variable-length string (utf-8 or ascii)    ``str``      ``str``
fixed-length utf-8 string                  ``str``      ``str`` (trailing NULs off)
fixed-length ascii string (``S10``)        ``bytes``    ``bytes`` (trailing NULs off)
opaque                                     ``bytes``    ``bytes`` (all of them)
variable-length numeric (``vlen_dtype``)   ``ragged``   1-D tensor
compound, reference, other enum, object    refused      ``UnsupportedDtypeError``
=========================================  ===========  ===========================
"""

from __future__ import annotations

import collections
import math
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._columns import ColumnSpec
from .._dataset import ColumnDataset, Output, load_columns
from .._storage import ready
from ..errors import (
    ColumnLengthError,
    MissingColumnError,
    MissingDependencyError,
    MissingFileError,
    SourceReadError,
    UnsupportedDtypeError,
    missing_dependency,
)
from ._io import read_into

__all__ = ["HDF5Dataset", "HDF5Source"]

PathLike = str | os.PathLike

_CHUNK = 64 << 20
"""Bytes of fixed-shape data read per ``read_direct`` call."""
_BLOCK = 16 << 20
"""Bytes of private memory one block of string / variable-length rows may take."""
_OBJECT_OVERHEAD = 112
"""Approximate bytes of one Python object (a ``bytes`` or ``ndarray``) beyond its data."""
_MAX_BLOCK_ROWS = 1 << 20
_LISTED = 20  # how many dataset names an error message lists

_NUMERIC = "biufc"


# Note [Inflating chunks in threads]
# ==================================
# HDF5 runs its filters in the calling thread, one chunk after another, and h5py
# serialises every call, so ``read_direct`` of a gzip dataset uses one core. For
# the common pipelines (``deflate``, optionally after ``shuffle``), shareddata reads
# each stored chunk's bytes itself (``chunk_iter`` gives their offsets, ``os.pread``
# reads them) and decodes them in several threads (``zlib`` and numpy release the
# GIL), each writing its chunk straight into the shared buffer; at most four chunks
# per thread wait in memory. A chunk's ``filter_mask`` says which filters were
# skipped for it. Unfiltered chunks that hold whole rows take the same path, each
# ``preadv``-ed by a thread straight into its rows (``read_direct`` copies them one
# after another through HDF5). Other filters (lzf, szip, fletcher32, plugins), chunks
# never written (the fill value) and other file drivers go through ``read_direct``.

_DEFLATE = 1  # H5Z_FILTER_DEFLATE
_SHUFFLE = 2  # H5Z_FILTER_SHUFFLE
_INFLATE_THREADS: int | None = None
"""Threads decoding gzip chunks (None: one per usable core, at most 8)."""


def _inflate_threads() -> int:
    if _INFLATE_THREADS is not None:
        return max(1, _INFLATE_THREADS)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _decode(raw: bytes, mask: int, filters: list[int], itemsize: int) -> bytes:
    """Undo a chunk's filters, last first, skipping those its ``filter_mask`` names."""
    data = raw
    for index in reversed(range(len(filters))):
        if mask >> index & 1:
            continue
        if filters[index] == _DEFLATE:
            data = zlib.decompress(data)
        elif itemsize > 1:  # shuffle: byte j of every element was stored together
            count = len(data) // itemsize
            planes = np.frombuffer(data, np.uint8, count * itemsize).reshape(itemsize, count)
            data = planes.T.tobytes() + data[count * itemsize :]
    return data


def _import_h5py() -> Any:
    """``h5py``, plus any filter plugins ``hdf5plugin`` registers when installed."""
    try:
        import h5py
    except ImportError as error:
        missing_dependency("h5py", "hdf5", error)
        raise  # unreachable: missing_dependency raises
    try:  # registers extra compression filters (blosc, zstd, lz4, ...) with HDF5
        import hdf5plugin  # noqa: F401
    except Exception:  # not installed, or broken: the built-in filters still work
        pass
    return h5py


def _listing(names: Sequence[str]) -> str:
    if not names:
        return "no datasets"
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    more = len(names) - _LISTED
    return shown + (f" and {more} more" if more > 0 else "")


@dataclass
class _Plan:
    """How one dataset becomes one column.

    ``reader`` is ``"direct"`` (numeric, ``read_direct``), ``"array"`` (an
    ``H5T_ARRAY`` element type, low-level read), ``"fixed"`` (fixed-length strings,
    trailing NULs stripped), ``"opaque"`` (fixed-size raw bytes), ``"vlen_str"`` or
    ``"vlen"`` (variable-length strings / numbers).
    """

    name: str
    rows: int
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]
    reader: str
    blocks: list[tuple[int, int, int]] = field(default_factory=list)
    """For variable-length kinds, after sizing: ``(start, stop, values)`` per block."""


class HDF5Source:
    """Reads datasets of an HDF5 file (see :class:`HDF5Dataset`).

    The constructor opens the file and reads metadata only; :meth:`specs` sizes
    the columns (reading variable-length datasets once, in bounded blocks);
    :meth:`read` fills the buffers it is given; :meth:`close` closes the file.

    Args:
        path: the HDF5 file.
        keys: dataset paths inside the file (``"images"``, ``"grp/labels"``; a leading
            ``/`` is accepted), in column order. ``None``: every dataset of the file
            (all groups, in visit order) whose first dimension equals the longest one.
    """

    def __init__(self, path: PathLike, keys: str | Sequence[str] | None = None) -> None:
        self._h5py = _import_h5py()
        self.label = os.fspath(path)
        self._file: Any = None
        self._specs: list[ColumnSpec] | None = None
        if not os.path.exists(self.label):
            raise MissingFileError(
                f"{self.label} does not exist. Pass the path of an HDF5 file (.h5, .hdf5)."
            )
        if os.path.isdir(self.label):
            raise SourceReadError(
                f"{self.label} is a folder, not an HDF5 file. Pass the path of an HDF5 file."
            )
        try:
            self._file = self._h5py.File(self.label, "r")
        except OSError as error:
            raise SourceReadError(
                f"{self.label} is not a readable HDF5 file ({error}). It may be truncated, "
                "corrupt or of another format; re-create or re-download it."
            ) from error
        try:
            self.plans = [self._plan(name, auto=keys is None) for name in self._select(keys)]
        except BaseException:
            self.close()
            raise

    # -- metadata ----------------------------------------------------------------------
    def _dataset_names(self, group: Any = None) -> list[str]:
        """Paths of every dataset under ``group`` (default: the file), in visit order."""
        group = self._file if group is None else group
        prefix = group.name.strip("/")
        names: list[str] = []

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, self._h5py.Dataset):
                names.append(f"{prefix}/{name}" if prefix else name)

        try:
            group.visititems(visit)
        except (OSError, RuntimeError, KeyError) as error:
            raise SourceReadError(
                f"{self.label}: the file's group structure cannot be read ({error}); the file "
                "is corrupt. Re-create or re-download it."
            ) from error
        return names

    def _get(self, name: str) -> Any:
        try:
            return self._file.get(name)
        except (KeyError, ValueError, TypeError):  # a path through a dataset, a bad name
            return None

    def _corrupt_metadata(self, name: str, error: BaseException) -> SourceReadError:
        return SourceReadError(
            f"{self.label}: the metadata of dataset {name!r} cannot be read ({error}); the "
            "file is corrupt. Re-create or re-download it."
        )

    def _select(self, keys: str | Sequence[str] | None) -> list[str]:
        if keys is None:
            with_rows = []
            for name in self._dataset_names():
                try:
                    shape = self._file[name].shape
                except (OSError, RuntimeError, ValueError, TypeError, KeyError) as error:
                    raise self._corrupt_metadata(name, error) from error
                if shape:  # not a scalar (()) or an empty dataspace (None)
                    with_rows.append((name, shape[0]))
            if not with_rows:
                raise MissingColumnError(
                    f"{self.label} holds no dataset with rows (only scalars, empty datasets "
                    "or groups); shareddata loads datasets whose first dimension is the row."
                )
            longest = max(rows for _, rows in with_rows)
            return [name for name, rows in with_rows if rows == longest]
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        names: list[str] = []
        for key in keys:
            if isinstance(key, bytes):
                key = key.decode()
            if not isinstance(key, str):
                raise TypeError(
                    f"keys must be dataset paths (str), got {type(key).__name__} {key!r}"
                )
            name = key.strip("/")
            if name in names:
                raise ValueError(f"key {key!r} is given twice; every column needs its own name")
            obj = self._get(name) if name else self._file
            if obj is None:
                raise MissingColumnError(
                    f"key {key!r} is not a dataset of {self.label}; its datasets are: "
                    f"{_listing(self._dataset_names())}."
                )
            if isinstance(obj, self._h5py.Group):
                inside = self._dataset_names(obj)
                raise MissingColumnError(
                    f"key {key!r} of {self.label} is a group, not a dataset; pass the datasets "
                    f"you want from it (keys=[...]). It holds: {_listing(inside)}."
                )
            if not isinstance(obj, self._h5py.Dataset):
                raise MissingColumnError(
                    f"key {key!r} of {self.label} is a {type(obj).__name__}, not a dataset; its "
                    f"datasets are: {_listing(self._dataset_names())}."
                )
            names.append(name)
        return names

    def _refuse(self, name: str, what: str, fix: str, auto: bool) -> UnsupportedDtypeError:
        hint = f" Or leave it out: pass keys=[...] without {name!r}." if auto else ""
        return UnsupportedDtypeError(
            f"dataset {name!r} of {self.label} {what}, which shareddata cannot store. "
            f"Fix: {fix}.{hint}"
        )

    def _check_filters(self, name: str, ds: Any) -> None:
        h5z = self._h5py.h5z
        dcpl = ds.id.get_create_plist()
        for i in range(dcpl.get_nfilters()):
            code, flags, _, filter_name = dcpl.get_filter(i)
            if h5z.filter_avail(code):
                continue
            if flags & h5z.FLAG_OPTIONAL and self._skipped(ds, i):
                continue  # an optional filter the writer could not apply: nothing to undo
            label = filter_name.decode(errors="replace") if filter_name else "unnamed"
            raise MissingDependencyError(
                f"dataset {name!r} of {self.label} is compressed with the HDF5 filter "
                f"{label!r} (id {code}), which is not available here. Install the filter "
                "plugins with: pip install hdf5plugin (shareddata uses them when installed)."
            )

    @staticmethod
    def _skipped(ds: Any, index: int) -> bool:
        """Whether the first stored chunk skipped filter ``index`` (or none is stored)."""
        try:
            if ds.id.get_num_chunks() == 0:
                return True
            return bool(ds.id.get_chunk_info(0).filter_mask >> index & 1)
        except (OSError, RuntimeError, ValueError, AttributeError):
            return False

    def _plan(self, name: str, auto: bool) -> _Plan:
        h5py = self._h5py
        try:
            ds = self._file[name]
            shape, dtype = ds.shape, ds.dtype
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as error:
            raise self._corrupt_metadata(name, error) from error
        if shape is None:
            raise self._refuse(
                name, "is empty (no dataspace)", "write it with a shape, rows first", auto
            )
        if shape == ():
            raise self._refuse(
                name,
                "is a scalar (one value)",
                "a column needs a first dimension of rows; store it as shape (rows, ...), "
                "or read it directly with h5py",
                auto,
            )
        self._check_filters(name, ds)
        rows, row_shape = int(shape[0]), tuple(int(s) for s in shape[1:])
        one_per_row = (
            f"is {len(shape)}-D with variable-length elements; a string or variable-length "
            "column holds one value per row"
        )
        one_per_row_fix = "store one 1-D dataset per position, or flatten the rows"

        string = h5py.check_string_dtype(dtype)
        if string is not None:
            if row_shape:
                raise self._refuse(name, one_per_row, one_per_row_fix, auto)
            if string.length is None:
                return _Plan(name, rows, "str", np.dtype(np.uint8), (), "vlen_str")
            kind = "str" if string.encoding == "utf-8" else "bytes"
            return _Plan(name, rows, kind, np.dtype(np.uint8), (), "fixed")
        if h5py.check_ref_dtype(dtype) is not None:
            raise self._refuse(
                name,
                "holds object or region references",
                "dereference them with h5py and store the referenced data as datasets",
                auto,
            )
        base = h5py.check_vlen_dtype(dtype)
        if base is not None:
            base = np.dtype(base)
            if base.kind not in _NUMERIC or base.fields is not None or base.subdtype is not None:
                raise self._refuse(
                    name,
                    f"holds variable-length sequences of {base}",
                    "store variable-length sequences of a plain numeric type "
                    "(h5py.vlen_dtype(np.int32)), one dataset per field",
                    auto,
                )
            if row_shape:
                raise self._refuse(name, one_per_row, one_per_row_fix, auto)
            return _Plan(name, rows, "ragged", base.newbyteorder("="), (), "vlen")
        if h5py.check_enum_dtype(dtype) is not None and dtype.kind != "b":
            raise self._refuse(
                name,
                f"is an enum ({dtype} with labels {sorted(h5py.check_enum_dtype(dtype))})",
                "store the integer codes as a plain integer dataset, e.g. "
                f"f[{name + '_codes'!r}] = (a := f[{name!r}][()]).astype(a.dtype.str), "
                "and keep the labels separately",
                auto,
            )
        if dtype.fields is not None:
            raise self._refuse(
                name,
                f"has a compound (struct) dtype {dtype}",
                "select fields into separate datasets and load those, e.g. "
                f"f[{name + '_' + dtype.names[0]!r}] = f[{name!r}][{dtype.names[0]!r}] "
                "for each field",
                auto,
            )
        if dtype.subdtype is not None:
            sub, sub_shape = dtype.subdtype
            if sub.kind in _NUMERIC and sub.fields is None and sub.subdtype is None:
                return _Plan(
                    name, rows, "tensor", sub.newbyteorder("="), row_shape + sub_shape, "array"
                )
            raise self._refuse(
                name,
                f"has an array dtype of {sub}",
                "store it as a plain numeric dataset with the array's shape as extra dimensions",
                auto,
            )
        if dtype.kind in _NUMERIC:
            return _Plan(name, rows, "tensor", dtype.newbyteorder("="), row_shape, "direct")
        if dtype.kind == "V":
            if row_shape:
                raise self._refuse(name, one_per_row, one_per_row_fix, auto)
            return _Plan(name, rows, "bytes", np.dtype(np.uint8), (), "opaque")
        raise self._refuse(
            name,
            f"has dtype {dtype} (HDF5 class {ds.id.get_type().get_class()})",
            "convert it to a numeric, string or variable-length numeric dataset",
            auto,
        )

    # -- Source protocol ---------------------------------------------------------------
    def specs(self) -> list[ColumnSpec]:
        """Exact specs of every selected column (sizes variable-length ones by reading)."""
        if self._specs is not None:
            return self._specs
        rows = {p.rows for p in self.plans}
        if len(rows) > 1:  # before any sizing pass reads data
            listing = ", ".join(f"{p.name!r}: {p.rows} rows" for p in self.plans)
            raise ColumnLengthError(
                f"datasets of {self.label} have different lengths ({listing}); every column "
                "needs one value per row. Pass keys=[...] of equal length, or trim them."
            )
        specs = []
        for plan in self.plans:
            values = self._size(plan) if plan.kind != "tensor" else 0
            specs.append(
                ColumnSpec(plan.name, plan.rows, plan.dtype, plan.shape, plan.kind, values)
            )
        self._specs = specs
        return specs

    def read(
        self, spec: ColumnSpec, buffers: dict[str, np.ndarray], progress: Callable[[int], None]
    ) -> None:
        """Fill ``buffers`` for ``spec`` (``data``, or ``offsets`` and ``values``)."""
        self.specs()  # variable-length columns are read in the blocks that sized them
        plan = next(p for p in self.plans if p.name == spec.name)
        ds = self._file[plan.name]
        with self._reading(plan):
            if plan.kind == "tensor":
                self._read_tensor(plan, ds, buffers["data"], progress)
            else:
                self._read_var(plan, ds, buffers["offsets"], buffers["values"], progress)

    def close(self) -> None:
        """Close the HDF5 file (idempotent)."""
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def __enter__(self) -> HDF5Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(
            "an HDF5Source holds an open h5py file and cannot be pickled; pickle the "
            "HDF5Dataset (it holds only handles to shared memory)"
        )

    # -- reading -----------------------------------------------------------------------
    @contextmanager
    def _reading(self, plan: _Plan) -> Iterator[None]:
        """Turn h5py's read errors into a :class:`SourceReadError` naming file and key."""
        try:
            yield
        except SourceReadError:
            raise
        except (OSError, RuntimeError) as error:
            raise SourceReadError(
                f"{self.label}: reading dataset {plan.name!r} failed ({error}). The file is "
                "truncated or corrupt; re-create or re-download it."
            ) from error

    @staticmethod
    def _steps(rows: int, row_bytes: int, budget: int, chunks: Any) -> Iterator[tuple[int, int]]:
        """Blocks of rows of about ``budget`` bytes, whole chunks along axis 0 if chunked."""
        step = max(1, budget // max(1, row_bytes))
        if chunks:
            along = int(chunks[0])
            step = max(along, step - step % along)
        for start in range(0, rows, step):
            yield start, min(rows, start + step)

    def _read_tensor(
        self, plan: _Plan, ds: Any, out: np.ndarray, progress: Callable[[int], None]
    ) -> None:
        if out.size == 0:
            return
        offset = self._raw_offset(plan, ds, out.nbytes)
        if offset is not None:  # contiguous and unfiltered: the bytes straight from the file
            what = f"{self.label}: dataset {plan.name!r}"
            read_into(self.label, offset, out, progress, what)
            if not ds.dtype.isnative and ds.dtype.itemsize > 1:
                out.byteswap(inplace=True)
            return
        filters = self._inflatable(plan, ds)
        if filters is not None and self._inflate(plan, ds, filters, out, progress):
            return
        row_bytes = out.nbytes // plan.rows
        if plan.reader == "array":
            h5s, h5t = self._h5py.h5s, self._h5py.h5t
            mtype = h5t.py_create(np.dtype((plan.dtype, ds.dtype.subdtype[1])))
            file_space = ds.id.get_space()
        for start, stop in self._steps(plan.rows, row_bytes, _CHUNK, ds.chunks):
            ready(out[:stop])  # pages still being allocated: wait for them
            if plan.reader == "direct":
                ds.read_direct(out, np.s_[start:stop], np.s_[start:stop])
            else:  # H5T_ARRAY: read_direct cannot convert, the low-level read can
                count = (stop - start, *ds.shape[1:])
                file_space.select_hyperslab((start,) + (0,) * (len(count) - 1), count)
                mem_space = h5s.create_simple(count)
                ds.id.read(mem_space, file_space, out[start:stop], mtype=mtype)
            progress((stop - start) * row_bytes)

    def _raw_offset(self, plan: _Plan, ds: Any, nbytes: int) -> int | None:
        """Where a contiguous, unfiltered numeric dataset's bytes start in the file, or None.

        Such a dataset is stored as one run of raw bytes (in the file's byte order),
        so ``preadv`` can copy it without HDF5's per-call overhead. Anything else
        (chunked, compact, external, virtual, not yet written, a driver other than a
        single plain file, a type HDF5 converts) goes through ``read_direct``.
        """
        if plan.reader != "direct" or ds.dtype.kind not in "iufc" or self._file.driver != "sec2":
            return None
        try:
            dcpl = ds.id.get_create_plist()
            if (
                dcpl.get_layout() != self._h5py.h5d.CONTIGUOUS
                or dcpl.get_nfilters()
                or dcpl.get_external_count()
                or ds.id.get_storage_size() != nbytes  # unallocated: its offset is garbage
            ):
                return None
            offset = ds.id.get_offset()
        except (OSError, RuntimeError, ValueError, AttributeError):
            return None
        return None if offset is None or offset < 0 else int(offset)

    def _inflatable(self, plan: _Plan, ds: Any) -> list[int] | None:
        """The filter pipeline of a deflate-compressed numeric dataset, or None.

        Only pipelines of ``deflate`` (gzip) and ``shuffle`` qualify, and no filters
        at all when each chunk holds whole rows: Note [Inflating chunks in threads].
        """
        if plan.reader != "direct" or ds.chunks is None or ds.dtype.kind not in "iufc":
            return None
        if self._file.driver != "sec2" or not hasattr(ds.id, "chunk_iter"):
            return None
        try:
            dcpl = ds.id.get_create_plist()
            filters = [int(dcpl.get_filter(i)[0]) for i in range(dcpl.get_nfilters())]
        except (OSError, RuntimeError, ValueError):
            return None
        if not filters and tuple(ds.chunks[1:]) == tuple(ds.shape[1:]):
            return filters  # chunks of whole rows, stored as they are
        if _DEFLATE not in filters or not set(filters) <= {_DEFLATE, _SHUFFLE}:
            return None
        return filters

    def _inflate(
        self,
        plan: _Plan,
        ds: Any,
        filters: list[int],
        out: np.ndarray,
        progress: Callable[[int], None],
    ) -> bool:
        """Read every chunk raw and decode it in threads, into ``out``; False if unsuitable."""
        stored: list[tuple[tuple[int, ...], int, int, int]] = []
        ds.id.chunk_iter(
            lambda c: stored.append((c.chunk_offset, c.filter_mask, c.byte_offset, c.size))
        )
        shape, chunks = tuple(ds.shape), tuple(ds.chunks)
        if len(stored) != math.prod(-(-s // c) for s, c in zip(shape, chunks)):
            return False  # chunks never written hold the fill value: HDF5 knows it
        dtype = ds.dtype
        chunk_bytes = math.prod(chunks) * dtype.itemsize
        what = f"{self.label}: reading dataset {plan.name!r}"

        def place(offset: tuple[int, ...], mask: int, address: int, size: int) -> int:
            if not filters and dtype.isnative:  # whole rows: straight into them
                rows = out[offset[0] : offset[0] + chunks[0]]
                target = rows.reshape(-1).view(np.uint8).data
                if size != chunk_bytes or os.preadv(fd, [target], address) != rows.nbytes:
                    raise SourceReadError(f"{what} failed: the file ends inside a chunk")
                return rows.nbytes
            raw = os.pread(fd, size, address)
            if len(raw) != size:
                raise SourceReadError(f"{what} failed: the file ends inside a chunk")
            data = _decode(raw, mask, filters, dtype.itemsize)
            if len(data) != chunk_bytes:
                raise SourceReadError(
                    f"{what} failed: a chunk decodes to {len(data)} bytes, not {chunk_bytes}"
                )
            where = tuple(slice(o, min(o + c, s)) for o, c, s in zip(offset, chunks, shape))
            block = np.frombuffer(data, dtype).reshape(chunks)
            out[where] = block[tuple(slice(0, w.stop - w.start) for w in where)]
            return math.prod(w.stop - w.start for w in where) * out.itemsize

        threads = _inflate_threads()
        fd = os.open(self.label, os.O_RDONLY | os.O_CLOEXEC)
        executor = ThreadPoolExecutor(threads, thread_name_prefix="shareddata-hdf5")
        pending: collections.deque[Future[int]] = collections.deque()
        try:
            for chunk in stored:
                if len(pending) >= 4 * threads:
                    progress(pending.popleft().result())
                ready(out[: min(chunk[0][0] + chunks[0], shape[0])])  # its pages are in
                pending.append(executor.submit(place, *chunk))
            while pending:
                progress(pending.popleft().result())
        except (zlib.error, OSError, ValueError) as error:
            if isinstance(error, SourceReadError):
                raise
            raise SourceReadError(
                f"{what} failed ({error}). The file is truncated or corrupt; re-create or "
                "re-download it."
            ) from error
        finally:  # no thread writes to ``out`` once this returns, on an error too
            executor.shutdown(wait=True, cancel_futures=True)
            os.close(fd)
        return True

    def _fixed_blocks(self, plan: _Plan, ds: Any) -> Iterator[tuple[int, int, Any]]:
        """Blocks of fixed-width rows read as numpy arrays, about ``_BLOCK / 3`` bytes each."""
        for start, stop in self._steps(plan.rows, ds.dtype.itemsize, _BLOCK // 3, ds.chunks):
            yield start, stop, ds[start:stop]

    def _lengths(self, plan: _Plan, block: Any) -> np.ndarray:
        if plan.reader == "opaque":
            return np.full(len(block), block.dtype.itemsize, np.int64)
        if plan.reader == "fixed":  # np.bytes_ semantics: trailing NULs are not part of it
            width = block.dtype.itemsize
            if width == 0 or len(block) == 0:
                return np.zeros(len(block), np.int64)
            nonzero = block.view(np.uint8).reshape(len(block), width) != 0
            last = width - np.argmax(nonzero[:, ::-1], axis=1)
            return np.where(nonzero.any(axis=1), last, 0).astype(np.int64)
        return np.fromiter(map(len, block), np.int64, count=len(block))

    def _size(self, plan: _Plan) -> int:
        """Total ``values`` of a variable-length column, reading it in bounded blocks.

        The blocks are kept (``plan.blocks``) so that :meth:`read` reads the same ones.
        """
        ds = self._file[plan.name]
        if plan.reader == "opaque":
            return plan.rows * ds.dtype.itemsize
        plan.blocks = []
        with self._reading(plan):
            if plan.reader == "fixed":
                for start, stop, block in self._fixed_blocks(plan, ds):
                    plan.blocks.append((start, stop, int(self._lengths(plan, block).sum())))
                    del block
            else:
                # a row's size is known only once read: grow the blocks from a few rows
                # to what the rows seen so far say fits in _BLOCK bytes of Python objects
                element = plan.dtype.itemsize
                start, step = 0, 8
                while start < plan.rows:
                    stop = min(plan.rows, start + step)
                    block = ds[start:stop]
                    total = int(self._lengths(plan, block).sum())
                    del block
                    plan.blocks.append((start, stop, total))
                    per_row = _OBJECT_OVERHEAD + element * total / (stop - start)
                    step = int(min(4 * step, _MAX_BLOCK_ROWS, max(1, _BLOCK // per_row)))
                    start = stop
        return sum(n for _, _, n in plan.blocks)

    def _read_var(
        self,
        plan: _Plan,
        ds: Any,
        offsets: np.ndarray,
        values: np.ndarray,
        progress: Callable[[int], None],
    ) -> None:
        ready(offsets[:1])
        offsets[0] = 0
        progress(offsets.itemsize)
        if plan.reader == "opaque":
            blocks: Iterator[tuple[int, int, Any]] = self._fixed_blocks(plan, ds)
        else:
            blocks = ((a, b, ds[a:b]) for a, b, _ in plan.blocks)
        sized = iter(plan.blocks)
        for start, stop, block in blocks:
            lengths = self._lengths(plan, block)
            base = int(offsets[start])
            total = int(lengths.sum())
            if plan.reader != "opaque" and total != next(sized)[2]:
                raise SourceReadError(
                    f"{self.label}: dataset {plan.name!r} changed while it was being loaded "
                    f"(rows {start}:{stop}); load it again when nothing writes to the file."
                )
            ready(offsets[: stop + 1])  # pages still being allocated: wait for them
            ready(values[: base + total])
            np.cumsum(lengths, out=offsets[start + 1 : stop + 1])
            offsets[start + 1 : stop + 1] += base
            dest = values[base : base + total]
            if total:
                self._fill(plan, block, lengths, dest)
            if plan.kind == "str":
                self._check_utf8(plan, values, offsets, start, stop)
            del block
            progress((stop - start) * offsets.itemsize + dest.nbytes)

    @staticmethod
    def _fill(plan: _Plan, block: Any, lengths: np.ndarray, dest: np.ndarray) -> None:
        if plan.reader == "vlen":
            np.concatenate([np.asarray(row).reshape(-1) for row in block], out=dest)
        elif plan.reader == "vlen_str":
            dest[:] = np.frombuffer(b"".join(block), np.uint8)
        else:  # fixed width: keep each row's first `length` bytes
            width = block.dtype.itemsize
            raw = block.view(np.uint8).reshape(len(block), width)
            if plan.reader == "opaque":
                dest[:] = raw.reshape(-1)
            else:
                dest[:] = raw[np.arange(width) < lengths[:, None]]

    def _check_utf8(
        self, plan: _Plan, values: np.ndarray, offsets: np.ndarray, start: int, stop: int
    ) -> None:
        """Refuse text that is not UTF-8 now, rather than fail when a worker decodes it."""
        lo, hi = int(offsets[start]), int(offsets[stop])
        try:
            str(values[lo:hi].data, "utf-8")
        except UnicodeDecodeError:
            pass
        else:
            # valid as a whole; each row is valid too if no row starts inside a character
            starts, ends = offsets[start:stop], offsets[start + 1 : stop + 1]
            if not np.any((values[starts[ends > starts]] & 0xC0) == 0x80):
                return
        bad = start
        for row in range(start, stop):  # rare path: find the first row that is not text
            try:
                str(values[offsets[row] : offsets[row + 1]].data, "utf-8")
            except UnicodeDecodeError:
                bad = row
                break
        raise SourceReadError(
            f"dataset {plan.name!r} of {self.label} is declared as text, but row {bad} is "
            "not valid UTF-8. Fix: re-write the dataset with valid UTF-8 strings, or store "
            "the raw bytes as fixed-length (ascii) strings or variable-length uint8."
        )


class HDF5Dataset(ColumnDataset):
    """Datasets of an HDF5 file as columns, loaded once into shared memory.

    Each HDF5 dataset is a column; its first dimension is the row. Numeric datasets
    (contiguous or chunked, compressed with gzip, lzf, szip or, when ``hdf5plugin``
    is installed, its filters) give tensors in the file's dtype (native byte order);
    strings give ``str`` (``bytes`` for fixed-length ascii); variable-length numeric
    datasets give 1-D tensors of varying length. The file is closed once loaded:
    workers index shared memory only.

    Args:
        path: the HDF5 file.
        keys: dataset paths inside the file (``"images"``, ``"grp/labels"``), in sample
            order; a column is named by its path without a leading ``/``. ``None``:
            every dataset in the file (all groups, in visit order) whose first dimension
            equals the longest one; shorter ones and scalars are skipped.
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{key: value}``) or ``"tuple"`` (in key order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared (for a small RAM or memory limit).
        progress: show a progress bar for loads longer than ~2 s.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        KeyError: a key is not a dataset of the file (the message lists those that are).
        ValueError: the datasets have different lengths.
        TypeError: a dataset's type cannot be stored (compound, references, enums).
        OSError: the file is truncated or corrupt (``SourceReadError``, naming it).
        ImportError: h5py is not installed (``pip install 'shareddata[hdf5]'``).
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import os, tempfile, h5py, numpy as np
        >>> from shareddata.sources.hdf5 import HDF5Dataset
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = os.path.join(tmp.name, "tiny.h5")
        >>> with h5py.File(path, "w") as f:
        ...     f["images"] = np.ones((4, 2, 2), np.float32)
        ...     f["meta/label"] = np.arange(4, dtype=np.int32)
        ...     f["meta/name"] = np.array(["a", "b", "c", "d"], dtype=h5py.string_dtype())
        >>> ds = HDF5Dataset(path)
        >>> len(ds), ds.columns
        (4, ['images', 'meta/label', 'meta/name'])
        >>> sample = ds[-1]
        >>> sample["images"].shape, sample["meta/label"], sample["meta/name"]
        (torch.Size([2, 2]), tensor(3, dtype=torch.int32), 'd')
        >>> HDF5Dataset(path, ["/meta/name"], output="tuple")[0]
        ('a',)
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        path: PathLike,
        keys: str | Sequence[str] | None = None,
        *,
        transform: Callable[[Any], Any] | None = None,
        output: Output = "dict",
        storage_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
    ) -> None:
        loaded = load_columns(HDF5Source(path, keys), storage_dir=storage_dir, progress=progress)
        super().__init__(loaded, transform=transform, output=output)
