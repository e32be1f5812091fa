"""Sparse rows: a CSR matrix kept as ``indptr``/``indices``/``data`` in shared memory.

The matrix is never densified whole. A row comes back as ``SparseSpec.output``
says: ``"dense"``, a 1-D tensor (a batch: ``(batch, columns)``), or ``"coo"``, a 1-D
``torch.sparse_coo`` tensor (a batch: one 2-D sparse COO tensor, rows stacked as
``torch.stack`` does; torch's ``default_collate`` refuses sparse tensors).
Duplicate column indices within a row add up, as in scipy's ``toarray``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..storage import SharedArray, SharedTensor, shared_tensor
from ._columns import COLUMN_KINDS, Column, ColumnSpec, Fill, Parts, row_elements, torch_dtype

__all__ = ["SPARSE_OUTPUTS", "SparseColumn", "SparseSpec"]

SPARSE_OUTPUTS = ("dense", "coo")


@dataclass(frozen=True)
class SparseSpec(ColumnSpec):
    """A :class:`ColumnSpec` for a ``"sparse"`` column.

    ``shape`` is ``(columns,)``, ``dtype`` the values', ``values`` the nonzeros;
    ``index_dtype`` the file's type of column indices; ``output`` ``"dense"`` or ``"coo"``.
    """

    index_dtype: str = "int64"
    output: str = "dense"

    def describe(self) -> str:
        """E.g. ``sparse float32 (2000,) as dense``."""
        return f"sparse {self.dtype} {self.shape} as {self.output}"


class SparseColumn(Column):
    """Rows of a CSR matrix in shared memory, each dense or ``torch.sparse_coo``.

    Example:
        >>> csr = {"indptr": [0, 2, 2, 3], "indices": [1, 3, 0], "data": np.float32([1, 2, 5])}
        >>> col = SparseColumn.over(SparseSpec("X", 3, np.float32, (4,), "sparse", 3), csr)
        >>> col.get(0)
        tensor([0., 1., 0., 2.])
        >>> col.gather(torch.tensor([2, 1]))
        tensor([[5., 0., 0., 0.],
                [0., 0., 0., 0.]])
        >>> spec = SparseSpec("X", 3, np.float32, (4,), "sparse", 3, output="coo")
        >>> coo = SparseColumn.over(spec, csr)
        >>> coo.get(0).to_dense(), coo.gather(torch.tensor([0, 2])).to_dense()
        (tensor([0., 1., 0., 2.]), tensor([[0., 1., 0., 2.],
                [5., 0., 0., 0.]]))
    """

    kind = "sparse"

    def __init__(self, spec: ColumnSpec, arrays: dict[str, SharedArray]) -> None:
        super().__init__(spec, arrays)
        if not isinstance(spec, SparseSpec):
            raise TypeError(f"a sparse column needs a SparseSpec, got {type(spec).__name__}")
        self._indptr = arrays["indptr"].numpy()
        self._indices = arrays["indices"].numpy()
        self._data = arrays["data"].numpy()
        self._width = int(spec.shape[0])
        self._dense = spec.output == "dense"
        self._dtype = torch_dtype(self._data.dtype)

    @staticmethod
    def layout(spec: ColumnSpec) -> dict[str, Any]:
        index_dtype = spec.index_dtype if isinstance(spec, SparseSpec) else "int64"
        return {
            "indptr": ((spec.rows + 1,), np.dtype(np.int64)),
            "indices": ((spec.values,), np.dtype(index_dtype)),
            "data": ((spec.values,), spec.dtype),
        }

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` as one ``(batch, columns)`` tensor, dense or sparse COO."""
        parts, fill = self.gather_plan(indices)
        return fill([torch.empty(s, dtype=d) for s, d in parts])  # type: ignore[no-any-return]

    def gather_plan(self, indices: torch.Tensor) -> tuple[Parts, Fill]:
        """Dense: the ``(batch, columns)`` tensor; COO: its indices and values.

        In a worker a COO batch is a sparse :class:`SharedTensor`, whose indices and
        values cross by handle.
        """
        idx = self._checked(indices)
        positions, rows = row_elements(self._indptr[idx], self._indptr[idx + 1])
        nnz, shape = len(positions), (len(idx), self._width)
        parts: Parts = (
            [(shape, self._dtype)]
            if self._dense
            else [((2, nnz), torch.int64), ((nnz,), self._dtype)]
        )

        def fill(outs: list[torch.Tensor]) -> torch.Tensor:
            columns = torch.from_numpy(self._indices[positions].astype(np.int64, copy=False))
            values = torch.from_numpy(self._data[positions])
            if self._dense:
                out = outs[0].as_subclass(torch.Tensor)
                out.zero_()
                flat = torch.from_numpy(rows) * self._width + columns
                out.view(-1).index_put_((flat,), values, accumulate=True)
                return outs[0]
            coords, vals = outs[0].as_subclass(torch.Tensor), outs[1].as_subclass(torch.Tensor)
            coords[0].copy_(torch.from_numpy(rows))
            coords[1].copy_(columns)
            vals.copy_(values)
            # canonical (sorted, no duplicates) when each row's indices strictly increase
            step = np.diff(columns.numpy())
            ordered = bool(np.all((step > 0) | (np.diff(rows) > 0))) if step.size else True
            batch = torch.sparse_coo_tensor(
                coords, vals, shape, is_coalesced=ordered, check_invariants=False
            )
            if isinstance(outs[0], SharedTensor):  # in a worker's memfd: it crosses by handle
                return shared_tensor(batch, outs[0].__dict__["_shared"])
            return batch

        return parts, fill


COLUMN_KINDS.setdefault(SparseColumn.kind, SparseColumn)
