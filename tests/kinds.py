"""The six dataset kinds, built over the same rows, for tests that must hold for every kind.

Every kind serves rows with the columns ``x`` (float32, shape (4,)) and ``y`` (int64
scalar); kinds that store text add ``t`` (str), and with ``ragged=True`` kinds that store
variable-length numbers add ``r`` (1-D int32 of length ``i % 4``; the default collate
cannot stack it, so it is off by default). Row ``i`` has
``x = [i, i + .25, i + .5, i + .75]``, ``y = 3 * i - 7``, ``t = f"row {i}"``.

    ds, expected = make("parquet", tmp_path, rows=64)
    assert_item(ds[5], expected[5])

The datasets are real: ``.npy`` files, an HDF5 file written by h5py, a Parquet file
written by pyarrow, a ``pyarrow.Table``, a user ``Dataset`` wrapped by
``sd.SharedDataset`` and a list of dicts in ``sd.SharedList``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import shareddata as sd

KINDS = ["numpy", "hdf5", "parquet", "arrow", "shared_dataset", "shared_list"]
"""Every dataset kind of the library."""

FILE_KINDS = ["numpy", "hdf5", "parquet"]
"""Kinds read from files on disk."""

COLUMN_KINDS = ["numpy", "hdf5", "parquet", "arrow"]
"""Kinds whose constructor takes ``output=`` ("dict" / "tuple")."""


def columns_of(kind: str, ragged: bool = False) -> list[str]:
    """The columns a kind's rows carry, in order."""
    if kind == "numpy":
        return ["x", "y"]
    return ["x", "y", "t", "r"] if ragged else ["x", "y", "t"]


def row(i: int, kind: str = "parquet", ragged: bool = False) -> dict[str, Any]:
    """Row ``i`` as plain values: numpy arrays, ints and strs."""
    values: dict[str, Any] = {
        "x": np.arange(4, dtype=np.float32) / 4 + i,
        "y": 3 * i - 7,
        "t": f"row {i}",
        "r": np.arange(i % 4, dtype=np.int32) + i,
    }
    return {c: values[c] for c in columns_of(kind, ragged)}


def _arrays(rows: int) -> dict[str, np.ndarray]:
    x = np.arange(4, dtype=np.float32)[None, :] / 4 + np.arange(rows, dtype=np.float32)[:, None]
    y = 3 * np.arange(rows, dtype=np.int64) - 7
    return {"x": x, "y": y}


class UserDataset(torch.utils.data.Dataset):
    """What a user's own Dataset looks like: dict items of tensors, ints, strs."""

    def __init__(self, rows: int, ragged: bool = False) -> None:
        self.rows = rows
        self.ragged = ragged

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.rows:
            raise IndexError(i)
        r = row(i, ragged=self.ragged)
        item = {"x": torch.from_numpy(r["x"]), "y": int(r["y"]), "t": r["t"]}
        if self.ragged:
            item["r"] = torch.from_numpy(r["r"])
        return item


def _table(rows: int, ragged: bool) -> Any:
    import pyarrow as pa

    a = _arrays(rows)
    columns = {
        "x": pa.FixedSizeListArray.from_arrays(pa.array(a["x"].reshape(-1)), 4),
        "y": pa.array(a["y"]),
        "t": pa.array([f"row {i}" for i in range(rows)]),
    }
    if ragged:
        rs = [row(i, ragged=True)["r"].tolist() for i in range(rows)]
        columns["r"] = pa.array(rs, pa.list_(pa.int32()))
    return pa.table(columns)


def _write_hdf5(file: str, rows: int, expected: list[dict[str, Any]], ragged: bool) -> None:
    import h5py

    with h5py.File(file, "w") as f:
        for name, array in _arrays(rows).items():
            f[name] = array
        f.create_dataset("t", data=[f"row {i}" for i in range(rows)], dtype=h5py.string_dtype())
        if ragged:
            vlen = f.create_dataset("r", (rows,), dtype=h5py.vlen_dtype(np.int32))
            for i in range(rows):
                vlen[i] = expected[i]["r"]


