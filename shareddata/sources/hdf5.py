"""HDF5 source: datasets of an HDF5 file, read with h5py straight into shared memory.

Opening the file reads metadata only (shapes, types, filters). Fixed-shape numeric
data is then read straight into the shared buffer, so no private copy of a column
exists: contiguous and gzip/unfiltered chunked datasets, and the fields of
unfiltered records, by shareddata itself (:mod:`~shareddata.sources._hdf5_chunks`),
everything else by HDF5 in bounded blocks of rows aligned to the dataset's chunks,
HDF5 converting types (byte order, enums, one field of a compound) on the way
into the buffer. Variable-length
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
)
from . import _hdf5_chunks
from ._hdf5_cf import warn_packed
from ._hdf5_layout import Plan
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
        skipped: with ``keys=None``, datasets and frame columns left out because
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
        self._runs: dict[str, list[tuple[int, int, int]] | None] = {}
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
                warn_packed(self.label, self._file, self.plans)
            paths = [p.special.datasets if p.special else [p.path] for p in self.plans]
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
                "needs one value per row. Pass keys=[...] of equal length, or trim them."
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
                values = self._values.size(plan, self._file[plan.path])
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
        ds = self._file[plan.path]
        with self._reading(plan):
            if plan.special is not None:
                plan.special.read(plan, self._file, buffers, progress, self._read_range)
            elif plan.kind != "tensor":
                self._values.read(plan, ds, buffers["offsets"], buffers["values"], progress)
            elif plan.reader == "direct":
                self._read_tensor(plan, ds, buffers["data"], progress)
            else:
                self._read_member(plan, ds, buffers["data"], progress)

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
        offset = self._raw_offset(plan, ds, row_bytes * int(ds.shape[0]))
        if offset is not None:  # contiguous and unfiltered: the bytes straight from the file
            what = f"{self.label}: dataset {plan.name!r}"
            start = offset + plan.first * row_bytes
            _hdf5_chunks.copy_raw(ds.file.filename, what, start, out, progress)
            if not ds.dtype.isnative and ds.dtype.itemsize > 1:
                out.rows(0, plan.rows).byteswap(inplace=True)
            return
        filters = self._inflatable(plan, ds)
        what = f"{self.label}: reading dataset {plan.name!r}"
        if filters is not None and _hdf5_chunks.inflate(
            ds.file.filename, what, ds, filters, out, progress
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
        runs = self._record_runs(plan, ds)
        if runs is not None:  # Note [Fields of raw records]
            runs = _hdf5_chunks.runs_within(
                runs, plan.first, plan.first + plan.rows, ds.dtype.itemsize
            )
            what = f"{self.label}: dataset {plan.path!r}"
            _hdf5_chunks.copy_field(
                ds.file.filename, what, ds, runs, lambda block: _field(plan, block), out, progress
            )
            return
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

    def _record_runs(self, plan: Plan, ds: Any) -> list[tuple[int, int, int]] | None:
        """Where a compound dataset's raw records are (``_hdf5_chunks.record_runs``), or None."""
        if not plan.member or self._swmr:  # a SWMR writer may be appending
            return None
        if plan.path not in self._runs:
            self._runs[plan.path] = _hdf5_chunks.record_runs(self._h5py, ds)
        return self._runs[plan.path]

    def _raw_offset(self, plan: Plan, ds: Any, nbytes: int) -> int | None:
        """Where a whole numeric dataset's raw bytes start (see ``_hdf5_chunks.raw_offset``)."""
        if plan.reader != "direct" or self._swmr:  # a SWMR writer may be appending
            return None
        return _hdf5_chunks.raw_offset(self._h5py, ds, nbytes)

    def _inflatable(self, plan: Plan, ds: Any) -> list[int] | None:
        """The pipeline ``_hdf5_chunks.inflate`` decodes for this plan, or None."""
        if plan.reader != "direct" or self._swmr or plan.rows != ds.shape[0]:
            return None  # (a node's share of the rows: read_direct selects them)
        return _hdf5_chunks.inflatable(ds)


def _field(plan: Plan, records: np.ndarray) -> np.ndarray:
    """The plan's field (and block position) of a block of records."""
    for part in plan.member:
        records = records[part]
    return records if plan.index is None else records[..., plan.index]
