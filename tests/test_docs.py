"""The README and every docs page: their ```python blocks run, and the site builds.

Conventions for the blocks of README.md and docs/**/*.md (stated in docs/index.md):

- The blocks of one page run in order, in one fresh interpreter, in an empty
  temporary directory, so a block can use what an earlier block of its page made.
- A block holding ``if __name__ == "__main__":`` is a complete program: it is written
  to a file and run on its own, as a user would run it (``spawn`` workers re-import
  it), with whatever files the page's other blocks wrote.
- A block right after the line ``<!-- not run: examples/NAME -->`` is not run here
  (it needs torchrun, say). Every line of it must then appear in that example, which
  tests/test_examples.py (or the test it names) runs.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import REPO

ROOT = pathlib.Path(REPO)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (examples/\S+) -->$")


def blocks(page: pathlib.Path) -> list[tuple[str, str | None]]:
    """``(code, example)`` per ```python block; ``example`` is set for not-run blocks."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            i = lines.index("```", start)  # the closing fence, unindented
            before = next((ln for ln in reversed(lines[: start - 1]) if ln.strip()), "")
            marker = NOT_RUN.match(before.strip())
            found.append(("\n".join(lines[start:i]) + "\n", marker and marker.group(1)))
        i += 1
    return found


def _run(args, cwd):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=cwd)


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", DOCS, ids=_name)
def test_code_blocks_run(page, tmp_path):
    found = blocks(page)
    if not found:
        pytest.skip(f"{_name(page)} has no python blocks")
    shared = [code for code, example in found if example is None and "__main__" not in code]
    if shared:
        proc = _run([sys.executable, "-c", "".join(shared)], tmp_path)
        assert proc.returncode == 0, f"{_name(page)}:\n{proc.stderr[-4000:]}"
    programs = [code for code, example in found if example is None and "__main__" in code]
    for n, code in enumerate(programs):
        script = tmp_path / f"program_{n}.py"
        script.write_text(code)
        proc = _run([sys.executable, script.name], tmp_path)
        assert proc.returncode == 0, f"{_name(page)}, program {n}:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("page", DOCS, ids=_name)
def test_blocks_not_run_here_are_in_a_tested_example(page):
    for code, example in blocks(page):
        if example is None:
            continue
        path = ROOT / example
        assert path.is_file(), f"{_name(page)} points to {example}, which does not exist"
        source = {line.strip() for line in path.read_text().splitlines()}
        missing = [ln for ln in code.splitlines() if ln.strip() and ln.strip() not in source]
        assert not missing, f"{_name(page)}: lines not in {example}: {missing}"


def test_readme_links_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (site / "api" / "index.html").read_text()
    for name in ("NumpyDataset", "SharedArray", "verify", "MemoryReport", "assert_shared"):
        assert f'id="shareddata.{name}"' in api or f'id="shareddata.testing.{name}"' in api, name
    assert 'class="gp">&gt;&gt;&gt; </span>' in api  # docstring examples render as code
    assert (site / "img" / "demo-memory.png").is_file()
    assert 'src="../img/demo-memory.png"' in (site / "quickstart" / "index.html").read_text()
