"""The data every topic reads, and every way of serving it (shareddata and its peers).

A *case* is one way of serving the same float32 rows to a DataLoader: shareddata
(default collate, without its collate shortcut, the ``IndexBatchSampler`` fast
path) and its peers (a numpy-array Dataset, ``TensorDataset``, ``share_memory_()``,
a lazy h5py Dataset, Hugging Face ``datasets``, tensordict). Peers come with
``pip install 'torch-shareddata[bench]'``; one not installed is reported, never dropped.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

import shareddata as sd

MIB = 1 << 20
CHUNK = 64 << 20
INSTALL_HINT = "pip install 'torch-shareddata[bench]'"
PEER_MODULES = ("h5py", "datasets", "tensordict")

# name: (peer module it needs, one line for the report)
CASES: dict[str, tuple[str | None, str]] = {
    "shareddata": (None, "`sd.NumpyDataset(path)`, default collate"),
    "shareddata, no shortcut": (
        None,
        "same, collated by stacking the samples (the collate path before the shortcut)",
    ),
    "shareddata fast path": (None, "`IndexBatchSampler` + `batch_size=None`"),
    "numpy array": (None, "a Dataset holding `np.load(path)`, one row per `__getitem__`"),
    "TensorDataset": (None, "`TensorDataset(torch.from_numpy(np.load(path)))`"),
    "share_memory_()": (None, "the same after `tensor.share_memory_()`"),
    "h5py lazy": ("h5py", "opens the HDF5 file in each worker, reads one row per item"),
    "HF datasets": ("datasets", "`Dataset.from_file(arrow).with_format('torch')` (memory map)"),
    "tensordict shared": ("tensordict", "`TensorDict(...).share_memory_()`, `collate_fn=identity`"),
    "tensordict memmap": (
        "tensordict",
        "`TensorDict(...).memmap_(prefix)` (MemoryMappedTensor on disk), `collate_fn=identity`",
    ),
}
PEERS = [c for c in CASES if not c.startswith("shareddata")]


def peer_status() -> dict[str, str]:
    """``{module: version}`` or ``{module: "not installed: ..."}`` for every optional peer."""
    status = {}
    for name in PEER_MODULES:
        try:
            status[name] = str(getattr(importlib.import_module(name), "__version__", "?"))
        except Exception as e:  # ImportError, or a broken install
            status[name] = f"not installed ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return status


def available(status: dict[str, str], case: str) -> bool:
    """Whether the peer module case ``case`` needs (if any) imported."""
    needs = CASES[case][0] if case in CASES else None
    return needs is None or not status.get(needs, "").startswith("not installed")


def missing_row(case: str, width: int) -> list[str]:
    """The table row of a case whose peer is not installed."""
    return [case, f"not installed: {INSTALL_HINT}", *[""] * (width - 2)]


# -- data files ---------------------------------------------------------------------------


@dataclass
class Files:
    """The same float32 rows as ``.npy`` and, where wanted, HDF5 / Arrow / Parquet."""

    npy: str
    rows: int
    row_floats: int
    work_dir: str  # where a case may write (tensordict's memmap, HF's cache)
    h5: str | None = None
    arrow: str | None = None
    parquet: str | None = None

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_floats * 4

    def remove(self) -> None:
        """Delete every file (the data of one topic is not the next one's)."""
        import shutil

        for path in (self.npy, self.h5, self.arrow, self.parquet):
            if path:
                os.unlink(path)
        shutil.rmtree(self.work_dir, ignore_errors=True)


def warm(path: str) -> None:
    """Read the whole file once so that it sits in the page cache."""
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def write_npy(path: str, nbytes: int, row_floats: int = 1024) -> int:
    """A float32 ``.npy`` of ~``nbytes`` written in chunks and fsynced; its rows."""
    rows = max(1, nbytes // (4 * row_floats))
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, row_floats))
    rng = np.random.default_rng(0)
    step = max(1, CHUNK // (4 * row_floats))
    for a in range(0, rows, step):
        out[a : a + step] = rng.random((min(rows, a + step) - a, row_floats), dtype=np.float32)
    out.flush()
    del out
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # no writeback may run during a measurement
    finally:
        os.close(fd)
    return rows


def write_files(
    tmp: str, tag: str, nbytes: int, row_bytes: int, formats: tuple[str, ...] = ()
) -> Files:
    """``nbytes`` of float32 rows as .npy, plus each of ``formats`` ("h5", "arrow", "parquet")."""
    row_floats = row_bytes // 4
    npy = os.path.join(tmp, f"{tag}.npy")
    rows = write_npy(npy, nbytes, row_floats)
    work = os.path.join(tmp, f"{tag}-work")
    os.makedirs(work, exist_ok=True)
    files = Files(npy, rows, row_floats, work)
    src = np.load(npy, mmap_mode="r")
    step = 16384
    blocks = (np.ascontiguousarray(src[a : a + step]) for a in range(0, rows, step))
    if "h5" in formats:
        import h5py

        files.h5 = os.path.join(tmp, f"{tag}.h5")
        with h5py.File(files.h5, "w") as f:
            d = f.create_dataset("data", shape=src.shape, dtype=np.float32)
            for a in range(0, rows, step):
                d[a : a + step] = src[a : a + step]
    if "arrow" in formats or "parquet" in formats:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("data", pa.list_(pa.float32(), row_floats))])
        batches = [
            pa.record_batch(
                [pa.FixedSizeListArray.from_arrays(pa.array(b.reshape(-1)), row_floats)],
                schema=schema,
            )
            for b in blocks
        ]
        if "arrow" in formats:
            files.arrow = os.path.join(tmp, f"{tag}.arrow")
            with pa.OSFile(files.arrow, "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
                for b in batches:
                    w.write_batch(b)
        if "parquet" in formats:
            files.parquet = os.path.join(tmp, f"{tag}.parquet")
            pq.write_table(
                pa.Table.from_batches(batches, schema), files.parquet, row_group_size=step
            )
        del batches
    del src
    for path in (files.npy, files.h5, files.arrow, files.parquet):
        if path:
            warm(path)
    return files


def peer_files(tmp: str, tag: str, nbytes: int, row_bytes: int, status: dict[str, str]) -> Files:
    """The files every installed peer reads (HDF5 for h5py, Arrow for HF datasets)."""
    wanted = (("h5", "h5py lazy"), ("arrow", "HF datasets"))
    formats = tuple(f for f, case in wanted if available(status, case))
    return write_files(tmp, tag, nbytes, row_bytes, formats)


# -- the cases ----------------------------------------------------------------------------


def identity(batch: Any) -> Any:
    """collate_fn for datasets whose ``__getitems__`` returns a whole batch (tensordict)."""
    return batch


def stack_collate(batch: Any) -> Any:
    """Default collate without shareddata's shortcut: ``list(batch)`` is stacked anew."""
    return default_collate(list(batch))


class NumpyArrayDataset(Dataset):
    """The usual Dataset: a numpy array attribute, one row per sample."""

    def __init__(self, path: str) -> None:
        self.data = np.load(path)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.data[i])


