"""anndata's encoded groups (``encoding-type``) and AnnData (``.h5ad``) files as columns.

Sparse matrices (also ``h5sparse`` and 10x groups) are read by :mod:`._hdf5_sparse`,
straight into shared memory; data frames, categoricals (codes, labels in
``ds.labels``) and nullable arrays by ``anndata.io.read_elem`` (the ``anndata`` extra).
``dict`` and ``raw`` groups give every element inside. An AnnData file loads ``X``
and every ``obs`` column by default; ``obsm``, ``layers``, ``obsp``, ``raw/X`` by key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import (
    MissingDependencyError,
    NullValuesError,
    SharedDataError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._hdf5_layout import Plan, Refuse, attr_value, plans_of, text
from ._hdf5_sparse import SparseRead, sparse_layout

__all__ = ["Encoded", "encoding", "is_anndata"]

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
            return self._plans(obj, name, skipped)
        except (UnsupportedDtypeError, NullValuesError) as error:
            if skipped is None:
                raise
            skipped[name] = str(error)
            return []
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
            return [self._column(value, name)]
        index = attr_value(obj, "_index")
        index = text(index) if isinstance(index, bytes) else index
        columns = [(f"{name}/{index}", value.index)] if index is not None else []
        plans: list[Plan] = []
        for column, values in columns + [(f"{name}/{c}", value[c]) for c in value.columns]:
            try:
                plans.append(self._column(values, column))
            except (UnsupportedDtypeError, NullValuesError) as error:
                if skipped is None:
                    raise
                skipped[column] = str(error)
        return plans

    def _column(self, values: Any, name: str) -> Plan:
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
        return plan

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
