"""The per-worker baseline: private memory of a loader's worker that holds no data."""

from __future__ import annotations

import inspect
import pickle
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from .._compat import dataloader_worker_pids, shutdown_dataloader_iterator
from ._process import KIB, measure, read_smaps_rollup
from ._size import children_of


def probe_baseline(loader: DataLoader, start_method: str | None) -> int:
    """Private dirty bytes of one of ``loader``'s workers that holds no data."""
    refs = probe_references(loader)
    # Under fork the first DataLoader of a process initialises state in the parent
    # after forking, which makes more of the worker's pages private: probe twice.
    runs = 2 if start_method == "fork" else 1
    baseline = 0
    for _ in range(runs):
        try:
            baseline = _run_probe(loader.multiprocessing_context, refs)
        except Exception:
            if not refs:
                raise
            # A reference that imports in the parent but not in a fresh worker (the
            # user's own loader would fail there as well): measure without them.
            refs = ()
            baseline = _run_probe(loader.multiprocessing_context, refs)
    return baseline


def _run_probe(context: Any, refs: tuple[Any, ...]) -> int:
    """Run a one-worker probe loader; return its worker's private dirty bytes."""
    dataset = TensorDataset(torch.arange(2))
    # Pickled by reference with the dataset: the worker imports what the real ones do.
    dataset.shareddataprobe_references = refs  # type: ignore[attr-defined]
    probe = DataLoader(dataset, batch_size=1, num_workers=1, multiprocessing_context=context)
    iterator = iter(probe)
    try:
        # Both batches received: the worker is idle, as the real ones are when measured.
        next(iterator)
        next(iterator)
        workers = dataloader_worker_pids(iterator) or []
        pid = workers[0] if workers else None
        if pid is None:
            return 0
        fields = read_smaps_rollup(pid)
        if fields is None or "Private_Dirty" not in fields:
            return measure(pid).uss
        return fields["Private_Dirty"]
    finally:
        shutdown_dataloader_iterator(iterator)
        del iterator


def probe_references(loader: DataLoader) -> tuple[Any, ...]:
    """Classes and functions of the dataset, its attributes, collate_fn and worker_init_fn.

    Only objects that pickle by reference (a module and a name, never data) are kept.
    """
    candidates: list[Any] = [type(loader.dataset)]
    candidates += _types_in(loader.dataset, depth=3)
    for fn in (loader.collate_fn, loader.worker_init_fn):
        candidates += _callable_references(fn)
    refs: list[Any] = []
    seen: set[int] = set()
    for obj in candidates:
        if id(obj) in seen or getattr(obj, "__module__", None) in (None, "builtins"):
            continue
        seen.add(id(obj))
        if not (isinstance(obj, type) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        try:
            if len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) > 4 * KIB:
                continue
        except Exception:  # a local class, a lambda: nothing a worker could import
            continue
        refs.append(obj)
    return tuple(refs)


def _callable_references(fn: Any) -> list[Any]:
    if fn is None:
        return []
    if inspect.ismethod(fn):  # never the bound object: it may be the dataset itself
        return [type(fn.__self__), fn.__func__]
    func = getattr(fn, "func", None)  # functools.partial
    if func is not None and callable(func):
        return [type(fn), *_callable_references(func)]
    if isinstance(fn, type) or inspect.isfunction(fn) or inspect.isbuiltin(fn):
        return [fn]
    return [type(fn)]


def _types_in(obj: Any, depth: int, limit: int = 200) -> list[Any]:
    """Types (and classes/functions held as values) found walking ``obj`` to ``depth``."""
    found: list[Any] = []
    seen: set[int] = set()
    level = [obj]
    for _ in range(depth):
        nxt: list[Any] = []
        for o in level:
            for child in islice(children_of(o), 32):
                if id(child) in seen:
                    continue
                seen.add(id(child))
                if isinstance(child, type) or (callable(child) and hasattr(child, "__code__")):
                    found.append(child)
                    continue
                found.append(type(child))
                nxt.append(child)
                if len(found) >= limit:
                    return found
        level = nxt
    return found
