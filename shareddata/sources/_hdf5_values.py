"""Variable-length HDF5 columns (strings, bytes, ``vlen`` numbers) read in bounded blocks.

A row's size is known only once it is read, so each column is read twice, block
by block: :meth:`VariableReader.size` counts the values (the loader then
allocates the ``values`` buffer exactly), :meth:`VariableReader.read` reads the
same blocks again into ``offsets`` and ``values``. At most one block of rows
exists as numpy arrays or Python objects at any time (:data:`_BLOCK` bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ..errors import SourceReadError
from ._hdf5_layout import Plan
from ._source import Buffer

__all__ = ["VariableReader"]

_BLOCK = 16 << 20
"""Bytes of private memory one block of string / variable-length rows may take."""
_OBJECT_OVERHEAD = 112
"""Approximate bytes of one Python object (a ``bytes`` or ``ndarray``) beyond its data."""
_MAX_BLOCK_ROWS = 1 << 20

Block = Callable[[Plan, Any, int, int], Any]
"""``block(plan, ds, start, stop)``: rows ``[start, stop)`` of the plan's values."""


def _utf8(block: Any) -> list[bytes]:
    """Rows of UCS-4 code points (PyTables' ``VLUnicodeAtom``) as UTF-8 bytes."""
    return [np.asarray(row, "<u4").tobytes().decode("utf-32-le").encode() for row in block]


class VariableReader:
    """Sizes and reads the variable-length columns of one HDF5 file.

    Args:
        label: the file, for messages.
        reading: ``reading(plan)``, a context that turns h5py's errors into
            :class:`~shareddata.errors.SourceReadError`.
        block: reads one block of rows of a plan.
    """

    def __init__(
        self,
        label: str,
        reading: Callable[[Plan], AbstractContextManager[None]],
        block: Block,
    ) -> None:
        self.label = label
        self._reading = reading
        self._block = block

    def _fixed_blocks(self, plan: Plan, ds: Any) -> Iterator[tuple[int, int, Any]]:
        """Blocks of fixed-width rows, about ``_BLOCK / 3`` bytes of records each."""
        step = max(1, (_BLOCK // 3) // max(1, ds.dtype.itemsize))
        if ds.chunks:
            along = int(ds.chunks[0])
            step = max(along, step - step % along)
        for start in range(0, plan.rows, step):
            stop = min(plan.rows, start + step)
            yield start, stop, self._block(plan, ds, start, stop)

    @staticmethod
    def _lengths(plan: Plan, block: Any) -> np.ndarray:
        if plan.reader == "opaque":
            return np.full(len(block), block.dtype.itemsize, np.int64)
        if plan.reader == "fixed":  # np.bytes_ semantics: trailing NULs are not part of it
            width = block.dtype.itemsize
            if width == 0 or len(block) == 0:
                return np.zeros(len(block), np.int64)
            nonzero = block.view(np.uint8).reshape(len(block), width) != 0
            last = width - np.argmax(nonzero[:, ::-1], axis=1)
            return np.where(nonzero.any(axis=1), last, 0).astype(np.int64)
        if plan.reader == "vlen_ucs4":
            return np.fromiter(map(len, _utf8(block)), np.int64, count=len(block))
        return np.fromiter(map(len, block), np.int64, count=len(block))

    def size(self, plan: Plan, ds: Any) -> int:
        """Total ``values`` of a variable-length column, reading it in bounded blocks.

        The blocks are kept (``plan.blocks``) so that :meth:`read` reads the same ones.
        """
        if plan.reader == "opaque":
            width = plan.source.itemsize if plan.source is not None else 0
            return plan.rows * width
        plan.blocks = []
        with self._reading(plan):
            if plan.reader == "fixed":
                for start, stop, block in self._fixed_blocks(plan, ds):
                    plan.blocks.append((start, stop, int(self._lengths(plan, block).sum())))
                    del block
            else:
                # a row's size is known only once read: grow the blocks from a few rows
                # to what the rows seen so far say fits in _BLOCK bytes of Python objects
                element = plan.dtype.itemsize
                start, step = 0, 8
                while start < plan.rows:
                    stop = min(plan.rows, start + step)
                    block = self._block(plan, ds, start, stop)
                    total = int(self._lengths(plan, block).sum())
                    del block
                    plan.blocks.append((start, stop, total))
                    per_row = _OBJECT_OVERHEAD + element * total / (stop - start)
                    step = int(min(4 * step, _MAX_BLOCK_ROWS, max(1, _BLOCK // per_row)))
                    start = stop
        return sum(n for _, _, n in plan.blocks)

    def read(
        self,
        plan: Plan,
        ds: Any,
        offsets: Buffer,
        values: Buffer,
        progress: Callable[[int], None],
    ) -> None:
        """Fill ``offsets`` and ``values`` of a column :meth:`size` has sized."""
        offsets.rows(0, 1)[0] = 0
        progress(offsets.itemsize)
        if plan.reader == "opaque":
            blocks: Iterator[tuple[int, int, Any]] = self._fixed_blocks(plan, ds)
        else:
            blocks = ((a, b, self._block(plan, ds, a, b)) for a, b, _ in plan.blocks)
        sized = iter(plan.blocks)
        for start, stop, block in blocks:
            lengths = self._lengths(plan, block)
            base = int(offsets[start])
            total = int(lengths.sum())
            if plan.reader != "opaque" and total != next(sized)[2]:
                raise SourceReadError(
                    f"{self.label}: dataset {plan.path!r} changed while it was being loaded "
                    f"(rows {start}:{stop}); load it again when nothing writes to the file."
                )
            ends = offsets.rows(start + 1, stop + 1)
            np.cumsum(lengths, out=ends)
            ends += base
            dest = values.rows(base, base + total)
            if total:
                self._fill(plan, block, lengths, dest)
            if plan.kind == "str":
                self._check_utf8(plan, values, offsets, start, stop)
            del block
            progress((stop - start) * offsets.itemsize + dest.nbytes)

    @staticmethod
    def _fill(plan: Plan, block: Any, lengths: np.ndarray, dest: np.ndarray) -> None:
        if plan.reader == "vlen":
            np.concatenate([np.asarray(row).reshape(-1) for row in block], out=dest)
        elif plan.reader == "vlen_str":
            dest[:] = np.frombuffer(b"".join(block), np.uint8)
        elif plan.reader == "vlen_ucs4":
            dest[:] = np.frombuffer(b"".join(_utf8(block)), np.uint8)
        else:  # fixed width: keep each row's first `length` bytes
            width = block.dtype.itemsize
            raw = block.view(np.uint8).reshape(len(block), width)
            if plan.reader == "opaque":
                dest[:] = raw.reshape(-1)
            else:
                dest[:] = raw[np.arange(width) < lengths[:, None]]

    def _check_utf8(
        self, plan: Plan, values: np.ndarray, offsets: np.ndarray, start: int, stop: int
    ) -> None:
        """Refuse text that is not UTF-8 now, rather than fail when a worker decodes it."""
        lo, hi = int(offsets[start]), int(offsets[stop])
        try:
            str(values[lo:hi].data, "utf-8")
        except UnicodeDecodeError:
            pass
        else:
            # valid as a whole; each row is valid too if no row starts inside a character
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
