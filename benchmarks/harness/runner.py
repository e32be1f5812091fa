"""The one runner: every measurement runs in a fresh process, with a timeout, and returns JSON.

A :class:`Runner` starts one interpreter (the *zygote*) that imports numpy, torch,
pyarrow, h5py and shareddata once, then forks one child per measurement: each
measurement gets a fresh address space without paying for the imports again. The
child calls ``module.function(**kwargs)`` and sends its return value (a JSON-able
dict) back. A function that wants its memory sampled calls :func:`go` when its
set-up is done: the parent then starts a :class:`memory.Sampler` on the child and
lets it continue; the sampler's peak and final figures are added to the result.

Note [Why a zygote]: a fresh interpreter costs ~2-3 s of imports here; the format
loads alone are ~80 measurements. A fork of a process that only imported modules
holds no heap of an earlier measurement. ``Runner(pythonpath=tree)`` runs another
checkout's library (``topics/compare.py``).

Note [Settling memory]: on this VM the first touch of fresh memory costs about 0.35 s
per GiB or about 0.8 s, and the two alternate from one process to the next (a 1 GiB
``MADV_POPULATE_WRITE`` in 12 fresh processes: 1.08 0.35 0.83 0.35 0.83 ... s; every
run slow with 2 s between runs; likely the host taking back memory the guest freed,
not checked). Two trees alternated in that rhythm get opposite states: ``NumpyDataset``
of 1 GiB, 527c53a then aaf2c1a, 7 times: 0.41 s against 1.26 s (medians). With
``BENCH_SETTLE_GIB=3`` every measurement starts after this process touched and freed
3 GiB (:func:`settle`, 1-2 s), and the two were 0.49 and 0.47 s.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
REPO = os.path.dirname(BENCH)

ZYGOTE = r"""
import importlib, json, os, sys, traceback
out = os.dup(1)

def say(*parts):
    os.write(out, (" ".join(map(str, parts)) + "\n").encode())

def readline():
    buf = b""
    while not buf.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            os._exit(0)
        buf += c
    return buf.decode()

def child(job):
    os.dup2(2, 1)  # the measurement's prints go to stderr, the protocol stays on `out`
    sys.stdout = sys.stderr
    os.environ["BENCH_CHILD_FD"] = str(out)
    try:
        fn = getattr(importlib.import_module(job["module"]), job["fn"])
        say("DONE", json.dumps(fn(**job["kwargs"]) or {}))
    except BaseException as e:
        traceback.print_exc()
        say("ERROR", json.dumps(f"{type(e).__name__}: {e}"))
    sys.stderr.flush()
    if os.environ.get("BENCH_SAMPLED"):
        readline()  # the parent reads the memory left after the measurement first

if len(sys.argv) > 2:  # one job in this fresh interpreter
    say("PID", os.getpid())
    child(json.loads(sys.argv[2]))
    say("EXITED")
    os._exit(0)
for name in sys.argv[1].split(","):
    if name:
        importlib.import_module(name)
say("ZYGOTE")
while True:
    job = json.loads(readline())
    pid = os.fork()
    if pid == 0:
        try:
            say("PID", os.getpid())  # the child says it, so it comes before the child's DONE
            child(job)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    say("EXITED")
