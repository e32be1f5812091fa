"""Shared test helpers: start methods, an isolated /dev/shm, and a leak check.

The tests follow the package's layout, so a new test has one obvious home:

* ``tests/`` itself: the core (``test_contract.py``, the contract every dataset kind
  keeps, over ``kinds.py``; errors, batches and collates, crossings between
  processes, handoff, wrapping, storage, the sweep, the CLI);
* ``sources/``: one module per source format (``shareddata/sources/``), the files of
  other tools (``test_compat_*``) and fuzzing;
* ``memory/``: ``verify`` and the plot (``shareddata/memory/``);
* ``distributed/``: torchrun jobs and restarts (``shareddata/distributed/``; the
  programs they launch are in ``distributed/scripts/``);
* ``faults/``: kills, full memory, leaks and read-only pages, each in its own ``/dev/shm``;
* ``project/``: the repository around the package: docs, examples, benchmarks, import
  layers, lint and types.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

START_METHODS = ["fork", "spawn", "forkserver"]

# Scripts that tests run as programs (torchrun, fault scenarios): not doctest modules.
collect_ignore_glob = ["distributed/scripts/*"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TORCHRUN_VARS = (
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_",
    "RANK",
    "WORLD_SIZE",
    "MASTER_",
    "TORCHELASTIC_",
    "SHAREDDATA_RANK_PID",
)
"""Prefixes of the variables torchrun sets (and ours): a launched job must not inherit them."""


def torchrun_env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's variables, for a ``torchrun`` job a test starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(TORCHRUN_VARS)}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)
    return env


@contextlib.contextmanager
def hard_timeout(seconds: int, what: str = "the test"):
    """Raise TimeoutError (after dumping every thread's stack) if the block runs too long.

    For tests that start processes: a hang fails instead of stalling the suite.
    """

    def expired(signum, frame):
        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"{what} hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def shm_names() -> set[str]:
    """Files in /dev/shm other than multiprocessing's short-lived semaphores."""
    try:
        return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.")}
    except FileNotFoundError:
        return set()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_links() -> dict[str, str]:
    """This process's open fds and what each one is (``/proc/self/fd``), to name a leak."""
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            links[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd listdir itself used
            pass
    return links


def can_unshare() -> bool:
    if os.geteuid() != 0:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True
    )
    return probe.returncode == 0


@dataclass
class IsolatedRun:
    returncode: int
    stdout: str
    stderr: str
    leftovers: list[str]
    isolated: bool


def run_isolated(
    code: str, *, shm_size: str = "64m", timeout: float = 180, extra_mounts: str = ""
) -> IsolatedRun:
    """Run ``code`` in a fresh Python with a private, small /dev/shm; list what it left.

    As root the script gets its own tmpfs on /dev/shm (``unshare -m``), so anything
    left there afterwards was left by it. Without root, /dev/shm is compared before
    and after instead.
    """
    script = textwrap.dedent(code)
    python = shlex.quote(sys.executable)
    env = {**os.environ, "PYTHONPATH": REPO}
    if can_unshare():
        shell = (
            f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm && {extra_mounts} "
            f"{python} -c {shlex.quote(script)}; rc=$?; "
            "echo '@@LEFT@@'; ls -A /dev/shm | grep -v '^sem\\.' ; exit $rc"
        )
        proc = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        out, _, left = proc.stdout.partition("@@LEFT@@\n")
        return IsolatedRun(proc.returncode, out, proc.stderr, left.split(), True)
    before = shm_names()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env
    )
    return IsolatedRun(
        proc.returncode, proc.stdout, proc.stderr, sorted(shm_names() - before), False
    )


