"""Every example runs, in a small mode."""

import subprocess
import sys

import pytest
from conftest import REPO

EXAMPLES = {
    "quickstart.py": ["--rows", "100000"],
    "wrap_existing.py": ["--items", "8192"],
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name):
    proc = subprocess.run(
        [sys.executable, f"examples/{name}", *EXAMPLES[name]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "dataset held" in proc.stdout
