"""The README and every docs page: their ```python blocks run as pasted, and the site builds.

Conventions for the blocks of README.md and docs/**/*.md (stated in docs/index.md):

- Each block is a program of its own: it is saved to a file and run with
  ``python FILE`` in a fresh interpreter, as a user who pastes it would run it, so a
  block that starts ``spawn``/``forkserver`` workers without its
  ``if __name__ == "__main__":`` guard fails (the workers re-import the file).
- A block right after the line ``<!-- continue -->`` is a fragment: it is appended to
  the program of the block before it (what that block defined, it may use).
- A block right after ``<!-- file: NAME.py -->`` is saved as ``NAME.py``, so a later
  block can import it (``from train import make_loader``) or a command can name it.
- The programs of one page run in order in one empty temporary directory, so a
  program can read the files an earlier one wrote (``data/x.npy``).
- A block right after ``<!-- not run: examples/NAME -->`` is not run here (it needs
  torchrun, say). Every line of it must then appear in that example, which
  tests/project/test_examples.py runs.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
from conftest import REPO

ROOT = pathlib.Path(REPO)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(
    r"^<!-- (not run: (?P<example>examples/\S+)|continue|file: (?P<file>\S+\.py)) -->$"
)
# a program that starts worker processes (DataLoader workers, a Pool, a Process)
STARTS_WORKERS = re.compile(r"num_workers\s*=\s*[1-9]|\bPool\(|\bProcess\(")
GUARD = 'if __name__ == "__main__":'


@dataclass
class Program:
    """One script: a block and the ``<!-- continue -->`` fragments that follow it."""

    page: pathlib.Path
    line: int  # of its first block's fence, 1-based
    code: str
    file: str

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def blocks(page: pathlib.Path) -> list[tuple[int, str, re.Match[str] | None]]:
    """``(line, code, marker)`` for each ```python block of ``page``."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            i = lines.index("```", start)  # the closing fence, unindented
            before = next((ln for ln in reversed(lines[: start - 1]) if ln.strip()), "")
            found.append((start, "\n".join(lines[start:i]) + "\n", MARKER.match(before.strip())))
        i += 1
    return found


def not_run(page: pathlib.Path) -> list[tuple[str, str]]:
    """``(code, example)`` of the blocks that an example runs instead."""
    return [
        (code, marker["example"])
        for _, code, marker in blocks(page)
        if marker and marker["example"]
    ]


def programs(page: pathlib.Path) -> list[Program]:
    """The programs of ``page``, in order; a fragment joins the page's program before it."""
    found: list[Program] = []
    for line, code, marker in blocks(page):
        if marker and marker["example"]:
            continue
        if marker and marker[1] == "continue":
            if not found:
                raise ValueError(f"{page}:{line}: <!-- continue --> with no program before it")
            found[-1].code += "\n" + code
        else:
            name = marker["file"] if marker and marker["file"] else f"block_{line}.py"
            found.append(Program(page, line, code, name))
    return found


def run_program(program: Program, folder: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """Save ``program`` in ``folder`` and run it there in a fresh interpreter."""
    (folder / program.file).write_text(program.code)
    return subprocess.run(
        [sys.executable, program.file],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


PAGES_THAT_RUN = [page for page in DOCS if programs(page)]


@pytest.mark.parametrize("page", PAGES_THAT_RUN, ids=_name)
def test_code_blocks_run_as_pasted(page, tmp_path):
    for program in programs(page):
        starts = STARTS_WORKERS.search(program.code)
        assert not starts or GUARD in program.code, (
            f"{program.where} starts worker processes ({starts and starts.group()}) without "
            f"`{GUARD}`: pasted into a file and run, spawn/forkserver workers fail"
        )
        proc = run_program(program, tmp_path)
        assert proc.returncode == 0, f"{program.where} ({program.file}):\n{proc.stderr[-4000:]}"


def test_an_unguarded_spawn_example_fails(tmp_path):
    """The reason for running each block from a file: a missing guard is caught."""
    page = tmp_path / "page.md"
    page.write_text(
        textwrap.dedent(
            """\
            ```python
            import torch
            from torch.utils.data import DataLoader

            loader = DataLoader(torch.arange(8), num_workers=1, multiprocessing_context="spawn")
            print(sum(int(b.sum()) for b in loader))
            ```
            """
        )
    )
    (program,) = programs(page)
    assert STARTS_WORKERS.search(program.code) and GUARD not in program.code  # the static check
    proc = run_program(program, tmp_path)  # and the run itself
    assert proc.returncode != 0
    assert "bootstrapping phase" in proc.stderr  # multiprocessing's error in the worker
    # (the guarded form runs: README.md's and quickstart.md's spawn programs above)


def test_fragments_join_the_block_they_continue(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- continue -->\n```python\ny = x + 1\n```\n\n"
        "<!-- not run: examples/quickstart.py -->\n```python\nz\n```\n\n"
        "<!-- file: train.py -->\n```python\nimport sys\n```\n"
    )
    found = programs(page)
    assert [(p.code, p.file) for p in found] == [
        ("x = 1\n\ny = x + 1\n", "block_1.py"),
        ("import sys\n", "train.py"),
    ]


@pytest.mark.parametrize("page", DOCS, ids=_name)
def test_blocks_not_run_here_are_in_a_tested_example(page):
    for code, example in not_run(page):
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
    assert (site / "internals" / "index.html").is_file()  # in the nav: code comments link it
