"""Errors in the middle of things: a failing transform, a load that breaks halfway.

The error must reach the user, say what failed (the file, the worker's traceback),
and free everything at once, even while the exception is still held (a notebook
keeps the last one in ``sys.last_value``).
"""

from __future__ import annotations

import gc
import os
import zipfile

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from faultlib import run_scenario

import shareddata as sd
from shareddata import ArrowDataset, ParquetDataset


def _ours() -> tuple[int, int, int]:
    """(descriptors, mappings of our segments, all mappings) of this process."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shareddata"):
                fds += 1
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        lines = f.read().splitlines()
    return fds, sum("memfd:shareddata" in line for line in lines), len(lines)


def test_exception_in_transform_reaches_the_user_with_the_workers_traceback():
    run = run_scenario(
        """
        import numpy as np, shareddata as sd
        from torch.utils.data import DataLoader
        from faultjobs import check_label

        rows = 64 * 256
        ds = sd.NumpyDataset({"x": np.broadcast_to(np.float32(1), (rows, 1024)),
                              "i": np.arange(rows)}, transform=check_label)
        announce()
        loader = DataLoader(ds, batch_size=100, num_workers=2, multiprocessing_context="spawn")
        try:
            for batch in loader:
                pass
        except ValueError as e:
            print("@@ERROR", json.dumps(str(e)), flush=True)
        del loader
        gc.collect()
        print("@@HELD", memfd_count(), flush=True)
        del ds
        gc.collect()
        print("@@AFTER", memfd_count(), mapping_count(), flush=True)
        """
    )
    assert run.returncode == 0, run.describe()
    message = run.value("@@ERROR")
    assert "Caught ValueError in DataLoader worker process" in message
    assert "Original Traceback" in message and "in check_label" in message
    assert "sample 700 has a bad label" in message
    assert run.value("@@AFTER") == "0 0"
    run.assert_clean()


# -- a load that fails halfway, for each source format -----------------------------------


def _npy_folder(tmp_path, monkeypatch):
    from shareddata.sources import npy

    for name in "abc":
        np.save(tmp_path / f"{name}.npy", np.ones((1 << 18, 4), np.float32))
    real = npy._NpyFile.read

    def read(self, out, progress, *args):  # b.npy shrinks after its header was checked
        if self.name == "b":
            os.truncate(self.path, os.path.getsize(self.path) // 2)
        return real(self, out, progress, *args)

    monkeypatch.setattr(npy._NpyFile, "read", read)
    return lambda: sd.NumpyDataset(tmp_path), "b.npy"


def _npy_eio(tmp_path, monkeypatch):
    for name in "ab":
        np.save(tmp_path / f"{name}.npy", np.ones((1 << 18, 4), np.float32))
    real, calls = os.sendfile, []

    def sendfile(out_fd, in_fd, offset, count):  # the disk fails while b.npy is read
        calls.append(in_fd)
        if len(calls) > 1:
            raise OSError(5, "Input/output error")
        return real(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "sendfile", sendfile)
    return lambda: sd.NumpyDataset(tmp_path), "b.npy"


def _npz(tmp_path, monkeypatch):
    path = tmp_path / "d.npz"
    np.savez_compressed(path, a=np.ones((1 << 16, 4), np.float32), b=np.arange(1 << 18))
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("b.npy")
    raw = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    middle = start + info.compress_size // 2
    raw[middle : middle + 64] = bytes(64)  # zeroed compressed bytes: inflate or CRC fails
    path.write_bytes(bytes(raw))
    return lambda: sd.NumpyDataset(path), "d.npz"


def _hdf5(tmp_path, monkeypatch):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.ones((1 << 16, 4), np.float32)
        f.create_dataset("b", data=np.arange(1 << 18), chunks=(1 << 14,), compression="gzip")
    with h5py.File(path) as f:
        chunk = f["b"].id.get_chunk_info(8)
    raw = bytearray(path.read_bytes())
    raw[chunk.byte_offset + 20 : chunk.byte_offset + 84] = bytes(64)
    path.write_bytes(bytes(raw))
    return lambda: sd.HDF5Dataset(path), "d.h5"


def _parquet(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    table = pa.table({"a": np.arange(1 << 17), "s": [f"row {i}" for i in range(1 << 17)]})
    pq.write_table(table, path, row_group_size=1 << 15, compression="gzip")
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(2).column(0)
    raw = bytearray(path.read_bytes())
    middle = col.data_page_offset + col.total_compressed_size // 2
    raw[middle : middle + 64] = bytes(64)
    path.write_bytes(bytes(raw))
    return lambda: ParquetDataset(path), "d.parquet"


def _arrow(tmp_path, monkeypatch):
    from shareddata.sources import _arrow_columns

    table = pa.table({"a": np.arange(1 << 16), "s": [f"row {i}" for i in range(1 << 16)]})
    real, calls = _arrow_columns.Writer.write, []

    def write(self, arr, where):  # fails on the second column
        calls.append(1)
        if len(calls) > 1:
            raise MemoryError("simulated: Arrow could not allocate")
        return real(self, arr, where)

    monkeypatch.setattr(_arrow_columns.Writer, "write", write)
    return lambda: ArrowDataset(table), "simulated"


class _Flaky(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        if i == 2048:
            raise OSError(f"image {i} could not be decoded")
        return torch.ones(256), i, f"item {i}"


def _shared_dataset(tmp_path, monkeypatch):
    return lambda: sd.SharedDataset(_Flaky(), progress=False), "image 2048"


def _interrupt(tmp_path, monkeypatch):
    from shareddata.sources import npy

    for name in "ab":
        np.save(tmp_path / f"{name}.npy", np.ones((1 << 18, 4), np.float32))
    real = npy._NpyFile.read

    def read(self, out, progress, *args):  # Ctrl-C while b.npy is read
        if self.name == "b":
            raise KeyboardInterrupt
        return real(self, out, progress, *args)

    monkeypatch.setattr(npy._NpyFile, "read", read)
    return lambda: sd.NumpyDataset(tmp_path), None


HALFWAY = [
    pytest.param(_npy_folder, id="npy-folder-truncated-while-loading"),
    pytest.param(_npy_eio, id="npy-disk-io-error"),
    pytest.param(_npz, id="npz-corrupt-member"),
    pytest.param(_hdf5, id="hdf5-corrupt-chunk"),
    pytest.param(_parquet, id="parquet-corrupt-page"),
    pytest.param(_arrow, id="arrow-allocation-failure"),
    pytest.param(_shared_dataset, id="shared-dataset-item-error"),
    pytest.param(_interrupt, id="npy-ctrl-c"),
]


@pytest.mark.parametrize("make", HALFWAY)
def test_a_load_failing_halfway_names_the_file_and_frees_everything(make, tmp_path, monkeypatch):
    case = make.__name__
    load, named = make(tmp_path, monkeypatch)
    gc.collect()
    fds_before, maps_before, _ = _ours()
    all_fds = len(os.listdir("/proc/self/fd"))
    held = None
    try:
        load()
    except BaseException as error:  # noqa: BLE001  (KeyboardInterrupt included)
        held = error  # kept, with its traceback, as a notebook keeps sys.last_value
    assert held is not None, f"{case}: the load did not fail"
    if named is None:
        assert isinstance(held, KeyboardInterrupt)
    elif make is _arrow:
        assert isinstance(held, MemoryError)
    elif make is _shared_dataset:
        assert isinstance(held, OSError) and named in str(held)
        assert any("item 2048" in note for note in getattr(held, "__notes__", []))
    else:
        assert isinstance(held, sd.SharedDataError), f"{case}: {type(held).__name__}: {held}"
        assert named in str(held), f"{case}: the message does not name {named}: {held}"
    gc.collect()
    fds, maps, _ = _ours()
    assert (fds, maps) == (fds_before, maps_before), (
        f"{case}: the failed load still holds {fds - fds_before} segment descriptors and "
        f"{maps - maps_before} mappings while its exception is alive"
    )
    del held
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == all_fds
