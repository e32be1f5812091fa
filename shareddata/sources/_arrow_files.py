"""Arrow data by path: IPC files (Feather v2), IPC streams, HF ``save_to_disk`` folders.

Note [Reading Arrow IPC files one column at a time]
===================================================
An IPC file or stream holds record batches, each batch's columns as buffers one
after the other. :class:`ArrowFileSource` maps the file (``mmap``) and reads ONE
top-level column at a time, batch by batch. A stream is read with
``IpcReadOptions(included_fields=[j])``: its reader slices the mapping. An IPC
file's reader copies the fields it is asked for, so an uncompressed file (whose
batches are slices of the mapping: checked on its first batch) is read without the
option, every field a slice and only field ``j`` touched; a compressed one (Feather's
default lz4, or zstd) with it, so that only that column of each batch is
decompressed. Arrow's pool is released after each batch, and once a batch is copied
into shared memory its pages leave the process's RSS (``MADV_DONTNEED``; the page
cache keeps them): the loading process holds the shared copy and about one batch,
never a private copy of the whole table (``benchmarks/bench_arrow_files.py``
measures it). An IPC file says its rows in its footer (``count_rows()``, metadata
only); a stream has no footer, so its rows are counted in one pass over one column.

A path is recognised by its first bytes, not its name: ``ARROW1`` is an IPC file
(Feather v2 is one), a continuation marker ``0xFFFFFFFF`` an IPC stream (what HF
``datasets`` writes, whatever the ``.arrow`` suffix says). A folder must hold an HF
``save_to_disk`` ``state.json``: its ``_data_files``, in order, are the dataset.
Anything else is refused with what it looks like and what to pass instead.
"""

from __future__ import annotations

import json
import mmap
import os
import reprlib
from collections.abc import Callable, Generator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from ..columns._columns import ColumnSpec
from ..errors import (
    ArgumentTypeError,
    MissingColumnError,
    MissingFileError,
    SharedDataError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._arrow_columns import Sizer, Writer
from ._arrow_extensions import UuidAs
from ._arrow_select import FillValue, make_columns, select_fields
from ._arrow_types import pyarrow_module, release_arrow_memory
from ._source import Buffer

__all__ = ["ACCEPTED", "ArrowFileSource", "arrow_paths", "is_path"]

ACCEPTED = (
    "an Arrow IPC file (.arrow, .feather: Feather v2), an Arrow IPC stream (.arrows, "
    "HF datasets' .arrow files), a list of them, or an HF datasets save_to_disk folder"
)
_NESTED_ROWS = 1 << 16
"""Rows of a nested column taken apart at a time (bounds the temporaries)."""

_LOOKS_LIKE = {
    b"PAR1": "a Parquet file: load it with sd.ParquetDataset(path)",
    b"FEA1": (
        "a Feather v1 file, which pyarrow deprecated in version 25: convert it once with "
        "pyarrow.feather.write_feather(pyarrow.feather.read_table(path), new_path)"
    ),
    b"\x89HDF": "an HDF5 file: load it with sd.HDF5Dataset(path)",
    b"\x93NUM": "a .npy file: load it with sd.NumpyDataset(path)",
    b"PK\x03\x04": "a zip archive (.npz?): load an .npz with sd.NumpyDataset(path)",
}


def is_path(obj: Any) -> bool:
    """Whether ``obj`` names files (a path, or a list of paths), not a table."""
    if isinstance(obj, (str, os.PathLike)):
        return True
    return isinstance(obj, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in obj)


def arrow_paths(path: Any) -> tuple[list[str], str]:
    """The Arrow files a path, list of paths or HF ``save_to_disk`` folder names, and a label."""
    if isinstance(path, (list, tuple)):
        files = [os.fspath(p) for p in path]
        if not files:
            raise MissingFileError("the list of Arrow files is empty; pass at least one file.")
        for f in files:
            if not os.path.isfile(f):
                what = "is a folder; list its files" if os.path.isdir(f) else "does not exist"
                raise MissingFileError(f"{f} {what} (in the list of Arrow files given).")
        label = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more files)"
        return files, label
    p = os.fspath(path)
    if os.path.isdir(p):
        return _hf_folder(p), p
    if os.path.exists(p):
        return [p], p
    raise MissingFileError(f"{p} does not exist. ArrowDataset takes {ACCEPTED}, or a table.")


