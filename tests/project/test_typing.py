"""The package type-checks (mypy, config in pyproject.toml) and users' code sees its types."""

import pathlib
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

import shareddata.testing


def _mypy(*args: str) -> subprocess.CompletedProcess:
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.fail("mypy is not installed (it is in the dev extra): pip install -e '.[dev]'")
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args], cwd=REPO, capture_output=True, text=True
    )


def test_package_and_examples_type_check():
    proc = _mypy()  # files = shareddata, examples
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout


def test_users_see_the_public_types(tmp_path):
    """Typed, not Any: a wrong use of the public API is an error in the user's code."""
    user = tmp_path / "user_code.py"
    user.write_text(
        textwrap.dedent(
            """
            import numpy as np
            import torch
            from torch.utils.data import DataLoader

            import shareddata as sd
            from shareddata.testing import assert_shared

            ds = sd.NumpyDataset(np.zeros((4, 2), np.float32), output="tuple")
            rows: int = len(ds)
            report: sd.MemoryReport = sd.verify(DataLoader(ds), max_duplication=None)
            ratio: float = report.duplication
            pids: list[int] = [p.pid for p in report.processes]
            array = sd.SharedArray.empty(4, "int64")
            view: np.ndarray = array.numpy()
            tensor: torch.Tensor = array.torch()
            checked: sd.MemoryReport = assert_shared(DataLoader(ds))
            wrong: str = report.duplication  # line 18: the one error expected
            """
        )
    )
    proc = _mypy(str(user))  # the project's options: the cache of the test above serves
    errors = [line for line in proc.stdout.splitlines() if "user_code.py" in line]
    assert len(errors) == 1, proc.stdout
    assert "user_code.py:18:" in errors[0] and 'expression has type "float"' in errors[0]


def test_py_typed_is_shipped():
    assert pathlib.Path(REPO, "shareddata", "py.typed").is_file()
    pyproject = pathlib.Path(REPO, "pyproject.toml").read_text()
    assert 'shareddata = ["py.typed"]' in pyproject  # package data: in wheels too


def test_testing_api_is_pinned():
    assert sorted(shareddata.testing.__all__) == [
        "SharedMemoryCheck",
        "assert_shared",
        "shared_memory_check",
    ]
