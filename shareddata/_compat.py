"""Every private torch, numpy and CPython name shareddata uses, in one place.

A library should leave torch as it found it and build on its public API; where the
public API has no way to do what is needed, the private name is reached here, and
only here, each with what it is for and what happens without it. Each one is
checked by ``tests/test_compat.py``, which fails loudly, naming the surface, when a
release changes it; ``scripts/compat.sh`` runs the suite against the oldest and
newest torch this package claims.

Nothing here changes torch: no reducer of torch's types is replaced, no function
of torch's is patched, no entry is added to a torch registry for a type that is not
shareddata's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "DisableTorchFunctionSubclass",
    "coo_parts",
    "collate",
    "collate_float_fn",
    "collate_int_fn",
    "collate_numpy_array_fn",
    "collate_numpy_scalar_fn",
    "collate_str_fn",
    "collate_tensor_fn",
    "default_collate_fn_map",
    "dataloader_progress",
    "dataloader_worker_pids",
    "disabled_torch_function",
    "make_subclass",
    "read_npy_header_3",
    "retype_new_views",
    "shutdown_dataloader_iterator",
    "stop_dataloader_workers",
    "torch_reduce_storage",
    "torch_reduce_tensor",
    "view_base",
]

disabled_torch_function = torch._C._disabled_torch_function_impl
"""The ``__torch_function__`` that makes every operation on a tensor subclass return a
plain tensor, at C speed (``torch.Tensor`` subclasses that only mark a type, such as
``BatchIndices``). torch documents it for this use in "Extending torch with a Tensor
subclass"; it lives in ``torch._C``."""

DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
"""Context manager under which a tensor subclass's ``__torch_function__`` runs the
plain operation (what ``torch.Tensor.__torch_function__`` itself uses; documented in
"Extending torch" but in ``torch._C``)."""


def coo_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and values tensors a sparse COO tensor holds, coalesced or not.

    The public ``indices()``/``values()`` refuse an uncoalesced tensor; a batch of
    sparse rows is sent as the two tensors it was built from (by handle), whatever
    its state. ``_indices()``/``_values()`` return them as they are.

    Example:
        >>> t = torch.sparse_coo_tensor([[0, 0]], [1.0, 2.0], (3,), check_invariants=False)
        >>> [p.tolist() for p in coo_parts(t)]
        [[[0, 0]], [1.0, 2.0]]
    """
    return tensor._indices(), tensor._values()


def make_subclass(cls: type, tensor: torch.Tensor) -> Any:
    """``tensor`` as an instance of the subclass ``cls``, for any layout.

    ``Tensor.as_subclass`` refuses sparse tensors ("Cannot access storage");
    ``Tensor._make_subclass`` (what ``nn.Parameter`` is made with) takes them. A sparse
    batch made in a worker is then a ``SharedTensor`` whose indices and values cross
    by handle; without it, torch's reducer would move them out of the batch's memfd.

    Example:
        >>> class Mine(torch.Tensor):
        ...     pass
        >>> t = torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=False)
        >>> type(make_subclass(Mine, t)).__name__, make_subclass(Mine, t).layout
        ('Mine', torch.sparse_coo)
    """
    return torch.Tensor._make_subclass(cls, tensor, tensor.requires_grad)


def retype_new_views(views: list[torch.Tensor], cls: type) -> list[Any]:
    """``views`` (plain tensors an operation just made, held by nothing else) made ``cls``.

    ``Tensor.as_subclass`` makes a second tensor object per view (an alias, ~1 us
    each: 256 rows of a batch cost more than the views did). A tensor subclass that
    adds no C fields has the layout of ``torch.Tensor``, so Python's ``__class__``
    assignment changes the type of the new object itself (~0.1 us); torch keys no
    dispatch on the Python type of a subclass without ``__torch_dispatch__``. If a
    release refuses the assignment, ``as_subclass`` (public) is used instead.

    Example:
        >>> class Mine(torch.Tensor):
        ...     pass
        >>> rows = retype_new_views(list(torch.arange(6).view(2, 3).unbind(0)), Mine)
        >>> [type(r).__name__ for r in rows], rows[1].tolist()
        (['Mine', 'Mine'], [3, 4, 5])
    """
    try:
        for view in views:
            view.__class__ = cls
    except TypeError:
        return [v if type(v) is cls else v.as_subclass(cls) for v in views]
    return views


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor that ``tensor`` is a view of, or None (``Tensor._base``).

    The rows of a worker's batch (``unbind``) find the batch's memory reference at the
    batch they view, so a row costs no dict of its own (``storage/_tensor.py``).
    ``_base`` is documented in torch's "Tensor Views" page but has a private name.
    Without it every row would carry its own reference (slower, same results).

    Example:
        >>> t = torch.zeros(4)
        >>> view_base(t[1:]) is t, view_base(t) is None
        (True, True)
    """
    return tensor._base


