"""The README and every docs page: their ```python blocks run as pasted, and the site builds.

Conventions for the blocks of README.md and docs/**/*.md (stated in docs/index.md):

- Each block is a program of its own: it is saved to a file and run with
  ``python FILE`` in a fresh interpreter, as a user who pastes it would run it, so a
  block that starts ``spawn``/``forkserver`` workers without its
  ``if __name__ == "__main__":`` guard fails (the workers re-import the file).
- Each block runs twice, the two ways a reader runs it: on its own in an empty
  folder, and after the page's earlier blocks, in order, in one folder (so it may
  find files they wrote). A block is run once when the two ways are the same run:
  the first block of a page without fragments (its folder is empty either way), and
  a later one whose earlier blocks left nothing in the folder but their own
  ``block_N.py`` scripts (which no block imports).
- A block right after the line ``<!-- continue -->`` needs the blocks before it.
  Run only after them, it is appended to the program of the block before it (what
  that block defined, it may use); with ``<!-- continue; file: NAME.py -->`` it is a
  program of its own, saved as ``NAME.py``, that needs their files (``train.py``).
  The page says so where a reader sees it: the paragraph right before such a block
  says it continues (``Continuing the example above:``).
- A block right after ``<!-- file: NAME.py -->`` is saved as ``NAME.py``, so a later
  block can import it (``from train import make_loader``) or a command can name it.
- A block right after ``<!-- not run: examples/NAME -->`` is not run here (it needs
  torchrun, say). Every line of it must then appear in that example, which
  tests/project/test_examples.py runs.
- No line of a code block is longer than :data:`WIDTH` characters (the site shows
  longer ones behind a scrollbar), except in what a program printed: ```text
  blocks and the command transcripts of docs/cli.md (tests/test_cli.py compares
  those with what the commands print).
"""

from __future__ import annotations

import dataclasses
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
    r"^<!-- (not run: (?P<example>examples/\S+)|(?P<continue>continue)(; )?"
    r"|)(file: (?P<file>\S+\.py))? -->$"
)
# what the paragraph before a continuing block says, for a reader of the page
SAYS_IT_CONTINUES = re.compile(r"\bcontinu(?:es|ing)\b", re.I)
# a program that starts worker processes (DataLoader workers, a Pool, a Process)
STARTS_WORKERS = re.compile(r"num_workers\s*=\s*[1-9]|\bPool\(|\bProcess\(")
GUARD = 'if __name__ == "__main__":'
WIDTH = 78
TRANSCRIPT = re.compile(r"^<!-- transcript: [\w-]+ -->$")  # docs/cli.md, tests/test_cli.py


@dataclass
class Block:
    """One fenced code block of a page."""

    line: int  # of its fence, 1-based
    lang: str
    code: str
    marker: re.Match[str] | None
    before: str  # the paragraph right before it (its marker line left out)
    preceding: str  # the line right before its fence


@dataclass
class Program:
    """One script: a block and the ``<!-- continue -->`` fragments that follow it."""

    page: pathlib.Path
    line: int  # of its first block's fence, 1-based
    code: str
    file: str
    alone: bool  # it runs on its own too (it does not continue the blocks before it)
    fragments: int = 0

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def all_blocks(page: pathlib.Path) -> list[Block]:
    """Every fenced block of ``page`` (fences at the start of a line)."""
    found, lines, i, end = [], page.read_text().splitlines(), 0, 0
    while i < len(lines):
        if lines[i].startswith("```") and len(lines[i]) > 3:
            start = i + 1
            i = lines.index("```", start)  # the closing fence, unindented
            prose = lines[end : start - 1]  # since the block before
            end = i + 1
            preceding = prose[-1].strip() if prose else ""
            marker = MARKER.match(preceding)
            if marker:
                prose = prose[:-1]
            text = "\n".join(prose).rstrip()
            before = text[text.rfind("\n\n") + 2 :] if "\n\n" in text else text
            code = "\n".join(lines[start:i]) + "\n"
            lang = lines[start - 1][3:].strip()
            found.append(Block(start, lang, code, marker, before, preceding))
        i += 1
    return found


def blocks(page: pathlib.Path) -> list[Block]:
    """The ```python blocks of ``page``."""
    return [b for b in all_blocks(page) if b.lang == "python"]


def not_run(page: pathlib.Path) -> list[tuple[str, str]]:
    """``(code, example)`` of the blocks that an example runs instead."""
    return [(b.code, b.marker["example"]) for b in blocks(page) if b.marker and b.marker["example"]]


def continuing(page: pathlib.Path) -> list[Block]:
    """The blocks of ``page`` that need the blocks before them."""
    return [b for b in blocks(page) if b.marker and b.marker["continue"]]


def programs(page: pathlib.Path) -> list[Program]:
    """The programs of ``page``, in order; a fragment joins the page's program before it."""
    found: list[Program] = []
    for block in blocks(page):
        marker = block.marker
        if marker and marker["example"]:
            continue
        name = marker["file"] if marker and marker["file"] else f"block_{block.line}.py"
        if marker and marker["continue"] and not marker["file"]:
            if not found:
                raise ValueError(f"{page}:{block.line}: <!-- continue --> with no block before")
            found[-1].code += "\n" + block.code
            found[-1].fragments += 1
        else:
            alone = not (marker and marker["continue"])
            found.append(Program(page, block.line, block.code, name, alone))
    return found


