"""Every example runs, in a small mode, and checks the memory it promises."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import REPO

# script -> arguments of its small mode (each loads >= 32 MiB, so that verify's
# 1.10 limit is meaningful next to the workers' few MiB of working memory)
EXAMPLES = {
    "quickstart.py": ["--rows", "100000"],
    "wrap_existing.py": ["--items", "4096"],
    "hdf5_images.py": ["--images", "4096"],
    "parquet_text.py": ["--rows", "60000"],
    "lightning_datamodule.py": ["--rows", "40000", "--epochs", "1", "--workers", "1"],
}
# examples run by other tests (they need more than one process to launch)
ELSEWHERE = {
    "ddp_train.py": "test_distributed.py",  # under real torchrun, 2 ranks, gloo
    "test_memory_check.py": "test_examples.py",  # under pytest, below
}


def _run(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_every_example_is_run_by_a_test():
    scripts = {p.name for p in pathlib.Path(REPO, "examples").glob("*.py")}
    assert scripts == set(EXAMPLES) | set(ELSEWHERE)
    for script, test_file in ELSEWHERE.items():
        assert f"{script}" in pathlib.Path(REPO, "tests", test_file).read_text()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name):
    if name == "lightning_datamodule.py" and importlib.util.find_spec("lightning") is None:
        pytest.fail("lightning is not installed (it is in the dev extra): pip install -e '.[dev]'")
    proc = _run(f"examples/{name}", *EXAMPLES[name])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "dataset held" in proc.stdout
    assert "(limit 1.10)" in proc.stdout  # checked, not only measured


def test_memory_check_example_under_pytest():
    proc = _run(
        "-m",
        "pytest",
        "-p",
        "shareddata.testing",
        "-p",
        "no:cacheprovider",
        "-rP",
        "examples/test_memory_check.py",
        env={**os.environ, "SHAREDDATA_EXAMPLE_ROWS": "65536"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout
    # the fixture put the measured table in the report
    assert "shareddata: memory of DataLoader 1" in proc.stdout
    assert "dataset held" in proc.stdout
