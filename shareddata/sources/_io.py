"""Files read straight into shared memory: the package's one read loop.

``sendfile`` copies from the page cache into a segment's file (``os.preadv`` into
other memory): one kernel copy, no private buffer, the GIL released while it runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import MissingFileError, SharedDataError, SourceReadError
from ..storage import segment_of

__all__ = ["fill_from", "listed_files", "read_into"]

_CHUNK = 64 << 20  # bytes per preadv call (one progress update each)


def fill_from(
    read: Callable[[Any, int], int], out: np.ndarray, progress: Callable[[int], None], what: str
) -> None:
    """Fill ``out`` by ``read(part, pos)`` calls, the package's one read loop.

    Each call fills the start of the bytes ``part`` (``pos`` bytes into ``out``) and
    returns how many; 0 means the data ended early, an error naming ``what``.

    Example:
        >>> out = np.zeros(3, np.uint8)
        >>> fill_from(lambda part, pos: part.nbytes, out, lambda n: None, "zeros")
        >>> fill_from(lambda part, pos: 0, out, lambda n: None, "x.bin")
        Traceback (most recent call last):
        ...
        shareddata.errors.SourceReadError: x.bin ended early, after 0 of 3 bytes of data: ...
    """
    view = out.reshape(-1).view(np.uint8).data.cast("B")
    pos = 0
    while pos < len(view):
        n = read(view[pos : pos + _CHUNK], pos)
        if not n:
            raise SourceReadError(
                f"{what} ended early, after {pos} of {len(view)} bytes of data: the file is "
                "truncated. Re-create or re-download it."
            )
        pos += n
        progress(n)


def read_into(
    path: str, offset: int, out: np.ndarray, progress: Callable[[int], None], what: str
) -> None:
    """Fill ``out`` (C-contiguous) from ``path`` at byte ``offset``.

    Over a shared segment the kernel copies into its file (:meth:`Segment.copy_file`,
    no page need be ready); into other memory, ``os.preadv``.

    A truncated file or an I/O error is a SourceReadError naming ``what`` and the fix.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(bytes(range(10))); f.flush()
        ...     out = np.zeros(4, np.uint8)
        ...     read_into(f.name, 3, out, lambda n: None, "ten bytes")
        >>> out.tolist()
        [3, 4, 5, 6]
    """
    found = segment_of(out)  # a segment's file is filled by the kernel, without its mapping
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:

            def read(part: memoryview, pos: int) -> int:
                if found is None:
                    return os.preadv(fd, [part], offset + pos)
                return found[0].copy_file(fd, offset + pos, found[1] + pos, len(part))

            fill_from(read, out, progress, what)
        finally:
            os.close(fd)
    except SharedDataError:  # SourceReadError, or the memory's own (full, no descriptor)
        raise
    except OSError as e:  # an I/O error of the disk or file system: name the file
        raise SourceReadError(
            f"{what} could not be read ({e}). Check the disk or file system, or copy the "
            "file elsewhere and load it again."
        ) from e


def listed_files(paths: Sequence[str | os.PathLike[str]], kind: str) -> tuple[list[str], str]:
    """A list of ``kind`` files given by the user, each checked to exist, and its label."""
    files = [os.fspath(p) for p in paths]
    if not files:
        raise MissingFileError(f"the list of {kind} files is empty; pass at least one file.")
    for f in files:
        if not os.path.isfile(f):
            what = "is a folder; list its files" if os.path.isdir(f) else "does not exist"
            raise MissingFileError(f"{f} {what} (in the list of {kind} files given).")
    label = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more files)"
    return files, label