def _hf_folder(folder: str) -> list[str]:
    """The data files of an HF ``save_to_disk`` folder, in the order its state.json lists."""
    state_path = os.path.join(folder, "state.json")
    if not os.path.isfile(state_path):
        splits_path = os.path.join(folder, "dataset_dict.json")
        if os.path.isfile(splits_path):
            splits = _json(splits_path).get("splits") or sorted(
                d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))
            )
            raise MissingFileError(
                f"{folder} is an HF DatasetDict folder (splits: {', '.join(map(str, splits))}); "
                f"pass the folder of one split, e.g. sd.ArrowDataset("
                f"{os.path.join(folder, str(splits[0]) if splits else 'train')!r})."
            )
        found = sorted(f for f in os.listdir(folder) if f.endswith((".arrow", ".feather")))
        hint = (
            f" It holds {len(found)} Arrow file(s) ({', '.join(found[:3])}...): pass them as a "
            f"list, e.g. sorted(glob.glob({os.path.join(folder, '*.arrow')!r}))."
            if found
            else ""
        )
        raise MissingFileError(
            f"folder {folder} has no state.json, so it is not an HF datasets save_to_disk "
            f"folder.{hint} ArrowDataset takes {ACCEPTED}."
        )
    state = _json(state_path)
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise SourceReadError(
            f"{state_path} lists no data files (_data_files: {reprlib.repr(entries)}); "
            "re-save the dataset with Dataset.save_to_disk."
        )
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        file = os.path.join(folder, str(name))
        if not name or not os.path.isfile(file):
            raise MissingFileError(
                f"{state_path} lists the data file {name!r}, which is not in {folder}; "
                "the folder is incomplete: copy it again or re-save it with save_to_disk."
            )
        files.append(file)
    return files


def _json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise SourceReadError(f"{path} could not be read as JSON ({e}); re-create it.") from e
    if not isinstance(data, dict):
        raise SourceReadError(f"{path} holds {type(data).__name__}, not a JSON object.")
    return data