"""

PRELOAD = "numpy,torch,torch.utils.data,h5py,pyarrow,pyarrow.parquet,shareddata"
SETTLE_GIB = float(os.environ.get("BENCH_SETTLE_GIB", "0"))


def settle(gib: float = SETTLE_GIB) -> None:
    """Touch and free ``gib`` GiB, so the next process starts in one memory state.

    Note [Settling memory]; 0 (the default, ``BENCH_SETTLE_GIB`` unset) does nothing.
    """
    if gib > 0:
        import numpy as np

        touched = np.empty(int(gib * (1 << 30)), np.uint8)
        touched[::4096] = 1
        del touched


def go() -> None:
    """In a measured child: tell the parent the set-up is done, wait for it to sample."""
    fd = os.environ.get("BENCH_CHILD_FD")
    if fd is None:  # called outside a runner (a plain import): nothing to wait for
        return
    os.environ["BENCH_SAMPLED"] = "1"
    os.write(int(fd), f"READY {os.getpid()}\n".encode())
    while os.read(0, 1) not in (b"\n", b""):
        pass


class _Pipe:
    """The protocol with one process: lines with a timeout, words expected, lines sent."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc, self._buf = proc, b""

    def line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout:.0f} s")
            if select.select([fd], [], [], min(left, 0.5))[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError("the measuring process ended")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def expect(self, word: str, timeout: float) -> str:
        line = self.line(timeout)
        head, _, rest = line.partition(" ")
        if head != word:
            raise RuntimeError(f"expected {word}, got {line[:300]!r}")
        return rest

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Runner:
    """Runs measurements in fresh processes: forks of one zygote, or new interpreters.

    Args:
        pythonpath: the checkout whose ``shareddata`` the measurements import.
        preload: modules the zygote imports once (``""``: no zygote is started).
        env: extra environment variables of every process.
    """

    def __init__(
        self, pythonpath: str = REPO, preload: str = PRELOAD, env: dict[str, str] | None = None
    ) -> None:
        path = os.pathsep.join([pythonpath, BENCH, os.environ.get("PYTHONPATH", "")])
        self.env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        self.cwd = pythonpath
        self.zygote: _Pipe | None = None
        if preload:
            self.zygote = self._start([preload])
            self.zygote.expect("ZYGOTE", 300)

    def _start(self, args: list[str]) -> _Pipe:
        cmd = [sys.executable, "-c", ZYGOTE, *args]
        return _Pipe(
            subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd=self.cwd
            )
        )

    def run(
        self, module: str, fn: str, timeout: float = 1800, interpreter: bool = False, **kwargs: Any
    ) -> dict[str, Any]:
        """``module.fn(**kwargs)`` in a fresh process; its result, plus memory if it called go().

        Args:
            module: dotted module name (importable with ``benchmarks/`` on the path).
            fn: the function; its keyword arguments and return value are JSON.
            timeout: seconds before the process is killed.
            interpreter: a new interpreter instead of a fork of the zygote (for figures
                that must not share the zygote's pages: PSS, time to first batch).
            **kwargs: the function's arguments.

        Raises:
            RuntimeError: the measurement raised (its traceback is on stderr).
            TimeoutError: no result within ``timeout`` s (the process is killed).
        """
        from harness.memory import Sampler

        job = json.dumps({"module": module, "fn": fn, "kwargs": kwargs})
        settle()
        if interpreter or self.zygote is None:
            pipe = self._start(["", job])
        else:
            pipe = self.zygote
            pipe.send(job)
        try:
            pid = int(pipe.expect("PID", 120))
            sampler = None
            try:
                line = pipe.line(timeout)
                if line.startswith("READY"):
                    sampler = Sampler(pid)
                    sampler.start()
                    time.sleep(0.02)
                    pipe.send("go")
                    line = pipe.line(timeout)
                if sampler is not None:
                    sampler.stop()  # its last sample: what the measurement left
                    pipe.send("bye")
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                if pipe is self.zygote:  # the zygote reaps its child and says so
                    pipe.expect("EXITED", 60)
                raise
            pipe.expect("EXITED", 120)
        finally:
            if pipe is not self.zygote:
                pipe.close()
        head, _, rest = line.partition(" ")
        if head != "DONE":
            raise RuntimeError(f"{module}.{fn} failed: {json.loads(rest) if rest else line}")
        result: dict[str, Any] = json.loads(rest)
        if sampler is not None:
            result.update(sampler.result())
        return result

    def jobs(
        self, module: str, fn: str, jobs: list[dict[str, Any]], one_process: bool
    ) -> dict[str, Any]:
        """``fn(jobs=[job])`` per job in its own new interpreter (all in one for a smoke run).

        ``fn`` returns ``{job id: result}``; a process that fails or times out gives
        ``{"error": ...}`` for each of its jobs.
        """
        out: dict[str, Any] = {}
        for group in [jobs] if one_process else [[j] for j in jobs]:
            try:
                out.update(self.run(module, fn, interpreter=True, jobs=group))
            except (RuntimeError, TimeoutError) as e:
                out.update({j["id"]: {"error": str(e)[-300:]} for j in group})
        return out

    def close(self) -> None:
        """End the zygote (bounded wait)."""
        if self.zygote is not None:
            self.zygote.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
