"""Every ```python block of the README and docs runs, so no example goes stale."""

import pathlib
import re
import subprocess
import sys

import pytest
from conftest import REPO

DOCS = [pathlib.Path(REPO, "README.md"), *sorted(pathlib.Path(REPO, "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_code_blocks_run(doc):
    blocks = BLOCK.findall(doc.read_text())
    if not blocks:
        pytest.skip(f"{doc.name} has no python blocks")
    code = "\n".join(blocks)  # blocks of one page build on each other
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, f"{doc.name}:\n{proc.stderr[-4000:]}"