# torch's own reducers of a tensor and of a storage (``torch.multiprocessing.reductions``,
# undocumented): what a tensor that is not ours to send by handle (a copy of it) is sent
# with, exactly as torch sends any tensor. Without them, such a tensor could not cross.
from torch.multiprocessing.reductions import (  # noqa: E402
    reduce_storage as torch_reduce_storage,
)
from torch.multiprocessing.reductions import (  # noqa: E402
    reduce_tensor as torch_reduce_tensor,
)

# ``default_collate`` dispatches on a registry of types, and its docstring documents
# registering a type there ("Option 2"); the registry and the generic ``collate`` live
# in ``torch.utils.data._utils.collate``. shareddata registers only its own types
# (``Row``, ``RowTuple``, ``RowList``, ``SharedTensor``: Note [The default collate's
# shortcut] in ``crossing/_batch.py``). The registry's own functions (``collate``'s
# docstring names them as what to extend) are recognised in a worker's collate into
# one memfd (Note [Collating into one memfd] in ``crossing/_collate.py``): without
# them every tensor of such a batch would leave the worker in a segment of its own.
from torch.utils.data._utils.collate import (  # noqa: E402
    collate,
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
    default_collate_fn_map,
)


def read_npy_header_3(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """The header of a version 3.0 ``.npy`` file (utf-8 field names), ``f`` after the magic.

    numpy reads versions 1.0 and 2.0 publicly (``read_array_header_1_0``/``2_0``);
    3.0 only through its private ``_read_array_header`` (moved to
    ``numpy.lib._format_impl`` in numpy 2).
    """
    impl = getattr(np.lib, "_format_impl", np.lib.format)
    return impl._read_array_header(f, (3, 0))  # type: ignore[no-any-return]


# A DataLoader's processes: ``verify`` measures each worker of a loader it iterates, and
# needs their pids and a way to end them. torch keeps both in its iterator
# (``_MultiProcessingDataLoaderIter._workers``, ``_shutdown_workers``) and the
# iterator of a persistent loader in ``loader._iterator``: no public API has them.
# Without them ``verify`` falls back to the main process's new children (pids) and
# to dropping the iterator (shutdown).


def dataloader_worker_pids(iterator: Any) -> list[int] | None:
    """The pids of a DataLoader iterator's worker processes, or None if it has none known."""
    workers = getattr(iterator, "_workers", None)
    return None if workers is None else [w.pid for w in workers]


def shutdown_dataloader_iterator(iterator: Any) -> None:
    """End a DataLoader iterator's workers now (they exit; its pins and queues close).

    torch joins each worker for 5 s, then sends SIGTERM to one still running and
    leaves it: a slow worker (a loaded machine) would stay a child of this process,
    holding two pipe fds, until multiprocessing's next ``start()``. Here it is
    joined, for at most ``JOIN_SECONDS``.
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    for worker in getattr(iterator, "_workers", ()):
        worker.join(JOIN_SECONDS)


JOIN_SECONDS = 10.0


def stop_dataloader_workers(loader: Any) -> None:
    """Shut down the workers a persistent ``DataLoader`` keeps between epochs."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shutdown_dataloader_iterator(iterator)
        loader._iterator = None


def dataloader_progress(loader: Any) -> tuple[int, int] | None:
    """``(batches yielded, batches per epoch)`` of a persistent loader's live workers."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None or not getattr(iterator, "_workers", None):
        return None
    return getattr(iterator, "_num_yielded", 0), len(iterator)
