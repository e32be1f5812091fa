"""Fault-injection helpers: run a scenario in a private /dev/shm and prove nothing is left.

A scenario is a Python script run by :func:`run_scenario` in a fresh interpreter
inside its own mount namespace (``unshare -m``, as root) with a small private tmpfs
on ``/dev/shm`` and, optionally, a small private tmpfs as ``storage_dir``. Every
process it starts (DataLoader workers, grandchildren) inherits an environment tag,
so afterwards we can tell whether any of them is still alive.

What "nothing is left behind" means here, checked by :meth:`Scenario.assert_clean`:

* no process of the scenario is alive once its deadline has passed (no hang; an
  orphaned DataLoader worker notices a dead parent within ~5 s);
* no file is left in the private ``/dev/shm`` (multiprocessing's ``sem.*``
  semaphores are counted apart: they are not the library's) nor in ``storage_dir``,
  whose tmpfs must also be back to 0 bytes used;
* no process of the machine still holds a segment the scenario announced (by device
  and inode, in ``/proc/*/fd`` and ``/proc/*/maps``): the kernel has freed its pages;
* ``Shmem`` in ``/proc/meminfo`` is back near where it was before the scenario. This
  figure is machine-wide and other jobs move it, so it is polled with a deadline and
  a slack of half the data the scenario held.

Scenario scripts start with :data:`PRELUDE` (helpers: ``announce()``, ``shmem_kib()``,
``memfd_count()``, ``child()``...).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass, field

import pytest
from conftest import can_unshare, holders

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG_ENV = "SHAREDDATA_FAULT_TAG"
STORE = "/tmp/shareddata-faults-store"  # mount point of the private storage_dir tmpfs

PRELUDE = r'''
import gc, json, os, signal, subprocess, sys, time
TAG = os.environ["SHAREDDATA_FAULT_TAG"]
STORE = os.environ.get("SHAREDDATA_FAULT_STORE")


def shmem_kib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])


def _our_fds():
    """(fd, target) of this process's segments: memfds, and files in the store."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:shareddata") or (STORE and target.startswith(STORE + "/")):
            out.append((int(fd), target))
    return out


def memfd_count():
    return len(_our_fds())


def mapping_count():
    """Mappings of this process's dataset segments (memfds and store files).

    Worker batches are left out: the main process keeps up to ``IDLE_BYTES`` of
    released batch mappings for reuse (Note [Reusing a batch's pages]), a bounded cache
    that ``maps_lines`` growth would show if it leaked.
    """
    with open("/proc/self/maps") as f:
        return sum(
            1
            for line in f
            if ("memfd:shareddata" in line and "shareddata-batch" not in line)
            or (STORE and STORE + "/" in line)
        )


def maps_lines():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def announce():
    """Print the (dev, inode) of every segment this process holds, for the leak check."""
    for fd, _ in _our_fds():
        st = os.fstat(fd)
        print(f"@@SEG {st.st_dev} {st.st_ino} {st.st_size}", flush=True)


def child(code, *args, session=True, **kw):
    """Start a Python child running PRELUDE + code (its own session: a process group)."""
    return subprocess.Popen(
        [sys.executable, "-c", f"PRELUDE = {PRELUDE!r}\n" + PRELUDE + code, *map(str, args)],
        start_new_session=session, **kw,
    )


def wait_line(proc, marker, timeout=120):
    """Read proc.stdout until a line starting with marker; return it (or fail)."""
    import select
    fd = proc.stdout.fileno()
    buf = getattr(proc, "_buf", b"")
    deadline = time.time() + timeout
    while time.time() < deadline:
        while b"\n" in buf:
            raw, buf = buf.split(b"\n", 1)
            line = raw.decode(errors="replace")
            print(line if line.startswith("@@") else "child: " + line, flush=True)
            if line.startswith(marker):
                proc._buf = buf
                return line
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                break
            buf += data
    proc._buf = buf
    raise SystemExit(f"child did not print {marker!r} in {timeout} s (rc={proc.poll()})")


