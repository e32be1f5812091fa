"""``HDF5Dataset``: the datasets of an HDF5 file (h5py, PyTables, pandas, AnnData, netCDF-4)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..sources.hdf5 import HDF5Source
from ._dataset import ColumnDataset, Output
from ._load import LoadOptions

__all__ = ["HDF5Dataset"]

PathLike = str | os.PathLike


class HDF5Dataset(ColumnDataset):
    """Datasets of an HDF5 file as columns, loaded once into shared memory.

    Each HDF5 dataset is a column; its first dimension is the row. Numeric datasets
    (contiguous or chunked, compressed with gzip, lzf, szip or, when ``hdf5plugin``
    is installed, its filters) give tensors in the file's dtype (native byte order);
    strings give ``str`` (``bytes`` for fixed-length ascii); variable-length numeric
    datasets give 1-D tensors of varying length. The file is closed once loaded:
    workers index shared memory only.

    Records: a compound dataset (PyTables tables, h5py structured arrays) gives one
    column per field, named ``dataset/field`` (``dataset/a/b`` for a nested one),
    array fields keeping their shape. A pandas store (``DataFrame.to_hdf``, either
    format) gives the frame's columns under their pandas names (a named index
    first); categories load as integer codes, dates as int64 in their unit. Enums
    load as their integer codes; :attr:`labels` maps each such column's labels to
    codes. External links are followed (their targets named by the link's path).

    Scientific files load as their users mean them. An AnnData ``.h5ad`` loads as
    cells: ``X`` then every ``obs`` column (categoricals as codes with labels; obs is
    read by anndata, the ``anndata`` extra, X straight into shared memory). A
    group encoding a sparse matrix (anndata's CSR/CSC, 10x ``matrix``, h5sparse),
    in any file, is ONE column of per-row values, kept compressed in shared memory;
    its rows are the file's rows. A netCDF-4 file loads its variables along one
    dimension (e.g. ``time``), decoded by the CF conventions as xarray does
    (packing, fill values to NaN, times as int64 ns since 1970 placed by cftime, the
    ``netcdf`` extra; times with no datetime64[ns] keep their numbers, with a warning
    naming them), other coordinates in :attr:`coords`. A plain HDF5 dataset with
    ``scale_factor``/``add_offset`` loads its codes, with a warning naming it.
    docs/tutorials/single-cell.md and climate-netcdf.md show both.

    Args:
        path: the HDF5 file.
        columns: what to load, in sample order: dataset paths (``"images"``,
            ``"grp/labels"``; a leading ``/`` is accepted), a field of a compound
            (``"table/x"``), a pandas frame's key (``"df"``) or one of its columns
            (``"df/price"``); a column is named by the path as given. ``None``:
            every dataset and pandas frame of the file whose rows equal the longest
            ones, in visit order. The default selection leaves out scalars, shorter
            datasets, PyTables' and pandas' own index arrays, and, with a warning,
            datasets whose type cannot be stored (times, quad floats, references);
            ``columns`` naming such a dataset raises instead.
        keys: the old name of ``columns`` (a ``FutureWarning``).
        transform: applied to each sample in the worker, after indexing.
        output: ``"dict"`` (``{key: value}``) or ``"tuple"`` (in key order).
        storage_dir: ``None`` keeps the data in RAM; a directory puts it in an
            anonymous file there, mapped shared (for a small RAM or memory limit).
        progress: show a progress bar for loads longer than ~2 s.
        share: under torchrun, ``"node"`` (the default there) loads once per node
            and the other local ranks attach; ``"process"`` loads in every process.
        shard: ``"node"`` loads only this node's contiguous share of the rows.
        timeout: seconds to wait for another local rank (default
            ``$SHAREDDATA_TIMEOUT``, else 300).
        nested: items give each column at its path, split at ``/`` (``{"points":
            {"x": ..., "c": ...}}`` for a compound's fields, ``{"meta": {"label":
            ...}}`` for a group's datasets, as h5py reaches them) instead of under its
            flat name (``{"points/x": ...}``, the default); batches are nested the
            same way. With ``output="tuple"``, the top-level values in order.
        sparse: a sparse matrix's row comes back as a dense tensor (``"dense"``,
            what the default collate stacks) or a 1-D ``torch.sparse_coo`` tensor
            (``"coo"``; a batch is one 2-D sparse COO tensor).
        decode_cf: for a netCDF file, decode the CF conventions (default); False
            keeps every variable's stored values (codes).

    Attributes:
        labels: for enum and category columns, ``{column: {label: code}}``.
        coords: a netCDF file's variables that do not run along the rows (decoded
            tensors, lists of str); ``{}`` otherwise.
        attrs: a netCDF file's attributes per column and coordinate, as xarray's
            ``.attrs`` (a decoded time says ``nanoseconds since 1970-01-01``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        KeyError: a key is not a dataset of the file (the message lists those that are).
        ValueError: the datasets have different lengths; ``columns=[]``.
        TypeError: a selected dataset's type cannot be stored (references, times).
        OSError: the file cannot be read: locked by a writer, not permitted, truncated
            or corrupt (``SourceReadError``, naming the cause and the fix).
        ImportError: h5py, or a compression filter, is not installed.
        MemoryError: not enough shared memory (``SharedMemoryFullError``), before loading.

    Example:
        >>> import os, tempfile, h5py, numpy as np
        >>> from shareddata import HDF5Dataset
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = os.path.join(tmp.name, "tiny.h5")
        >>> with h5py.File(path, "w") as f:
        ...     f["images"] = np.ones((4, 2, 2), np.float32)
        ...     f["meta/label"] = np.arange(4, dtype=np.int32)
        ...     f["meta/name"] = np.array(["a", "b", "c", "d"], dtype=h5py.string_dtype())
        >>> ds = HDF5Dataset(path)
        >>> len(ds), ds.columns
        (4, ['images', 'meta/label', 'meta/name'])
        >>> sample = ds[-1]
        >>> sample["images"].shape, sample["meta/label"], sample["meta/name"]
        (torch.Size([2, 2]), tensor(3, dtype=torch.int32), 'd')
        >>> HDF5Dataset(path, ["/meta/name"], output="tuple")[0]
        ('a',)

        A compound (record) dataset and an enum:

        >>> color = h5py.enum_dtype({"red": 0, "green": 1}, basetype="i1")
        >>> rec = np.array([(1.5, 0), (2.5, 1)], dtype=[("x", "f4"), ("c", color)])
        >>> with h5py.File(path, "w") as f:
        ...     f["points"] = rec
        >>> ds = HDF5Dataset(path)
        >>> ds.columns, ds[1]["points/c"], ds.labels["points/c"]["green"]
        (['points/x', 'points/c'], tensor(1, dtype=torch.int8), 1)
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        path: PathLike,
        columns: str | Sequence[str] | None = None,
        *,
        keys: str | Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        output: Output = "dict",
        storage_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
        share: Literal["node", "process"] | None = None,
        shard: Literal["node"] | None = None,
        timeout: float | None = None,
        nested: bool = False,
        sparse: Literal["dense", "coo"] = "dense",
        decode_cf: bool = True,
    ) -> None:
        if not isinstance(decode_cf, bool):
            raise ArgumentTypeError(f"decode_cf must be True or False, got {decode_cf!r}")
        if keys is not None:
            if columns is not None:
                raise InvalidArgumentError(
                    f"HDF5Dataset({os.fspath(path)!r}) got both columns= and keys=; pass "
                    "columns= alone (keys= is its old name)."
                )
            warnings.warn(
                "HDF5Dataset(keys=...) is now HDF5Dataset(columns=...), the name every "
                "dataset class uses; keys= still works for now.",
                FutureWarning,
                stacklevel=2,
            )
            columns = keys
        source = HDF5Source(path, columns, sparse, decode_cf)
        self.labels = {p.name: dict(p.labels) for p in source.plans if p.labels is not None}
        self.coords = {n: _coord(v) for n, v in source.coords.items()}
        self.attrs = source.attrs
        try:
            options = LoadOptions(storage_dir, progress, share, shard, timeout)
            # what ranks must agree on: the file and the columns, in order, and the options
            names = [p.name for p in source.plans]
            key = ("HDF5Dataset", source.label, names, sparse, decode_cf)
            super().__init__(
                options.loader(source, key),
                transform=transform,
                output=output,
                nested=nested,
                paths={p.name: tuple(p.name.split("/")) for p in source.plans},
            )
        except BaseException:  # refused before the loader owns the file (close is idempotent)
            source.close()
            raise

    def __getstate__(self) -> dict[str, Any]:
        extra = {"labels": self.labels, "coords": self.coords, "attrs": self.attrs}
        return {**super().__getstate__(), **extra}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.labels = state.pop("labels", {})
        self.coords = state.pop("coords", {})
        self.attrs = state.pop("attrs", {})
        super().__setstate__(state)


def _coord(values: Any) -> Any:
    """A coordinate as a tensor (a list of str stays a list)."""
    return (
        torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else values
    )
