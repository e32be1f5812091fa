"""HDF5 source: an HDF5 file's datasets read by h5py straight into shared memory.

Fixed-shape numbers go through ``read_direct`` in chunk-aligned blocks (Note [Reading
HDF5 chunks once]), gzip chunks through :mod:`._hdf5_chunks`. Variable-length rows are
read twice in bounded blocks, to size the ``values`` buffer and then to fill it. Types:
:mod:`._hdf5_layout`; anndata groups: :mod:`._hdf5_encoded`; netCDF: :mod:`._hdf5_cf`.
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
from ..errors import ArgumentTypeError, ColumnLengthError, InvalidArgumentError, SourceReadError
from . import _hdf5_chunks
from ._hdf5_chunks import row_steps
from ._hdf5_layout import Plan, attr_value, native
from ._hdf5_open import check_filters, import_h5py, open_file, read_errors
from ._hdf5_select import Selection
from ._io import read_into
from ._source import Buffer

__all__ = ["HDF5Source"]

PathLike = str | os.PathLike

_CHUNK = 64 << 20
"""Bytes of fixed-shape data HDF5 reads per call."""
_BLOCK = 16 << 20
"""Bytes of private memory one block of variable-length rows may take."""
_OBJECT_OVERHEAD = 112  # bytes of one Python bytes/ndarray beyond its data
_MAX_BLOCK_ROWS = 1 << 20


class HDF5Source:
    """Reads datasets of an HDF5 file (see :class:`HDF5Dataset`): metadata on open.

    Attributes:
        plans: how each column is read, in column order.
        skipped: with ``columns=None``, columns left out as unstorable (name: reason).
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
        self._specs: list[ColumnSpec] | None = None
        self._total = -1  # rows of every column, once checked equal
        self._file, self._swmr = open_file(self._h5py, self.label)
        try:
            selection = Selection(self._h5py, self._file, self.label, sparse, decode_cf)
            self.plans = selection.auto() if keys is None else selection.select(keys)
            self.skipped = selection.skipped
            netcdf = selection.netcdf
            self.coords: dict[str, Any] = {}
            self.attrs: dict[str, Any] = {}
            if netcdf is not None:
                with read_errors(self.label, "the coordinates", "their stored type"):
                    self.coords = {n: netcdf.coord(n) for n in selection.coords}
                self.attrs = {p.name: netcdf.attrs(p.path) for p in self.plans}
                self.attrs.update({n: netcdf.attrs(n) for n in self.coords})
            else:
                _warn_packed(self.label, self._file, self.plans)
            paths = [p.special.datasets if p.special else [p.path] for p in self.plans
                     if p.values is None]  # fmt: skip
            for path_ in dict.fromkeys(path_ for some in paths for path_ in some):
                check_filters(self._h5py, self.label, path_, self._file[path_])
        except BaseException:
            self.close()
            raise

    # -- Source protocol ---------------------------------------------------------------
    def total_rows(self) -> int:
        """Rows of the selected datasets, before any :meth:`select_rows`."""
        if self._total < 0:
            lengths = {p.rows for p in self.plans}
            if len(lengths) > 1:  # before any sizing pass reads data
                listing = ", ".join(f"{p.name!r}: {p.rows} rows" for p in self.plans)
                raise ColumnLengthError(
                    f"datasets of {self.label} have different lengths ({listing}); every "
                    "column needs one value per row. Pass columns=[...] of equal length, "
                    "or trim them."
                )
            self._total = lengths.pop() if lengths else 0
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

    def specs(self) -> list[ColumnSpec]:
        """Exact specs of every selected column (sizes variable-length ones by reading)."""
        if self._specs is not None:
            return self._specs
        self.total_rows()
        specs = []
        for plan in self.plans:
            with self._reading(plan):
                if plan.special is not None:  # a sparse matrix
                    specs.append(plan.special.spec(plan, self._file))
                    continue
                values = 0 if plan.kind == "tensor" else self._size(plan, self._dataset(plan))
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
                self._read_values(plan, self._dataset(plan), buffers, progress)
            elif plan.values is not None:  # read by anndata
                out = buffers["data"].rows(0, plan.rows)
                out[...] = plan.values[plan.first : plan.first + plan.rows]
                progress(out.nbytes)
            else:
                ds = _uncached(self._h5py, self._file, plan.path)
                if plan.reader == "direct":
                    self._read_tensor(plan, ds, buffers["data"], progress)
                elif plan.decode is not None or plan.index is not None:  # CF, a block's column
                    self._read_blocks(plan, ds, buffers["data"], progress)
                else:
                    self._read_member(plan, ds, buffers["data"], progress)
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

    # -- fixed-shape numbers -----------------------------------------------------------
    def _reading(self, plan: Plan) -> AbstractContextManager[None]:
        return read_errors(self.label, plan.path, f"{plan.source} to {plan.dtype}")

    def _dataset(self, plan: Plan) -> Any:
        """The plan's h5py dataset, or the numpy values anndata read (sliced the same way)."""
        return self._file[plan.path] if plan.values is None else plan.values

    def _read_range(
        self, ds: Any, out: Buffer, start: int, stop: int, progress: Callable[[int], None]
    ) -> None:
        """Rows ``[start, stop)`` of a numeric dataset into ``out`` (a sparse matrix's)."""
        name = ds.name.lstrip("/")
        plan = Plan(name, name, stop - start, "tensor", out.dtype, out.shape[1:], "direct")
        plan.first = start
        self._read_tensor(plan, ds, out.rows(0, stop - start).view(Buffer), progress)

    def _block(self, plan: Plan, ds: Any, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of the plan's values as numpy (PyTables' UCS-4 as UTF-8)."""
        start, stop = plan.first + start, plan.first + stop
        block = ds.fields(plan.member[0])[start:stop] if plan.member else ds[start:stop]
        for part in plan.member[1:]:
            block = block[part]
        if plan.index is not None:
            block = np.ascontiguousarray(block[..., plan.index])
        return _utf8(block) if plan.reader == "vlen_ucs4" else block

    def _read_tensor(
        self, plan: Plan, ds: Any, out: Buffer, progress: Callable[[int], None]
    ) -> None:
        if out.size == 0:
            return
        what = f"{self.label}: reading dataset {plan.name!r}"
        if self._inflatable(plan, ds) and _hdf5_chunks.inflate(what, ds, out, progress):
            return
        row_bytes = out.nbytes // plan.rows
        stored = ds.chunks is None and ds.external is None and ds.dtype == out.dtype
        stored = stored and ds.id.get_storage_size() == ds.size * ds.dtype.itemsize  # written
        stored = stored and ds.file.driver == "sec2" and not self._swmr  # one plain file
        offset = ds.id.get_offset() if stored else None
        if offset is not None:  # contiguous bytes as stored: the kernel copies them
            rows = out.view(np.ndarray)  # no page need be ready (read_into in _io.py)
            at = offset + plan.first * row_bytes  # in its own file (an external link's)
            read_into(ds.file.filename, at, rows, progress, what)
            return
        for start, stop in row_steps(plan.rows, row_bytes, _CHUNK, ds.chunks):
            ds.read_direct(out.rows(start, stop), np.s_[plan.first + start : plan.first + stop])
            progress((stop - start) * row_bytes)

    def _read_member(
        self, plan: Plan, ds: Any, out: Buffer, progress: Callable[[int], None]
    ) -> None:
        """Numbers HDF5 converts on the way in: compound fields, enums, array types."""
        if out.size == 0:
            return
        row_bytes = out.nbytes // plan.rows
        leaf = plan.source if plan.source is not None else plan.dtype
        base = native(leaf.base) if leaf.base.kind in "iufc" else leaf.base
        memory = np.dtype((base, leaf.shape)) if leaf.shape else base
        for part in reversed(plan.member):  # HDF5 converts the one field by its name
            memory = np.dtype([(part, memory)])
        mtype = self._h5py.h5t.py_create(memory, logical=True)  # enum codes convert to ints
        file_space = ds.id.get_space()
        row_shape = tuple(ds.shape[1:])
        record_bytes = ds.dtype.itemsize * int(np.prod(row_shape))
        for start, stop in row_steps(plan.rows, record_bytes, _CHUNK, ds.chunks):
            count = (stop - start, *row_shape)
            file_space.select_hyperslab((plan.first + start,) + (0,) * len(row_shape), count)
            space = self._h5py.h5s.create_simple(count)
            ds.id.read(space, file_space, out.rows(start, stop), mtype=mtype)
            progress((stop - start) * row_bytes)

    def _read_blocks(
        self, plan: Plan, ds: Any, out: Buffer, progress: Callable[[int], None]
    ) -> None:
        """Rows through numpy in blocks of about ``_BLOCK`` bytes, then ``plan.decode``.

        For a column of a pandas block (one position of each row) and for rows that
        ``plan.decode`` decodes (CF variables, MultiIndex levels).
        """
        record_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:]))
        row_bytes = max(record_bytes, out.itemsize * int(np.prod(plan.shape)))
        for start, stop in row_steps(plan.rows, row_bytes, _BLOCK, ds.chunks):
            block = self._block(plan, ds, start, stop)
            dest = out.rows(start, stop)
            dest[...] = block if plan.decode is None else plan.decode(block)
            progress(dest.nbytes)

    def _inflatable(self, plan: Plan, ds: Any) -> bool:
        """Whether ``_hdf5_chunks.inflate`` reads this plan's dataset (gzip chunks)."""
        if plan.reader != "direct" or self._swmr or plan.rows != ds.shape[0]:
            return False  # (a node's share of the rows: read_direct selects them)
        return _hdf5_chunks.inflatable(ds)

    # -- variable-length rows ----------------------------------------------------------
    def _size(self, plan: Plan, ds: Any) -> int:
        """Total ``values`` of a variable-length column; its blocks kept in ``plan.blocks``."""
        plan.blocks = []
        if plan.reader in ("fixed", "opaque"):  # blocks of about _BLOCK / 3 bytes of records
            width = plan.source.itemsize if plan.source is not None else 0
            for start, stop in row_steps(plan.rows, ds.dtype.itemsize, _BLOCK // 3, ds.chunks):
                if plan.reader == "opaque":  # every row is its type's width: nothing to read
                    plan.blocks.append((start, stop, (stop - start) * width))
                    continue
                block = self._block(plan, ds, start, stop)
                plan.blocks.append((start, stop, int(_lengths(plan, block).sum())))
            return sum(n for _, _, n in plan.blocks)
        # a row's size is known once read: grow the blocks from a few rows to what
        # the rows seen so far say fits in _BLOCK bytes of Python objects
        start, step = 0, 8
        while start < plan.rows:
            stop = min(plan.rows, start + step)
            total = int(_lengths(plan, self._block(plan, ds, start, stop)).sum())
            plan.blocks.append((start, stop, total))
            per_row = _OBJECT_OVERHEAD + plan.dtype.itemsize * total / (stop - start)
            step = int(min(4 * step, _MAX_BLOCK_ROWS, max(1, _BLOCK // per_row)))
            start = stop
        return sum(n for _, _, n in plan.blocks)

    def _read_values(
        self, plan: Plan, ds: Any, buffers: dict[str, Buffer], progress: Callable[[int], None]
    ) -> None:
        """Fill ``offsets`` and ``values`` of a column :meth:`_size` has sized."""
        offsets, values = buffers["offsets"], buffers["values"]
        offsets.rows(0, 1)[0] = 0
        progress(offsets.itemsize)
        for start, stop, sized in plan.blocks:
            block = self._block(plan, ds, start, stop)
            lengths = _lengths(plan, block)
            base, total = int(offsets[start]), int(lengths.sum())
            if total != sized:
                raise SourceReadError(
                    f"{self.label}: dataset {plan.path!r} changed while it was being loaded "
                    f"(rows {start}:{stop}); load it again when nothing writes to the file."
                )
            ends = offsets.rows(start + 1, stop + 1)
            np.cumsum(lengths, out=ends)
            ends += base
            dest = values.rows(base, base + total)
            if total:
                _fill(plan, block, lengths, dest)
            if plan.kind == "str":
                self._check_utf8(plan, values, offsets, start, stop)
            del block
            progress((stop - start) * offsets.itemsize + dest.nbytes)

    def _check_utf8(
        self, plan: Plan, values: np.ndarray, offsets: np.ndarray, start: int, stop: int
    ) -> None:
        """Refuse text that is not UTF-8 now, rather than fail when a worker decodes it."""
        try:
            str(values[int(offsets[start]) : int(offsets[stop])].data, "utf-8")
        except UnicodeDecodeError:
            pass
        else:  # each row is valid too if no row starts inside a character
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
            f"{plan.name!r} of {self.label} is declared as text, but row {bad} is not valid "
            "UTF-8. Fix: re-write the dataset with valid UTF-8 strings, or store the raw "
            "bytes as fixed-length (ascii) strings or variable-length uint8."
        )


def _utf8(block: Any) -> list[bytes]:
    """Rows of UCS-4 code points (PyTables' ``VLUnicodeAtom``) as UTF-8 bytes."""
    return [np.asarray(row, "<u4").tobytes().decode("utf-32-le").encode() for row in block]


def _lengths(plan: Plan, block: Any) -> np.ndarray:
    if plan.reader == "opaque":
        return np.full(len(block), block.dtype.itemsize, np.int64)
    if plan.reader == "fixed":  # np.bytes_ semantics: trailing NULs are not part of it
        return np.char.str_len(block).astype(np.int64)
    return np.fromiter(map(len, block), np.int64, count=len(block))


def _fill(plan: Plan, block: Any, lengths: np.ndarray, dest: np.ndarray) -> None:
    if plan.reader == "vlen":
        np.concatenate([np.asarray(row).reshape(-1) for row in block], out=dest)
    elif plan.reader in ("vlen_str", "vlen_ucs4"):
        dest[:] = np.frombuffer(b"".join(block), np.uint8)
    else:  # fixed width: keep each row's first `length` bytes
        width = block.dtype.itemsize
        raw = block.view(np.uint8).reshape(len(block), width)
        dest[:] = (
            raw.reshape(-1) if plan.reader == "opaque" else raw[np.arange(width) < lengths[:, None]]
        )


def _warn_packed(label: str, file: Any, plans: list[Plan]) -> None:
    """Warn that packing attributes outside netCDF are not decoded (no one convention)."""
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
    """Refuse data read from a file cut after it was opened (HDF5 reads zeros past its end)."""
    size, expected = os.stat(ds.file.filename).st_size, ds.file.id.get_filesize()
    if size < expected:
        raise SourceReadError(
            f"{what} ended early: the file is {size} bytes, {expected} when it was opened "
            "(it was truncated while being loaded). Re-create or re-download it."
        )


# Note [Reading HDF5 chunks once]
# ===============================
# A load reads every chunk once, in blocks of whole chunks, so HDF5's chunk cache
# (8 MiB per dataset) only adds a copy through it (~9 MiB private at the peak); with
# a zero-byte cache ``read_direct`` places each chunk straight into the buffer, as
# fast (docs/benchmarks.md). HDF5 applies the cache setting only when no other handle
# of the dataset is open. Variable-length rows keep the cache: their blocks need not
# end on a chunk.


def _uncached(h5py: Any, file: Any, path: str) -> Any:
    """Dataset ``path`` opened without HDF5's chunk cache (Note [Reading HDF5 chunks once])."""
    access = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    access.set_chunk_cache(0, 0, 1.0)  # slots, bytes, preemption
    return h5py.Dataset(h5py.h5d.open(file.id, path.encode(), access))
