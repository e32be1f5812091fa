"""Which datasets of an HDF5 file become columns: ``keys`` resolved, or the default selection."""

from __future__ import annotations

import os
import reprlib
import warnings
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

from ..errors import (
    ArgumentTypeError,
    EmptySelectionError,
    InvalidArgumentError,
    MissingColumnError,
    MissingFileError,
    SharedDataError,
    SourceReadError,
    UnsupportedDtypeError,
)
from ._hdf5_cf import Netcdf, is_netcdf
from ._hdf5_encoded import Encoded, is_anndata, sparse_layout
from ._hdf5_layout import Plan, gather, is_bookkeeping, plans_of
from ._hdf5_pandas import frame_plans, is_frame

__all__ = ["Selection"]

_LISTED = 20  # how many dataset names an error message lists
_SPARSE_PARTS = {"data", "indices", "indptr", "shape"}


def _corrupt(label: str, error: BaseException) -> SourceReadError:
    return SourceReadError(
        f"{label}: the file's group structure cannot be read ({error}); the file is "
        "corrupt. Re-create or re-download it."
    )


def _listing(names: Sequence[str] | dict[str, str]) -> str:
    """Up to ``_LISTED`` names (a :meth:`Selection.walk`'s frames marked as such)."""
    if not names:
        return "no datasets"
    kinds = names if isinstance(names, dict) else {}
    names = list(names)
    shown = ", ".join(
        repr(n) + (" (a pandas frame)" if kinds.get(n) == "frame" else "") for n in names[:_LISTED]
    )
    more = len(names) - _LISTED
    return shown + (f" and {more} more" if more > 0 else "")


