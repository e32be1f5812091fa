"""HDF5 source: datasets of an HDF5 file, read with h5py straight into shared memory.

Opening the file reads metadata only (shapes, types, filters). Fixed-shape numeric
data is then read straight into the shared buffer, so no private copy of a column
exists: contiguous and gzip/unfiltered chunked datasets by shareddata itself
(:mod:`~shareddata.sources._hdf5_chunks`), everything else by HDF5 in bounded
blocks of rows aligned to the dataset's chunks, HDF5 converting types (byte
order, enums, one field of a compound) on the way into the buffer. Variable-length
data (strings, ``vlen`` sequences) is read twice in bounded blocks of rows: once
to size the ``values`` buffer exactly, once to fill it; at most one block exists
as Python objects at any time. docs/internals.md gives the memory this takes.

How HDF5 types map to columns (:mod:`~shareddata.sources._hdf5_layout`):

=========================================  ===========  ===========================
HDF5 / h5py dtype                          column kind  a sample's value
=========================================  ===========  ===========================
integer, float, complex (any byte order)   ``tensor``   tensor, native byte order
bool (h5py's enum, PyTables' bitfield)     ``tensor``   bool tensor
enum                                       ``tensor``   its integer code (labels:
                                                        :attr:`HDF5Dataset.labels`)
array type (``H5T_ARRAY``)                 ``tensor``   its shape added to the row
compound (record)                          one column   as its field's type
                                           per field
variable-length string (utf-8 or ascii)    ``str``      ``str``
fixed-length utf-8 string                  ``str``      ``str`` (trailing NULs off)
fixed-length ascii string (``S10``)        ``bytes``    ``bytes`` (trailing NULs off)
opaque                                     ``bytes``    ``bytes`` (all of them)
variable-length numeric (``vlen_dtype``)   ``ragged``   1-D tensor
reference, time, quad float, object        refused      ``UnsupportedDtypeError``
=========================================  ===========  ===========================
"""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._columns import ColumnSpec
from .._dataset import ColumnDataset, Output, load_columns
from ..errors import (
    ArgumentTypeError,
    ColumnLengthError,
    EmptySelectionError,
    InvalidArgumentError,
    MissingColumnError,
    MissingDependencyError,
    MissingFileError,
    SourceReadError,
    UnsupportedDtypeError,
    missing_dependency,
)
from . import _hdf5_chunks
from ._hdf5_chunks import rows
from ._hdf5_layout import Plan, frame_plans, is_bookkeeping, is_frame, plans_of
from ._hdf5_values import VariableReader
from ._io import read_into

__all__ = ["HDF5Dataset", "HDF5Source"]

PathLike = str | os.PathLike

_CHUNK = 64 << 20
"""Bytes of fixed-shape data HDF5 reads per call."""
_LISTED = 20  # how many dataset names an error message lists

_HDF5PLUGIN = {32001, 32004, 32008, 32013, 32015, 32017, 32018, 32024, 32026, 32028, 307}
"""Filter ids ``hdf5plugin`` provides (blosc, lz4, bitshuffle, zfp, zstd, sz, ...)."""
_LZO = 305
_MAGIC = {b"PAR1": "Parquet", b"\x93NUMPY": ".npy", b"PK\x03\x04": "zip/.npz", b"ARROW1": "Arrow"}


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


