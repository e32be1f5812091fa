"""The one loading path: every dataset kind is sized, allocated, filled, sealed and shared here.

:func:`build` is what ``NumpyDataset``, ``HDF5Dataset``, ``ParquetDataset``,
``ArrowDataset``, ``SharedDataset`` and ``SharedList`` all call. It owns, in this
order:

1. node sharing and the identity key: under torchrun only local rank 0 of each node
   runs the steps below; the other local ranks attach to its columns and never open
   the files or read the wrapped dataset (:func:`shareddata.distributed.load_on_node`);
2. ``shard="node"``: the source reads only this node's contiguous rows;
3. allocation, with its capacity check (:class:`Allocator`: every segment made for
   the load is freed at once if anything fails, Ctrl-C included);
4. the fill, through :class:`Buffer` sinks (``buf.rows(a, b)``): a source never
   waits for pages nor imports storage internals;
5. sealing (no process can change the columns' files any more) and building the columns.

A source is either a :class:`Source` (exact sizes known before reading: the file
formats, ``SharedList``) or a :class:`Producer` (sizes known only while reading:
``SharedDataset``, which asks the :class:`Allocator` for segments as it goes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from .._text import format_bytes
from ..columns._columns import COLUMN_KINDS, Column, ColumnSpec
from ..distributed import NodeShard, load_on_node, node_rows, resolve_timeout
from ..errors import ColumnLengthError, ShardingNotSupportedError
from ..sources._source import Source, as_buffer
from ..storage import SharedArray, allocate, seal
from ..storage._capacity import private_peak, resolve_storage_dir
from ..storage._sweep import auto_sweep

__all__ = [
    "READ_CHUNK_BYTES",
    "Allocator",
    "Columns",
    "LoadOptions",
    "Part",
    "Producer",
    "Share",
    "Shard",
    "build",
    "check_lengths",
    "progress_bar",
]

Share = Literal["node", "process"]
Shard = Literal["node"]
Part = tuple[type[Column], ColumnSpec, dict[str, SharedArray]]
"""One column as a producer made it: its class, spec and filled arrays."""

READ_CHUNK_BYTES = 64 << 20
"""Private memory a :class:`Source` reads into at most at once, besides its columns.

