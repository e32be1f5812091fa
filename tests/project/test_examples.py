"""Every example runs, every command line its docstring advertises, and checks its memory."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
from conftest import REPO

EXAMPLES = pathlib.Path(REPO, "examples")
TORCHRUN = ["-m", "torch.distributed.run"]
# Each command line an example's docstring advertises -> the run that checks it here
# (small mode: each loads >= 32 MiB, so that verify's 1.10 limit is meaningful next to
# the workers' few MiB of working memory), or why it cannot run on a CPU-only machine.
SMALL_DDP = ["--rows", "150000", "--epochs", "1", "--workers", "1"]
RUNS: dict[str, list[str]] = {
    "quickstart": ["examples/quickstart.py", "--rows", "100000"],
    "wrap_existing": ["examples/wrap_existing.py", "--items", "4096"],
    "hdf5_images": ["examples/hdf5_images.py", "--images", "4096"],
    "parquet_text": ["examples/parquet_text.py", "--rows", "60000"],
    "lightning_1_device": [
        "examples/lightning_datamodule.py",
        *("--rows", "40000", "--epochs", "1", "--workers", "1", "--batches", "10"),
    ],
    "lightning_ddp_2_devices": [
        "examples/lightning_datamodule.py",
        *("--devices", "2", "--strategy", "ddp"),
        *("--rows", "80000", "--epochs", "1", "--workers", "1", "--batches", "5"),
    ],
    "ddp_1_process": ["examples/ddp_train.py", *SMALL_DDP],
    "ddp_torchrun_2_ranks": [
        *(*TORCHRUN, "--standalone", "--nproc_per_node=2"),
        *("examples/ddp_train.py", *SMALL_DDP),
    ],
}
ADVERTISED = {
    "python examples/quickstart.py [--rows N]": "quickstart",
    "python examples/wrap_existing.py [--items N]": "wrap_existing",
    "python examples/hdf5_images.py [--images N] [--size PIXELS]": "hdf5_images",
    "python examples/parquet_text.py [--rows N]": "parquet_text",
    "python examples/lightning_datamodule.py": "lightning_1_device",
    "python examples/lightning_datamodule.py --devices 2 --strategy ddp": "lightning_ddp_2_devices",
    "python examples/ddp_train.py": "ddp_1_process",
    "torchrun --standalone --nproc_per_node=2 examples/ddp_train.py": "ddp_torchrun_2_ranks",
    "torchrun --standalone --nproc_per_node=8 examples/ddp_train.py": "needs 8 GPUs (NCCL)",
    "torchrun --nnodes=2 --node_rank=NODE --nproc_per_node=8 --rdzv-backend=c10d "
    "--rdzv-endpoint=HOST:29500 examples/ddp_train.py --shard": "test_ddp_two_nodes_shard",
    "pytest -p shareddata.testing examples/test_memory_check.py -rP": "test_memory_check",
}
COMMAND = re.compile(r"^\s*(?:Run:\s*)?((?:python|torchrun|pytest) [^#]*?examples/.*?)\s*(?:#.*)?$")


def advertised() -> list[str]:
    """The command lines of the examples' docstrings (continuation lines joined)."""
    found = []
    for path in sorted(EXAMPLES.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        for match in map(COMMAND.match, doc.replace("\\\n", "").splitlines()):
            if match:
                found.append(re.sub(r"\s+", " ", match.group(1)))
    return found


def _run(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_every_advertised_command_line_is_run():
    lines = advertised()
    assert set(lines) == set(ADVERTISED), "update ADVERTISED (and RUNS) for the docstrings"
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == {re.search(r"examples/(\S+\.py)", line).group(1) for line in lines}
    for line, run in ADVERTISED.items():
        assert run in RUNS or run in globals() or run.startswith("needs "), line


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name):
    if "lightning" in name and importlib.util.find_spec("lightning") is None:
        pytest.fail("lightning is not installed (it is in the dev extra): pip install -e '.[dev]'")
    proc = _run(*RUNS[name])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "dataset held" in proc.stdout
    assert "(limit 1.10)" in proc.stdout  # checked, not only measured
    if "2_ranks" in name or "2_devices" in name:  # one copy for the node, not one per rank
        assert "copies in the 2 ranks' main processes: 1" in proc.stdout
    if name.startswith("ddp"):
        assert "epoch 0: mean loss" in proc.stdout
    if name.startswith("lightning"):
        assert "trained" in proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_two_nodes_shard(tmp_path):
    """The two-node `--shard` command, as two simulated nodes of one rank on this machine."""
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                *TORCHRUN,
                *("--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1"),
                *("--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=examples"),
                *("examples/ddp_train.py", "--shard", "--rows", "20000", "--epochs", "1"),
                *("--workers", "0"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, out[-2000:] + err[-4000:]
    # node 0 prints (global rank 0): its half of the rows, trained together with node 1
    assert "rows 0:10000 of 20000 on node 0 of 2" in outputs[0][0]
    assert "epoch 0: mean loss" in outputs[0][0]


def test_memory_check():
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
