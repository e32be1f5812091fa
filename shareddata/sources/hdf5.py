"""HDF5 source: datasets of an HDF5 file, read with h5py straight into shared memory.

Opening the file reads metadata only (shapes, types, filters). Fixed-shape numeric
data is then read straight into the shared buffer, so no private copy of a column
exists: by h5py's ``read_direct`` in bounded blocks of rows aligned to the dataset's
chunks (Note [Reading HDF5 chunks once]), HDF5 converting types (byte order, enums,
one field of a compound) on the way into the buffer; gzip chunks and the fields of
raw records by shareddata itself, where it measured faster
(:mod:`~shareddata.sources._hdf5_chunks`). Variable-length
data (strings, ``vlen`` sequences) is read twice in bounded blocks of rows: once
to size the ``values`` buffer exactly, once to fill it; at most one block exists
as Python objects at any time. docs/internals.md gives the memory this takes.

How HDF5 types map to columns: :mod:`~shareddata.sources._hdf5_layout`; anndata's
encoded groups (sparse matrices, categoricals, data frames):
:mod:`~shareddata.sources._hdf5_encoded`; netCDF and the CF conventions:
:mod:`~shareddata.sources._hdf5_cf`.
"""

from __future__ import annotations

import os
import reprlib
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ..columns._columns import ColumnSpec
from ..columns._sparse import SPARSE_OUTPUTS
from ..errors import (
    ArgumentTypeError,
    ColumnLengthError,
    InvalidArgumentError,
    SourceReadError,
)
from . import _hdf5_chunks
from ._hdf5_layout import Plan, attr_value
from ._hdf5_open import check_filters, import_h5py, open_file, read_errors
from ._hdf5_select import Selection
from ._hdf5_values import VariableReader
from ._source import Buffer

__all__ = ["HDF5Source"]

PathLike = str | os.PathLike

_CHUNK = 64 << 20
"""Bytes of fixed-shape data HDF5 reads per call."""