def alone(page: pathlib.Path) -> list[Program]:
    """Each program that runs on its own too, as its first block alone.

    The first program of a page without fragments is left out: its run after the
    page's earlier blocks (none) is the same run, in an empty folder.
    """
    found = programs(page)
    return [
        dataclasses.replace(p, code=next(b.code for b in blocks(page) if b.line == p.line))
        for i, p in enumerate(found)
        if p.alone and (i > 0 or p.fragments)
    ]


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


def _failure(program: Program, folder: pathlib.Path, how: str) -> str | None:
    """Why ``program`` fails when run in ``folder`` (``how``: which way), or None."""
    starts = STARTS_WORKERS.search(program.code)
    if starts and GUARD not in program.code:
        return (
            f"{program.where} starts worker processes ({starts.group()}) without "
            f"`{GUARD}`: pasted into a file and run, spawn/forkserver workers fail"
        )
    proc = run_program(program, folder)
    if proc.returncode != 0:
        return f"{program.where} ({program.file}, {how}):\n{proc.stderr[-3000:]}"
    return None


PAGES_THAT_RUN = [page for page in DOCS if programs(page)]
PAGES_WITH_ALONE = [page for page in DOCS if alone(page)]


RAN_AS_IF_ALONE: dict[pathlib.Path, set[int]] = {}
"""Per page, the programs (by line) that passed after the page's earlier blocks in a
folder holding only those blocks' ``block_N.py`` scripts: that was their run alone
too, so test_code_blocks_run_alone_in_an_empty_folder does not repeat it."""


@pytest.mark.parametrize("page", PAGES_THAT_RUN, ids=_name)
def test_code_blocks_run_after_the_pages_earlier_blocks(page, tmp_path):
    how = "after the page's earlier blocks"
    failed, scripts, as_if_alone = [], set(), set()
    for program in programs(page):
        inert = {f.name for f in tmp_path.iterdir()} <= scripts
        failure = _failure(program, tmp_path, how)
        if failure:
            failed.append(failure)
        elif inert and program.alone and not program.fragments:
            as_if_alone.add(program.line)
        if re.fullmatch(r"block_\d+\.py", program.file):
            scripts.add(program.file)
    RAN_AS_IF_ALONE[page] = as_if_alone
    assert not failed, "\n\n".join(failed)


@pytest.mark.parametrize("page", PAGES_WITH_ALONE, ids=_name)
def test_code_blocks_run_alone_in_an_empty_folder(page, tmp_path):
    failed = []
    for program in alone(page):
        if program.line in RAN_AS_IF_ALONE.get(page, ()):
            continue  # it ran in a folder with nothing of the earlier blocks: the same run
        folder = tmp_path / program.file.removesuffix(".py")
        folder.mkdir()
        failed.append(_failure(program, folder, "alone, in an empty folder"))
    failed = [f for f in failed if f]
    assert not failed, "\n\n".join(failed) + (
        "\n\nMake such a block stand alone (its imports, the files it reads), or say "
        "before it that it continues the example above (<!-- continue -->)."
    )


@pytest.mark.parametrize("page", DOCS, ids=_name)
def test_a_block_that_continues_says_so_on_the_page(page):
    for block in continuing(page):
        assert SAYS_IT_CONTINUES.search(block.before), (
            f"{_name(page)}:{block.line} continues the blocks before it (<!-- continue -->), "
            "but the paragraph right before it does not say so (a reader sees no marker): "
            f"start it with 'Continuing the example above:'. It says: {block.before[-200:]!r}"
        )


@pytest.mark.parametrize("page", DOCS, ids=_name)
def test_code_lines_fit_the_page(page):
    long = [
        f"{_name(page)}:{block.line + 1 + i}: {len(line)} characters"
        for block in all_blocks(page)
        # what a program printed (a transcript is compared with it by test_cli.py)
        if block.lang != "text" and not TRANSCRIPT.match(block.preceding)
        for i, line in enumerate(block.code.splitlines())
        if len(line) > WIDTH
    ]
    assert not long, f"code lines over {WIDTH} characters (wrap them):\n" + "\n".join(long)


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
        "```python\nx = 1\n```\n\nContinuing the example above:\n\n<!-- continue -->\n"
        "```python\ny = x + 1\n```\n\n"
        "<!-- not run: examples/quickstart.py -->\n```python\nz\n```\n\n"
        "<!-- file: train.py -->\n```python\nimport sys\n```\n\n"
        "Next to it:\n\n<!-- continue; file: check.py -->\n```python\nimport train\n```\n"
    )
    found = programs(page)
    assert [(p.code, p.file, p.alone, p.fragments) for p in found] == [
        ("x = 1\n\ny = x + 1\n", "block_1.py", True, 1),
        ("import sys\n", "train.py", True, 0),
        ("import train\n", "check.py", False, 0),
    ]
    # alone: the first block without its fragment, and train.py; never check.py
    assert [(p.code, p.file) for p in alone(page)] == [
        ("x = 1\n", "block_1.py"),
        ("import sys\n", "train.py"),
    ]
    saying = [SAYS_IT_CONTINUES.search(b.before) is not None for b in continuing(page)]
    assert saying == [True, False]  # "Next to it:" does not say that it needs the blocks above


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