def _open(h5py: Any, label: str) -> tuple[Any, bool]:
    """The file opened for reading, and whether as a SWMR reader; errors name the cause."""
    try:
        os.stat(label)
    except FileNotFoundError as error:
        raise MissingFileError(
            f"{label} does not exist. Pass the path of an HDF5 file (.h5, .hdf5)."
        ) from error
    except PermissionError as error:  # a folder on the way that may not be searched
        raise SourceReadError(
            f"{label} cannot be reached by this process: permission denied on a folder of "
            "its path. Fix: make the folders searchable (chmod a+x) or run as a user who "
            "may read them."
        ) from error
    if os.path.isdir(label):
        raise SourceReadError(
            f"{label} is a folder, not an HDF5 file. Pass the path of an HDF5 file."
        )
    if not os.access(label, os.R_OK):
        raise _unreadable(label)
    try:
        return h5py.File(label, "r"), False
    except OSError as error:
        text = str(error)
        if error.errno in (errno.EAGAIN, errno.EWOULDBLOCK) or "unable to lock file" in text:
            raise SourceReadError(
                f"{label} is locked by another process that has it open for writing "
                "(HDF5's file lock). Fix: close the file in the writer before loading; or, "
                "to read it while it is written, have the writer open it with "
                "libver='latest' and set f.swmr_mode = True (shareddata then reads it as "
                "a SWMR reader); or, if no process writes it (a lock left behind on a "
                "network file system), set HDF5_USE_FILE_LOCKING=FALSE in the environment."
            ) from error
        if "already open for write" in text:  # a SWMR writer, or one that crashed
            try:
                return h5py.File(label, "r", swmr=True), True
            except OSError:
                raise SourceReadError(
                    f"{label} is marked as open for writing by another process (HDF5's "
                    "consistency flags), without SWMR. Fix: close the file in the writer, "
                    "or open it there with f.swmr_mode = True; if no process writes it "
                    f"(the writer crashed), clear the flags with: h5clear -s {label}"
                ) from error
        if error.errno in (errno.EACCES, errno.EPERM):
            raise _unreadable(label) from error
        if error.errno == errno.EIO:
            raise SourceReadError(
                f"{label} could not be read: the disk or file system reported an I/O "
                f"error ({error}). Check the disk, or copy the file elsewhere and load it."
            ) from error
        raise SourceReadError(
            f"{label} is not a readable HDF5 file ({error}). {_guess(label)}"
        ) from error


def _unreadable(label: str) -> SourceReadError:
    try:
        st = os.stat(label)
        owner = f" (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o})"
    except OSError:
        owner = ""
    return SourceReadError(
        f"{label} cannot be read by this process: permission denied{owner}. Fix: make it "
        f"readable (chmod a+r {label}) or run as a user who may read it."
    )


def _guess(label: str) -> str:
    """What a file that is not HDF5 seems to be, and the fix."""
    try:
        with open(label, "rb") as f:
            head = f.read(8)
    except OSError:
        head = b""
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            return f"It is a {kind} file: load it with the dataset class for {kind}."
    if head.startswith(b"\x89HDF"):
        return "It is cut short or corrupt; re-create or re-download it."
    return "It may be truncated, corrupt or of another format; re-create or re-download it."


