"""The exceptions shareddata raises.

Every error is an instance of :class:`SharedDataError` *and* of the built-in type
a caller would expect, so existing ``except FileNotFoundError:`` clauses keep
working::

    SharedDataError (Exception)
    ├── MissingFileError        (+ FileNotFoundError)  a source path does not exist
    ├── MissingColumnError      (+ KeyError)           a key/column is not in the source
    ├── ColumnLengthError       (+ ValueError)         columns have different lengths
    ├── NullValuesError         (+ ValueError)         a column holds nulls, no fill given
    ├── EmptySelectionError     (+ ValueError)         columns=[] / keys=[]: nothing selected
    ├── UnsupportedDtypeError   (+ TypeError)          object / nested / compound data
    ├── SourceReadError         (+ OSError)            corrupt or truncated file
    ├── MissingDependencyError  (+ ImportError)        an optional extra is not installed
    ├── SharedMemoryFullError   (+ MemoryError)        not enough room, raised before loading
    ├── AttachError             (+ OSError)            a process cannot map a segment
    └── DuplicationError        (+ AssertionError)     verify() found duplicated data

Messages name the file, column or key, the value seen, and the fix.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AttachError",
    "ColumnLengthError",
    "DuplicationError",
    "EmptySelectionError",
    "MissingColumnError",
    "MissingDependencyError",
    "MissingFileError",
    "NullValuesError",
    "SharedDataError",
    "SharedMemoryFullError",
    "SourceReadError",
    "UnsupportedDtypeError",
]


class SharedDataError(Exception):
    """Base class of every error raised by shareddata."""


class MissingFileError(SharedDataError, FileNotFoundError):
    """A source file or folder does not exist."""


class MissingColumnError(SharedDataError, KeyError):
    """A requested key or column is not in the source."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ColumnLengthError(SharedDataError, ValueError):
    """Columns of one dataset have different numbers of rows."""


class NullValuesError(SharedDataError, ValueError):
    """A column holds null values and no fill value was given."""


class EmptySelectionError(SharedDataError, ValueError):
    """A selection (``columns=[]``, ``keys=[]``, an empty mapping) names no data at all.

    A dataset of no columns would have no rows, and a training loop over it would
    run no batches without a word; the message lists what the source has instead.
    """


class UnsupportedDtypeError(SharedDataError, TypeError):
    """A column's type cannot be stored in shared memory as it is."""


class SourceReadError(SharedDataError, OSError):
    """A source file is corrupt, truncated or unreadable."""


class MissingDependencyError(SharedDataError, ImportError):
    """An optional dependency (an extra) is not installed."""


class SharedMemoryFullError(SharedDataError, MemoryError):
    """There is not enough shared memory for an allocation (raised before loading)."""


class AttachError(SharedDataError, OSError):
    """A process could not map a shared segment created by another process."""


class DuplicationError(SharedDataError, AssertionError):
    """:func:`shareddata.verify` measured the dataset held more often than allowed.

    Attributes:
        report: the :class:`shareddata.MemoryReport` that failed.
    """

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


def missing_dependency(package: str, extra: str, cause: BaseException | None = None) -> None:
    """Raise :class:`MissingDependencyError` naming the extra that installs ``package``."""
    raise MissingDependencyError(
        f"{package} is required for this source but is not installed. "
        f"Install it with: pip install 'shareddata[{extra}]'"
    ) from cause
