"""NumPy source: ``.npy`` files, ``.npz`` archives, folders of ``.npy``, arrays, mappings.

Sizes come from the ``.npy`` headers alone; data is then read straight into the
shared buffers (``os.preadv`` into the mapped pages, in bounded chunks), so no
private copy of the data ever exists.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._columns import ColumnSpec
from .._dataset import ColumnDataset, Output, load_columns
from .._storage import copy_chunked
from ..errors import MissingColumnError, MissingFileError, SourceReadError, UnsupportedDtypeError

__all__ = ["NumpyDataset", "NumpySource"]

_CHUNK = 64 << 20
PathLike = str | os.PathLike


def _check_dtype(dtype: np.dtype, name: str, label: str) -> None:
    fix = None
    if dtype.hasobject:
        fix = (
            "object arrays hold Python objects, which cannot be shared without copying them "
            "into every process. Convert to a numeric dtype, or keep per-row objects in a "
            "SharedList"
        )
    elif dtype.fields is not None:
        fix = "split the structured array into one column per field: {f: arr[f] for f in names}"
    elif dtype.kind in "US":
        fix = "convert strings to numeric codes, or store them in a SharedList"
    elif dtype.kind in "mM":
        fix = "store datetimes as integers: arr.astype('int64')"
    elif dtype.kind == "V":
        fix = "view the raw bytes as uint8: arr.view(np.uint8)"
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
        return fmt._read_array_header(f, version)  # 3.0 (utf-8 field names)
    except (ValueError, SyntaxError, TypeError, EOFError, OSError) as e:
        raise SourceReadError(
            f"{where} is not a valid .npy file ({e}). Re-create it with np.save."
        ) from e


class _Entry:
    """One column's origin: in memory, a .npy file, or a member of an .npz archive."""

    def __init__(self, name: str, label: str) -> None:
        self.name = name
        self.label = label
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

    def read(self, out: np.ndarray, progress: Callable[[int], None]) -> None:
        raise NotImplementedError


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

    def read(self, out: np.ndarray, progress: Callable[[int], None]) -> None:
        copy_chunked(out, self.array, progress)


def _byteswap_if_needed(out: np.ndarray, dtype: np.dtype) -> None:
    if not dtype.isnative and dtype.itemsize > 1:
        out.byteswap(inplace=True)


class _NpyFile(_Entry):
    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, path)
        self.path = path
        with open(path, "rb") as f:
            self.shape, self.fortran, self.dtype = _read_header(f, path)
            self.offset = f.tell()
            size = os.fstat(f.fileno()).st_size
        if self.dtype.hasobject:
            return  # refused with a clear message by spec()
        needed = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if size < self.offset + needed:
            raise SourceReadError(
                f"{path} is truncated: its header says shape {self.shape} {self.dtype} "
                f"({needed} bytes) but only {max(0, size - self.offset)} bytes of data follow. "
                "Re-create the file."
            )

    def read(self, out: np.ndarray, progress: Callable[[int], None]) -> None:
        if self.fortran and out.ndim > 1:
            mapped = np.load(self.path, mmap_mode="r")
            copy_chunked(out, mapped, progress)
            del mapped
            return
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pos = 0
            while pos < len(view):
                n = os.preadv(fd, [view[pos : pos + _CHUNK]], self.offset + pos)
                if n == 0:
                    raise SourceReadError(f"{self.path} ended early, after {pos} bytes of data")
                pos += n
                progress(n)
        finally:
            os.close(fd)
        _byteswap_if_needed(out, self.dtype)


class _NpzMember(_Entry):
    def __init__(self, name: str, path: str, archive: zipfile.ZipFile, member: str) -> None:
        super().__init__(name, f"{path}[{member}]")
        self.path, self.archive, self.member = path, archive, member
        with archive.open(member) as f:
            self.shape, self.fortran, self.dtype = _read_header(f, self.label)

    def read(self, out: np.ndarray, progress: Callable[[int], None]) -> None:
        if self.fortran and out.ndim > 1:
            raise UnsupportedDtypeError(
                f"{self.label} is stored in Fortran order inside an .npz; save it C-ordered "
                "(np.ascontiguousarray) or as a separate .npy file."
            )
        view = memoryview(out.reshape(-1).view(np.uint8))
        try:
            with self.archive.open(self.member) as f:
                _read_header(f, self.label)
                pos = 0
                while pos < len(view):
                    n = f.readinto(view[pos : pos + _CHUNK])
                    if not n:
                        raise SourceReadError(f"{self.label} ended early, after {pos} bytes")
                    pos += n
                    progress(n)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
            if isinstance(e, SourceReadError):
                raise
            raise SourceReadError(f"{self.label} is corrupt ({e}). Re-create the file.") from e
        _byteswap_if_needed(out, self.dtype)


def _missing(path: str) -> MissingFileError:
    return MissingFileError(
        f"{path} does not exist. Pass a .npy or .npz file, a folder of .npy files, an "
        "array, or a mapping {column: array or path}."
    )