TRAIN = r"""
import faulthandler
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang's stacks, on request
import numpy as np, shareddata as sd
from torch.utils.data import DataLoader
method, workers, mib, where = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = mib * 256  # 4 KiB rows
ds = sd.NumpyDataset(
    {"x": np.broadcast_to(np.float32(1.0), (rows, 1024)), "i": np.arange(rows)},
    storage_dir=STORE if where == "store" else None,
)
announce()
loader = DataLoader(ds, batch_size=256, num_workers=workers, multiprocessing_context=method,
                    shuffle=True)
for epoch in range(1000):
    for n, batch in enumerate(loader):
        if epoch == 0 and n == 2:
            print("@@RUNNING", flush=True)
        time.sleep(0.02)
"""
'''

_WAITER = r"""
import os, sys, time, signal
tag, deadline = sys.argv[1].encode(), time.time() + float(sys.argv[2])
me = os.getpid()
def alive():
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me:
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"SHAREDDATA_FAULT_TAG=" + tag in env and state != "Z":
            pids.append(int(p))
    return pids
start = time.time()
while alive() and time.time() < deadline:
    time.sleep(0.2)
left = alive()
print(f"@@WAITED {time.time() - start:.2f}")
if left:
    print("@@ALIVE", *left)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
"""


def shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    raise RuntimeError("no Shmem in /proc/meminfo")


def require_isolation() -> None:
    """Fail (not skip) when the machine cannot give a scenario its own /dev/shm."""
    if not can_unshare():
        pytest.fail(
            "fault-injection scenarios need root and `unshare -m` (a private /dev/shm per "
            "scenario); run the suite as root, e.g. in the project's container"
        )


@dataclass
class Scenario:
    """The outcome of :func:`run_scenario`."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    shm_left: list[str]
    sem_left: list[str]
    store_left: list[str]
    store_used_kib: int | None
    alive_after: list[int]
    timed_out: bool
    shmem_before: int
    segments: set[tuple[int, int]] = field(default_factory=set)
    segment_bytes: int = 0

    def lines(self, marker: str) -> list[str]:
        return [
            line[len(marker) :].strip()
            for line in self.stdout.splitlines()
            if line.startswith(marker)
        ]

    def value(self, marker: str) -> str:
        found = self.lines(marker)
        assert found, f"scenario printed no {marker!r} line\n{self.describe()}"
        return found[-1]

    def describe(self) -> str:
        return (
            f"rc={self.returncode} timed_out={self.timed_out} in {self.seconds:.1f} s\n"
            f"--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"
        )

    def assert_clean(self, *, deadline: float = 30.0, slack_kib: int | None = None) -> None:
        """Nothing left behind, nothing hung (see the module docstring)."""
        assert not self.timed_out, f"scenario hung (killed at its timeout)\n{self.describe()}"
        assert not self.alive_after, (
            f"processes of the scenario were still alive after its deadline (a hang): "
            f"{self.alive_after}\n{self.describe()}"
        )
        assert self.shm_left == [], f"left in /dev/shm: {self.shm_left}\n{self.describe()}"
        assert self.store_left == [], f"left in storage_dir: {self.store_left}"
        assert self.store_used_kib in (None, 0), (
            f"storage_dir's tmpfs still uses {self.store_used_kib} KiB"
        )
        end = time.time() + deadline
        held = holders(self.segments)
        while held and time.time() < end:
            time.sleep(0.2)
            held = holders(self.segments)
        assert not held, f"segments still held by processes {held}\n{self.describe()}"
        if slack_kib is None:
            slack_kib = max(64 << 10, self.segment_bytes // 2048)
        grown = shmem_kib() - self.shmem_before
        while grown > slack_kib and time.time() < end:
            time.sleep(0.5)
            grown = shmem_kib() - self.shmem_before
        assert grown <= slack_kib, (
            f"Shmem is {grown} KiB above where it started (slack {slack_kib} KiB)"
        )


def run_scenario(
    code: str,
    *,
    shm_size: str = "64m",
    store_size: str | None = None,
    timeout: float = 150,
    settle: float = 20,
    env: dict[str, str] | None = None,
) -> Scenario:
    """Run ``PRELUDE + code`` in a private /dev/shm (and storage_dir); see the module doc.

    Args:
        code: the scenario (dedented).
        shm_size: size of the private /dev/shm tmpfs.
        store_size: when given, a private tmpfs of this size is mounted at :data:`STORE`
            and passed as ``SHAREDDATA_FAULT_STORE``.
        timeout: the whole run's limit; past it everything is killed and ``timed_out``.
        settle: how long the scenario's processes may outlive its script (orphaned
            workers), before they count as hung and are killed.
        env: extra environment variables for the scenario.
    """
    require_isolation()
    tag = uuid.uuid4().hex
    script = f"PRELUDE = {PRELUDE!r}\n" + PRELUDE + textwrap.dedent(code)
    python = shlex.quote(sys.executable)
    mounts = f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm"
    store_report = ""
    here = os.path.dirname(os.path.abspath(__file__))  # faultjobs: picklable callables
    run_env = {**os.environ, "PYTHONPATH": f"{REPO}:{here}", **(env or {})}
    run_env.pop(TAG_ENV, None)
    if store_size is not None:
        os.makedirs(STORE, exist_ok=True)
        mounts += f" && mount -t tmpfs -o size={store_size} tmpfs {STORE}"
        store_report = (
            f"echo '@@STORE@@'; ls -A {STORE}; echo '@@USED@@'; "
            f"df -k --output=used {STORE} | tail -1; "
        )
        run_env["SHAREDDATA_FAULT_STORE"] = STORE
    shell = (
        f"{mounts} || exit 99; "
        f"{TAG_ENV}={tag} {python} -c {shlex.quote(script)}; rc=$?; "
        f"{python} -c {shlex.quote(_WAITER)} {tag} {settle}; "
        f"echo '@@SHM@@'; ls -A /dev/shm; {store_report}exit $rc"
    )
    before = shmem_kib()
    start = time.time()
    proc = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run_env,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout + settle)
    except subprocess.TimeoutExpired:
        timed_out = True
        stacks = _stacks_of_tagged(tag)
        _kill_tagged(tag)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err = f"{err}\n--- stacks at the timeout (py-spy dump) ---\n{stacks}"
    seconds = time.time() - start
    if proc.returncode == 99 and "@@SHM@@" not in out:
        pytest.fail(f"could not mount the private tmpfs: {err}")
    body, _, tail = out.partition("@@SHM@@\n")
    shm_part, _, store_part = tail.partition("@@STORE@@\n")
    names = shm_part.split()
    store_names, _, used = store_part.partition("@@USED@@\n")
    alive = []
    for line in body.splitlines():
        if line.startswith("@@ALIVE"):
            alive = [int(p) for p in line.split()[1:]]
    alive += _kill_tagged(tag)  # anything that escaped the namespace's waiter
    segments, nbytes = set(), 0
    for dev, ino, size in re.findall(r"^@@SEG (\d+) (\d+) (\d+)$", body, re.M):
        if (int(dev), int(ino)) not in segments:
            nbytes += int(size)
        segments.add((int(dev), int(ino)))
    return Scenario(
        returncode=proc.returncode,
        stdout=body,
        stderr=err,
        seconds=seconds,
        shm_left=sorted(n for n in names if not n.startswith("sem.")),
        sem_left=sorted(n for n in names if n.startswith("sem.")),
        store_left=store_names.split(),
        store_used_kib=int(used.split()[0]) if used.split() else None,
        alive_after=alive,
        timed_out=timed_out,
        shmem_before=before,
        segments=segments,
        segment_bytes=nbytes,
    )


def _tagged(tag: str) -> list[int]:
    """The pids of the live processes carrying ``tag`` in their environment."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(p))
    return found


def _stacks_of_tagged(tag: str) -> str:
    """Every thread's Python stack in each process of a hung scenario (py-spy, if installed)."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return "py-spy is not installed: no stacks"
    out = []
    for pid in _tagged(tag):
        try:
            dump = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20
            )
            out.append(f"pid {pid}:\n{dump.stdout}{dump.stderr}")
        except subprocess.TimeoutExpired:
            out.append(f"pid {pid}: py-spy dump took over 20 s")
    return "\n".join(out)


def _kill_tagged(tag: str) -> list[int]:
    """SIGKILL every live process carrying ``tag``; return their pids."""
    killed = []
    for pid in _tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            continue
    return killed
