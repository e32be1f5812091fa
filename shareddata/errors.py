"""The exceptions shareddata raises: each a :class:`SharedDataError` and a builtin.

So an existing ``except FileNotFoundError:`` keeps working. Messages name the file,
column or key, the value seen, and the fix::

    SharedDataError (Exception)
    ├── MissingFileError        (+ FileNotFoundError)  a source path does not exist
    ├── MissingColumnError      (+ KeyError)           a key/column is not in the source
    ├── ColumnLengthError       (+ ValueError)         columns have different lengths
    ├── NullValuesError         (+ ValueError)         a column holds nulls, no fill given
    ├── EmptySelectionError     (+ ValueError)         columns=[]: nothing selected
    ├── UnsupportedDtypeError   (+ TypeError)          object / nested / compound data
    │   └── UnpicklableItemError                       an item that cannot be pickled
    ├── SourceReadError         (+ OSError)            corrupt or truncated file
    ├── MissingDependencyError  (+ ImportError)        an optional extra is not installed
    ├── SharedMemoryFullError   (+ MemoryError)        not enough room, raised before loading
    ├── AttachError             (+ OSError)            a process cannot map a segment
    ├── TooManyOpenFilesError   (+ OSError)            the descriptor limit (ulimit -n) is reached
    ├── DuplicationError        (+ AssertionError)     verify() found duplicated data
    ├── InconclusiveError       (+ AssertionError)     verify() cannot tell: below its resolution
    ├── InvalidArgumentError    (+ ValueError)         an argument's value is not allowed
    ├── ArgumentTypeError       (+ TypeError)          an argument has the wrong type
    ├── IndexOutOfRangeError    (+ IndexError)         an index beyond the rows
    ├── IndexTypeError          (+ TypeError)          an index that is not an integer
    ├── ItemMismatchError       (+ TypeError)          SharedDataset: item unlike item 0
    ├── ItemValueError          (+ ValueError)         SharedDataset: value its column cannot hold
    ├── ShardingNotSupportedError (+ NotImplementedError) shard="node" cannot apply
    ├── LocalRankError          (+ RuntimeError)       another local rank failed or differs
    │   └── LocalRankTimeoutError (+ TimeoutError)     waited too long for another rank
    └── BatchSendError          (+ RuntimeError)       a worker's batch cannot be pickled

``DuplicationError`` and ``InconclusiveError`` carry the measured
:class:`shareddata.MemoryReport` as ``.report``. An error raised on local rank 0
while it loads a node-shared dataset is raised again on the other local ranks with
the same class (looked up here by name); a class from elsewhere arrives as
:class:`LocalRankError` naming it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ArgumentTypeError",
    "AttachError",
    "BatchSendError",
    "ColumnLengthError",
    "DuplicationError",
    "EmptySelectionError",
    "InconclusiveError",
    "IndexOutOfRangeError",
    "IndexTypeError",
    "InvalidArgumentError",
    "ItemMismatchError",
    "ItemValueError",
    "LocalRankError",
    "LocalRankTimeoutError",
    "MissingColumnError",
    "MissingDependencyError",
    "MissingFileError",
    "NullValuesError",
    "ShardingNotSupportedError",
    "SharedDataError",
    "SharedMemoryFullError",
    "SourceReadError",
    "TooManyOpenFilesError",
    "UnpicklableItemError",
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
    """A selection (``columns=[]``, an empty mapping) names no data at all."""


class UnsupportedDtypeError(SharedDataError, TypeError):
    """A column's type cannot be stored in shared memory as it is."""


class UnpicklableItemError(UnsupportedDtypeError):
    """An item (``SharedList``) or a field kept pickled (``SharedDataset``) cannot be pickled."""


class SourceReadError(SharedDataError, OSError):
    """A source file is corrupt, truncated or unreadable."""


class MissingDependencyError(SharedDataError, ImportError):
    """An optional dependency (an extra) is not installed."""


class SharedMemoryFullError(SharedDataError, MemoryError):
    """There is not enough shared memory for an allocation (raised before loading)."""


class AttachError(SharedDataError, OSError):
    """A process could not map a shared segment created by another process."""


class TooManyOpenFilesError(SharedDataError, OSError):
    """The open-descriptor limit (``ulimit -n``) is reached; ``errno`` EMFILE or ENFILE."""


class DuplicationError(SharedDataError, AssertionError):
    """:func:`shareddata.verify` measured the dataset held more often than allowed."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class InconclusiveError(SharedDataError, AssertionError):
    """:func:`shareddata.verify` cannot tell (a copy would be within its resolution): no pass."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class InvalidArgumentError(SharedDataError, ValueError):
    """An argument's value is not one the function accepts (``output=``, ``share=``...)."""


class ArgumentTypeError(SharedDataError, TypeError):
    """An argument has a type the function does not accept (``transform=`` not callable...)."""


class IndexOutOfRangeError(SharedDataError, IndexError):
    """An index beyond the rows of a dataset or the items of a ``SharedList``."""


class IndexTypeError(SharedDataError, TypeError):
    """An index that is not an integer (a float, a boolean mask, a string)."""


class ItemMismatchError(SharedDataError, TypeError):
    """An item's structure or type differs from the first item's (``SharedDataset``)."""


class ItemValueError(SharedDataError, ValueError):
    """An item holds a value its column cannot store (an int beyond int64, invalid text)."""


class ShardingNotSupportedError(SharedDataError, NotImplementedError):
    """``shard="node"`` was asked of a source that cannot read a range of rows."""


class LocalRankError(SharedDataError, RuntimeError):
    """Another local rank of this node failed, exited, or built a different dataset."""


class LocalRankTimeoutError(LocalRankError, TimeoutError):
    """A local rank waited longer than the timeout (``SHAREDDATA_TIMEOUT``) for another."""


class BatchSendError(SharedDataError, RuntimeError):
    """A DataLoader worker's batch cannot be pickled: raised in the main process for it."""


def missing_dependency(package: str, extra: str, cause: BaseException | None = None) -> None:
    """Raise :class:`MissingDependencyError` naming the extra that installs ``package``."""
    raise MissingDependencyError(
        f"{package} is required for this source but is not installed. "
        f"Install it with: pip install 'torch-shareddata[{extra}]'"
    ) from cause
