"""HDF5 groups that encode one element, as anndata writes them, and AnnData files.

anndata (``.h5ad``) marks each element with an ``encoding-type`` attribute; a
group element is read as the columns it means, never as its raw arrays:

================================  ==============================================
``encoding-type``                 columns (named by the group's path)
================================  ==============================================
``csr_matrix``, ``csc_matrix``    one ``"sparse"`` column (:mod:`._hdf5_sparse`;
                                  also ``h5sparse`` and 10x ``matrix`` groups)
``categorical``                   its ``codes`` (int), labels in ``ds.labels``
                                  (``-1``: missing, as pandas' codes)
``nullable-integer``/``-boolean``  its ``values`` when none is missing, else
``nullable-string-array``         refused (``NullValuesError``, how many)
``dataframe``                     its index, then its columns (``column-order``)
``dict``, ``raw``                 every element inside
``awkward-array``, ...            refused by name
================================  ==============================================

An AnnData file (root ``encoding-type`` ``anndata``) loads as cells: by default
``X`` (dense, or sparse rows) and every ``obs`` column, index first; ``obsm``,
``layers``, ``obsp`` and ``raw/X`` are loaded when named in ``keys``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import NullValuesError, SharedDataError, SourceReadError, UnsupportedDtypeError
from ._hdf5_layout import Plan, Refuse, attr_value, plans_of
from ._hdf5_sparse import SparseRead, sparse_layout

__all__ = ["Encoded", "encoding", "is_anndata"]

_UNITS = {"categorical", "dataframe", "nullable-integer", "nullable-boolean",
          "nullable-string-array", "csr_matrix", "csc_matrix"}  # fmt: skip
"""Encodings of a group that the default selection takes as one unit."""
_CONTAINERS = {"dict", "raw", "anndata"}


def encoding(obj: Any) -> str:
    """The ``encoding-type`` anndata wrote on ``obj`` ("" if none).

    Example:
        >>> encoding({"encoding-type": b"csr_matrix"})
        'csr_matrix'
    """
    value = attr_value(obj, "encoding-type")
    return value.decode() if isinstance(value, bytes) else value if isinstance(value, str) else ""


def is_anndata(file: Any) -> bool:
    """Whether an open HDF5 file is an AnnData (``.h5ad``) file."""
    return encoding(file) == "anndata"


def _label(value: Any) -> Any:
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", errors="replace")
    return value.item() if isinstance(value, np.generic) else value


class Encoded:
    """Makes the plans of encoded groups of one file.

    Args:
        h5py: the module.
        label: the file, for messages.
        refuse: makes the error for a type that cannot be stored.
        output: what a sparse row comes back as (``"dense"`` or ``"coo"``).
    """

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
        """The columns of element ``obj`` (a dataset or an encoded group) at path ``name``.

        ``skipped``: when given, columns that cannot be stored are left out and
        recorded there (name: reason) instead of raising.
        """
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
                "keys=[...] without it."
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
        if kind == "categorical":
            return self._categorical(obj, name)
        if kind.startswith("nullable-"):
            return self._nullable(obj, name)
        if kind == "dataframe":
            return self._frame(obj, name, skipped)
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

    def _categorical(self, group: Any, name: str) -> list[Plan]:
        plans = plans_of(self._h5py, group["codes"], name, self._refuse, path=f"{name}/codes")
        categories = group["categories"][()]
        labels = {_label(value): code for code, value in enumerate(categories)}
        for plan in plans:
            plan.labels = labels
        return plans

    def _nullable(self, group: Any, name: str) -> list[Plan]:
        missing = int(np.count_nonzero(group["mask"][()])) if "mask" in group else 0
        if missing:
            raise NullValuesError(
                f"{name!r} of {self.label} has {missing} missing value(s) (pandas <NA>); a "
                "column needs a value in every row. Fix: fill them before writing (e.g. "
                f"adata.obs[col] = adata.obs[col].fillna(0)), or pass keys=[...] without it."
            )
        return plans_of(self._h5py, group["values"], name, self._refuse, path=f"{name}/values")

    def _frame(self, group: Any, name: str, skipped: dict[str, str] | None) -> list[Plan]:
        index = attr_value(group, "_index")
        order = attr_value(group, "column-order")
        columns = [] if order is None else [_label(c) for c in np.asarray(order).reshape(-1)]
        keys = ([_label(index)] if index is not None else []) + columns
        plans: list[Plan] = []
        for key in dict.fromkeys(keys):
            if key in group:
                plans += self.plans(group[key], f"{name}/{key}", skipped)
        return plans

    def anndata(self, file: Any, skipped: dict[str, str] | None) -> list[Plan]:
        """An AnnData file's default columns: ``X``, then ``obs`` (index first)."""
        plans: list[Plan] = []
        for key in ("X", "obs"):
            if key in file:
                plans += self.plans(file[key], key, skipped)
        return plans
