"""Arrow data by path as an Arrow input: IPC files (Feather v2), IPC streams, HF folders.

Note [Reading Arrow IPC files one column at a time]
===================================================
:class:`IpcInput` maps each file and reads ONE top-level column at a time, batch by
batch. A stream's reader (``included_fields=[j]``) slices the mapping. A file's
reader copies the fields it is asked for, so an uncompressed file (its first batch
slices the mapping) is read without the option, only field ``j`` touched; a
compressed one (lz4, zstd) with it, so only that column is decompressed. After each
batch Arrow's pool is released and the copied pages leave the RSS (``MADV_DONTNEED``):
the process holds the shared copy and about one batch
(``benchmarks/bench_arrow_files.py``). A file's rows come from its footer; a
stream's from one pass over one column. A path is recognised by its first bytes
(``ARROW1``: file; ``0xFFFFFFFF``: stream, what HF ``datasets`` writes); a folder
must hold an HF ``save_to_disk`` ``state.json``, whose ``_data_files`` are the data.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import reprlib
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ArgumentTypeError, MissingFileError, SourceReadError
from ._arrow_types import pyarrow_module, release_arrow_memory
from ._io import listed_files
from .arrow import ArrowInput, Piece, check_files, read_error, read_errors

__all__ = ["ACCEPTED", "IpcInput", "arrow_paths", "is_path"]

ACCEPTED = (
    "an Arrow IPC file (.arrow, .feather: Feather v2), an Arrow IPC stream (.arrows, "
    "HF datasets' .arrow files), a list of them, or an HF datasets save_to_disk folder"
)
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
    paths = obj if isinstance(obj, (list, tuple)) else [obj]
    return isinstance(obj, (str, os.PathLike, list, tuple)) and all(
        isinstance(p, (str, os.PathLike)) for p in paths
    )


def arrow_paths(path: Any) -> tuple[list[str], str, dict[str, Any] | None]:
    """The files a path, list or HF folder names, a label, and the folder's ``Dataset.format``."""
    if isinstance(path, (list, tuple)):
        files, label = listed_files(path, "Arrow")
        return files, label, None
    p = os.fspath(path)
    if os.path.isdir(p):
        files, hf_format = _hf_folder(p)
        return files, p, hf_format
    if os.path.exists(p):
        return [p], p, None
    raise MissingFileError(f"{p} does not exist. ArrowDataset takes {ACCEPTED}, or a table.")


def _hf_folder(folder: str) -> tuple[list[str], dict[str, Any]]:
    """An HF ``save_to_disk`` folder's data files (in state.json's order) and saved format."""
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
    saved = ("type", "columns", "format_kwargs")
    hf_format = {k: state.get(f"_format_{k}") for k in saved}
    return files, {**hf_format, "output_all_columns": state.get("_output_all_columns")}


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
    seen = seen if head else "empty"
    raise SourceReadError(
        f"{path} is not an Arrow IPC file or stream (it starts with {head!r}"
        f"{': it is ' + seen if seen else ''}). ArrowDataset takes {ACCEPTED}."
    )


@dataclass
class _ArrowFile:
    path: str
    stream: bool
    schema: Any
    rows: int = -1  # -1: not counted yet (a stream)
    sliced: bool = False  # an IPC file whose batches slice the mapping (uncompressed)


class IpcInput(ArrowInput):
    """IPC files or streams, a list of them, or an HF ``save_to_disk`` folder (Note above)."""

    format = "Arrow IPC"

    def __init__(self, path: Any, columns: Sequence[str] | None = None) -> None:
        if not is_path(path):
            raise ArgumentTypeError(
                f"ArrowDataset cannot read {reprlib.repr(path)} (type {type(path).__name__}); "
                f"it takes {ACCEPTED}, or a table."
            )
        self.paths, self.label, self.hf_format = arrow_paths(path)
        self.files = [self._open(p) for p in self.paths]
        files = [(f.path, f.schema) for f in self.files]
        self.schema, self.file_types = check_files(files, columns, promote=False)

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
        except read_errors() as e:
            raise read_error(path, self.format, e, "reading its schema") from e
        return info

    def _rows(self, info: _ArrowFile) -> int:
        """Rows of one file: the footer's count, or for a stream one pass over one column."""
        if info.rows < 0:
            pa = pyarrow_module()
            fixed = [i for i, f in enumerate(info.schema) if pa.types.is_primitive(f.type)]
            j = fixed[0] if fixed else 0  # a fixed-width column decodes cheapest
            try:
                info.rows = sum(len(chunk) for chunk in self._batches(info, j))
            except read_errors() as e:
                raise read_error(info.path, self.format, e, "counting its rows") from e
        return info.rows

    def total_rows(self) -> int:
        """Rows of every file together."""
        return sum(self._rows(info) for info in self.files)

    def pieces(self, column: Any) -> Iterator[Piece]:
        """One piece per file: its rows, and ``column``'s top-level column batch by batch."""
        for info in self.files:
            j = info.schema.get_field_index(column.path[0])
            read = functools.partial(self._batches, info, j)
            yield Piece(info.path, info.path, self._rows(info), read)

    def _batches(self, info: _ArrowFile, j: int) -> Generator[Any, None, None]:
        """Column ``j`` of each record batch of one file (Note above)."""
        pa = pyarrow_module()
        options = pa.ipc.IpcReadOptions(included_fields=[j], use_threads=False)
        with open(info.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            source = pa.BufferReader(pa.py_buffer(mapped))
            if info.stream:  # the stream reader slices the mapping, field or not
                reader: Any = pa.ipc.open_stream(source, options=options)
                batches: Any = iter(reader)
            else:  # uncompressed: every field a slice, only j read; compressed: j decompressed
                reader = pa.ipc.open_file(source, options=None if info.sliced else options)
                batches = map(reader.get_batch, range(reader.num_record_batches))
            for batch in batches:
                chunk = batch.column(j if info.sliced else 0)
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