def _is_stream(path: str) -> bool:
    """True for an IPC stream, False for an IPC file; anything else is refused by name."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise SourceReadError(f"{path} could not be opened ({e}).") from e
    if head[:6] == b"ARROW1":
        return False
    if head[:4] == b"\xff\xff\xff\xff":
        return True
    seen = next((what for magic, what in _LOOKS_LIKE.items() if head.startswith(magic)), None)
    if not head:
        seen = "empty"
    raise SourceReadError(
        f"{path} is not an Arrow IPC file or stream (it starts with {head!r}"
        f"{': it is ' + seen if seen else ''}). ArrowDataset takes {ACCEPTED}."
    )


def _read_error(path: str, e: BaseException, doing: str) -> SourceReadError:
    return SourceReadError(
        f"{path} could not be read as Arrow IPC while {doing} ({type(e).__name__}: {e}). "
        "The file may be truncated or corrupt; re-create it."
    )


@dataclass
class _ArrowFile:
    path: str
    stream: bool
    schema: Any
    rows: int = -1  # -1: not counted yet (a stream)
    sliced: bool = False  # an IPC file whose batches slice the mapping (uncompressed)


class ArrowFileSource:
    """Reads columns of Arrow IPC files/streams by path (Note above), one column at a time.

    Args:
        path: an IPC file, an IPC stream, a list of them, or an HF ``save_to_disk`` folder.
        columns: the columns to load, in this order (default: all).
        fill_value: what nulls become (see :class:`ParquetDataset`); ``None`` refuses nulls.
        records: a list of structs comes back as a list of dicts (else a dict of lists).
        uuid_as: ``arrow.uuid`` values as ``"uuid"`` (``uuid.UUID``) or ``"tensor"``.
    """

    def __init__(
        self,
        path: Any,
        columns: Sequence[str] | None = None,
        *,
        fill_value: FillValue = None,
        records: bool = True,
        uuid_as: UuidAs = "uuid",
    ) -> None:
        if not is_path(path):
            raise ArgumentTypeError(
                f"ArrowDataset cannot read {reprlib.repr(path)} (type {type(path).__name__}); "
                f"it takes {ACCEPTED}, or a table."
            )
        self.paths, self.label = arrow_paths(path)
        self.files = [self._open(p) for p in self.paths]
        first = self.files[0]
        names = select_fields(first.schema, columns, self.label)
        tops = list(dict.fromkeys(c.split(".")[0] if c not in first.schema.names else c
                                  for c in names))  # fmt: skip
        for other in self.files[1:]:
            _check_same(first, other, tops, columns is None)
        self.columns = make_columns(first.schema, names, self.label, fill_value, records, uuid_as)
        self._by_name = {c.name: c for c in self.columns}
        self._window: tuple[int, int] | None = None

    def _open(self, path: str) -> _ArrowFile:
        pa = pyarrow_module()
        stream = _is_stream(path)
        try:
            with pa.memory_map(path) as mm:
                reader = pa.ipc.open_stream(mm) if stream else pa.ipc.open_file(mm)
                info = _ArrowFile(path, stream, reader.schema)
                if not stream:
                    info.rows = int(reader.count_rows())  # from the footer: no data read
                    info.sliced = _slices(reader, mm)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise _read_error(path, e, "reading its schema") from e
        return info

    def _rows(self, info: _ArrowFile) -> int:
        """Rows of one file: the footer's count, or for a stream one pass over one column."""
        if info.rows < 0:
            fixed = [i for i, f in enumerate(info.schema) if _fixed_width(f.type)]
            j = fixed[0] if fixed else 0  # a fixed-width column decodes cheapest
            info.rows = sum(len(chunk) for chunk in self._batches(info, j, "counting its rows"))
        return info.rows

    def total_rows(self) -> int:
        """Rows of every file together (before :meth:`select_rows`)."""
        return sum(self._rows(info) for info in self.files)

    def select_rows(self, start: int, stop: int) -> None:
        """Describe and read only rows ``[start, stop)`` of all files (``shard="node"``)."""
        self._window = (int(start), int(stop))

    def _batches(self, info: _ArrowFile, j: int, what: str) -> Generator[Any, None, None]:
        """Column ``j`` of each record batch of one file, over a mapping dropped as it goes.

        Once a batch is copied its pages leave this process's RSS (``MADV_DONTNEED``;
        they stay in the page cache). Note [Reading Arrow IPC files one column at a time].
        """
        pa = pyarrow_module()
        options = pa.ipc.IpcReadOptions(included_fields=[j], use_threads=False)
        try:
            with open(info.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                source = pa.BufferReader(pa.py_buffer(mapped))
                if info.stream:  # the stream reader slices the mapping, field or not
                    reader: Any = pa.ipc.open_stream(source, options=options)
                    batches, k = iter(reader), 0
                elif info.sliced:  # uncompressed: every field is a slice, only j is read
                    reader = pa.ipc.open_file(source)
                    batches, k = map(reader.get_batch, range(reader.num_record_batches)), j
                else:  # compressed: only field j is decompressed
                    reader = pa.ipc.open_file(source, options=options)
                    batches, k = map(reader.get_batch, range(reader.num_record_batches)), 0
                for batch in batches:
                    chunk = batch.column(k)
                    del batch
                    yield chunk
                    del chunk
                    mapped.madvise(mmap.MADV_DONTNEED)
                    release_arrow_memory()  # what a compressed batch was decoded into
            finally:
                reader = batches = source = None
                try:
                    mapped.close()
                except BufferError:  # a chunk still refers to it: unmapped when it is freed
                    pass
        except (pa.ArrowException, OSError, ValueError) as e:
            if isinstance(e, SharedDataError):
                raise
            raise _read_error(info.path, e, what) from e

    def _each_chunk(self, column: Any, fn: Callable[[str, str, Any], None]) -> None:
        step = _NESTED_ROWS if column.kind.kind == "nested" else None
        base = 0
        for info in self.files:
            j = info.schema.get_field_index(column.path[0])
            first = base
            base += self._rows(info)
            lo, hi = self._window or (0, base)
            if min(base, hi) <= max(first, lo):
                continue
            at = first
            what = f"reading column {column.path[0]!r}"
            with closing(self._batches(info, j, what)) as batches:
                for chunk in batches:
                    n = len(chunk)
                    a, b = max(at, lo), min(at + n, hi)
                    at += n
                    if a < b:
                        part = chunk if b - a == n else chunk.slice(a - (at - n), b - a)
                        _pieces(column, part, step, info.path, fn)
                        del part
                    del chunk  # no reference left when the next batch is decoded
            release_arrow_memory()

    def specs(self) -> list[ColumnSpec]:
        """Exact specs, from one pass over each column (zero-copy when uncompressed)."""
        rows = self.total_rows()
        if self._window is not None:
            rows = self._window[1] - self._window[0]
        specs = []
        for column in self.columns:
            sizer = Sizer(column)
            self._each_chunk(column, sizer.add)
            specs.append(sizer.spec(rows))
        return specs

    def read(
        self, spec: ColumnSpec, buffers: dict[str, Buffer], progress: Callable[[int], None]
    ) -> None:
        """Fill one column's buffers, one record batch at a time."""
        writer = Writer(self._by_name[spec.name], spec, buffers)
        self._each_chunk(
            writer.column, lambda _, where, chunk: progress(writer.write(chunk, where))
        )
        writer.finish(self.label)

    def close(self) -> None:
        """Give Arrow's memory back (every mapping is closed after its pass)."""
        release_arrow_memory()


def _pieces(
    column: Any, chunk: Any, step: int | None, path: str, fn: Callable[[str, str, Any], None]
) -> None:
    """``fn`` on a chunk, or on its pieces of ``step`` rows (bounded nested temporaries)."""
    for start in range(0, len(chunk), step or max(1, len(chunk))):
        fn(path, path, column.extract(chunk if step is None else chunk.slice(start, step)))


def _slices(reader: Any, mm: Any) -> bool:
    """Whether an IPC file's batches are slices of its mapping (not decompressed copies)."""
    if reader.num_record_batches == 0:
        return True
    mm.seek(0)
    whole = mm.read_buffer(mm.size())  # the mapping itself
    for column in reader.get_batch(0).columns:
        for buf in column.buffers():
            if buf is not None and buf.size:
                return bool(whole.address <= buf.address < whole.address + whole.size)
    return True


def _fixed_width(t: Any) -> bool:
    try:
        return int(t.bit_width) > 0
    except ValueError:  # pyarrow: "Non-fixed width type"
        return False


def _check_same(first: _ArrowFile, other: _ArrowFile, tops: list[str], every: bool) -> None:
    """Refuse a file whose loaded columns differ from the first file's."""
    if every and other.schema.names != first.schema.names:
        raise MissingColumnError(
            f"{other.path} and {first.path} have different columns ({other.schema.names} vs "
            f"{first.schema.names}); every file must have the same columns. Pass "
            "columns=[...] to load the columns they share."
        )
    for name in tops:
        if name not in other.schema.names:
            raise MissingColumnError(
                f"column {name!r} is in {first.path} but not in {other.path}, which has: "
                f"{', '.join(repr(n) for n in other.schema.names)}."
            )
        a, b = first.schema.field(name), other.schema.field(name)
        if a.type != b.type:
            raise UnsupportedDtypeError(
                f"column {name!r} is {b.type} in {other.path} but {a.type} in {first.path}; "
                "the files of one dataset must have one type per column. Rewrite them with "
                f"one type, or leave {name!r} out with columns=[...]."
            )