def _ours(name: str) -> bool:
    """Names this library or this test process's torch would make (not other sessions')."""
    if name.startswith("shareddata"):
        return True
    parts = name.split("_")
    return name.startswith("torch_") and len(parts) > 1 and parts[1] == str(os.getpid())


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test: no new file in /dev/shm afterwards (the library never names one)."""
    before = shm_names()
    yield
    left = {n for n in shm_names() - before if _ours(n)}
    if left:  # torch creates and unlinks its batch segments at once: allow that instant
        import time

        time.sleep(1)
        left &= shm_names()
    assert not left, f"test left files in /dev/shm: {sorted(left)}"


def holders(segments: set[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """Which processes of the machine still hold each (dev, inode), as an fd or a mapping."""
    found: dict[tuple[int, int], list[int]] = {}
    if not segments:
        return found
    inodes = {ino for _, ino in segments}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in segments:
                found.setdefault((st.st_dev, st.st_ino), []).append(int(p))
        try:
            with open(f"/proc/{p}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 5 or not parts[4].isdigit() or int(parts[4]) not in inodes:
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            key = (os.makedev(major, minor), int(parts[4]))
            if key in segments:
                found.setdefault(key, []).append(int(p))
    return found


# The quick tier (`bash scripts/test.sh --quick`, or `pytest --quick`; its items also carry
# the `quick` marker): the contract over every dataset kind under `fork` workers, in
# under 3 minutes on 2 cores. The default run still runs everything.
QUICK_FILES = (
    "test_contract.py",
    "test_crossing.py",
    "test_batch.py",
    "test_errors.py",
    "test_handoff.py",
    "test_storage.py",
    "test_compat.py",
    "test_locks.py",
    "sources/test_*.py",
    "project/test_quality.py",
)
QUICK_ONLY = {"project/test_quality.py": {"test_ruff_check", "test_ruff_format"}}
"""In these files, only these tests are quick."""
_FRESH = "starts fresh interpreters (spawn, subprocess or an isolated /dev/shm)"
QUICK_SKIP = {
    "test_mutated_files_end_in_data_or_a_named_error": "fuzzing (scripts/fuzz.sh runs longer)",
    "test_cases_found_by_long_runs": "fuzzing: each case in a fresh interpreter",
    **dict.fromkeys(
        (
            "test_every_shape_under_forkserver_and_the_file_system_strategy",
            "test_spawn_and_forkserver_workers_exit_right_after_the_task",
            "test_verify_passes_with_string_and_ragged_columns_under_spawn",
            "test_verify_string_and_ragged_columns_held_once",
            "test_index_batch_sampler_fast_path[2]",
            "test_torch_multiprocessing_pool",
            "test_storage_dir_is_file_backed_and_nameless",
            "test_only_the_creator_may_discard",
            "test_sigkill_of_the_parent_leaves_nothing",
            "test_ctrl_c_during_a_load_frees_everything",
            "test_full_storage_dir_raises_and_small_dev_shm_is_not_a_limit",
            "test_200_mib_dataset_in_a_64_mib_dev_shm",
            "test_the_same_run_killed_midway_leaves_nothing",
            "test_arrow_memory_goes_back_after_a_load",
            "test_import_shareddata_does_not_import_pyarrow",
            "test_shareddata_imports_without_h5py",
        ),
        _FRESH,
    ),
}
"""Tests of the quick files left to the full run (by name, or name[parameters]), and why."""
SLOW_START_METHODS = {"spawn", "forkserver"}
"""A test parametrized with one of these is left to the full run (fork is quick)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="run the quick tier only: the contract over every kind with fork workers",
    )
    parser.addoption(
        "--bench",
        action="store_true",
        help="also run the tests marked bench (the benchmark suite end to end, ~1 min)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # registered here, not in pyproject.toml (whose checksum scripts/setup.sh keys its
    # reinstall on)
    config.addinivalue_line(
        "markers", "bench: opt-in, run by pytest --bench: the benchmark suite end to end"
    )
    # torch < 2.4's DataLoader, on an error from a worker's queue, probes the fd limit with
    # ten NamedTemporaryFiles it never closes (torch's own leak, closed by an ExitStack in
    # later releases): their ResourceWarnings are not ours, and the compat runs meet them
    import inspect

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter as Iter

    try:
        source = inspect.getsource(Iter._try_get_data)
    except (OSError, TypeError):  # torch installed without its sources: nothing to tell
        source = ""
    if "fs = [tempfile.NamedTemporaryFile()" in source:
        config.addinivalue_line(
            "filterwarnings",
            r"ignore:Exception ignored in. <_io.FileIO name='/tmp/tmp:"
            "pytest.PytestUnraisableExceptionWarning",
        )


def _quick_file(path) -> str | None:
    """The QUICK_FILES pattern that ``path`` (under tests/) matches, or None."""
    import fnmatch

    try:
        rel = os.path.relpath(str(path), os.path.join(REPO, "tests"))
    except ValueError:
        return None
    return next((p for p in QUICK_FILES if fnmatch.fnmatch(rel, p)), None)


def _is_quick(item: pytest.Item) -> bool:
    pattern = _quick_file(item.path)
    if pattern is None:
        return False
    name = item.originalname if isinstance(item, pytest.Function) else item.name
    if pattern in QUICK_ONLY and name not in QUICK_ONLY[pattern]:
        return False
    if name in QUICK_SKIP or item.name in QUICK_SKIP or item.get_closest_marker("slow"):
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    return not any(isinstance(v, str) and v in SLOW_START_METHODS for v in params.values())


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """Under --quick, files outside QUICK_FILES are not even imported."""
    quick = config.getoption("quick") and collection_path.suffix == ".py"
    return True if quick and _quick_file(collection_path) is None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    quick, rest = [], []
    opt_in = pytest.mark.skip(reason="opt-in: bash scripts/test.sh --bench (README.md#tests)")
    for item in items:
        if item.get_closest_marker("bench") and not config.getoption("bench"):
            item.add_marker(opt_in)
        if _is_quick(item):
            item.add_marker(pytest.mark.quick)
            quick.append(item)
        else:
            rest.append(item)
    if config.getoption("quick") and rest:
        config.hook.pytest_deselected(items=rest)
        items[:] = quick