def make(
    kind: str,
    tmp_path: str | os.PathLike[str],
    rows: int = 64,
    *,
    ragged: bool = False,
    reuse: bool = False,
    **kwargs: Any,
) -> tuple[Any, list[dict[str, Any]]]:
    """A dataset of ``kind`` over ``rows`` rows, and the expected row values.

    Args:
        kind: one of :data:`KINDS`.
        tmp_path: a directory for the kind's files.
        rows: number of rows.
        ragged: add the variable-length column ``r`` (not to ``numpy``).
        reuse: open the kind's files in ``tmp_path`` if they exist instead of writing
            them (several processes building the same dataset).
        **kwargs: passed to the dataset's constructor (``share=``, ``storage_dir=``,
            ``output=`` for :data:`COLUMN_KINDS`, ...).

    Returns:
        ``(dataset, expected)``: ``expected[i]`` is :func:`row` ``(i, kind)``.
    """
    expected = [row(i, kind, ragged) for i in range(rows)]
    path = os.fspath(tmp_path)
    os.makedirs(path, exist_ok=True)
    if kind == "numpy":
        folder = os.path.join(path, "npy")
        if not (reuse and os.path.isdir(folder)):
            os.makedirs(folder, exist_ok=True)
            for name, array in _arrays(rows).items():
                np.save(os.path.join(folder, f"{name}.npy"), array)
        ds = sd.NumpyDataset(folder, **kwargs)
    elif kind == "hdf5":
        file = os.path.join(path, "data.h5")
        if not (reuse and os.path.exists(file)):
            _write_hdf5(file, rows, expected, ragged)
        ds = sd.HDF5Dataset(file, columns_of(kind, ragged), **kwargs)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        file = os.path.join(path, "data.parquet")
        if not (reuse and os.path.exists(file)):
            pq.write_table(_table(rows, ragged), file, row_group_size=max(1, rows // 3))
        ds = sd.ParquetDataset(file, **kwargs)
    elif kind == "arrow":
        ds = sd.ArrowDataset(_table(rows, ragged), **kwargs)
    elif kind == "shared_dataset":
        ds = sd.SharedDataset(UserDataset(rows, ragged), **kwargs)
    elif kind == "shared_list":
        user = UserDataset(rows, ragged)
        ds = sd.SharedList([user[i] for i in range(rows)], **kwargs)
    else:
        raise ValueError(f"unknown kind {kind!r}; kinds are {KINDS}")
    return ds, expected


def as_dict(item: Any, kind: str, ragged: bool = False) -> dict[str, Any]:
    """A row as a dict, whether the dataset gave a dict or a tuple in column order."""
    if isinstance(item, Mapping):
        return dict(item)
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
        return dict(zip(columns_of(kind, ragged), item))
    raise AssertionError(f"a row should be a dict or a tuple, got {type(item).__name__}")


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, str) or isinstance(got, str):
        return got == want
    if isinstance(want, bytes) or isinstance(got, bytes):
        return bytes(got) == bytes(want)
    g = got if isinstance(got, torch.Tensor) else torch.as_tensor(np.asarray(got))
    w = torch.as_tensor(np.asarray(want))
    return tuple(g.shape) == tuple(w.shape) and bool((g.to(w.dtype) == w).all())


def assert_item(got: Any, want: Mapping[str, Any], kind: str = "parquet") -> None:
    """``got`` (a dict or tuple row) holds exactly the values of ``want``."""
    got = as_dict(got, kind, "r" in want)
    assert list(got) == list(want), f"columns {list(got)} != {list(want)}"
    for name, value in want.items():
        assert _same(got[name], value), f"column {name!r}: {got[name]!r} != {value!r}"


def assert_batch(batch: Any, want: Sequence[Mapping[str, Any]], kind: str = "parquet") -> None:
    """A default-collated batch (dict of columns, or list of columns) equals rows ``want``."""
    if isinstance(batch, Mapping):
        columns = dict(batch)
    else:
        columns = dict(zip(columns_of(kind, "r" in want[0]), batch))
    for name in want[0]:
        got = columns[name]
        for k, w in enumerate(want):
            assert _same(got[k], w[name]), f"row {k} column {name!r}: {got[k]!r} != {w[name]!r}"


class AllKinds(torch.utils.data.Dataset):
    """Row ``i`` of every dataset given, as ``{kind: row}``: one loader checks every kind.

    ``__getitems__`` fetches each kind's batch the way the DataLoader would (its own
    ``__getitems__`` where it has one), so both access paths run in the workers.
    """

    def __init__(self, datasets: Mapping[str, Any]) -> None:
        self.datasets = dict(datasets)
        self.rows = min(len(ds) for ds in self.datasets.values())

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {kind: ds[i] for kind, ds in self.datasets.items()}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        per_kind = {}
        for kind, ds in self.datasets.items():
            getitems = getattr(ds, "__getitems__", None)
            per_kind[kind] = getitems(indices) if getitems else [ds[i] for i in indices]
        return [{kind: per_kind[kind][k] for kind in self.datasets} for k in range(len(indices))]


def to_plain(obj: Any) -> Any:
    """``obj`` with every tensor/array turned into nested lists (crosses as plain data)."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return obj.tolist()
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return (
            type(obj)(to_plain(v) for v in obj)
            if isinstance(obj, tuple)
            else [to_plain(v) for v in obj]
        )
    return obj


# -- nested items: records and groups -------------------------------------------------------

NESTED_KINDS = ["hdf5", "parquet", "arrow"]
"""Kinds whose constructor takes ``nested=`` (records/structs and HDF5 groups nest)."""


def nested_row(i: int) -> dict[str, Any]:
    """Row ``i`` of :func:`make_nested`'s datasets as a nested item of plain values."""
    r = row(i)
    return {"meta": {"t": r["t"]}, "rec": {"x": r["x"], "y": r["y"]}}


def make_nested(
    kind: str, tmp_path: str | os.PathLike[str], rows: int = 64, **kwargs: Any
) -> tuple[Any, list[dict[str, Any]]]:
    """A dataset of ``kind`` (:data:`NESTED_KINDS`) whose columns are record fields.

    ``t`` is ``meta/t`` (an HDF5 dataset in group ``meta``, the field of an Arrow
    struct ``meta``); ``x`` and ``y`` are fields of a record ``rec`` (an HDF5 compound
    dataset, an Arrow struct). Columns in that order (HDF5's visit order is by name);
    with ``nested=True`` items are :func:`nested_row`.
    """
    path = os.fspath(tmp_path)
    os.makedirs(path, exist_ok=True)
    expected = [nested_row(i) for i in range(rows)]
    a = _arrays(rows)
    text = [f"row {i}" for i in range(rows)]
    if kind == "hdf5":
        import h5py

        file = os.path.join(path, "records.h5")
        records = np.zeros(rows, dtype=[("x", np.float32, (4,)), ("y", np.int64)])
        records["x"], records["y"] = a["x"], a["y"]
        with h5py.File(file, "w") as f:
            f["rec"] = records
            f.create_dataset("meta/t", data=text, dtype=h5py.string_dtype())
        return sd.HDF5Dataset(file, **kwargs), expected
    import pyarrow as pa

    x = pa.FixedSizeListArray.from_arrays(pa.array(a["x"].reshape(-1)), 4)
    table = pa.table(
        {
            "meta": pa.StructArray.from_arrays([pa.array(text)], ["t"]),
            "rec": pa.StructArray.from_arrays([x, pa.array(a["y"])], ["x", "y"]),
        }
    )
    if kind == "arrow":
        return sd.ArrowDataset(table, **kwargs), expected
    if kind == "parquet":
        import pyarrow.parquet as pq

        file = os.path.join(path, "records.parquet")
        pq.write_table(table, file, row_group_size=max(1, rows // 3))
        return sd.ParquetDataset(file, **kwargs), expected
    raise ValueError(f"no nested dataset of kind {kind!r}; kinds are {NESTED_KINDS}")


def assert_nested(got: Any, want: Any, where: str = "item") -> None:
    """``got`` has exactly the nested structure of ``want`` (dicts, then leaves) and its values."""
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{where}: {got!r} is not a dict"
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key, value in want.items():
            assert_nested(got[key], value, f"{where}[{key!r}]")
    elif isinstance(want, list):
        assert len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for k, (g, w) in enumerate(zip(got, want)):
            assert_nested(g, w, f"{where}[{k}]")
    else:
        assert _same(got, want), f"{where}: {got!r} != {want!r}"


def collated(rows: Sequence[Any]) -> Any:
    """What the default collate gives for nested items of plain values (lists of strs)."""
    first = rows[0]
    if isinstance(first, Mapping):
        return {k: collated([r[k] for r in rows]) for k in first}
    if isinstance(first, str):
        return list(rows)
    return np.stack([np.asarray(r) for r in rows])
