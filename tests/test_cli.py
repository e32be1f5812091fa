"""The command line: docs/cli.md's transcripts, re-run; usage errors; --json; --help.

docs/cli.md shows real transcripts, each a ```console block after a
``<!-- transcript: NAME -->`` line whose first line is the command. The test makes the
page's example files (its ```python blocks), runs every command there, and compares
the output with the page after normalising what varies between runs and machines
(numbers, units, torch's worker-count warnings). ``SHAREDDATA_UPDATE_TRANSCRIPTS=1``
writes the fresh output into the page instead.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO

import shareddata as sd
from shareddata.cli import main

PAGE = pathlib.Path(REPO) / "docs" / "cli.md"
UPDATE = os.environ.get("SHAREDDATA_UPDATE_TRANSCRIPTS", "") not in ("", "0")
TRANSCRIPT = re.compile(
    r"^<!-- transcript: (?P<name>[\w-]+) -->\n```console\n(?P<body>.*?)^```$", re.M | re.S
)
PYTHON = re.compile(
    r"^(?:<!-- (?:continue; )?file: (?P<file>\S+) -->\n)?```python\n(?P<code>.*?)^```$",
    re.M | re.S,
)
# commands that run DataLoader workers: a fresh interpreter each (forkserver preloads)
IN_SUBPROCESS = ("demo", "verify-ok", "verify-fail")
SHM = "/dev/shm"


def normalise(text: str) -> str:
    """What must match: the words and layout, not the figures of one run."""
    lines = []
    for line in text.splitlines():
        if re.match(r"\s*warning \(", line):  # torch's worker-count warning: machine-dependent
            continue
        line = re.sub(r"-?\d+(?:[.,]\d+)*", "N", line)
        line = re.sub(r"N (?:B|KiB|MiB|GiB|TiB)\b", "N <size>", line)
        line = re.sub(r"\s+", " ", line).strip()
        if line:
            lines.append(line)
    return "\n".join(lines)


def _make_files(folder: pathlib.Path, shm: pathlib.Path) -> None:
    """The page's example files (its python blocks), and one dead process's leftover."""
    for match in PYTHON.finditer(PAGE.read_text()):
        if match["file"]:
            (folder / match["file"]).write_text(match["code"])
        else:
            exec(compile(match["code"], f"{PAGE}:python block", "exec"), {})
    shm.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = shm / f"torch_{dead.pid}_2961407238_17"
    leftover.write_bytes(bytes(1 << 20))
    old = time.time() - 3600
    os.utime(leftover, (old, old))


def _start(argv: list[str], folder: pathlib.Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "shareddata", *argv],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )


def _in_process(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def test_transcripts_in_the_docs_match_the_commands(tmp_path, monkeypatch):
    page = PAGE.read_text()
    transcripts = {m["name"]: m for m in TRANSCRIPT.finditer(page)}
    assert set(transcripts) >= {
        "demo",
        "info-h5",
        "verify-ok",
        "verify-fail",
        "verify-unsure",
        "clean",
    }
    monkeypatch.chdir(tmp_path)
    _make_files(tmp_path, tmp_path / "shm")
    commands = {}
    for name, match in transcripts.items():
        first = match["body"].splitlines()[0]
        assert first.startswith("$ python -m shareddata "), f"{name}: {first!r}"
        argv = shlex.split(first[len("$ python -m shareddata ") :])
        commands[name] = (first, [str(tmp_path / "shm") if a == SHM else a for a in argv])
    running = {  # the slow ones, side by side
        name: _start(argv, tmp_path)
        for name, (_, argv) in commands.items()
        if name in IN_SUBPROCESS
    }
    monkeypatch.setattr(sys, "path", list(sys.path))  # verify-typo imports train.py here
    try:
        results = {
            name: _in_process(argv) for name, (_, argv) in commands.items() if name not in running
        }
    finally:
        sys.modules.pop("train", None)
    for name, proc in running.items():
        out, _ = proc.communicate(timeout=300)
        results[name] = (proc.returncode, out)
    expected_codes = {"verify-fail": 1, "verify-typo": 2, "info-error": 2, "verify-unsure": 3}
    fresh = {}
    for name, (code, out) in results.items():
        assert code == expected_codes.get(name, 0), f"{name} exited {code}:\n{out}"
        fresh[name] = commands[name][0] + "\n" + out.replace(str(tmp_path / "shm"), SHM)
        fresh[name] = fresh[name].replace(str(tmp_path) + os.sep, "")
    if UPDATE:
        PAGE.write_text(
            TRANSCRIPT.sub(
                lambda m: (
                    f"<!-- transcript: {m['name']} -->\n```console\n"
                    f"{fresh[m['name']].rstrip()}\n```"
                ),
                page,
            )
        )
        transcripts = {m["name"]: m for m in TRANSCRIPT.finditer(PAGE.read_text())}
    for name, text in fresh.items():
        assert normalise(transcripts[name]["body"]) == normalise(text), (
            f"docs/cli.md's {name} transcript is stale; run SHAREDDATA_UPDATE_TRANSCRIPTS=1 "
            f"pytest tests/test_cli.py. This run printed:\n{text}"
        )
    # what the transcripts show, checked in words and numbers
    demo = results["demo"][1]
    assert "Memory saved" in " ".join(demo.split())
    held = [float(x) for x in re.findall(r"^dataset held\s+([\d.]+)x\s+([\d.]+)x", demo, re.M)[0]]
    assert held[0] > 2.5 and held[1] < 1.3, demo
    assert "OK: the dataset is held" in results["verify-ok"][1]
    assert "FAIL: the dataset is duplicated" in results["verify-fail"][1]
    unsure = results["verify-unsure"][1].strip().splitlines()[-1]
    assert (
        unsure.startswith("CANNOT TELL: 2.0 MiB of the dataset's 2.0 MiB")
        and "num_workers" in unsure
    )
    info = results["info-h5"][1]
    assert "4 columns, 1,000 rows" in info and "ragged int32" in info and " str " in info
    assert "(32, 32, 3)" in info and "fits: yes" in info
    parquet = results["info-parquet"][1]
    assert " bytes " in parquet and "ragged int32" in parquet and "1 column" not in parquet
    assert "keys" in results["info-error"][1] and "--keys" in results["info-error"][1]
    assert "would remove /dev/shm/torch_" in fresh["clean"] and "1 name " in fresh["clean"]
    assert (tmp_path / "shm").exists() and len(list((tmp_path / "shm").iterdir())) == 1


def test_usage_errors_are_one_line_with_exit_code_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "factories.py").write_text(
        "import torch\nNOT_A_FUNCTION = 3\n"
        "def dataset():\n    return torch.utils.data.TensorDataset(torch.zeros(4))\n"
        "def broken():\n    raise RuntimeError('boom')\n"
        "def empty():\n"
        "    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0)))\n"
        "class Bad(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 4\n"
        "    def __getitem__(self, i):\n        return {}['label']\n"
        "def failing():\n    return torch.utils.data.DataLoader(Bad())\n"
    )
    (tmp_path / "needs_missing.py").write_text("import no_such_package_h4\n")
    (tmp_path / "notes.txt").write_text("not data")
    np.save(tmp_path / "x.npy", np.zeros(3))
    cases = [
        (["verify", "factories"], "expected MODULE:FUNCTION"),
        (["verify", "no_such_module_h4:make"], "no module named 'no_such_module_h4'"),
        (["verify", "./nosuch_h4.py:make"], f"no file {tmp_path / 'nosuch_h4.py'} (MODULE"),
        (["verify", "needs_missing:make"], "importing needs_missing failed"),
        (["verify", "factories:make_loader"], "has no 'make_loader'; its functions"),
        (["verify", "factories:NOT_A_FUNCTION"], "is a int, not a function"),
        (["verify", "factories:dataset"], "returned a TensorDataset, not a torch"),
        (["verify", "factories:broken"], "factories:broken() raised RuntimeError"),
        # a loader that yields nothing, or fails, is an error (2), never "duplicated" (1)
        (["verify", "factories:empty"], "the DataLoader yielded no batch"),
        (["verify", "factories:failing"], "failed while verify iterated it: KeyError"),
        (["info", "missing.h5"], "missing.h5 does not exist"),
        (["info", "notes.txt"], "notes.txt: not a format shareddata reads"),
        (["info", "x.npy", "--columns", "nope"], "nope"),
        (["clean", "--dir", "nowhere"], "nowhere is not a folder"),
    ]
    try:
        for argv, words in cases:
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            last = err.strip().splitlines()[-1]
            assert last.startswith("error: ") and words in last, (argv, err)
            if argv[1] not in ("needs_missing:make", "factories:broken"):
                assert "Traceback" not in err, (argv, err)  # the user's own code: traceback
    finally:
        for name in ("factories", "needs_missing"):
            sys.modules.pop(name, None)


def _info_of(path: str, capsys) -> tuple[int, str, str]:
    code = main(["info", path])
    out, err = capsys.readouterr()
    return code, out, err


def test_info_fails_where_the_load_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "a.npy", np.zeros(10))
    np.save(tmp_path / "data" / "b.npy", np.zeros(7))
    with pytest.raises(sd.ColumnLengthError) as load:
        sd.NumpyDataset("data")
    code, out, err = _info_of("data", capsys)
    assert code == 2 and "fits" not in out, out
    assert err.startswith(f"error: {load.value}"), err  # the load's own error, word for word
    assert "'a': 10 rows" in err and "'b': 7 rows" in err


def test_info_says_which_class_reads_which_files(tmp_path, monkeypatch, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixed").mkdir()
    np.save(tmp_path / "mixed" / "x.npy", np.zeros((5, 3), np.float32))
    np.save(tmp_path / "mixed" / "y.npy", np.arange(5))
    pq.write_table(pa.table({"text": ["a", "bb"]}), tmp_path / "mixed" / "t.parquet")
    code, out, _ = _info_of("mixed", capsys)
    assert code == 0, out
    numpy_part, parquet_part = out.split("mixed as sd.ParquetDataset loads it")
    for ds, part, files in [
        (sd.NumpyDataset("mixed"), numpy_part, "x.npy, y.npy"),
        (sd.ParquetDataset("mixed"), parquet_part, "t.parquet"),
    ]:
        # what each class loads: its rows, its columns, its bytes, from these files
        assert f"{len(ds)} rows" in part and f"read: {files}\n" in part, out
        assert [ln.split()[0] for ln in part.splitlines() if ln.startswith("  ")][2:] == (
            ds.columns
        ), out
        assert f"({ds.nbytes:,} bytes)" in part, out
    assert "mixed as sd.NumpyDataset loads it: 2 columns, 5 rows" in numpy_part
    # a column that only one format has selects that class
    assert main(["info", "mixed", "--columns", "text"]) == 0
    out = capsys.readouterr().out
    assert "sd.ParquetDataset" in out and "sd.NumpyDataset" not in out, out


def test_help_has_descriptions_defaults_and_examples(capsys):
    for command, words in [
        ("demo", ["(default: 256MiB)", "(default: 2)", "examples:", "--plot"]),
        ("info", ["--keys NAME[,NAME...], --columns", "examples:"]),
        ("verify", ["(default: 1.1)", "--json", "examples:", "Exit code", "3 when"]),
        # a load sweeps only when asked (the default is off: Note in storage/_sweep.py)
        ("clean", ["(default: /dev/shm)", "--dry-run", "examples:", "unless SHAREDDATA_SWEEP=1"]),
    ]:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        for word in words:
            assert word in out, (command, word, out)
    with pytest.raises(SystemExit) as done:
        main(["demo", "--size", "lots"])
    assert done.value.code == 2 and "not a size: 'lots'" in capsys.readouterr().err


def test_verify_json_is_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "loaders.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "def plain():\n"
        "    return DataLoader(TensorDataset(torch.zeros(8192, 256)), batch_size=64)\n"
        "def tiny():\n"
        "    return DataLoader(TensorDataset(torch.zeros(1024, 256)), batch_size=64)\n"
    )
    try:
        assert main(["verify", "loaders.py:plain", "--json", "--batches", "4"]) == 0
        out, err = capsys.readouterr()
        # 1 MiB without workers: within the estimate's resolution, cannot tell (exit 3)
        assert main(["verify", "loaders.py:tiny", "--json", "--batches", "4"]) == 3
        tiny_out, tiny_err = capsys.readouterr()
        # and duplicated (exit 1): more than half a copy is over a limit of 0.5
        assert (
            main(["verify", "loaders.py:plain", "--batches", "2", "--max-duplication", "0.5"]) == 1
        )
    finally:
        sys.modules.pop("loaders", None)
    report = json.loads(out)
    assert report["passed"] is True and abs(report["dataset_bytes"] - 8192 * 256 * 4) < 4096
    assert [p["role"] for p in report["processes"]] == ["main"] and report["batches"] == 4
    assert report["status"] == "ok" and report["conclusive"] is True
    assert err.strip().splitlines()[-1].startswith("OK: the dataset is held")
    tiny = json.loads(tiny_out)
    assert tiny["status"] == "inconclusive" and tiny["passed"] is False
    assert tiny["needed_bytes"] > tiny["resolution"] > tiny["dataset_bytes"]
    assert tiny_err.strip().splitlines()[-1].startswith("CANNOT TELL: 1.0 MiB of the dataset's")