The ``preadv`` steps of ``sources/_io.py``, the blocks of ``npy.py`` and ``hdf5.py``
(64 MiB each), a Parquet batch and its row group's pages: counted by the capacity
check of every file load.
"""


class Columns(dict):  # type: ignore[type-arg]
    """Loaded columns by name; what :func:`build` returns (and pickles across ranks).

    ``ColumnDataset`` reads :attr:`node_shard` from the columns it is given, so
    every source gets it without plumbing of its own (and it survives pickling).

    Attributes:
        node_shard: with ``shard="node"``, the rows of the whole dataset held here.
        meta: what a :class:`Producer` returned with its columns (else ``None``).
    """

    node_shard: NodeShard | None = None
    meta: Any = None


class Producer(Protocol):
    """A source whose sizes are known only while it reads (``SharedDataset``).

    Same optional ``select_rows``/``total_rows`` as :class:`Source`.
    """

    label: str

    def produce(self, alloc: Allocator, progress: bool) -> tuple[list[Part], Any]:
        """Fill columns in segments from ``alloc``; return them and any metadata.

        The metadata (picklable) travels with the columns to the other local ranks.
        On an error, stop any thread writing to the segments before raising: the
        loader then frees them.
        """
        ...

    def close(self) -> None:
        """Release what the producer holds (called after loading, also on error)."""
        ...


class Allocator:
    """Every segment of one load: allocated with a capacity check, freed together on failure."""

    def __init__(self, storage_dir: str | os.PathLike[str] | None) -> None:
        self.storage_dir = storage_dir
        self._segments: list[Any] = []

    def __call__(
        self,
        layouts: Sequence[tuple[Sequence[int], Any]],
        what: str,
        *,
        reserve: bool = True,
        ahead: bool = False,
    ) -> list[SharedArray]:
        """Arrays of ``layouts`` in one new segment (see ``_storage.allocate``).

        Raises:
            SharedMemoryFullError: before anything is allocated, when there is no room.
        """
        arrays = allocate(layouts, self.storage_dir, what=what, reserve=reserve, ahead=ahead)
        if arrays:
            self._segments.append(arrays[0].segment)
        return arrays

    def adopt(self, segment: Any) -> None:
        """Free ``segment`` with the others if the load fails (a producer made it itself)."""
        self._segments.append(segment)

    def finish(self) -> None:
        """Wait for background page allocation to end (it may raise SharedMemoryFullError)."""
        for segment in self._segments:
            segment.finish_population()

    def discard(self) -> None:
        """Free every segment now (Note [Freeing a failed load] in ``storage/_segment.py``)."""
        for segment in self._segments:
            segment.stop_population()
            segment.discard()
        self._segments.clear()


@contextmanager
def progress_bar(
    total: int, desc: str, enabled: bool, unit: str = "B"
) -> Iterator[Callable[[int], None]]:
    """A progress callback: a tqdm bar on a terminal for runs longer than ~2 s, else a no-op."""
    if not enabled or not sys.stderr.isatty() or total == 0:
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    # delay: only loads that take more than ~2 s show a bar
    scaled = {"unit_scale": unit == "B", "unit_divisor": 1024}
    with tqdm(total=total, desc=desc, unit=unit, delay=2, **scaled) as bar:
        yield bar.update


def check_lengths(specs: Sequence[ColumnSpec], label: str) -> int:
    """The common row count of ``specs``, or :class:`ColumnLengthError` naming each."""
    rows = {s.rows for s in specs}
    if len(rows) > 1:
        listing = ", ".join(f"{s.name!r}: {s.rows} rows" for s in specs)
        raise ColumnLengthError(
            f"columns of {label} have different lengths ({listing}); every column of a "
            "dataset needs one value per row. Select columns of equal length "
            "(columns=[...]) or trim them to the same number of rows."
        )
    return rows.pop() if rows else 0


def build(
    source: Source | Producer | Callable[[], Source | Producer],
    *,
    key: Any = None,
    share: Share | None = None,
    shard: Shard | None = None,
    storage_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    timeout: float | None = None,
) -> Columns:
    """Load ``source`` into sealed shared columns, once per node: THE loading path.

    Under torchrun only local rank 0 of each node loads; the other local ranks
    attach to its columns (Note [How local ranks share one copy] in
    ``distributed/_node.py``). If anything fails (a read error, Ctrl-C),
    everything allocated is freed before the error propagates.

    Args:
        source: a :class:`Source` or :class:`Producer`, or a function that makes one
            (called only where the data is loaded: attaching ranks never open files).
        key: the dataset's arguments, equal on every local rank (default: the
            source's type and label); ranks check they build the same dataset. A
            function returning them is called only when local ranks share.
        share: ``"node"`` (one copy per node; the default under torchrun) or
            ``"process"`` (this process loads its own copy).
        shard: ``"node"`` loads only this node's contiguous share of the rows (the
            source needs ``select_rows``); ``None`` loads every row.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.
        progress: show a progress bar for loads longer than ~2 s (on a terminal).
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).

    Returns:
        The columns, read-only, by name in source order; ``.node_shard`` says which
        rows they hold with ``shard="node"``, ``.meta`` is a producer's metadata.

    Example:
        >>> import numpy as np
        >>> from shareddata.sources.npy import NumpySource
        >>> cols = build(NumpySource(np.arange(6)), share="process", progress=False)
        >>> cols["data"].get(5).item(), cols.node_shard
        (5, None)
    """
    if timeout is not None:
        resolve_timeout(timeout)  # checked on every rank, whether it waits or not
    resolve_storage_dir(storage_dir)  # so is storage_dir, before anything is read
    factory = callable(source) and not hasattr(source, "close")
    if key is None:
        key = ("build",) if factory else (type(source).__name__, source.label)  # type: ignore[union-attr]

    def load(place: tuple[int, int] | None) -> Columns:
        made = source() if factory else source  # type: ignore[operator]
        return _load_here(made, storage_dir, progress, place)  # type: ignore[arg-type]

    close = None if factory else source.close  # type: ignore[union-attr]
    return load_on_node(load, share=share, shard=shard, key=key, close=close, timeout=timeout)


@dataclass(frozen=True)
class LoadOptions:
    """How a dataset is loaded: the arguments every dataset kind takes, held once.

    Attributes:
        storage_dir: ``None`` for RAM; a directory for file-backed storage.
        progress: show a progress bar for loads longer than ~2 s (on a terminal).
        share: ``"node"`` (one copy per node; the default under torchrun) or
            ``"process"`` (this process loads its own copy).
        shard: ``"node"`` loads only this node's contiguous share of the rows.
        timeout: seconds to wait for another local rank.

    Example:
        >>> import numpy as np
        >>> from shareddata.sources.npy import NumpySource
        >>> load = LoadOptions(share="process", progress=False).loader(
        ...     lambda: NumpySource(np.arange(3)), key=("example",))
        >>> load()["data"].get(2).item()
        2
    """

    storage_dir: str | os.PathLike[str] | None = None
    progress: bool = True
    share: Share | None = None
    shard: Shard | None = None
    timeout: float | None = None

    def loader(
        self, source: Source | Producer | Callable[[], Source | Producer], key: Any
    ) -> Callable[[], Columns]:
        """The load of ``source`` with these options, for ``ColumnDataset`` to call.

        ``ColumnDataset`` checks its own arguments first and calls it after: a bad
        ``output`` or ``transform`` is refused before anything is read.
        """
        return functools.partial(build, source, key=key, **dataclasses.asdict(self))


def _load_here(
    source: Source | Producer,
    storage_dir: str | os.PathLike[str] | None,
    progress: bool,
    place: tuple[int, int] | None,
) -> Columns:
    """Load ``source`` in this process; ``place`` is ``(node, num_nodes)`` for a node shard."""
    auto_sweep()  # names that killed DataLoader processes left: Note in _sweep.py
    alloc = Allocator(storage_dir)
    try:
        shard = _select(source, place)
        if hasattr(source, "produce"):
            parts, meta = source.produce(alloc, progress)
        else:
            parts, meta = _fill(source, alloc, progress), None  # type: ignore[arg-type]
        alloc.finish()
    except BaseException:
        # Free the segments now, although the traceback still refers to the
        # buffers: Note [Freeing a failed load] in storage/_segment.py.
        alloc.discard()
        raise
    finally:
        source.close()
    # sealed against writes, growth and shrinking: Note [Sealed segments] in storage/_segment.py
    sealed = iter(seal([a for _, _, arrays in parts for a in arrays.values()]))
    columns = Columns(
        {spec.name: cls(spec, {k: next(sealed) for k in arrays}) for cls, spec, arrays in parts}
    )
    columns.node_shard, columns.meta = shard, meta
    return columns


def _select(source: Any, place: tuple[int, int] | None) -> NodeShard | None:
    """Narrow ``source`` to node ``place[0]`` of ``place[1]``'s rows (``shard="node"``)."""
    if place is None:
        return None
    select_rows = getattr(source, "select_rows", None)
    if select_rows is None:
        raise ShardingNotSupportedError(
            f"shard='node' needs a source that reads a range of rows, and "
            f"{type(source).__name__} ({getattr(source, 'label', '?')}) does not. Load the "
            "whole dataset on every node (shard=None), or store it as .npy files and use "
            "sd.NumpyDataset(..., shard='node')."
        )
    total_rows = getattr(source, "total_rows", None)
    total = total_rows() if total_rows else check_lengths(source.specs(), source.label)
    start, stop = node_rows(total, *place)
    select_rows(start, stop)
    return NodeShard(start, stop, total, *place)


