"""NumPy source: ``.npy`` files, ``.npz`` archives, folders of ``.npy``, arrays, mappings.

Sizes come from the ``.npy`` headers alone; data is then read straight into the
shared buffers (``os.preadv`` into the mapped pages, in bounded blocks of rows taken
with ``Buffer.rows``), so no private copy of the data ever exists.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import reprlib
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from .._compat import read_npy_header_3
from ..columns._columns import ColumnSpec
from ..errors import (
    ArgumentTypeError,
    MissingFileError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._io import fill_from, read_into
from ._source import Buffer, select_columns

__all__ = ["NumpySource"]

_CHUNK = 64 << 20
PathLike = str | os.PathLike


def _blocks(out: np.ndarray) -> Iterator[tuple[int, int]]:
    """Row ranges ``[a, b)`` of ``out`` of about ``_CHUNK`` bytes each."""
    rows = out.shape[0]
    row_bytes = max(1, out.nbytes // max(rows, 1))
    step = max(1, _CHUNK // row_bytes)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _copy_rows(out: Buffer, src: Any, progress: Callable[[int], None]) -> None:
    """Copy ``src`` (``len(out)`` rows) into ``out``, a block of rows at a time."""
    for a, b in _blocks(out):
        rows = out.rows(a, b)
        rows[...] = src[a:b]
        progress(rows.nbytes)


def _check_dtype(dtype: np.dtype, name: str, label: str) -> None:
    fix = None
    if dtype.hasobject:
        fix = (
            "object arrays hold Python objects, which cannot be shared without copying them into "
            "every process. Convert to a numeric dtype, or keep per-row objects in a SharedList"
        )
    elif dtype.fields is not None:
        fix = "split the structured array into one column per field: {f: arr[f] for f in names}"
    elif dtype.kind in "US":
        fix = "convert strings to numeric codes, or store them in a SharedList"
    elif dtype.kind in "mM":
        fix = "store datetimes as integers: arr.astype('int64')"
    elif dtype.kind == "V":
        fix = "view the raw bytes as uint8: arr.view(np.uint8)"
    elif dtype.kind in "fc" and dtype.itemsize > (8 if dtype.kind == "f" else 16):
        fix = (
            "torch has no extended-precision type; convert with arr.astype(np.float64) "
            "(or np.complex128), or store the raw bytes with arr.view(np.uint8)"
        )
    if fix is not None:
        raise UnsupportedDtypeError(
            f"column {name!r} of {label} has dtype {dtype}, which shareddata cannot store. Fix: "
            f"{fix}."
        )


def _read_header(f: Any, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            return fmt.read_array_header_1_0(f)
        if version == (2, 0):
            return fmt.read_array_header_2_0(f)
        if version == (3, 0):  # utf-8 field names; numpy's reader is private
            return read_npy_header_3(f)
        raise ValueError(f"unknown .npy format version {version[0]}.{version[1]}")
    except Exception as e:  # numpy's header parser raises many types (TokenError too)
        raise SourceReadError(
            f"{where} is not a valid .npy file ({type(e).__name__}: {e}). Re-create it with "
            "np.save."
        ) from e


def _data_bytes(shape: tuple[int, ...], dtype: np.dtype, where: str) -> int:
    """Bytes of data a header announces, refusing shapes no array can have."""
    if any(d < 0 for d in shape):
        raise SourceReadError(
            f"{where} is not a valid .npy file: its header's shape {shape} has a negative "
            "dimension. Re-create it with np.save."
        )
    if math.prod(d for d in shape if d) * max(dtype.itemsize, 1) >= 1 << 63:
        raise SourceReadError(
            f"{where} is not a valid .npy file: its header's shape {shape} is too large for "
            "any array. Re-create it with np.save."
        )
    return math.prod(shape) * dtype.itemsize  # exact: no int64 wrap-around


class _Entry:
    """One column: an array in memory, a .npy file, or a member of an .npz archive."""

    fortran = False

    def __init__(self, name: str, label: str) -> None:
        self.name, self.label = name, label
        self.shape: tuple[int, ...] = ()
        self.dtype = np.dtype("u1")

    def spec(self) -> ColumnSpec:
        _check_dtype(self.dtype, self.name, self.label)
        if not self.shape:
            raise UnsupportedDtypeError(
                f"column {self.name!r} of {self.label} is a 0-d array (a single value); a "
                "column needs a first dimension of rows. Wrap it: np.asarray([value])."
            )
        return ColumnSpec(self.name, self.shape[0], self.dtype.newbyteorder("="), self.shape[1:])

    def read(self, out: Buffer, progress: Callable[[int], None], start: int = 0) -> None:
        """Fill ``out`` with rows ``start : start + len(out)``."""
        raise NotImplementedError

    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def _header(self, f: Any, stored: Callable[[int], int]) -> int:
        """Read the header from ``f``; check that the ``stored(offset)`` bytes hold the data."""
        self.shape, self.fortran, self.dtype = _read_header(f, self.label)
        offset = f.tell()
        if self.dtype.hasobject:
            return offset  # refused with a clear message by spec()
        needed, have = _data_bytes(self.shape, self.dtype, self.label), stored(offset)
        if have < needed:
            raise SourceReadError(
                f"{self.label} is truncated: its header says shape {self.shape} {self.dtype} "
                f"({needed} bytes) but only {max(0, have)} bytes of data follow. Re-create "
                "the file."
            )
        return offset


class _Memory(_Entry):
    def __init__(self, name: str, array: Any, label: str) -> None:
        super().__init__(name, label)
        if isinstance(array, torch.Tensor):
            array = array.detach().cpu()
            if array.dtype == torch.bfloat16:
                raise UnsupportedDtypeError(
                    f"column {name!r} is a bfloat16 tensor, which numpy cannot hold; convert it "
                    "with .float() or store its bits with .view(torch.int16)."
                )
            array = array.numpy()
        self.array = np.asarray(array)
        self.shape, self.dtype = self.array.shape, self.array.dtype

    def read(self, out: Buffer, progress: Callable[[int], None], start: int = 0) -> None:
        _copy_rows(out, self.array[start : start + len(out)], progress)


def _byteswap_if_needed(out: np.ndarray, dtype: np.dtype) -> None:
    if not dtype.isnative and dtype.itemsize > 1:
        out.byteswap(inplace=True)


class _NpyFile(_Entry):
    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, path)
        self.path = path
        with open(path, "rb") as f:
            self.offset = self._header(f, lambda at: os.fstat(f.fileno()).st_size - at)

    def read(self, out: Buffer, progress: Callable[[int], None], start: int = 0) -> None:
        if self.fortran and out.ndim > 1:
            mapped = np.load(self.path, mmap_mode="r")
            _copy_rows(out, mapped[start : start + len(out)], progress)
            del mapped
            return
        row_bytes = self.row_bytes()
        for a, b in _blocks(out):
            # read_into needs no page ready, and leaves the rows' pages allocated
            rows = out.view(np.ndarray)[a:b]
            read_into(self.path, self.offset + (start + a) * row_bytes, rows, progress, self.path)
            _byteswap_if_needed(rows, self.dtype)


_ZIP_ERRORS = (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error)


class _NpzMember(_Entry):
    def __init__(self, name: str, path: str, archive: zipfile.ZipFile, member: str) -> None:
        super().__init__(name, f"{path}[{member}]")
        self.archive, self.member = archive, member
        size = archive.getinfo(member).file_size
        try:
            with archive.open(member) as f:
                self.offset = self._header(f, lambda at: size - at)
        except _ZIP_ERRORS as e:
            if isinstance(e, SourceReadError):
                raise
            raise SourceReadError(
                f"{self.label} cannot be opened: {path} is not a valid .npz archive "
                f"({type(e).__name__}: {e}). Re-create the file with np.savez."
            ) from e

    def read(self, out: Buffer, progress: Callable[[int], None], start: int = 0) -> None:
        if self.fortran and out.ndim > 1:
            raise UnsupportedDtypeError(
                f"{self.label} is stored in Fortran order inside an .npz; save it C-ordered "
                "(np.ascontiguousarray) or as a separate .npy file."
            )
        try:
            with cast(io.BufferedIOBase, self.archive.open(self.member)) as f:  # a ZipExtFile
                f.seek(self.offset + start * self.row_bytes())  # compressed: read past
                for a, b in _blocks(out):
                    rows = out.rows(a, b)
                    fill_from(lambda part, _: f.readinto(part), rows, progress, self.label)
                    _byteswap_if_needed(rows, self.dtype)
        except _ZIP_ERRORS as e:
            if isinstance(e, SourceReadError):
                raise
            raise SourceReadError(f"{self.label} is corrupt ({e}). Re-create the file.") from e


def _existing(path: PathLike) -> str:
    if not os.path.exists(path):
        raise MissingFileError(
            f"{os.fspath(path)} does not exist. Pass a .npy or .npz file, a folder of .npy "
            "files, an array, or a mapping {column: array or path}."
        )
    return os.fspath(path)


class NumpySource:
    """Reads a ``.npy``/``.npz`` file, a folder of ``.npy``, an array or a mapping of them."""

    def __init__(self, source: Any, columns: Sequence[str] | None = None) -> None:
        self._archives: list[zipfile.ZipFile] = []
        self._rows: tuple[int, int] | None = None
        try:
            by_name = {e.name: e for e in self._entries(source)}
            self.entries = [by_name[n] for n in select_columns(list(by_name), columns, self.label)]
        except BaseException:
            self.close()
            raise

    def _entries(self, source: Any) -> list[_Entry]:
        if isinstance(source, (np.ndarray, torch.Tensor)):
            self.label = "the array"
            return [_Memory("data", source, self.label)]
        if isinstance(source, Mapping):
            self.label = "the mapping"
            return [
                _NpyFile(str(k), _existing(v))
                if isinstance(v, (str, os.PathLike))
                else _Memory(str(k), v, f"the mapping (column {str(k)!r})")
                for k, v in source.items()
            ]
        if isinstance(source, (str, os.PathLike)):
            self.label = path = _existing(source)
            if os.path.isdir(path):
                files = sorted(f for f in os.listdir(path) if f.endswith(".npy"))
                if not files:
                    raise MissingFileError(
                        f"folder {path} holds no .npy files; NumpyDataset reads one column "
                        "per .npy file (its stem is the column name)."
                    )
                return [_NpyFile(f[: -len(".npy")], os.path.join(path, f)) for f in files]
            if not path.endswith(".npz") and not zipfile.is_zipfile(path):
                return [_NpyFile(os.path.splitext(os.path.basename(path))[0], path)]
            try:
                archive = zipfile.ZipFile(path)
            except (zipfile.BadZipFile, OSError) as e:
                raise SourceReadError(f"{path} is not a valid .npz archive ({e}).") from e
            self._archives.append(archive)
            members = [m for m in archive.namelist() if m.endswith(".npy")]
            return [_NpzMember(m[: -len(".npy")], path, archive, m) for m in members]
        hint = ""
        if isinstance(source, np.generic):
            hint = " A numpy scalar has no rows; pass an array with one row per sample."
        elif isinstance(source, (list, tuple)):
            hint = " For a list of numbers, pass np.asarray(source)."
        raise ArgumentTypeError(
            f"NumpyDataset cannot read source={reprlib.repr(source)} (type "
            f"{type(source).__name__}); pass a .npy/.npz path, a folder of .npy files, an "
            f"array, or a mapping {{column: array or path}}.{hint}"
        )

    def specs(self) -> list[ColumnSpec]:
        """One tensor column per entry (of the selected rows, see :meth:`select_rows`)."""
        specs = [e.spec() for e in self.entries]
        if self._rows is None:
            return specs
        start, stop = self._rows
        return [dataclasses.replace(s, rows=stop - start) for s in specs]

    def select_rows(self, start: int, stop: int) -> None:
        """Describe and read only rows ``[start, stop)`` of every column."""
        if not 0 <= start <= stop:
            raise ValueError(f"invalid row range [{start}, {stop})")
        self._rows = (start, stop)

    def read(
        self, spec: ColumnSpec, buffers: dict[str, Buffer], progress: Callable[[int], None]
    ) -> None:
        """Fill the column's ``data`` buffer."""
        entry = next(e for e in self.entries if e.name == spec.name)
        args = () if self._rows is None else (self._rows[0],)  # (tests patch read(out, progress))
        entry.read(buffers["data"], progress, *args)

    def close(self) -> None:
        """Close any open archives."""
        for archive in self._archives:
            archive.close()
        self._archives.clear()
