"""anndata's encoded groups and sparse matrices, and AnnData (``.h5ad``) files, as columns.

Sparse matrices (:func:`sparse_layout`: anndata's ``csr_matrix``/``csc_matrix``, the
older ``h5sparse_format`` attributes, plain ``data``/``indices``/``indptr``/``shape``
groups such as 10x ``matrix``, rows along ``indptr``) are read straight into the column's
shared ``indptr``/``indices``/``data``; CSC is turned into CSR on the way, never
densified. Data frames, categoricals (codes, labels in ``ds.labels``) and nullable
arrays are read by ``anndata.io.read_elem`` (the ``anndata`` extra). ``dict`` and
``raw`` groups give every element inside. An AnnData file loads ``X`` and every
``obs`` column by default; ``obsm``, ``layers``, ``obsp``, ``raw/X`` by key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from ..columns._sparse import SparseSpec
from ..errors import (
    MissingDependencyError,
    NullValuesError,
    SharedDataError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._hdf5_layout import Plan, Refuse, attr_value, gather, native, plans_of, text
from ._source import Buffer

__all__ = ["Encoded", "SparseRead", "encoding", "is_anndata", "sparse_layout"]

_REFUSED = (UnsupportedDtypeError, NullValuesError)  # a column left out, not a broken file
_BLOCK = 4 << 20  # nonzeros per block when a CSC matrix is turned into rows

ReadRange = Callable[[Any, Buffer, int, int, Callable[[int], None]], None]
"""``read_range(ds, out, start, stop, progress)``: 1-D ``ds[start:stop]`` into ``out``."""


def _shape(group: Any, key: str) -> tuple[int, int] | None:
    value = attr_value(group, key)
    if value is None and key == "shape" and "shape" in group:
        value = group["shape"][()]
    try:
        rows, cols = (int(v) for v in np.asarray(value).reshape(-1))
    except (TypeError, ValueError):
        return None
    return rows, cols


def sparse_layout(h5py: Any, group: Any) -> tuple[str, tuple[int, int]] | None:
    """``("csr" | "csc", (rows, columns))`` if ``group`` holds a sparse matrix, else None."""
    if not isinstance(group, h5py.Group):
        return None
    kind = text(attr_value(group, "encoding-type") or "")
    if kind in ("csr_matrix", "csc_matrix"):
        shape = _shape(group, "shape")
        return (kind[:3], shape) if shape else None
    legacy = text(attr_value(group, "h5sparse_format") or "")
    if legacy in ("csr", "csc"):
        shape = _shape(group, "h5sparse_shape")
        return (legacy, shape) if shape else None
    if kind or not {"data", "indices", "indptr"} <= set(group):
        return None
    shape = _shape(group, "shape")
    return None if shape is None else _plain(group, shape)


def _plain(group: Any, shape: tuple[int, int]) -> tuple[str, tuple[int, int]] | None:
    pointers = group["indptr"].shape
    if not pointers or len(pointers) != 1:
        return None
    if pointers[0] == shape[0] + 1:
        return "csr", shape
    if pointers[0] == shape[1] + 1:
        return "csr", (shape[1], shape[0])  # along indptr: 10x's barcodes
    return None


@dataclass
class SparseRead:
    """How one sparse group (``layout`` "csr"/"csc") becomes a ``"sparse"`` column."""

    label: str
    group: str
    layout: str
    shape: tuple[int, int]
    output: str
    counts: np.ndarray | None = field(default=None, repr=False)  # CSC: nonzeros per row

    @property
    def datasets(self) -> list[str]:
        return [f"{self.group}/{k}" for k in ("data", "indices", "indptr")]

    def plan(self, name: str, group: Any) -> Plan:
        """The column's plan (its dtype and the lengths of its arrays checked)."""
        data, indices, indptr = group["data"], group["indices"], group["indptr"]
        along = self.shape[0] if self.layout == "csr" else self.shape[1]
        problem = None
        if indptr.shape != (along + 1,):
            problem = f"'indptr' has shape {indptr.shape}, not ({along + 1},)"
        elif data.shape != indices.shape or len(data.shape) != 1:
            problem = f"'data' {data.shape} and 'indices' {indices.shape} differ"
        elif data.dtype.kind not in "biuf" or indices.dtype.kind not in "iu":
            problem = f"'data' is {data.dtype} and 'indices' {indices.dtype}"
        elif along and int(indptr[-1]) != data.shape[0]:
            problem = f"'indptr' ends at {int(indptr[-1])}, but there are {data.shape[0]} values"
        if problem:
            raise SourceReadError(
                f"{self.label}: group {self.group!r} is marked as a {self.layout.upper()} "
                f"sparse matrix of shape {self.shape}, but {problem}; it is corrupt. "
                "Re-write it (e.g. with anndata or scipy), or pass columns=[...] without it."
            )
        return Plan(name, self.group, self.shape[0], "sparse", native(data.dtype),
                    (self.shape[1],), "sparse", special=self)  # fmt: skip

    def _index_dtype(self, file: Any) -> np.dtype:
        if self.layout == "csr":
            return native(file[self.group]["indices"].dtype)
        return np.dtype(np.int32 if self.shape[1] <= np.iinfo(np.int32).max else np.int64)

    def spec(self, plan: Plan, file: Any) -> SparseSpec:
        """The column's exact spec (counts a CSC matrix's nonzeros per row)."""
        group = file[self.group]
        if self.layout == "csr":
            indptr = group["indptr"]
            nnz = int(indptr[plan.first + plan.rows]) - int(indptr[plan.first])
        else:
            self.counts = self._count(group, plan)
            nnz = int(self.counts.sum())
        return SparseSpec(plan.name, plan.rows, plan.dtype, plan.shape, "sparse", nnz,
                          index_dtype=self._index_dtype(file).str, output=self.output)  # fmt: skip

    def _blocks(self, indptr: np.ndarray) -> list[tuple[int, int]]:
        """Runs of whole columns of about ``_BLOCK`` nonzeros."""
        cuts = [0]
        while cuts[-1] < len(indptr) - 1:
            want = indptr[cuts[-1]] + _BLOCK
            stop = int(np.searchsorted(indptr, want, side="right")) - 1
            cuts.append(min(len(indptr) - 1, max(cuts[-1] + 1, stop)))
        return list(zip(cuts, cuts[1:]))

    def _count(self, group: Any, plan: Plan) -> np.ndarray:
        indptr, indices = group["indptr"][()], group["indices"]
        counts = np.zeros(plan.rows, np.int64)
        for a, b in self._blocks(indptr):
            rows = indices[int(indptr[a]) : int(indptr[b])].astype(np.int64) - plan.first
            self._check(rows + plan.first, self.shape[0], "row")
            rows = rows[(rows >= 0) & (rows < plan.rows)]
            counts += np.bincount(rows, minlength=plan.rows)
        return counts

    def _check(self, indices: np.ndarray, limit: int, what: str) -> None:
        if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= limit):
            raise SourceReadError(
                f"{self.label}: sparse matrix {self.group!r} of shape {self.shape} has a "
                f"{what} index outside [0, {limit}) ({int(indices.min())}..{int(indices.max())}); "
                "it is corrupt. Re-write it, or pass columns=[...] without it."
            )

    def read(
        self,
        plan: Plan,
        file: Any,
        buffers: dict[str, Buffer],
        progress: Callable[[int], None],
        read_range: ReadRange,
    ) -> None:
        """Fill the column's ``indptr``, ``indices`` and ``data`` buffers."""
        group = file[self.group]
        if self.layout == "csc":
            self._read_csc(group, plan, buffers, progress)
            return
        indptr = buffers["indptr"].rows(0, plan.rows + 1)
        indptr[:] = group["indptr"][plan.first : plan.first + plan.rows + 1]
        base, nnz = int(indptr[0]), int(indptr[-1] - indptr[0])
        indptr -= base
        if np.any(np.diff(indptr) < 0):
            raise SourceReadError(
                f"{self.label}: sparse matrix {self.group!r} has an 'indptr' that decreases; "
                "it is corrupt. Re-write it, or pass columns=[...] without it."
            )
        progress(indptr.nbytes)
        if nnz:
            read_range(group["indices"], buffers["indices"], base, base + nnz, progress)
            read_range(group["data"], buffers["data"], base, base + nnz, progress)
            self._check(buffers["indices"].rows(0, nnz), self.shape[1], "column")

    def _read_csc(
        self, group: Any, plan: Plan, buffers: dict[str, Buffer], progress: Callable[[int], None]
    ) -> None:
        counts = self.counts if self.counts is not None else self._count(group, plan)
        indptr = buffers["indptr"].rows(0, plan.rows + 1)
        indptr[0] = 0
        np.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        out_indices = buffers["indices"].rows(0, nnz)
        out_data = buffers["data"].rows(0, nnz)
        cursor = indptr[:-1].copy()
        pointers, indices, data = group["indptr"][()], group["indices"], group["data"]
        for a, b in self._blocks(pointers):
            lo, hi = int(pointers[a]), int(pointers[b])
            rows = indices[lo:hi].astype(np.int64) - plan.first
            columns = np.repeat(np.arange(a, b, dtype=np.int64), np.diff(pointers[a : b + 1]))
            values = data[lo:hi]
            keep = (rows >= 0) & (rows < plan.rows)
            rows, columns, values = rows[keep], columns[keep], values[keep]
            order = np.argsort(rows, kind="stable")  # by row; columns stay in order
            rows = rows[order]
            rank = np.arange(rows.size) - np.searchsorted(rows, rows)  # place within its row
            at = cursor[rows] + rank
            out_indices[at] = columns[order]
            out_data[at] = values[order]
            cursor += np.bincount(rows, minlength=plan.rows)
            progress(int(keep.sum()) * (out_indices.itemsize + out_data.itemsize))
        if not np.array_equal(cursor, indptr[1:]):
            raise SourceReadError(
                f"{self.label}: sparse matrix {self.group!r} changed while it was being "
                "loaded; load it again when nothing writes to the file."
            )
        progress(indptr.nbytes)