class HDF5Source:
    """Reads datasets of an HDF5 file (see :class:`HDF5Dataset`).

    The constructor opens the file and reads metadata only; :meth:`specs` sizes
    the columns (reading variable-length datasets once, in bounded blocks);
    :meth:`read` fills the buffers it is given; :meth:`close` closes the file.

    Args:
        path: the HDF5 file.
        keys: dataset paths inside the file, in column order (see
            :class:`HDF5Dataset`). ``None``: the default selection.
        sparse: what a sparse matrix's row comes back as (see :class:`HDF5Dataset`).
        decode_cf: decode a netCDF file's variables (see :class:`HDF5Dataset`).

    Attributes:
        plans: how each column is read, in column order.
        skipped: with ``columns=None``, datasets and frame columns left out because
            their type cannot be stored (name: the reason).
        coords: a netCDF file's variables along other dimensions, decoded (numpy).
        attrs: a netCDF file's variable attributes, by column and coordinate.
    """

    def __init__(
        self,
        path: PathLike,
        keys: str | Sequence[str] | None = None,
        sparse: str = "dense",
        decode_cf: bool = True,
    ) -> None:
        if sparse not in SPARSE_OUTPUTS:
            raise InvalidArgumentError(
                f"HDF5Dataset: sparse={sparse!r} is not one of {SPARSE_OUTPUTS}: 'dense' gives "
                "each sparse row as a dense tensor, 'coo' as a torch.sparse_coo tensor."
            )
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise ArgumentTypeError(
                f"HDF5Dataset: path={reprlib.repr(path)} (type {type(path).__name__}) is not a "
                "path; pass the HDF5 file's path (a str or pathlib.Path)."
            )
        self._h5py = import_h5py()
        self.label = os.fspath(path)
        self._file: Any = None
        self._specs: list[ColumnSpec] | None = None
        self._total = -1  # rows of every column, once checked equal
        self.skipped: dict[str, str] = {}
        self._file, self._swmr = open_file(self._h5py, self.label)
        try:
            selection = Selection(self._h5py, self._file, self.label, sparse, decode_cf)
            self.plans = selection.auto() if keys is None else selection.select(keys)
            self.skipped = selection.skipped
            netcdf = selection.netcdf
            with read_errors(self.label, "the coordinates", "their stored type"):
                self.coords = {n: netcdf.coord(n) for n in selection.coords} if netcdf else {}
            self.attrs = {p.name: netcdf.attrs(p.path) for p in self.plans} if netcdf else {}
            self.attrs.update({n: netcdf.attrs(n) for n in self.coords} if netcdf else {})
            if netcdf is None:
                _warn_packed(self.label, self._file, self.plans)
            paths = [p.special.datasets if p.special else [p.path] for p in self.plans]
            paths = [some for p, some in zip(self.plans, paths) if p.values is None]
            for path_ in dict.fromkeys(path_ for some in paths for path_ in some):
                check_filters(self._h5py, self.label, path_, self._file[path_])
            self._values = VariableReader(self.label, self._reading, self._block)
        except BaseException:
            self.close()
            raise

    # -- Source protocol ---------------------------------------------------------------
    def total_rows(self) -> int:
        """Rows of the selected datasets, before any :meth:`select_rows`."""
        self._check_lengths()
        return self._total

    def select_rows(self, start: int, stop: int) -> None:
        """Describe and read only rows ``[start, stop)`` (``shard="node"``)."""
        total = self.total_rows()
        if not 0 <= start <= stop <= total:
            raise InvalidArgumentError(
                f"rows [{start}, {stop}) are not within the {total} rows of {self.label}"
            )
        for plan in self.plans:
            plan.first, plan.rows, plan.blocks = start, stop - start, []
        self._specs = None

    def _check_lengths(self) -> None:
        if self._total >= 0:
            return
        lengths = {p.rows for p in self.plans}
        if len(lengths) > 1:  # before any sizing pass reads data
            listing = ", ".join(f"{p.name!r}: {p.rows} rows" for p in self.plans)
            raise ColumnLengthError(
                f"datasets of {self.label} have different lengths ({listing}); every column "
                "needs one value per row. Pass columns=[...] of equal length, or trim them."
            )
        self._total = lengths.pop() if lengths else 0

    def specs(self) -> list[ColumnSpec]:
        """Exact specs of every selected column (sizes variable-length ones by reading)."""
        if self._specs is not None:
            return self._specs
        self._check_lengths()
        specs = []
        for plan in self.plans:
            if plan.special is not None:  # a sparse matrix's rows, a CF-decoded variable
                with self._reading(plan):
                    specs.append(plan.special.spec(plan, self._file))
                continue
            values = 0
            if plan.kind != "tensor":
                ds = self._file[plan.path] if plan.values is None else None
                values = self._values.size(plan, ds)
            specs.append(
                ColumnSpec(plan.name, plan.rows, plan.dtype, plan.shape, plan.kind, values)
            )
        self._specs = specs
        return specs

    def read(
        self, spec: ColumnSpec, buffers: dict[str, Buffer], progress: Callable[[int], None]
    ) -> None:
        """Fill ``buffers`` for ``spec`` (``data``, or ``offsets`` and ``values``)."""
        self.specs()  # variable-length columns are read in the blocks that sized them
        plan = next(p for p in self.plans if p.name == spec.name)
        with self._reading(plan):
            if plan.special is not None:
                plan.special.read(plan, self._file, buffers, progress, self._read_range)
            elif plan.kind != "tensor":
                ds = self._file[plan.path] if plan.values is None else None
                self._values.read(plan, ds, buffers["offsets"], buffers["values"], progress)
            elif plan.values is not None:  # read by anndata
                out = buffers["data"].rows(0, plan.rows)
                out[...] = plan.values[plan.first : plan.first + plan.rows]
                progress(out.nbytes)
            else:
                ds = _uncached(self._h5py, self._file, plan.path)
                read = self._read_tensor if plan.reader == "direct" else self._read_member
                read(plan, ds, buffers["data"], progress)
                _check_length(ds, f"{self.label}: dataset {plan.path!r}")

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
    def _reading(self, plan: Plan) -> AbstractContextManager[None]:
        """Turn h5py's read errors into a :class:`SourceReadError` naming file and key."""
        return read_errors(self.label, plan.path, f"{plan.source} to {plan.dtype}")

    def _read_range(
        self, ds: Any, out: Buffer, start: int, stop: int, progress: Callable[[int], None]
    ) -> None:
        """Rows ``[start, stop)`` of a numeric dataset into ``out``, by the fastest path."""
        name = ds.name.lstrip("/")
        plan = Plan(name, name, stop - start, "tensor", out.dtype, out.shape[1:], "direct")
        plan.first = start
        self._read_tensor(plan, ds, out.rows(0, stop - start).view(Buffer), progress)

    def _block(self, plan: Plan, ds: Any, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of the plan's values as numpy (one bounded block)."""
        start, stop = plan.first + start, plan.first + stop
        if plan.values is not None:  # read by anndata
            return plan.values[start:stop]
        if not plan.member:
            block = ds[start:stop]
        else:
            block = ds.fields(plan.member[0])[start:stop]
            for part in plan.member[1:]:
                block = block[part]
        if plan.index is not None:
            block = np.ascontiguousarray(block[..., plan.index])
        return block

    def _read_tensor(
        self, plan: Plan, ds: Any, out: Buffer, progress: Callable[[int], None]
    ) -> None:
        if out.size == 0:
            return
        row_bytes = out.nbytes // plan.rows
        what = f"{self.label}: reading dataset {plan.name!r}"
        if self._inflatable(plan, ds) and _hdf5_chunks.inflate(
            ds.file.filename, what, ds, out, progress
        ):
            return
        first = plan.first
        for start, stop in _hdf5_chunks.row_steps(plan.rows, row_bytes, _CHUNK, ds.chunks):
            ds.read_direct(out.rows(start, stop), np.s_[first + start : first + stop])
            progress((stop - start) * row_bytes)

    def _read_member(
        self, plan: Plan, ds: Any, out: Buffer, progress: Callable[[int], None]
    ) -> None:
        """Numbers HDF5 converts on the way in: compound fields, enums, array types."""
        if out.size == 0:
            return
        row_bytes = out.nbytes // plan.rows
        if plan.index is not None:  # a column of a pandas block: through a small block
            budget = _CHUNK // 16
            for start, stop in _hdf5_chunks.row_steps(
                plan.rows, ds.dtype.itemsize, budget, ds.chunks
            ):
                out.rows(start, stop)[...] = self._block(plan, ds, start, stop)
                progress((stop - start) * row_bytes)
            return
        h5t, h5s = self._h5py.h5t, self._h5py.h5s
        leaf = plan.source if plan.source is not None else plan.dtype
        sub = leaf.subdtype
        base = sub[0] if sub else leaf
        labels = self._h5py.check_enum_dtype(base)
        if labels is not None and base.kind != "b":
            base = self._h5py.enum_dtype(labels, basetype=np.dtype(base.str).newbyteorder("="))
        elif base.kind in "iufc":
            base = np.dtype(base.str).newbyteorder("=")
        mtype = h5t.py_create(np.dtype((base, sub[1])) if sub else base, logical=True)
        for part in reversed(plan.member):
            outer = h5t.create(h5t.COMPOUND, mtype.get_size())
            outer.insert(part.encode(), 0, mtype)
            mtype = outer
        file_space = ds.id.get_space()
        row_shape = tuple(ds.shape[1:])
        record_bytes = ds.dtype.itemsize * int(np.prod(row_shape))
        for start, stop in _hdf5_chunks.row_steps(plan.rows, record_bytes, _CHUNK, ds.chunks):
            count = (stop - start, *row_shape)
            file_space.select_hyperslab((plan.first + start,) + (0,) * len(row_shape), count)
            ds.id.read(h5s.create_simple(count), file_space, out.rows(start, stop), mtype=mtype)
            progress((stop - start) * row_bytes)

    def _inflatable(self, plan: Plan, ds: Any) -> bool:
        """Whether ``_hdf5_chunks.inflate`` reads this plan's dataset (gzip chunks)."""
        if plan.reader != "direct" or self._swmr or plan.rows != ds.shape[0]:
            return False  # (a node's share of the rows: read_direct selects them)
        return _hdf5_chunks.inflatable(ds)


def _warn_packed(label: str, file: Any, plans: list[Plan]) -> None:
    """Warn about datasets of a file that is not netCDF which carry packing attributes.

    ``scale_factor`` / ``add_offset`` outside netCDF follow no one convention (CF's
    ``codes * scale + offset``, HDF-EOS/MODIS ``scale * (codes - offset)``), so the
    codes are loaded as stored and the warning names each dataset and its attributes.
    """
    for path in dict.fromkeys(p.path for p in plans if p.kind == "tensor" and p.values is None):
        ds = file[path]
        packing = {k: attr_value(ds, k) for k in ("scale_factor", "add_offset") if k in ds.attrs}
        if packing:
            warnings.warn(
                f"{label}: dataset {path!r} carries {packing} but the file is not netCDF, "
                f"so its stored {ds.dtype} codes are loaded as they are (packing "
                "conventions differ outside CF: CF is codes * scale_factor + add_offset, "
                "HDF-EOS scale_factor * (codes - add_offset)). Decode them in a transform, "
                "or write the file with netCDF4/xarray to have shareddata decode it.",
                UserWarning,
                stacklevel=2,
            )


def _check_length(ds: Any, what: str) -> None:
    """Refuse data read from a file that shrank after it was opened.

    HDF5 checks a file's length when it opens it, but reads past the end of a file
    cut later as zeros, without an error.
    """
    size, expected = os.stat(ds.file.filename).st_size, ds.file.id.get_filesize()
    if size < expected:
        raise SourceReadError(
            f"{what} ended early: the file is {size} bytes, {expected} when it was opened "
            "(it was truncated while being loaded). Re-create or re-download it."
        )


# Note [Reading HDF5 chunks once]
# ===============================
# A load reads every chunk once, in blocks of whole chunks along the rows, so HDF5's
# chunk cache (8 MiB per dataset by default) holds nothing worth keeping: with it a chunk that
# fits is read into the cache and copied out (~9 MiB of private memory at the
# peak), without it ``read_direct`` places the chunk straight into the buffer
# (0.2 MiB), as fast (docs/benchmarks.md). Fixed-shape reads therefore open their
# dataset with a zero-byte cache (HDF5 applies it only when no other handle of the
# dataset is open: a second open shares the first's cache). Variable-length rows
# keep the cache: they are read in blocks that need not end on a chunk.


def _uncached(h5py: Any, file: Any, path: str) -> Any:
    """Dataset ``path`` opened without HDF5's chunk cache (Note [Reading HDF5 chunks once])."""
    access = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    access.set_chunk_cache(0, 0, 1.0)  # slots, bytes, preemption
    return h5py.Dataset(h5py.h5d.open(file.id, path.encode(), access))
