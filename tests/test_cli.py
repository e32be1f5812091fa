import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

FACTORIES = """
import numpy as np
import torch
import shareddata as sd
from torch.utils.data import DataLoader, Dataset

DATA = np.ones((16384, 1024), np.float32)  # 64 MiB


class Plain(Dataset):
    def __init__(self):
        self.data = DATA.copy()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return torch.from_numpy(self.data[i])


def shared():
    return DataLoader(sd.NumpyDataset(DATA), batch_size=256, num_workers=2,
                      multiprocessing_context="spawn")


def naive():
    return DataLoader(Plain(), batch_size=256, num_workers=2, multiprocessing_context="spawn")


def not_a_loader():
    return 42
"""


def _cli(*args, cwd=REPO, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "shareddata", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def test_info_npz(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.zeros((100, 3, 4), np.float32), y=np.arange(100))
    proc = _cli("info", str(tmp_path / "d.npz"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "100 rows, 2 columns" in out
    assert "float32 (3, 4)" in out and "int64 ()" in out
    assert f"({100 * 12 * 4 + 100 * 8} bytes)" in out
    assert "fits: yes" in out and "/dev/shm" in out


def test_info_missing_file(tmp_path):
    proc = _cli("info", str(tmp_path / "nope.npy"))
    assert proc.returncode == 2
    assert "nope.npy does not exist" in proc.stderr


@pytest.fixture
def factories(tmp_path):
    (tmp_path / "factories.py").write_text(FACTORIES)
    return tmp_path


def test_verify_gates_on_duplication(factories):
    ok = _cli("verify", "factories:shared", "--batches", "8", cwd=factories)
    assert ok.returncode == 0, ok.stderr
    assert "dataset held" in ok.stdout and "worker 1" in ok.stdout
    bad = _cli("verify", "factories:naive", "--batches", "8", "--json", cwd=factories)
    assert bad.returncode == 1, bad.stderr
    report = json.loads(bad.stdout)
    assert report["duplication"] > 2.5
    assert len(report["processes"]) >= 3


def test_verify_usage_errors(factories):
    proc = _cli("verify", "factories:not_a_loader", cwd=factories)
    assert proc.returncode != 0 and "DataLoader" in proc.stderr
    proc = _cli("verify", "factories", cwd=factories)
    assert proc.returncode != 0 and "MODULE:FUNCTION" in proc.stderr


def test_demo_small():
    proc = _cli("demo", "--size", "48MiB", "--workers", "2", "--batches", "20")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "naive numpy Dataset" in out and "shareddata.NumpyDataset" in out
    assert "2 spawn workers over 48.0 MiB" in out


def test_info_hdf5_and_parquet(tmp_path):
    import h5py
    import pyarrow as pa
    import pyarrow.parquet as pq

    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["grp/x"] = np.zeros((50, 4), np.float32)
        f["name"] = [f"n{i}" for i in range(50)]
    pq.write_table(
        pa.table({"a": list(range(30)), "s": [str(i) for i in range(30)]}), tmp_path / "d.parquet"
    )
    h5 = _cli("info", str(tmp_path / "d.h5"))
    assert h5.returncode == 0, h5.stderr
    assert "50 rows, 2 columns" in h5.stdout and "grp/x" in h5.stdout and "str" in h5.stdout
    table = _cli("info", str(tmp_path / "d.parquet"))
    assert table.returncode == 0, table.stderr
    assert "30 rows, 2 columns" in table.stdout and "fits: yes" in table.stdout
