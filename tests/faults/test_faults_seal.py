"""Sealed segments: no process can write, grow or shrink a loaded dataset's memory.

Note [Sealed segments] in shareddata/storage/_segment.py. Every attached process holds
a descriptor of the dataset's file, and the same user can reopen any process's
descriptor read-write through /proc: the seals are what refuses a write, a shared
writable mapping or a truncation, whoever tries. The attacks run in a fresh
interpreter, so that a truncation that went through (a SIGBUS in the main process)
fails the test instead of killing the test run. A writable ``SharedArray`` stays
writable by every process and is sealed against resizing only.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import START_METHODS
from kinds import KINDS, make

import shareddata as sd

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEALED = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
RESIZE_SEALED = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
REFUSED = {"EPERM", "EBADF", "EACCES", "EINVAL"}  # EINVAL: ftruncate of an O_RDONLY fd


def descriptors_of(identities: frozenset[tuple[int, int]]) -> list[int]:
    """This process's descriptors open on the files of ``identities`` (device, inode)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in identities:
            found.append(int(name))
    return found


def run_python(code: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run ``code`` in a fresh interpreter; its ``@@RESULT`` JSON line, parsed."""
    path = [os.path.dirname(TESTS), TESTS, os.path.join(TESTS, "faults")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@RESULT ")]
    result = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    return proc, result


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_sealed_against_writes_growth_and_shrinking(kind, tmp_path):
    ds, expected = make(kind, tmp_path / "data", rows=64, ragged=kind != "numpy")
    identities = ds.segment_identity()
    fds = descriptors_of(identities)
    assert identities and len(fds) >= len(identities), (identities, fds)
    assert {fd: fcntl.fcntl(fd, fcntl.F_GET_SEALS) for fd in fds} == dict.fromkeys(fds, SEALED)
    assert float(ds[5]["x"][1]) == float(expected[5]["x"][1])  # and it still reads


_ATTACK = """
    import functools, json, os, sys
    import numpy as np, shareddata as sd
    from torch.utils.data import DataLoader
    from faultjobs import attack_segments
    method, report = sys.argv[1], sys.argv[2]
    rows = 4096
    ds = sd.NumpyDataset({"x": np.arange(rows, dtype=np.int64)})
    identities = sorted(ds.segment_identity())
    arrays = ds._columns["x"].arrays.values()
    sizes = [os.fstat(a.segment.fd).st_size for a in arrays]
    init = functools.partial(attack_segments, os.getpid(), identities, report)
    loader = DataLoader(ds, batch_size=512, num_workers=1, multiprocessing_context=method,
                        worker_init_fn=init)
    total = sum(int(batch["x"].sum()) for batch in loader)
    column = ds._columns["x"].arrays["data"].numpy()
    print("@@RESULT", json.dumps({
        "unchanged": bool((column == np.arange(rows)).all()),
        "batches": total == rows * (rows - 1) // 2,
        "sizes": sizes == [os.fstat(a.segment.fd).st_size for a in arrays],
    }), flush=True)
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_a_worker_can_neither_write_nor_resize_the_data(method, tmp_path):
    report = tmp_path / "attacks.json"
    proc, result = run_python(_ATTACK, method, str(report))
    assert proc.returncode == 0, f"the main process died (rc {proc.returncode}):\n{proc.stderr}"
    attacks = json.loads(report.read_text())
    found = attacks.pop("found")
    assert found[0] >= 1 and found[1] >= 1, found  # the worker reached both descriptors
    assert attacks and all(v in REFUSED for v in attacks.values()), attacks
    assert result == {"unchanged": True, "batches": True, "sizes": True}, result


_WRITABLE = """
    import fcntl, json, multiprocessing as mp, sys
    import shareddata as sd
    from faultjobs import write_and_resize
    method, report = sys.argv[1], sys.argv[2]
    array = sd.SharedArray.empty(1024, "int64")
    child = mp.get_context(method).Process(target=write_and_resize, args=(array, report))
    child.start()
    child.join(120)
    print("@@RESULT", json.dumps({
        "exitcode": child.exitcode,
        "values": array.numpy()[:3].tolist(),
        "seals": fcntl.fcntl(array.segment.fd, fcntl.F_GET_SEALS),
    }), flush=True)
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_a_shared_array_stays_writable_everywhere_and_keeps_its_size(method, tmp_path):
    report = tmp_path / "resize.json"
    proc, result = run_python(_WRITABLE, method, str(report))
    assert proc.returncode == 0, f"the main process died (rc {proc.returncode}):\n{proc.stderr}"
    assert result["exitcode"] == 0, proc.stderr
    assert result["values"] == [7, 8, 0]  # the child's numpy write and pwrite both arrived
    assert result["seals"] == RESIZE_SEALED
    assert json.loads(report.read_text()) == {"ftruncate 0": "EPERM", "ftruncate grow": "EPERM"}


def test_a_shared_array_made_here_is_sealed_against_resizing_only():
    array = sd.SharedArray.empty(16, "float32")
    assert fcntl.fcntl(array.segment.fd, fcntl.F_GET_SEALS) == RESIZE_SEALED
    array.numpy()[:] = 1.5  # still writable here
    assert float(array.torch().sum()) == 24.0


def test_a_segment_another_mapping_still_writes_is_sealed_against_resizing_with_a_warning():
    # F_SEAL_WRITE is EBUSY while a writable shared mapping exists (here a second one of
    # this process; in a job, a process that wrote into the load and has not exited)
    from shareddata.storage import Segment
    from shareddata.storage._linux import map_fd, unmap

    segment = Segment.create(4096)
    other = map_fd(segment.fd, 4096)
    try:
        with pytest.warns(RuntimeWarning, match="sealed against resizing only"):
            assert segment.seal() is True
        assert fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS) == RESIZE_SEALED
    finally:
        unmap(other, 4096)