class LazyH5Dataset(Dataset):
    """The usual lazy HDF5 Dataset: each process opens the file on first use, reads per sample."""

    def __init__(self, path: str, key: str = "data") -> None:
        import h5py

        self.path, self.key, self._pid, self._data = path, key, -1, None
        with h5py.File(path, "r") as f:
            self.n = len(f[key])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._pid != os.getpid():  # a forked worker must not share the parent's handle
            import h5py

            self._data, self._pid = h5py.File(self.path, "r")[self.key], os.getpid()
        return torch.from_numpy(self._data[i])  # type: ignore[index]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_data": None}


def loader_kwargs(name: str, ds: Any, batch: int) -> dict[str, Any]:
    """The DataLoader arguments of case ``name`` for ``batch``-sized batches, shuffled."""
    if name == "shareddata fast path":
        return {"sampler": sd.IndexBatchSampler(ds, batch, shuffle=True), "batch_size": None}
    kw: dict[str, Any] = {"batch_size": batch, "shuffle": True}
    if name == "shareddata, no shortcut":
        kw["collate_fn"] = stack_collate
    elif name.startswith("tensordict"):
        kw["collate_fn"] = identity
    return kw


def build(name: str, files: Files) -> Any:
    """The dataset of case ``name`` over ``files`` (``limit``: a dataset of nothing)."""
    if name == "limit":  # nothing to pickle: what starting the workers costs
        return TensorDataset(torch.zeros(1024, 1))
    if name.startswith("shareddata"):
        return sd.NumpyDataset(files.npy, progress=False)
    if name == "numpy array":
        return NumpyArrayDataset(files.npy)
    if name in ("TensorDataset", "share_memory_()"):
        t = torch.from_numpy(np.load(files.npy))
        return TensorDataset(t.share_memory_() if name == "share_memory_()" else t)
    if name == "h5py lazy":
        assert files.h5 is not None
        return LazyH5Dataset(files.h5)
    if name == "HF datasets":
        import datasets

        assert files.arrow is not None
        datasets.disable_progress_bars()
        return datasets.Dataset.from_file(files.arrow).with_format("torch")
    if name.startswith("tensordict"):
        from tensordict import TensorDict

        data = torch.from_numpy(np.load(files.npy))
        td = TensorDict({"data": data}, batch_size=[len(data)])
        if name == "tensordict shared":
            return td.share_memory_()
        return td.memmap_(prefix=tempfile.mkdtemp(dir=files.work_dir))
    raise ValueError(f"unknown case {name!r}")


def batch_len(batch: Any) -> int:
    """Samples in a batch of any case (tensor, dict, list, TensorDict)."""
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)
