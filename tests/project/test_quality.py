import shutil
import subprocess
import sys

import pytest
from conftest import REPO

import shareddata as sd


def _ruff():
    exe = shutil.which("ruff", path=str(__import__("pathlib").Path(sys.executable).parent))
    if exe is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    return exe


def test_ruff_check():
    proc = subprocess.run([_ruff(), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format():
    proc = subprocess.run(
        [_ruff(), "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_public_api_is_pinned():
    assert sorted(sd.__all__) == [
        "ArgumentTypeError",
        "ArrowDataset",
        "AttachError",
        "BatchSendError",
        "ColumnLengthError",
        "DuplicationError",
        "EmptySelectionError",
        "HDF5Dataset",
        "InconclusiveError",
        "IndexBatchSampler",
        "IndexOutOfRangeError",
        "IndexTypeError",
        "InvalidArgumentError",
        "ItemMismatchError",
        "ItemValueError",
        "LocalRankError",
        "LocalRankTimeoutError",
        "MemoryReport",
        "MissingColumnError",
        "MissingDependencyError",
        "MissingFileError",
        "NodeShardSampler",
        "NullValuesError",
        "NumpyDataset",
        "ParquetDataset",
        "ProcessMemory",
        "ShardingNotSupportedError",
        "SharedArray",
        "SharedDataError",
        "SharedDataset",
        "SharedList",
        "SharedMemoryFullError",
        "SharedTensor",
        "SourceReadError",
        "TooManyOpenFilesError",
        "UnpicklableItemError",
        "UnsupportedDtypeError",
        "__version__",
        "verify",
    ]
    for name in sd.__all__:
        assert hasattr(sd, name), name


def test_every_error_is_a_shareddata_error_and_a_builtin():
    builtins = {
        sd.MissingFileError: FileNotFoundError,
        sd.MissingColumnError: KeyError,
        sd.ColumnLengthError: ValueError,
        sd.NullValuesError: ValueError,
        sd.UnsupportedDtypeError: TypeError,
        sd.SourceReadError: OSError,
        sd.MissingDependencyError: ImportError,
        sd.SharedMemoryFullError: MemoryError,
        sd.AttachError: OSError,
        sd.TooManyOpenFilesError: OSError,
    }
    for cls, builtin in builtins.items():
        assert issubclass(cls, sd.SharedDataError) and issubclass(cls, builtin)


def test_every_note_cited_with_a_file_is_in_that_file():
    # "Note [Title] in ``path``" sends a reader to a file: the file exists and holds it.
    import re
    from pathlib import Path

    package = Path(REPO) / "shareddata"
    cite = re.compile(r"Note \[([^\]]+)\] in (?:``)?([\w/]+(?:\.py)?)")
    wrong = []
    for path in sorted(package.rglob("*.py")):
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())
        for title, where in cite.findall(text):
            name = where if where.endswith(".py") else where + ".py"
            candidates = [path.parent / name, package / name, path.parent / where / "__init__.py"]
            found = [c for c in candidates if c.is_file()]
            if not found or not any(f"Note [{title}]" in c.read_text() for c in found):
                wrong.append(f"{path.relative_to(package)}: Note [{title}] in {where}")
    assert not wrong, "\n".join(wrong)
