"""UUID rows: 16 bytes each in one shared array; each row comes back as a ``uuid.UUID``.

What an Arrow ``arrow.uuid`` column loads as by default (``sources/_arrow_extensions.py``;
``uuid_as="tensor"`` gives the bytes as a plain uint8 tensor column instead).

``default_collate`` refuses types it does not know, ``uuid.UUID`` among them. The rows
are therefore instances of :class:`UUID`, shareddata's own subclass of ``uuid.UUID``
(equal to, hashing as, and printing as the ``uuid.UUID`` of the same value), and only
that type is registered in ``default_collate_fn_map`` (the documented way): a batch of
them is their list, as for strings. torch's registry is left as it was for every type
that is not shareddata's (issue 21).
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from .._compat import default_collate_fn_map
from ._columns import COLUMN_KINDS, Alloc, TensorColumn

__all__ = ["UUID", "UuidColumn", "collate_uuids"]


class UUID(uuid.UUID):
    """A ``uuid.UUID`` read from a shared column (equal to the ``uuid.UUID`` of its value).

    Example:
        >>> UUID(int=5) == uuid.UUID(int=5), isinstance(UUID(int=5), uuid.UUID)
        (True, True)
        >>> UUID(int=5)
        UUID('00000000-0000-0000-0000-000000000005')
    """

    __slots__ = ()


class UuidColumn(TensorColumn):
    """Rows of 16 bytes (``data`` of shape ``(rows, 16)``, uint8), each a ``uuid.UUID``.

    A batch is the list of the rows' UUIDs (what the default collate makes of them).

    Example:
        >>> import numpy as np
        >>> from shareddata.columns._columns import ColumnSpec
        >>> from shareddata.storage import SharedArray
        >>> raw = np.frombuffer(uuid.UUID(int=1).bytes + uuid.UUID(int=2).bytes, np.uint8)
        >>> spec = ColumnSpec("id", 2, np.dtype(np.uint8), (16,), "uuid")
        >>> col = UuidColumn(spec, {"data": SharedArray.from_array(raw.reshape(2, 16))})
        >>> col.get(1)
        UUID('00000000-0000-0000-0000-000000000002')
        >>> [u.int for u in col.gather(torch.tensor([1, 0]))]
        [2, 1]
    """

    kind = "uuid"

    def get(self, index: int) -> uuid.UUID:  # type: ignore[override]
        """Row ``index`` as a ``uuid.UUID`` (a :class:`UUID`)."""
        return UUID(bytes=self._np[index].tobytes())

    def gather(  # type: ignore[override]
        self, indices: torch.Tensor, alloc: Alloc | None = None, out: Any = None
    ) -> list[uuid.UUID]:
        """Rows ``indices`` (checked by the dataset) as a list of ``uuid.UUID``."""
        rows = self._np[indices.numpy()]
        return [UUID(bytes=row.tobytes()) for row in rows]

    def batch_parts(self, indices: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """None: UUIDs are Python objects, which leave a worker by value."""
        return []

    def gather_into(self, indices: torch.Tensor, outs: list[torch.Tensor]) -> list[uuid.UUID]:  # type: ignore[override]
        """:meth:`gather` (no buffers)."""
        return self.gather(indices)

    def split(self, batch: list[uuid.UUID]) -> list[uuid.UUID]:  # type: ignore[override]
        """A gathered batch is already a list of rows."""
        return batch


def collate_uuids(batch: list[uuid.UUID], *, collate_fn_map: Any = None) -> list[uuid.UUID]:
    """``default_collate`` of UUIDs: the list of them, as for strings."""
    return list(batch)


COLUMN_KINDS.setdefault(UuidColumn.kind, UuidColumn)
default_collate_fn_map[UUID] = collate_uuids
