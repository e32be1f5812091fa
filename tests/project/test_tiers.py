"""The quick tier (``pytest --quick``, tests/conftest.py) selects what it says it does.

Its lists name files and tests: a renamed test must not silently fall into (or out of)
the tier, and the tier must keep the contract over every dataset kind.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import subprocess
import sys

import conftest
from conftest import REPO
from kinds import KINDS

TESTS = os.path.join(REPO, "tests")


def _quick_files() -> list[str]:
    return [
        rel
        for rel in sorted(
            os.path.relpath(p, TESTS) for p in glob.glob(f"{TESTS}/**/test_*.py", recursive=True)
        )
        if any(fnmatch.fnmatch(rel, pattern) for pattern in conftest.QUICK_FILES)
    ]


def _defined(files: list[str]) -> set[str]:
    names = set()
    for rel in files:
        with open(os.path.join(TESTS, rel)) as f:
            names.update(re.findall(r"^def (test_\w+)\(", f.read(), re.MULTILINE))
    return names


def test_every_name_in_the_tier_lists_is_a_test_of_a_quick_file():
    files = _quick_files()
    for pattern in conftest.QUICK_FILES:
        assert any(fnmatch.fnmatch(rel, pattern) for rel in files), f"{pattern}: no such file"
    defined = _defined(files)
    stale = [n for n in conftest.QUICK_SKIP if n.split("[")[0] not in defined]
    for rel, names in conftest.QUICK_ONLY.items():
        stale += sorted(set(names) - _defined([rel]))
    assert not stale, f"tests/conftest.py names tests that no quick file defines: {stale}"


def test_the_quick_tier_is_the_contract_over_every_kind_with_fork_workers():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--quick", "tests", "--collect-only", "-q"]
        + ["-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert ids and all(i.split("::")[0][len("tests/") :] in _quick_files() for i in ids)
    params = [re.split(r"[-\[\]]", i.partition("[")[2]) for i in ids]
    assert not [i for i, p in zip(ids, params) if {"spawn", "forkserver"} & set(p)]
    for kind in KINDS:  # the contract, for every kind
        assert f"tests/test_contract.py::test_pickles_as_a_handle[{kind}]" in ids, kind
    assert "tests/test_contract.py::test_workers_index_one_copy[fork]" in ids
    assert not [i for i in ids if any(n in i for n in conftest.QUICK_SKIP)]
    assert {i for i in ids if i.startswith("tests/project/")} == {
        "tests/project/test_quality.py::test_ruff_check",
        "tests/project/test_quality.py::test_ruff_format",
    }
