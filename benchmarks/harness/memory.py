"""The one memory sampler: a process's (or process tree's) memory over time, peak and after.

``/proc/<pid>/status`` is read every ~1 ms: its ``RssAnon`` (private anonymous
memory: what a temporary copy occupies), ``RssShmem`` (shared memory, the data
shareddata fills) and ``VmRSS`` come from the kernel's per-process counters in
O(1). ``smaps_rollup`` gives PSS/USS but walks every page table (~50 ms per read
with 2 GiB mapped): it is read once before and once after (:func:`rollup`), never
sampled. PSS of a whole job after an epoch is ``sd.verify``'s (shareddata.memory).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

FIELDS = ("RssAnon", "RssShmem", "VmRSS")


def kb_fields(path: str) -> dict[str, int]:
    """``Name:  123 kB`` fields of a ``/proc`` file, in bytes (empty if the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant (``/proc/<pid>/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def status(pid: int, with_children: bool = False) -> dict[str, int]:
    """``RssAnon``, ``RssShmem``, ``VmRSS`` of ``pid`` (summed over its tree if asked)."""
    total = dict.fromkeys(FIELDS, 0)
    for p in tree(pid) if with_children else [pid]:
        fields = kb_fields(f"/proc/{p}/status")
        for k in FIELDS:
            total[k] += fields.get(k, 0)
    return total


def rollup(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes (Pss, Private_*, Anonymous, ...): slow, O(mappings)."""
    return kb_fields(f"/proc/{pid}/smaps_rollup")


class Sampler(threading.Thread):
    """Samples :func:`status` of a process (tree) every ``interval`` s until :meth:`stop`.

    :meth:`result` gives, over the data the process did not hold at the start:
    ``peak_private`` (max RssAnon growth), ``retained_private`` (RssAnon growth at
    the end), ``peak_rss``, ``peak_private_plus_shmem`` and ``smaps_*`` cross-checks.
    """

    def __init__(self, pid: int, interval: float = 0.001, with_children: bool = False) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.with_children = pid, interval, with_children
        self.start_status = status(pid, with_children)
        self.start_rollup = rollup(pid)
        self.samples: list[dict[str, int]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.samples.append(status(self.pid, self.with_children))
            time.sleep(self.interval)

    def stop(self) -> None:
        """Stop sampling and take the final sample (call while the process still lives)."""
        self._stop_event.set()
        self.join()
        self.samples.append(status(self.pid, self.with_children))
        self.end_rollup = rollup(self.pid)

    def result(self) -> dict[str, Any]:
        """Peak and final growth over the start, in bytes."""
        s0, last = self.start_status, self.samples[-1]
        return {
            "peak_private": max(s["RssAnon"] for s in self.samples) - s0["RssAnon"],
            "retained_private": last["RssAnon"] - s0["RssAnon"],
            "peak_rss": max(s["VmRSS"] for s in self.samples) - s0["VmRSS"],
            "peak_private_plus_shmem": max(s["RssAnon"] + s["RssShmem"] for s in self.samples)
            - s0["RssAnon"]
            - s0["RssShmem"],
            "smaps_anonymous_before": self.start_rollup.get("Anonymous", 0),
            "smaps_anonymous_after": self.end_rollup.get("Anonymous", 0),
            "samples": len(self.samples),
        }