def _fill(source: Source, alloc: Allocator, progress: bool) -> list[Part]:
    """Size ``source``'s columns, allocate them in one segment, let the source fill them."""
    specs = source.specs()
    check_lengths(specs, source.label)
    layouts = [(spec, COLUMN_KINDS[spec.kind].layout(spec)) for spec in specs]
    flat = [shape_dtype for _, layout in layouts for shape_dtype in layout.values()]
    size = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in flat)
    # a source reads into private memory at most a chunk at a time (Note [A load is
    # refused, never killed] in storage/_capacity.py)
    with private_peak(min(size, READ_CHUNK_BYTES)):
        # pages are allocated while the source fills the first ones: Note [Filling
        # while the pages are allocated] in storage/_pages.py
        arrays = iter(alloc(flat, source.label, ahead=True))
        parts: list[Part] = [
            (COLUMN_KINDS[spec.kind], spec, {k: next(arrays) for k in layout})
            for spec, layout in layouts
        ]
        total = sum(a.nbytes for _, _, group in parts for a in group.values())
        desc = f"loading {os.path.basename(source.label) or source.label} ({format_bytes(total)})"
        with progress_bar(total, desc, progress) as update:
            for _, spec, group in parts:
                source.read(spec, {k: as_buffer(a.numpy()) for k, a in group.items()}, update)
    return parts
