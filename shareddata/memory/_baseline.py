"""The per-worker baseline: private memory of a loader's worker that holds no data."""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from .._compat import dataloader_worker_pids, shutdown_dataloader_iterator
from ._process import KIB, measure, read_smaps_rollup


def probe_baseline(context: Any, refs: tuple[Any, ...]) -> int:
    """Private dirty bytes of an idle one-worker probe loader's worker, under ``context``.

    Its two-item dataset carries ``refs`` (pickled by reference), so that the worker
    imports what the real ones do. Under fork it runs twice: the first DataLoader of
    a process initialises state in the parent that makes more of a worker's pages
    private.
    """
    baseline = 0
    for _ in range(2 if _method(context) == "fork" else 1):
        try:
            baseline = _run_probe(context, refs)
        except Exception:
            if not refs:
                raise
            # A reference that imports here but not in a fresh worker (the user's own
            # loader would fail there as well): measure without them.
            refs = ()
            baseline = _run_probe(context, refs)
    return baseline


def _method(context: Any) -> str | None:
    return context if context is None or isinstance(context, str) else context.get_start_method()


def _run_probe(context: Any, refs: tuple[Any, ...]) -> int:
    dataset = TensorDataset(torch.arange(2))
    dataset.shareddataprobe_references = refs  # type: ignore[attr-defined]
    probe = DataLoader(dataset, batch_size=1, num_workers=1, multiprocessing_context=context)
    iterator = iter(probe)
    try:
        next(iterator)
        next(iterator)  # both batches received: idle, as the real workers are when measured
        pids = dataloader_worker_pids(iterator)
        if not pids:
            return 0
        pid = pids[0]
        fields = read_smaps_rollup(pid)
        return fields["Private_Dirty"] if fields and "Private_Dirty" in fields else measure(pid).uss
    finally:
        shutdown_dataloader_iterator(iterator)
        del iterator


def probe_references(code: Iterable[Any], *callables: Any) -> tuple[Any, ...]:
    """The classes and functions among ``code`` and ``callables`` that pickle by reference.

    A bound method gives its class and function, never the object bound (it may be
    the dataset itself); anything that does not pickle in under 4 KiB (a local class,
    a lambda) is left out.
    """
    candidates = list(code)
    for fn in callables:
        if inspect.ismethod(fn):
            candidates += [type(fn.__self__), fn.__func__]
        elif callable(getattr(fn, "func", None)):  # functools.partial
            candidates += [type(fn), fn.func]
        elif fn is not None:
            candidates.append(fn if isinstance(fn, type) or inspect.isroutine(fn) else type(fn))
    refs: dict[int, Any] = {}
    for obj in candidates:
        if getattr(obj, "__module__", None) in (None, "builtins") or id(obj) in refs:
            continue
        if not (isinstance(obj, type) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        try:
            if len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) <= 4 * KIB:
                refs[id(obj)] = obj
        except Exception:
            continue
    return tuple(refs.values())
