"""Sparse rows: a CSR matrix kept as ``indptr``/``indices``/``data`` in shared memory.

A ``"sparse"`` column is one row of a sparse matrix per sample (a cell of a
single-cell count matrix: its genes' counts). The matrix stays compressed in
shared memory, in scipy's CSR layout: ``indptr`` (int64, ``rows + 1``), the
column ``indices`` of the nonzeros (the file's integer type) and their ``data``
values; it is never densified whole. A row comes back, as
:class:`SparseSpec.output` says:

* ``"dense"``: a 1-D tensor of ``shape[0]`` values, zeros filled in (a batch: a
  ``(batch, columns)`` tensor, what the default collate stacks);
* ``"coo"``: a 1-D ``torch.sparse_coo`` tensor (a batch: one 2-D sparse COO
  tensor of ``(batch, columns)``, the rows stacked as ``torch.stack`` does;
  torch's own ``default_collate`` refuses sparse tensors).

Duplicate column indices within a row add up, as scipy's ``toarray`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..storage import SharedArray, SharedTensor, shared_tensor
from ._columns import COLUMN_KINDS, Alloc, Column, ColumnSpec

__all__ = ["SPARSE_OUTPUTS", "SparseColumn", "SparseSpec", "row_elements"]

SPARSE_OUTPUTS = ("dense", "coo")
"""What a sparse row comes back as: a dense tensor, or a ``torch.sparse_coo`` one."""


@dataclass(frozen=True)
class SparseSpec(ColumnSpec):
    """A :class:`ColumnSpec` for a ``"sparse"`` column.

    ``shape`` is ``(columns,)`` (a row's length once dense), ``dtype`` the values'
    type, ``values`` the number of nonzeros.

    Attributes:
        index_dtype: the type of the column indices (as the file stores them).
        output: ``"dense"`` or ``"coo"`` (see the module docstring).
    """

    index_dtype: str = "int64"
    output: str = "dense"

    def describe(self) -> str:
        """E.g. ``sparse float32 (2000,) as dense``."""
        return f"sparse {self.dtype} {self.shape} as {self.output}"


def row_elements(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``[starts[r], stops[r])`` of every row ``r`` in one array, and each one's row.

    Example:
        >>> pos, row = row_elements(np.array([5, 0, 2]), np.array([7, 0, 3]))
        >>> pos.tolist(), row.tolist()
        ([5, 6, 2], [0, 0, 2])
    """
    lengths = stops - starts
    total = int(lengths.sum())
    rows = np.repeat(np.arange(len(starts), dtype=np.int64), lengths)
    first = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return first + np.arange(total, dtype=np.int64), rows


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


class SparseColumn(Column):
    """Rows of a CSR matrix in shared memory, each dense or ``torch.sparse_coo``.

    Example:
        >>> data = np.array([1.0, 2.0, 5.0], np.float32)
        >>> col = SparseColumn.from_csr("X", [0, 2, 2, 3], [1, 3, 0], data, 4)
        >>> col.get(0)
        tensor([0., 1., 0., 2.])
        >>> col.gather(torch.tensor([2, 1]))
        tensor([[5., 0., 0., 0.],
                [0., 0., 0., 0.]])
        >>> coo = SparseColumn.from_csr("X", [0, 2, 2, 3], [1, 3, 0], data, 4, "coo")
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
        self._dtype = _torch_dtype(self._data.dtype)

    @staticmethod
    def layout(spec: ColumnSpec) -> dict[str, tuple[tuple[int, ...], Any]]:
        """``indptr`` (int64, rows + 1), ``indices`` and ``data`` (one per nonzero)."""
        index_dtype = spec.index_dtype if isinstance(spec, SparseSpec) else "int64"
        return {
            "indptr": ((spec.rows + 1,), np.dtype(np.int64)),
            "indices": ((spec.values,), np.dtype(index_dtype)),
            "data": ((spec.values,), spec.dtype),
        }

    # -- one row, a batch ------------------------------------------------------------
    def get(self, index: int) -> torch.Tensor:
        """Row ``index``: dense, or a 1-D sparse COO tensor."""
        return self.gather(torch.tensor([index]))[0]

    def batch_parts(self, indices: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Dense: the ``(batch, columns)`` tensor; COO: its indices and values."""
        if self._dense:
            return [((len(indices), self._width), self._dtype)]
        idx = indices.numpy()
        nnz = int((self._indptr[idx + 1] - self._indptr[idx]).sum())
        return [((2, nnz), torch.int64), ((nnz,), self._dtype)]

    def gather(self, indices: torch.Tensor, alloc: Alloc | None = None) -> torch.Tensor:
        """Rows ``indices`` as one ``(batch, columns)`` tensor, dense or sparse COO.

        With ``alloc`` (in a DataLoader worker) the batch is built in the worker's
        batch memfd (Note [How a batch leaves a worker] in ``crossing/_outbox.py``); a
        COO batch is then a sparse :class:`~shareddata.SharedTensor`, whose indices and
        values cross by handle.
        """
        parts = self.batch_parts(indices)
        if alloc is not None:
            outs = alloc(parts)
        else:
            outs = [torch.empty(shape, dtype=dtype) for shape, dtype in parts]
        return self.gather_into(indices, outs)

    def gather_into(self, indices: torch.Tensor, outs: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`gather` into the buffers of :meth:`batch_parts`."""
        idx = indices.numpy()
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"index out of range for column {self.name!r} of {len(self)} rows")
        starts, stops = self._indptr[idx], self._indptr[idx + 1]
        positions, rows = row_elements(starts, stops)
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
            coords,
            vals,
            (len(idx), self._width),
            is_coalesced=ordered,
            check_invariants=False,
        )
        if isinstance(outs[0], SharedTensor):  # in a worker's memfd: it crosses by handle
            return shared_tensor(batch, outs[0].__dict__["_shared"])
        return batch

    def split(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """Each row of a batch: a view (dense) or a 1-D sparse COO tensor."""
        return list(batch.unbind(0))

    @classmethod
    def from_csr(
        cls,
        name: str,
        indptr: Any,
        indices: Any,
        data: Any,
        width: int,
        output: str = "dense",
    ) -> SparseColumn:
        """A column over a copy of a CSR matrix's arrays (for tests and small data)."""
        arrays = {
            "indptr": np.asarray(indptr, np.int64),
            "indices": np.asarray(indices),
            "data": np.asarray(data),
        }
        spec = SparseSpec(
            name,
            len(arrays["indptr"]) - 1,
            arrays["data"].dtype,
            (width,),
            "sparse",
            len(arrays["data"]),
            index_dtype=str(arrays["indices"].dtype),
            output=output,
        )
        return cls(spec, {k: SharedArray.from_array(a).readonly() for k, a in arrays.items()})


COLUMN_KINDS.setdefault(SparseColumn.kind, SparseColumn)