_UNITS = {"categorical", "dataframe", "nullable-integer", "nullable-boolean",
          "nullable-string-array", "csr_matrix", "csc_matrix"}  # fmt: skip
_CONTAINERS = {"dict", "raw", "anndata"}


def encoding(obj: Any) -> str:
    """The ``encoding-type`` anndata wrote on ``obj`` ("" if none).

    Example:
        >>> encoding({"encoding-type": b"csr_matrix"})
        'csr_matrix'
    """
    value = attr_value(obj, "encoding-type")
    return text(value) if isinstance(value, (bytes, str)) else ""


def is_anndata(file: Any) -> bool:
    """Whether an open HDF5 file is an AnnData (``.h5ad``) file."""
    return encoding(file) == "anndata"


def _label(value: Any) -> Any:
    if isinstance(value, (bytes, np.bytes_)):
        return text(value)
    return value.item() if isinstance(value, np.generic) else value


class Encoded:
    """Makes the plans of encoded groups of one file (``output``: a sparse row's form)."""

    def __init__(self, h5py: Any, label: str, refuse: Refuse, output: str) -> None:
        self._h5py = h5py
        self.label = label
        self._refuse = refuse
        self.output = output

    def is_unit(self, obj: Any) -> bool:
        """Whether the default selection takes group ``obj`` as one element."""
        if not isinstance(obj, self._h5py.Group):
            return False
        return encoding(obj) in _UNITS or sparse_layout(self._h5py, obj) is not None

    def is_element(self, obj: Any) -> bool:
        """Whether a key naming group ``obj`` loads what it encodes (units and containers)."""
        return self.is_unit(obj) or encoding(obj) in _CONTAINERS

    def plans(self, obj: Any, name: str, skipped: dict[str, str] | None) -> list[Plan]:
        """The columns of element ``obj`` at ``name`` (unstorable ones to ``skipped`` if given)."""
        try:
            return gather(skipped, name, partial(self._plans, obj, name, skipped), _REFUSED)
        except (OSError, RuntimeError, KeyError, ValueError) as error:
            if isinstance(error, SharedDataError):
                raise
            raise SourceReadError(
                f"{self.label}: {name!r} (anndata {encoding(obj) or 'element'}) cannot be "
                f"read ({error}); it is incomplete or corrupt. Re-write it, or pass "
                "columns=[...] without it."
            ) from error

    def _plans(self, obj: Any, name: str, skipped: dict[str, str] | None) -> list[Plan]:
        h5py = self._h5py
        if isinstance(obj, h5py.Dataset):
            return plans_of(h5py, obj, name, self._refuse, path=name)
        kind = encoding(obj)
        layout = sparse_layout(h5py, obj)
        if layout is not None:
            read = SparseRead(self.label, name, layout[0], layout[1], self.output)
            return [read.plan(name, obj)]
        if kind in _UNITS:  # a data frame, categorical or nullable array
            return self._element(obj, name, skipped)
        if kind in _CONTAINERS:
            plans = []
            for key in obj:
                if key in ("var", "varm", "varp", "uns") and kind in ("raw", "anndata"):
                    continue  # along the genes, or unstructured: not per cell
                plans += self.plans(obj[key], f"{name}/{key}", skipped)
            return plans
        raise self._refuse(
            name,
            f"is an anndata {kind or 'group'} element",
            "load its arrays by their own keys, or convert it to a numeric or string array",
        )

    def _element(self, obj: Any, name: str, skipped: dict[str, str] | None) -> list[Plan]:
        """A data frame, categorical or nullable array, read by anndata's own reader."""
        value = _read_elem(self.label, name)(obj)
        if encoding(obj) != "dataframe":
            return self._column(value, name)
        index = attr_value(obj, "_index")
        index = text(index) if isinstance(index, bytes) else index
        columns = [(f"{name}/{index}", value.index)] if index is not None else []
        plans: list[Plan] = []
        for column, values in columns + [(f"{name}/{c}", value[c]) for c in value.columns]:
            plans += gather(skipped, column, partial(self._column, values, column), _REFUSED)
        return plans

    def _column(self, values: Any, name: str) -> list[Plan]:
        """The plan of one column anndata read (numbers, strings, a categorical)."""
        labels = None
        if hasattr(values, "cat"):  # a pandas Series of a categorical
            values = values.array
        if hasattr(values, "categories"):  # pandas' codes: -1 is a missing category
            labels = {_label(v): code for code, v in enumerate(values.categories)}
            values = values.codes
        missing = int(np.count_nonzero(getattr(values, "isna", lambda: [])()))
        if missing:
            raise NullValuesError(
                f"{name!r} of {self.label} has {missing} missing value(s) (pandas <NA>); a "
                "column needs a value in every row. Fix: fill them before writing (e.g. "
                f"adata.obs[col] = adata.obs[col].fillna(0)), or pass columns=[...] without it."
            )
        array = np.asarray(values)
        if array.dtype.kind in "OUS":  # strings: stored as UTF-8 bytes
            kind = "bytes" if array.dtype.kind == "S" else "str"
            array = np.array([_utf8(v, name, self._refuse) for v in array.reshape(-1)], object)
            plan = Plan(name, name, len(array), kind, np.dtype(np.uint8), (), "vlen_str")
        elif array.dtype.kind in "biuf" and array.ndim == 1:
            plan = Plan(name, name, len(array), "tensor", array.dtype, (), "direct")
        else:
            raise self._refuse(name, f"holds {array.dtype} values", "store numbers or strings")
        plan.values, plan.labels = array, labels
        return [plan]

    def anndata(self, file: Any, skipped: dict[str, str] | None) -> list[Plan]:
        """An AnnData file's default columns: ``X``, then ``obs`` (index first)."""
        plans: list[Plan] = []
        for key in ("X", "obs"):
            if key in file:
                plans += self.plans(file[key], key, skipped)
        return plans


def _read_elem(label: str, name: str) -> Callable[[Any], Any]:
    """The reader of one anndata element (``read_elem``), or the error naming the extra."""
    try:
        import anndata
    except ImportError as error:
        raise MissingDependencyError(
            f"{label}: {name!r} is an anndata element (data frame, categorical or nullable "
            "array), which anndata's own reader reads, and anndata is not installed. "
            "Install it with: pip install 'torch-shareddata[anndata]' (or pass "
            "columns=['X', ...] without it: matrices and plain arrays need no anndata)."
        ) from error
    io: Any = getattr(anndata, "io", None)
    return io.read_elem if hasattr(io, "read_elem") else anndata.experimental.read_elem


def _utf8(value: Any, name: str, refuse: Refuse) -> bytes:
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise refuse(name, f"holds {type(value).__name__} values among strings", "store strings")
