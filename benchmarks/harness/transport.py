"""The two ways a batch can leave a DataLoader worker, for benchmarks that compare them.

``shared_empty`` is torch's way (what ``default_collate`` does in a worker: a tensor in
torch's shared memory); :func:`transport` is shareddata's worker-batch module, found in
whichever tree is imported (its path moved in the folder layout of issue 21), so that
an A/B run can import a baseline revision with the same benchmark script.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import torch


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor in torch's shared memory, as ``default_collate`` makes in workers."""
    numel = math.prod(shape)
    proto = torch.empty(0, dtype=dtype)
    storage = proto._typed_storage()._new_shared(numel, device="cpu")
    return proto.new(storage).view(shape) if numel else torch.empty(shape, dtype=dtype)


def transport() -> ModuleType:
    """shareddata's module with ``worker_empty`` and ``POOL``, wherever this tree keeps it."""
    for name in ("shareddata.crossing._outbox", "shareddata.crossing._transport",
                 "shareddata._transport"):  # fmt: skip
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no shareddata worker-batch module found")
