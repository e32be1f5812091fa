"""The machine a run measures: what it is, how busy it is, and small shared helpers."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterable
from typing import Any

from harness.memory import kb_fields
from harness.runner import REPO

MIB, GIB = 1 << 20, 1 << 30


def median(values: Iterable[float]) -> float:
    """Median of the values (NaN for none)."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (other users of the machine show here)."""
    return [round(x, 2) for x in os.getloadavg()]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def shmem_enabled() -> str:
    """The selected value of ``transparent_hugepage/shmem_enabled`` (``never`` here)."""
    text = _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text


def machine_info() -> dict[str, Any]:
    """Cores, RAM, kernel, CPU, versions, commit: what the figures depend on."""
    import numpy as np
    import torch

    import shareddata as sd

    cpu = next(
        (
            x.split(":", 1)[1].strip()
            for x in _read("/proc/cpuinfo").splitlines()
            if "model name" in x
        ),
        "?",
    )
    commit = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "ram_gib": round(kb_fields("/proc/meminfo")["MemTotal"] / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "nice": os.nice(0),
        "numpy": np.__version__,
        "shareddata": sd.__version__,
        "commit": commit or "?",
        "thp_shmem": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
    }


class CpuMonitor:
    """CPU that other processes used meanwhile: the machine's busy time minus ours.

    Ours is this process and every child it has reaped (``os.times``); a child still
    running (a zygote's) counts as others'.
    """

    def __init__(self) -> None:
        self.start = self._snap()

    @staticmethod
    def _snap() -> tuple[float, float, float, float]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        t = os.times()
        busy = (v[0] + v[1] + v[2] + v[5] + v[6]) / hz  # user nice system irq softirq
        steal = v[7] / hz if len(v) > 7 else 0.0
        return (
            time.monotonic(),
            busy,
            steal,
            t.user + t.system + t.children_user + t.children_system,
        )

    def result(self) -> dict[str, float]:
        """Cores used on average since the start: by others, by us, stolen by the host."""
        end = self._snap()
        wall = max(end[0] - self.start[0], 1e-9)
        ours = end[3] - self.start[3]
        return {
            "wall_s": wall,
            "others_cores": max(0.0, (end[1] - self.start[1]) - ours) / wall,
            "ours_cores": ours / wall,
            "steal_cores": (end[2] - self.start[2]) / wall,
        }


def wait_idle(limit_s: float, threshold: float = 0.2) -> float:
    """Wait up to ``limit_s`` for a 1 s window where others use < ``threshold`` cores."""
    deadline = time.monotonic() + limit_s
    while True:
        mon = CpuMonitor()
        time.sleep(1.0)
        others = mon.result()["others_cores"]
        if others < threshold or time.monotonic() >= deadline:
            return others