class Selection:
    """The plans of an open HDF5 file's columns (``skipped``: what :meth:`auto` left out)."""

    def __init__(
        self, h5py: Any, file: Any, label: str, sparse: str = "dense", decode_cf: bool = True
    ) -> None:
        self._h5py = h5py
        self._file = file
        self.label = label
        self.skipped: dict[str, str] = {}
        self.encoded = Encoded(h5py, label, self._refuse, sparse)
        try:
            self.netcdf = Netcdf(h5py, file, decode_cf, label) if is_netcdf(file) else None
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
            raise _corrupt(label, error) from error
        self.coords: list[str] = []  # netCDF variables not along the rows

    def _along_rows(self, plans: list[Plan]) -> list[Plan]:
        """netCDF: the plans along the rows, decoded; the rest become coordinates."""
        if self.netcdf is None:
            return plans
        plans, self.coords = self.netcdf.split(plans)
        return plans

    def _external(self, name: str) -> Any:
        """The object an external link ``name`` points to; an error naming the link if none."""
        link = self._file.get(name, getlink=True)
        try:
            return self._file[name]
        except (KeyError, OSError) as error:
            folder = os.path.dirname(os.path.abspath(self.label))
            target = os.path.join(folder, link.filename)
            where = f"{link.filename}:{link.path}"
            if not os.path.exists(target):
                raise MissingFileError(
                    f"{self.label}: {name!r} is an external link to {where}, and that file "
                    f"does not exist (HDF5 looks for it next to the linking file: {target}). "
                    f"Fix: put {link.filename!r} there, or pass columns=[...] without {name!r}."
                ) from error
            raise MissingColumnError(
                f"{self.label}: {name!r} is an external link to {where}, which cannot be "
                f"opened ({error}). Fix: check that {link.path!r} exists in {target}, or "
                f"pass columns=[...] without {name!r}."
            ) from error

    def _get(self, name: str) -> Any:
        try:
            return self._file.get(name)
        except (KeyError, ValueError, TypeError):  # a path through a dataset, a bad name
            return None

    def _choices(self) -> str:
        """What a key may name: data datasets and pandas frames (no bookkeeping)."""
        return _listing(self._walk())

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
        """Every storable dataset and frame of the longest length (sparse matrices' first)."""
        if self.netcdf is not None:
            return self._netcdf_auto(self.netcdf)
        if is_anndata(self._file):
            found: dict[str, str] = {}
            plans = self.encoded.anndata(self._file, found)
            self._left_out(list(found.items()), plans[0].rows if plans else 0)
            if plans:
                return self._unique(plans)
        units: list[tuple[int, list[Plan]]] = []
        skipped: list[tuple[str, int, str]] = []
        for name, kind in self._walk().items():
            obj = self._file[name]
            if kind == "dataset" and not obj.shape:  # a scalar (()) or an empty dataspace
                continue
            skips: dict[str, str] = {}
            plans = self._plans(obj, name, skips)
            length = plans[0].rows if plans else self._rows(obj, kind)
            skipped += [(c, length, why) for c, why in skips.items()]
            if plans:
                units.append((length, plans))
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
        sparse = [length for length, made in units if any(p.kind == "sparse" for p in made)]
        longest = max(sparse or [length for length, _ in units])
        self._left_out([(n, why) for n, length, why in skipped if length in (longest, -1)], longest)
        plans = [plan for length, made in units if length == longest for plan in made]
        return self._unique(plans)

    def _netcdf_auto(self, netcdf: Netcdf) -> list[Plan]:
        """Every storable variable along the rows' dimension."""
        plans: list[Plan] = []
        skipped: dict[str, str] = {}
        for name in netcdf.default_names():
            plans += self._plans(self._file[name], name, skipped)
        if not plans:
            raise MissingColumnError(
                f"{self.label} (netCDF) holds no variable with a dimension shareddata can "
                f"store{': ' + ' '.join(skipped.values()) if skipped else ''}."
            )
        self._left_out(list(skipped.items()), plans[0].rows)
        return self._along_rows(self._unique(plans))

    def _left_out(self, left_out: list[tuple[str, str]], rows: int) -> None:
        """Record and warn about columns of ``rows`` rows that the default selection left out."""
        self.skipped = dict(left_out)
        if left_out:
            warnings.warn(
                f"{self.label}: left out {len(left_out)} dataset(s) of {rows} rows whose "
                f"type or values cannot be stored: {' '.join(why for _, why in left_out)}",
                UserWarning,
                stacklevel=5,
            )

    def _walk(self) -> dict[str, str]:
        """Data datasets, pandas frames and encoded groups in visit order: name -> kind.

        The kind is ``"dataset"``, ``"frame"`` or ``"element"``. External links are
        followed (named by the link's path); soft links are not.
        """
        found: dict[str, str] = {}
        units: list[str] = []  # frames and elements: their own arrays are read through them
        matrices: set[str] = set()  # sparse groups: their other members are datasets

        def visit(name: str, obj: Any) -> None:
            for unit in units:
                inside = name.startswith(unit + "/")
                if inside and (unit not in matrices or name[len(unit) + 1 :] in _SPARSE_PARTS):
                    return
            if isinstance(obj, self._h5py.Group):
                if is_frame(obj) or self.encoded.is_unit(obj):
                    found[name] = "frame" if is_frame(obj) else "element"
                    units.append(name)
                    if sparse_layout(self._h5py, obj) is not None:
                        matrices.add(name)
            elif isinstance(obj, self._h5py.Dataset) and not is_bookkeeping(name, obj):
                found[name] = "dataset"

        def visit_link(name: str, link: Any) -> None:
            if not isinstance(link, self._h5py.ExternalLink):
                return
            try:
                target = self._external(name)
            except (MissingFileError, MissingColumnError) as error:
                warnings.warn(f"left out: {error}", UserWarning, stacklevel=6)
                return
            visit(name, target)
            if isinstance(target, self._h5py.Group) and name not in units:
                target.visititems(lambda inner, obj: visit(f"{name}/{inner}", obj))

        try:
            self._file.visititems(visit)
            self._file.visititems_links(visit_link)
        except (OSError, RuntimeError, KeyError) as error:
            raise _corrupt(self.label, error) from error
        return found

    @staticmethod
    def _rows(obj: Any, kind: str) -> int:
        """Rows of a dataset or frame whose columns were all left out (-1: an element's)."""
        if kind == "element":
            return -1
        if kind == "dataset":
            return int(obj.shape[0])
        table = obj.get("table") or obj.get("axis1")
        return int(table.shape[0]) if table is not None and table.shape else 0

    def _plans(self, obj: Any, name: str, skipped: dict[str, str] | None) -> list[Plan]:
        """A dataset's, frame's or encoded element's columns (unstorable ones to ``skipped``)."""
        if is_frame(obj):
            return frame_plans(self._h5py, obj, self._refuse, skipped)
        if self.encoded.is_element(obj):
            return self.encoded.plans(obj, name, skipped)
        make = partial(plans_of, self._h5py, obj, name, self._refuse, path=name)
        try:
            return gather(skipped, name, make)
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as error:
            if isinstance(error, SharedDataError):  # a refusal, raised for a key
                raise
            raise self.corrupt_metadata(name, error) from error

    def select(self, keys: str | Sequence[str]) -> list[Plan]:
        """Plans for ``keys``, in their order (a dataset or frame gives several)."""
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        elif not isinstance(keys, Iterable):
            raise ArgumentTypeError(
                f"columns={reprlib.repr(keys)} (type {type(keys).__name__}) for {self.label} "
                "is not a dataset path or a list of them; pass one of those, or columns=None "
                "for the default selection."
            )
        keys = list(keys)
        if not keys:
            raise EmptySelectionError(
                f"columns=[] selects no dataset of {self.label}; pass the datasets to load, or "
                f"columns=None for the default selection. Its datasets are: {self._choices()}."
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
        return self._along_rows(self._unique(plans))

    def _key_plans(self, key: str) -> list[Plan]:
        name = key.strip("/")
        obj = self._get(name) if name else self._file
        h5py = self._h5py
        if obj is None and name:
            self._broken_link(name)
        if isinstance(obj, h5py.Dataset):
            return self._plans(obj, name, None)
        if isinstance(obj, h5py.Group):
            if is_frame(obj) or self.encoded.is_element(obj):
                return self._plans(obj, name, None)
            prefix = f"{name}/" if name else ""
            inside = {n: kind for n, kind in self._walk().items() if n.startswith(prefix)}
            raise MissingColumnError(
                f"key {key!r} of {self.label} is a group, not a dataset; pass the datasets "
                f"you want from it (columns=[...]). It holds: {_listing(inside)}."
            )
        if obj is not None:
            raise MissingColumnError(
                f"key {key!r} of {self.label} is a {type(obj).__name__}, not a dataset; its "
                f"datasets are: {self._choices()}."
            )
        parts = name.split("/")
        for cut in range(len(parts) - 1, 0, -1):  # a field of a compound, a frame's column
            owner = self._get("/".join(parts[:cut]))
            rest, column = parts[cut:], "/".join(parts[cut:])
            if isinstance(owner, h5py.Dataset) and owner.dtype.names:
                dtype = owner.dtype
                for depth, part in enumerate(rest):
                    if part not in (dtype.names or ()):
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
                if column in refused:
                    raise UnsupportedDtypeError(refused[column])
                found = [p for p in columns if p.name == column]
                if not found:
                    raise MissingColumnError(
                        f"key {key!r} of {self.label}: the pandas frame {owner.name!r} has no "
                        f"column {column!r}; its columns are: "
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

    def _broken_link(self, name: str) -> None:
        """Raise the error of an external link on the way to ``name`` that cannot be followed."""
        parts = name.split("/")
        for cut in range(1, len(parts) + 1):
            prefix = "/".join(parts[:cut])
            try:
                link = self._file.get(prefix, getlink=True)
            except (KeyError, ValueError, TypeError, OSError):
                return
            if isinstance(link, self._h5py.ExternalLink):
                self._external(prefix)
            if link is None:
                return

    def _unique(self, plans: list[Plan]) -> list[Plan]:
        seen: dict[str, Plan] = {}
        for plan in plans:
            if plan.name in seen:
                first = seen[plan.name].path
                where = f"from {first!r} and {plan.path!r}"
                if first == plan.path:
                    where = f"twice from {first!r}: by its own key and by the dataset or frame key"
                raise InvalidArgumentError(
                    f"column {plan.name!r} of {self.label} is selected twice ({where}); every "
                    "column needs its own name. Pass columns=[...] naming each column once."
                )
            seen[plan.name] = plan
        return plans
