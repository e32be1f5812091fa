"""Which datasets of an HDF5 file become columns: ``keys`` resolved, or the default selection.

The default selection (``keys=None``) takes every dataset and pandas frame whose
rows equal the longest ones, leaving out scalars, PyTables' and pandas' own
index arrays, and (with a warning) datasets whose type cannot be stored. Keys
name datasets, fields of compound datasets, pandas frames or their columns.
"""

from __future__ import annotations

import reprlib
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import (
    ArgumentTypeError,
    EmptySelectionError,
    InvalidArgumentError,
    MissingColumnError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._hdf5_layout import Plan, frame_plans, is_bookkeeping, is_frame, plans_of

__all__ = ["Selection"]

_LISTED = 20  # how many dataset names an error message lists


def _listing(names: Sequence[str], frames: Sequence[str] = ()) -> str:
    if not names:
        return "no datasets"
    shown = ", ".join(
        repr(n) + (" (a pandas frame)" if n in frames else "") for n in names[:_LISTED]
    )
    more = len(names) - _LISTED
    return shown + (f" and {more} more" if more > 0 else "")


class Selection:
    """The plans of an open HDF5 file's columns.

    Args:
        h5py: the module.
        file: the open ``h5py.File``.
        label: its path, for messages.

    Attributes:
        skipped: after :meth:`auto`, datasets and frame columns of the longest
            length left out because their type cannot be stored (name: reason).
    """

    def __init__(self, h5py: Any, file: Any, label: str) -> None:
        self._h5py = h5py
        self._file = file
        self.label = label
        self.skipped: dict[str, str] = {}

    def _dataset_names(self, group: Any = None) -> list[str]:
        """Paths of every dataset under ``group`` (default: the file), in visit order."""
        group = self._file if group is None else group
        prefix = group.name.strip("/")
        names: list[str] = []

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, self._h5py.Dataset):
                names.append(f"{prefix}/{name}" if prefix else name)

        try:
            group.visititems(visit)
        except (OSError, RuntimeError, KeyError) as error:
            raise SourceReadError(
                f"{self.label}: the file's group structure cannot be read ({error}); the file "
                "is corrupt. Re-create or re-download it."
            ) from error
        return names

    def _get(self, name: str) -> Any:
        try:
            return self._file.get(name)
        except (KeyError, ValueError, TypeError):  # a path through a dataset, a bad name
            return None

    def _choices(self) -> str:
        """What a key may name: data datasets and pandas frames (no bookkeeping)."""
        frames: list[str] = []
        names = self._names_and_frames(frames)
        return _listing(names, frames)

    def corrupt_metadata(self, name: str, error: BaseException) -> SourceReadError:
        return SourceReadError(
            f"{self.label}: the metadata of dataset {name!r} cannot be read ({error}); the "
            "file is corrupt. Re-create or re-download it."
        )

    def _refuse(self, column: str, what: str, fix: str) -> UnsupportedDtypeError:
        return UnsupportedDtypeError(
            f"{column!r} of {self.label} {what}; shareddata cannot store it. Fix: {fix}."
        )

    def auto(self) -> list[Plan]:
        """Every storable dataset and pandas frame of the longest length (see HDF5Dataset)."""
        units: list[tuple[int, list[Plan]]] = []
        skipped: list[tuple[str, int, str]] = []
        frames: list[str] = []
        for name in self._names_and_frames(frames):
            obj = self._file[name]
            if name in frames:
                frame_skips: dict[str, str] = {}
                plans = frame_plans(self._h5py, obj, self._refuse, frame_skips)
                length = plans[0].rows if plans else self._frame_rows(obj)
                skipped += [(c, length, why) for c, why in frame_skips.items()]
                if plans:
                    units.append((length, plans))
                continue
            try:
                shape = obj.shape
            except (OSError, RuntimeError, ValueError, TypeError, KeyError) as error:
                raise self.corrupt_metadata(name, error) from error
            if not shape:  # a scalar (()) or an empty dataspace (None)
                continue
            try:
                units.append((shape[0], plans_of(self._h5py, obj, name, self._refuse)))
            except UnsupportedDtypeError as error:
                skipped.append((name, shape[0], str(error)))
            except (OSError, RuntimeError, KeyError) as error:
                raise self.corrupt_metadata(name, error) from error
        if not units:
            if skipped:
                raise UnsupportedDtypeError(
                    f"{self.label} holds no dataset shareddata can store: "
                    + " ".join(why for _, _, why in skipped)
                )
            raise MissingColumnError(
                f"{self.label} holds no dataset with rows (only scalars, empty datasets "
                "or groups); shareddata loads datasets whose first dimension is the row."
            )
        longest = max(length for length, _ in units)
        left_out = [(name, why) for name, length, why in skipped if length == longest]
        self.skipped = dict(left_out)
        if left_out:
            warnings.warn(
                f"{self.label}: left out {len(left_out)} dataset(s) of {longest} rows whose "
                f"type cannot be stored: {' '.join(why for _, why in left_out)}",
                UserWarning,
                stacklevel=4,
            )
        plans = [plan for length, made in units if length == longest for plan in made]
        return self._unique(plans)

    def _names_and_frames(self, frames: list[str]) -> list[str]:
        """Data datasets and pandas frames, in visit order; bookkeeping left out."""
        names: list[str] = []

        def visit(name: str, obj: Any) -> None:
            if any(name.startswith(frame + "/") for frame in frames):
                return  # a frame's own arrays: read through the frame
            if isinstance(obj, self._h5py.Group):
                if is_frame(obj):
                    frames.append(name)
                    names.append(name)
            elif isinstance(obj, self._h5py.Dataset) and not is_bookkeeping(name, obj):
                names.append(name)

        try:
            self._file.visititems(visit)
        except (OSError, RuntimeError, KeyError) as error:
            raise SourceReadError(
                f"{self.label}: the file's group structure cannot be read ({error}); the file "
                "is corrupt. Re-create or re-download it."
            ) from error
        return names

    @staticmethod
    def _frame_rows(group: Any) -> int:
        table = group.get("table") or group.get("axis1")
        return int(table.shape[0]) if table is not None and table.shape else 0

    def select(self, keys: str | Sequence[str]) -> list[Plan]:
        """Plans for ``keys``, in their order (a dataset or frame gives several)."""
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        elif not isinstance(keys, Iterable):
            raise ArgumentTypeError(
                f"keys={reprlib.repr(keys)} (type {type(keys).__name__}) for {self.label} is not "
                "a dataset path or a list of them; pass one of those, or keys=None for the "
                "default selection."
            )
        keys = list(keys)
        if not keys:
            raise EmptySelectionError(
                f"keys=[] selects no dataset of {self.label}; pass the datasets to load, or "
                f"keys=None for the default selection. Its datasets are: {self._choices()}."
            )
        plans: list[Plan] = []
        for key in keys:
            if isinstance(key, bytes):
                key = key.decode()
            if not isinstance(key, str):
                raise ArgumentTypeError(
                    f"keys must be dataset paths (str), got {type(key).__name__} {key!r}"
                )
            plans += self._key_plans(key)
        return self._unique(plans)

    def _key_plans(self, key: str) -> list[Plan]:
        name = key.strip("/")
        obj = self._get(name) if name else self._file
        h5py = self._h5py
        if isinstance(obj, h5py.Dataset):
            try:
                return plans_of(h5py, obj, name, self._refuse)
            except (OSError, RuntimeError, KeyError) as error:
                raise self.corrupt_metadata(name, error) from error
        if isinstance(obj, h5py.Group):
            if is_frame(obj):
                return frame_plans(h5py, obj, self._refuse, None)
            inside = self._dataset_names(obj)
            raise MissingColumnError(
                f"key {key!r} of {self.label} is a group, not a dataset; pass the datasets "
                f"you want from it (keys=[...]). It holds: {_listing(inside)}."
            )
        if obj is not None:
            raise MissingColumnError(
                f"key {key!r} of {self.label} is a {type(obj).__name__}, not a dataset; its "
                f"datasets are: {self._choices()}."
            )
        parts = name.split("/")
        for cut in range(len(parts) - 1, 0, -1):  # a field of a compound, a frame's column
            owner = self._get("/".join(parts[:cut]))
            rest = parts[cut:]
            if isinstance(owner, h5py.Dataset) and owner.dtype.names:
                dtype = owner.dtype
                for depth, part in enumerate(rest):
                    if dtype.names is None or part not in dtype.names:
                        where = "/".join(parts[: cut + depth])
                        raise MissingColumnError(
                            f"key {key!r} of {self.label}: {where!r} has no field {part!r}; "
                            f"its fields are: {_listing(list(dtype.names or ()))}."
                        )
                    dtype = dtype[part]
                return plans_of(h5py, owner, name, self._refuse, tuple(rest))
            if isinstance(owner, h5py.Group) and is_frame(owner):
                refused: dict[str, str] = {}
                columns = frame_plans(h5py, owner, self._refuse, refused)
                if "/".join(rest) in refused:
                    raise UnsupportedDtypeError(refused["/".join(rest)])
                found = [p for p in columns if p.name == "/".join(rest)]
                if not found:
                    raise MissingColumnError(
                        f"key {key!r} of {self.label}: the pandas frame {owner.name!r} has no "
                        f"column {'/'.join(rest)!r}; its columns are: "
                        f"{_listing([p.name for p in columns])}."
                    )
                for plan in found:
                    plan.name = name
                return found
            if owner is not None:
                break
        raise MissingColumnError(
            f"key {key!r} is not a dataset of {self.label}; its datasets are: {self._choices()}."
        )

    def _unique(self, plans: list[Plan]) -> list[Plan]:
        seen: dict[str, Plan] = {}
        for plan in plans:
            if plan.name in seen:
                first = seen[plan.name].path
                where = (
                    f"from {first!r} and {plan.path!r}"
                    if first != plan.path
                    else (f"twice from {first!r}: by its own key and by the dataset or frame key")
                )
                raise InvalidArgumentError(
                    f"column {plan.name!r} of {self.label} is selected twice ({where}); every "
                    "column needs its own name. Pass keys=[...] naming each column once."
                )
            seen[plan.name] = plan
        return plans