class NumpySource:
    """Reads the columns of a NumPy source (see :class:`shareddata.NumpyDataset`).

    Args:
        source: a ``.npy``/``.npz`` path, a folder of ``.npy`` files, an array or
            tensor, or a mapping ``{column: array | tensor | .npy path}``.
        columns: the columns to load, in this order (default: all).
    """

    def __init__(self, source: Any, columns: Sequence[str] | None = None) -> None:
        self._archives: list[zipfile.ZipFile] = []
        try:
            entries = self._entries(source)
            self.entries = self._select(entries, columns)
        except BaseException:
            self.close()
            raise

    def _entries(self, source: Any) -> list[_Entry]:
        if isinstance(source, (np.ndarray, torch.Tensor)):
            self.label = "the array"
            return [_Memory("data", source, self.label)]
        if isinstance(source, Mapping):
            self.label = "the mapping"
            entries: list[_Entry] = []
            for key, value in source.items():
                name = str(key)
                if isinstance(value, (str, os.PathLike)):
                    path = os.fspath(value)
                    if not os.path.exists(path):
                        raise _missing(path)
                    entries.append(_NpyFile(name, path))
                else:
                    entries.append(_Memory(name, value, f"the mapping (column {name!r})"))
            return entries
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            self.label = path
            if not os.path.exists(path):
                raise _missing(path)
            if os.path.isdir(path):
                files = sorted(f for f in os.listdir(path) if f.endswith(".npy"))
                if not files:
                    raise MissingFileError(
                        f"folder {path} holds no .npy files; NumpyDataset reads one column "
                        "per .npy file (its stem is the column name)."
                    )
                return [_NpyFile(f[: -len(".npy")], os.path.join(path, f)) for f in files]
            if path.endswith(".npz") or zipfile.is_zipfile(path):
                return self._npz(path)
            stem = os.path.splitext(os.path.basename(path))[0]
            return [_NpyFile(stem, path)]
        raise TypeError(
            f"NumpyDataset cannot read a {type(source).__name__}; pass a .npy/.npz path, a "
            "folder of .npy files, an array, or a mapping {column: array or path}."
        )

    def _npz(self, path: str) -> list[_Entry]:
        try:
            archive = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as e:
            raise SourceReadError(f"{path} is not a valid .npz archive ({e}).") from e
        self._archives.append(archive)
        members = [m for m in archive.namelist() if m.endswith(".npy")]
        return [_NpzMember(m[: -len(".npy")], path, archive, m) for m in members]

    def _select(self, entries: list[_Entry], columns: Sequence[str] | None) -> list[_Entry]:
        if columns is None:
            return entries
        if isinstance(columns, str):
            columns = [columns]
        by_name = {e.name: e for e in entries}
        missing = [c for c in columns if c not in by_name]
        if missing:
            raise MissingColumnError(
                f"column {missing[0]!r} is not in {self.label}; it has: "
                f"{', '.join(repr(n) for n in by_name) or 'no columns'}."
            )
        return [by_name[c] for c in columns]

    def specs(self) -> list[ColumnSpec]:
        """One tensor column per entry."""
        return [e.spec() for e in self.entries]

    def read(
        self, spec: ColumnSpec, buffers: dict[str, np.ndarray], progress: Callable[[int], None]
    ) -> None:
        """Fill the column's ``data`` buffer."""
        entry = next(e for e in self.entries if e.name == spec.name)
        entry.read(buffers["data"], progress)

    def close(self) -> None:
        """Close any open archives."""
        for archive in self._archives:
            archive.close()
        self._archives.clear()


class NumpyDataset(ColumnDataset):
    """A dataset of NumPy arrays, loaded once into shared memory.

    Args:
        source: a ``.npy`` or ``.npz`` path, a folder of ``.npy`` files (one column
            per file, named by its stem, in sorted order), a numpy array or tensor
            (column ``"data"``), or a mapping ``{column: array | tensor | path}``.
        columns: names of the columns to load, in sample order (default: all).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{column: tensor}``) or ``"tuple"`` (column order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared (for a small RAM or memory limit).
        progress: show a progress bar for loads longer than ~2 s.

    Raises:
        FileNotFoundError: a path does not exist.
        KeyError: a requested column does not exist (the message lists those that do).
        ValueError: columns have different lengths.
        TypeError: a column's dtype cannot be stored (object, structured, strings).
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import numpy as np, shareddata as sd
        >>> ds = sd.NumpyDataset({"x": np.ones((4, 3), np.float32), "y": np.arange(4)},
        ...                      output="tuple")
        >>> len(ds), ds.columns
        (4, ['x', 'y'])
        >>> x, y = ds[-1]
        >>> x.shape, int(y)
        (torch.Size([3]), 3)
    """

    def __init__(
        self,
        source: Any,
        *,
        columns: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        output: Output = "dict",
        storage_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
    ) -> None:
        loaded = load_columns(
            NumpySource(source, columns), storage_dir=storage_dir, progress=progress
        )
        super().__init__(loaded, transform=transform, output=output)
