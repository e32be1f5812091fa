"""The one loading path: every dataset kind is sized, allocated, filled, sealed and shared here.

:func:`build`, in order: node sharing (under torchrun only local rank 0 of a node
loads, the others attach: :func:`shareddata.distributed.load_on_node`);
``shard="node"``; allocation with its capacity check (:class:`Allocator`, which frees
everything on failure); the fill, by a :class:`Source` (sizes known before reading)
or a :class:`Producer` (known while reading: ``SharedDataset``, ``SharedList``);
sealing.
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
"""Private memory a :class:`Source` reads into at once (counted by the capacity check)."""


class Columns(dict):  # type: ignore[type-arg]
    """Loaded columns by name; what :func:`build` returns (and pickles across ranks).

    Attributes:
        node_shard: with ``shard="node"``, the rows of the whole dataset held here.
        meta: what a :class:`Producer` returned with its columns (else ``None``).
    """

    node_shard: NodeShard | None = None
    meta: Any = None


class Producer(Protocol):
    """A source whose sizes are known only while it reads.

    Optional ``select_rows``/``total_rows``, as for :class:`Source`.
    """

    label: str

    def produce(self, alloc: Allocator, progress: bool) -> tuple[list[Part], Any]:
        """Fill columns in segments from ``alloc``; return them and picklable metadata.

        On an error, stop any thread writing to the segments before raising.
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
        """Arrays of ``layouts`` in one new segment (``SharedMemoryFullError`` if no room)."""
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

    Under torchrun local rank 0 loads and the others attach (Note [How local ranks
    share one copy] in ``distributed/_node.py``). If anything fails, Ctrl-C included,
    everything allocated is freed before the error propagates.

    Args:
        source: a :class:`Source` or :class:`Producer`, or a function making one
            (called only where the data is loaded).
        key: the dataset's arguments, which local ranks check are equal (default: the
            source's type and label); a function is called only when ranks share.
        share: ``"node"`` or ``"process"`` (:class:`LoadOptions`).
        shard: ``"node"`` or ``None``.
        storage_dir: ``None`` for RAM; a directory for file-backed storage.
        progress: a progress bar for loads longer than ~2 s.
        timeout: seconds to wait for another local rank.

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
        progress: a progress bar for loads longer than ~2 s (on a terminal).
        share: ``"node"`` (one copy per node; the default under torchrun) or
            ``"process"`` (this process loads its own copy).
        shard: ``"node"`` loads only this node's contiguous share of the rows.
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).

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
        """The load of ``source`` with these options (``ColumnDataset`` calls it last)."""
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
        alloc.discard()  # Note [Freeing a failed load] in storage/_segment.py
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
    # Note [A load is refused, never killed] in storage/_capacity.py
    with private_peak(min(size, READ_CHUNK_BYTES)):
        # Note [Filling while the pages are allocated] in storage/_pages.py
        arrays = iter(alloc(flat, source.label, ahead=True))
        parts: list[Part] = [
            (COLUMN_KINDS[spec.kind], spec, {k: next(arrays) for k in layout})
            for spec, layout in layouts
        ]
        desc = f"loading {os.path.basename(source.label) or source.label} ({format_bytes(size)})"
        with progress_bar(size, desc, progress) as update:
            for _, spec, group in parts:
                source.read(spec, {k: as_buffer(a.numpy()) for k, a in group.items()}, update)
    return parts