class HDF5Source:
    """Reads datasets of an HDF5 file (see :class:`HDF5Dataset`).

    The constructor opens the file and reads metadata only; :meth:`specs` sizes
    the columns (reading variable-length datasets once, in bounded blocks);
    :meth:`read` fills the buffers it is given; :meth:`close` closes the file.

    Args:
        path: the HDF5 file.
        keys: dataset paths inside the file, in column order (see
            :class:`HDF5Dataset`). ``None``: the default selection.

    Attributes:
        plans: how each column is read, in column order.
        skipped: with ``keys=None``, datasets and frame columns left out because
            their type cannot be stored (name: the reason).
    """

    def __init__(self, path: PathLike, keys: str | Sequence[str] | None = None) -> None:
        self._h5py = _import_h5py()
        self.label = os.fspath(path)
        self._file: Any = None
        self._specs: list[ColumnSpec] | None = None
        self.skipped: dict[str, str] = {}
        self._file, self._swmr = _open(self._h5py, self.label)
        try:
            self.plans = self._auto() if keys is None else self._select(keys)
            for path_ in dict.fromkeys(p.path for p in self.plans):
                self._check_filters(path_, self._file[path_])
            self._values = VariableReader(self.label, self._reading, self._block)
        except BaseException:
            self.close()
            raise

    # -- selection ---------------------------------------------------------------------
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

    def _refuse(self, column: str, what: str, fix: str) -> UnsupportedDtypeError:
        return UnsupportedDtypeError(
            f"{column!r} of {self.label} {what}; shareddata cannot store it. Fix: {fix}."
        )

    def _auto(self) -> list[Plan]:
        """Every storable dataset and pandas frame of the longest length (see HDF5Dataset)."""
        units: list[tuple[int, list[Plan]]] = []
        skipped: list[tuple[str, int, str]] = []
        frames: list[str] = []
        for name in self._names_and_frames(frames):
            obj = self._file[name]
            if name in frames:
                frame_skips: dict[str, str] = {}
                plans = frame_plans(self._h5py, obj, self._refuse, frame_skips)
                length = plans[0].rows if plans else self._frame_rows(obj)
                skipped += [(c, length, why) for c, why in frame_skips.items()]
                if plans:
                    units.append((length, plans))
                continue
            try:
                shape = obj.shape
            except (OSError, RuntimeError, ValueError, TypeError, KeyError) as error:
                raise self._corrupt_metadata(name, error) from error
            if not shape:  # a scalar (()) or an empty dataspace (None)
                continue
            try:
                units.append((shape[0], plans_of(self._h5py, obj, name, self._refuse)))
            except UnsupportedDtypeError as error:
                skipped.append((name, shape[0], str(error)))
            except (OSError, RuntimeError, KeyError) as error:
                raise self._corrupt_metadata(name, error) from error
        if not units:
            if skipped:
                raise UnsupportedDtypeError(
                    f"{self.label} holds no dataset shareddata can store: "
                    + " ".join(why for _, _, why in skipped)
                )
            raise MissingColumnError(
                f"{self.label} holds no dataset with rows (only scalars, empty datasets "
                "or groups); shareddata loads datasets whose first dimension is the row."
            )
        longest = max(length for length, _ in units)
        left_out = [(name, why) for name, length, why in skipped if length == longest]
        self.skipped = dict(left_out)
        if left_out:
            warnings.warn(
                f"{self.label}: left out {len(left_out)} dataset(s) of {longest} rows whose "
                f"type cannot be stored: {' '.join(why for _, why in left_out)}",
                UserWarning,
                stacklevel=4,
            )
        plans = [plan for length, made in units if length == longest for plan in made]
        return self._unique(plans)

    def _names_and_frames(self, frames: list[str]) -> list[str]:
        """Data datasets and pandas frames, in visit order; bookkeeping left out."""
        names: list[str] = []

        def visit(name: str, obj: Any) -> None:
            if any(name.startswith(frame + "/") for frame in frames):
                return  # a frame's own arrays: read through the frame
            if isinstance(obj, self._h5py.Group):
                if is_frame(obj):
                    frames.append(name)
                    names.append(name)
            elif isinstance(obj, self._h5py.Dataset) and not is_bookkeeping(name, obj):
                names.append(name)

        try:
            self._file.visititems(visit)
        except (OSError, RuntimeError, KeyError) as error:
            raise SourceReadError(
                f"{self.label}: the file's group structure cannot be read ({error}); the file "
                "is corrupt. Re-create or re-download it."
            ) from error
        return names

    @staticmethod
    def _frame_rows(group: Any) -> int:
        table = group.get("table") or group.get("axis1")
        return int(table.shape[0]) if table is not None and table.shape else 0

    def _select(self, keys: str | Sequence[str]) -> list[Plan]:
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        keys = list(keys)
        if not keys:
            raise EmptySelectionError(
                f"keys=[] selects no dataset of {self.label}; pass the datasets to load, or "
                f"keys=None for the default selection. Its datasets are: "
                f"{_listing(self._dataset_names())}."
            )
        plans: list[Plan] = []
        for key in keys:
            if isinstance(key, bytes):
                key = key.decode()
            if not isinstance(key, str):
                raise ArgumentTypeError(
                    f"keys must be dataset paths (str), got {type(key).__name__} {key!r}"
                )
            plans += self._key_plans(key)
        return self._unique(plans)

    def _key_plans(self, key: str) -> list[Plan]:
        name = key.strip("/")
        obj = self._get(name) if name else self._file
        h5py = self._h5py
        if isinstance(obj, h5py.Dataset):
            try:
                return plans_of(h5py, obj, name, self._refuse)
            except (OSError, RuntimeError, KeyError) as error:
                raise self._corrupt_metadata(name, error) from error
        if isinstance(obj, h5py.Group):
            if is_frame(obj):
                return frame_plans(h5py, obj, self._refuse, None)
            inside = self._dataset_names(obj)
            raise MissingColumnError(
                f"key {key!r} of {self.label} is a group, not a dataset; pass the datasets "
                f"you want from it (keys=[...]). It holds: {_listing(inside)}."
            )
        if obj is not None:
            raise MissingColumnError(
                f"key {key!r} of {self.label} is a {type(obj).__name__}, not a dataset; its "
                f"datasets are: {_listing(self._dataset_names())}."
            )
        parts = name.split("/")
        for cut in range(len(parts) - 1, 0, -1):  # a field of a compound, a frame's column
            owner = self._get("/".join(parts[:cut]))
            rest = parts[cut:]
            if isinstance(owner, h5py.Dataset) and owner.dtype.names:
                dtype = owner.dtype
                for depth, part in enumerate(rest):
                    if dtype.names is None or part not in dtype.names:
                        where = "/".join(parts[: cut + depth])
                        raise MissingColumnError(
                            f"key {key!r} of {self.label}: {where!r} has no field {part!r}; "
                            f"its fields are: {_listing(list(dtype.names or ()))}."
                        )
                    dtype = dtype[part]
                return plans_of(h5py, owner, name, self._refuse, tuple(rest))
            if isinstance(owner, h5py.Group) and is_frame(owner):
                refused: dict[str, str] = {}
                columns = frame_plans(h5py, owner, self._refuse, refused)
                if "/".join(rest) in refused:
                    raise UnsupportedDtypeError(refused["/".join(rest)])
                found = [p for p in columns if p.name == "/".join(rest)]
                if not found:
                    raise MissingColumnError(
                        f"key {key!r} of {self.label}: the pandas frame {owner.name!r} has no "
                        f"column {'/'.join(rest)!r}; its columns are: "
                        f"{_listing([p.name for p in columns])}."
                    )
                for plan in found:
                    plan.name = name
                return found
            if owner is not None:
                break
        raise MissingColumnError(
            f"key {key!r} is not a dataset of {self.label}; its datasets are: "
            f"{_listing(self._dataset_names())}."
        )

    def _unique(self, plans: list[Plan]) -> list[Plan]:
        seen: dict[str, Plan] = {}
        for plan in plans:
            if plan.name in seen:
                first = seen[plan.name].path
                where = (
                    f"from {first!r} and {plan.path!r}"
                    if first != plan.path
                    else (f"twice from {first!r}: by its own key and by the dataset or frame key")
                )
                raise InvalidArgumentError(
                    f"column {plan.name!r} of {self.label} is selected twice ({where}); every "
                    "column needs its own name. Pass keys=[...] naming each column once."
                )
            seen[plan.name] = plan
        return plans

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
            if code in _HDF5PLUGIN:
                fix = (
                    "install the filter plugins with: pip install hdf5plugin (shareddata "
                    "uses them when installed)"
                )
            elif code == _LZO:
                fix = (
                    "no pip package gives h5py the LZO filter (hdf5plugin has none); "
                    "re-compress the file where PyTables reads it, e.g. ptrepack "
                    f"--complib=zlib --complevel=5 {self.label} out.h5"
                )
            else:
                fix = (
                    f"build or install the HDF5 plugin of filter id {code} and point "
                    "HDF5_PLUGIN_PATH at its folder, or re-write the file with gzip"
                )
            raise MissingDependencyError(
                f"dataset {name!r} of {self.label} is compressed with the HDF5 filter "
                f"{label!r} (id {code}), which is not available here. Fix: {fix}."
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

    # -- Source protocol ---------------------------------------------------------------
    def specs(self) -> list[ColumnSpec]:
        """Exact specs of every selected column (sizes variable-length ones by reading)."""
        if self._specs is not None:
            return self._specs
        lengths = {p.rows for p in self.plans}
        if len(lengths) > 1:  # before any sizing pass reads data
            listing = ", ".join(f"{p.name!r}: {p.rows} rows" for p in self.plans)
            raise ColumnLengthError(
                f"datasets of {self.label} have different lengths ({listing}); every column "
                "needs one value per row. Pass keys=[...] of equal length, or trim them."
            )
        specs = []
        for plan in self.plans:
            values = 0
            if plan.kind != "tensor":
                values = self._values.size(plan, self._file[plan.path])
            specs.append(
                ColumnSpec(plan.name, plan.rows, plan.dtype, plan.shape, plan.kind, values)
            )
        self._specs = specs
        return specs

    def read(
        self, spec: ColumnSpec, buffers: Mapping[str, np.ndarray], progress: Callable[[int], None]
    ) -> None:
        """Fill ``buffers`` for ``spec`` (``data``, or ``offsets`` and ``values``)."""
        self.specs()  # variable-length columns are read in the blocks that sized them
        plan = next(p for p in self.plans if p.name == spec.name)
        ds = self._file[plan.path]
        with self._reading(plan):
            if plan.kind != "tensor":
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
    @contextmanager
    def _reading(self, plan: Plan) -> Iterator[None]:
        """Turn h5py's read errors into a :class:`SourceReadError` naming file and key."""
        try:
            yield
        except SourceReadError:
            raise
        except (OSError, RuntimeError) as error:
            if isinstance(error, OSError) and error.errno == errno.EIO:
                cause = (
                    "The disk or file system reported an I/O error; check it, or copy the "
                    "file elsewhere and load it again."
                )
            else:
                cause = "The file is truncated or corrupt; re-create or re-download it."
            raise SourceReadError(
                f"{self.label}: reading dataset {plan.path!r} failed ({error}). {cause}"
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

    def _block(self, plan: Plan, ds: Any, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of the plan's values as numpy (one bounded block)."""
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
        self, plan: Plan, ds: Any, out: np.ndarray, progress: Callable[[int], None]
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
        what = f"{self.label}: reading dataset {plan.name!r}"
        if filters is not None and _hdf5_chunks.inflate(
            self.label, what, ds, filters, out, progress
        ):
            return
        row_bytes = out.nbytes // plan.rows
        for start, stop in self._steps(plan.rows, row_bytes, _CHUNK, ds.chunks):
            rows(out, start, stop)
            ds.read_direct(out, np.s_[start:stop], np.s_[start:stop])
            progress((stop - start) * row_bytes)

    def _read_member(
        self, plan: Plan, ds: Any, out: np.ndarray, progress: Callable[[int], None]
    ) -> None:
        """Numbers HDF5 converts on the way in: compound fields, enums, array types."""
        if out.size == 0:
            return
        row_bytes = out.nbytes // plan.rows
        if plan.index is not None:  # a column of a pandas block: through a small block
            budget = _CHUNK // 16
            for start, stop in self._steps(plan.rows, ds.dtype.itemsize, budget, ds.chunks):
                rows(out, start, stop)[...] = self._block(plan, ds, start, stop)
                progress((stop - start) * row_bytes)
            return
        h5t, h5s = self._h5py.h5t, self._h5py.h5s
        assert plan.source is not None
        leaf = plan.source
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
        for start, stop in self._steps(plan.rows, record_bytes, _CHUNK, ds.chunks):
            count = (stop - start, *row_shape)
            file_space.select_hyperslab((start,) + (0,) * len(row_shape), count)
            ds.id.read(h5s.create_simple(count), file_space, rows(out, start, stop), mtype=mtype)
            progress((stop - start) * row_bytes)

    def _raw_offset(self, plan: Plan, ds: Any, nbytes: int) -> int | None:
        """Where a whole numeric dataset's raw bytes start (see ``_hdf5_chunks.raw_offset``)."""
        if plan.reader != "direct" or self._swmr:  # a SWMR writer may be appending
            return None
        return _hdf5_chunks.raw_offset(self._h5py, ds, nbytes)

    def _inflatable(self, plan: Plan, ds: Any) -> list[int] | None:
        """The pipeline ``_hdf5_chunks.inflate`` decodes for this plan, or None."""
        if plan.reader != "direct" or self._swmr:
            return None
        return _hdf5_chunks.inflatable(ds)


class HDF5Dataset(ColumnDataset):
    """Datasets of an HDF5 file as columns, loaded once into shared memory.

    Each HDF5 dataset is a column; its first dimension is the row. Numeric datasets
    (contiguous or chunked, compressed with gzip, lzf, szip or, when ``hdf5plugin``
    is installed, its filters) give tensors in the file's dtype (native byte order);
    strings give ``str`` (``bytes`` for fixed-length ascii); variable-length numeric
    datasets give 1-D tensors of varying length. The file is closed once loaded:
    workers index shared memory only.

    Records: a compound dataset (PyTables tables, h5py structured arrays) gives one
    column per field, named ``dataset/field`` (``dataset/a/b`` for a nested one),
    array fields keeping their shape. A pandas store (``DataFrame.to_hdf``, either
    format) gives the frame's columns under their pandas names (a named index
    first); categories load as integer codes, dates as int64 in their unit. Enums
    load as their integer codes; :attr:`labels` maps each such column's labels to
    codes.

    Args:
        path: the HDF5 file.
        keys: what to load, in sample order: dataset paths (``"images"``,
            ``"grp/labels"``; a leading ``/`` is accepted), a field of a compound
            (``"table/x"``), a pandas frame's key (``"df"``) or one of its columns
            (``"df/price"``); a column is named by the path as given. ``None``:
            every dataset and pandas frame of the file whose rows equal the longest
            ones, in visit order. The default selection leaves out scalars, shorter
            datasets, PyTables' and pandas' own index arrays, and, with a warning,
            datasets whose type cannot be stored (times, quad floats, references);
            ``keys`` naming such a dataset raises instead.
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{key: value}``) or ``"tuple"`` (in key order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared (for a small RAM or memory limit).
        progress: show a progress bar for loads longer than ~2 s.

    Attributes:
        labels: for enum and pandas category columns, ``{column: {label: code}}``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        KeyError: a key is not a dataset of the file (the message lists those that are).
        ValueError: the datasets have different lengths; ``keys=[]``.
        TypeError: a selected dataset's type cannot be stored (references, times).
        OSError: the file cannot be read: locked by a writer, not permitted, truncated
            or corrupt (``SourceReadError``, naming the cause and the fix).
        ImportError: h5py, or a compression filter, is not installed.
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

        A compound (record) dataset and an enum:

        >>> color = h5py.enum_dtype({"red": 0, "green": 1}, basetype="i1")
        >>> rec = np.array([(1.5, 0), (2.5, 1)], dtype=[("x", "f4"), ("c", color)])
        >>> with h5py.File(path, "w") as f:
        ...     f["points"] = rec
        >>> ds = HDF5Dataset(path)
        >>> ds.columns, ds[1]["points/c"], ds.labels["points/c"]["green"]
        (['points/x', 'points/c'], tensor(1, dtype=torch.int8), 1)
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
        source = HDF5Source(path, keys)
        self.labels = {p.name: dict(p.labels) for p in source.plans if p.labels is not None}
        loaded = load_columns(source, storage_dir=storage_dir, progress=progress)
        super().__init__(loaded, transform=transform, output=output)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "labels": self.labels}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.labels = state.pop("labels", {})
        super().__setstate__(state)
