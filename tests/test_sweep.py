"""The sweeper of names left in /dev/shm by killed DataLoader processes (_sweep.py)."""

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, can_unshare, run_isolated

from shareddata.storage._sweep import leftovers, sweep


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _make(directory, name: str, age: float, size: int = 4096) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.truncate(size)
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_only_old_unheld_torch_names_of_dead_processes_are_leftovers(tmp_path):
    dead = _dead_pid()
    garbage = _make(tmp_path, f"torch_{dead}_123_0", age=60, size=1 << 20)
    _make(tmp_path, f"torch_{os.getpid()}_123_0", age=60)  # a live process's
    _make(tmp_path, f"torch_{dead}_456_1", age=1)  # too young: torch may be about to unlink
    held = _make(tmp_path, f"torch_{dead}_789_2", age=60)  # someone still holds it
    _make(tmp_path, "sem.mp-abc", age=60)  # not torch's
    _make(tmp_path, "my_own_file", age=60)
    with open(held, "rb"):
        found = leftovers(str(tmp_path))
        assert [(f.path, f.pid, f.nbytes) for f in found] == [(garbage, dead, 1 << 20)]
        paths = [f.path for f in found]
        assert [f.path for f in sweep(str(tmp_path), dry_run=True)] == paths
        assert os.path.exists(garbage)
        assert [f.path for f in sweep(str(tmp_path))] == paths
    assert not os.path.exists(garbage)
    assert len(os.listdir(tmp_path)) == 5


def test_clean_command_lists_then_removes(tmp_path):
    dead = _dead_pid()
    path = _make(tmp_path, f"torch_{dead}_1_0", age=60, size=8192)
    cmd = [sys.executable, "-m", "shareddata", "clean", "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": REPO}
    dry = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, env=env)
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {path}" in dry.stdout and f"process {dead}" in dry.stdout
    assert os.path.exists(path)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0 and f"removed {path}" in done.stdout
    assert not os.path.exists(path)


@pytest.mark.skipif(not can_unshare(), reason="needs root for a private /dev/shm")
def test_loading_a_dataset_sweeps_what_a_killed_job_left_only_when_asked():
    # a whole-job SIGKILL while a worker was creating a batch leaves torch's name: the
    # next load removes it with SHAREDDATA_SWEEP=1, and leaves other programs' files
    # alone by default (a /dev/shm shared across PID namespaces: issue 21)
    run = run_isolated(
        """
        import os, subprocess, sys, time
        import numpy as np, shareddata as sd
        proc = subprocess.Popen([sys.executable, "-c", "pass"]); proc.wait()
        def make(name):
            path = "/dev/shm/" + name
            open(path, "wb").close()
            os.utime(path, (time.time() - 60,) * 2)
            return path
        kept = make(f"torch_{proc.pid}_1_0")
        sd.NumpyDataset(np.zeros(4))
        print("@@KEPT", os.path.exists(kept))
        os.environ["SHAREDDATA_SWEEP"] = "1"
        sd.NumpyDataset(np.zeros(4))
        print("@@SWEPT", not os.path.exists(kept))
        """
    )
    assert run.returncode == 0, run.stderr
    assert "@@KEPT True" in run.stdout and "@@SWEPT True" in run.stdout, run.stdout
    assert run.leftovers == []
