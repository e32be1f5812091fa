"""Every private torch, numpy and CPython name shareddata uses, in one place.

Each is here only because no public API does the job, with what it is for and what
happens without it; ``tests/test_compat.py`` checks each one, naming it when a
release changes it (``scripts/compat.sh`` runs the suite on the oldest and newest
torch claimed). Nothing here changes torch: no reducer replaced, no function
patched, no registry entry for a type that is not shareddata's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# torch's own reducers (``torch.multiprocessing.reductions``, undocumented): a tensor
# that is not ours to send by handle is sent exactly as torch sends any tensor.
from torch.multiprocessing.reductions import reduce_storage as torch_reduce_storage
from torch.multiprocessing.reductions import reduce_tensor as torch_reduce_tensor

# ``default_collate``'s registry of types (its docstring documents registering one,
# "Option 2") and its own functions, private in ``torch.utils.data._utils.collate``.
# shareddata registers only its own types (Note [The default collate's shortcut] in
# ``crossing/_collate.py``) and recognises torch's functions to collate a worker's batch
# into one memfd (Note [Collating into one memfd] in ``crossing/_collate.py``).
from torch.utils.data._utils.collate import (
    collate,
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
    default_collate_fn_map,
)

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
"""A ``__torch_function__`` that makes every result of a marker subclass a plain tensor,
at C speed (documented in "Extending torch", but in ``torch._C``)."""

DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
"""Context under which a subclass's ``__torch_function__`` runs the plain operation."""


def coo_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO tensor's indices and values as they are, coalesced or not.

    The public ``indices()``/``values()`` refuse an uncoalesced tensor.
    """
    return tensor._indices(), tensor._values()


def make_subclass(cls: type, tensor: torch.Tensor) -> Any:
    """``tensor`` as an instance of the subclass ``cls``, sparse layouts too.

    ``as_subclass`` refuses sparse tensors; without this a sparse batch's indices and
    values would leave its memfd through torch's reducer.
    """
    return torch.Tensor._make_subclass(cls, tensor, tensor.requires_grad)


def retype_new_views(views: list[torch.Tensor], cls: type) -> list[Any]:
    """``views`` (new plain tensors held by nothing else) made ``cls`` in place.

    ``__class__`` assignment (~0.1 us) instead of ``as_subclass``'s alias per view
    (~1 us); a subclass without C fields or ``__torch_dispatch__`` has the layout of
    ``torch.Tensor``. Falls back to ``as_subclass`` if a release refuses it.
    """
    try:
        for view in views:
            view.__class__ = cls
    except TypeError:
        return [v if type(v) is cls else v.as_subclass(cls) for v in views]
    return views


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` views, or None: a batch's rows find its memory reference there."""
    return tensor._base


def read_npy_header_3(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """The header of a version 3.0 ``.npy`` file (``f`` after the magic); 1.0/2.0 are public."""
    impl = getattr(np.lib, "_format_impl", np.lib.format)  # moved in numpy 2
    return impl._read_array_header(f, (3, 0))  # type: ignore[no-any-return]


# A DataLoader's workers, which verify measures and ends: torch keeps them in its
# iterator (``_workers``, ``_shutdown_workers``), a persistent loader's iterator in
# ``loader._iterator``. Without them verify falls back to the main process's new
# children (pids) and to dropping the iterator (shutdown).


def dataloader_worker_pids(iterator: Any) -> list[int] | None:
    """The pids of a DataLoader iterator's worker processes, or None if it has none known."""
    workers = getattr(iterator, "_workers", None)
    return None if workers is None else [w.pid for w in workers]


def shutdown_dataloader_iterator(iterator: Any) -> None:
    """End a DataLoader iterator's workers now, joining each for up to ``JOIN_SECONDS``.

    torch joins for 5 s, then SIGTERMs and leaves a slow worker a child holding two fds.
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
