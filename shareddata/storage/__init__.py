"""Shared memory: segments, their pages, and the arrays laid over them.

Modules, one job each (lower ones never import higher ones):

- ``_pages``: every page of a segment allocated before it is written, by threads,
  optionally ahead of the writer (:func:`populate`, :func:`ready`;
  Note [Allocating shared pages], Note [Filling while the pages are allocated]);
- ``_segment``: :class:`Segment`, one anonymous shared file: created, pickled as a
  handle, attached in another process, sealed against any change, freed
  (Note [How shared segments are made, shared and freed], Note [Sealed segments],
  Note [Freeing a failed load], Note [One descriptor per segment]);
- ``_tensor``: :class:`SharedTensor`, the tensor type over our memory, and how it
  crosses processes by handle (Note [Tensors over our memory cross by handle]);
- ``_array``: :class:`SharedArray` over a segment, :func:`allocate` of several arrays
  in one segment, :func:`seal` of a loaded dataset's arrays.

Handing a segment to a process that has not opened it yet is ``_handoff.py``; a
DataLoader worker that exits with its killed main process is ``_parent.py``; the
room left and the errors for a full memory (or no descriptor left) are
``_capacity.py``; the libc calls are ``_linux.py``.
"""

from ._array import SharedArray, allocate, seal, to_numpy_dtype
from ._pages import populate, population_threads, ready
from ._segment import Segment, attach, attached_segments
from ._tensor import MemoryRef, SharedTensor, shared_tensor

__all__ = [
    "MemoryRef",
    "Segment",
    "SharedArray",
    "SharedTensor",
    "allocate",
    "attach",
    "attached_segments",
    "populate",
    "population_threads",
    "ready",
    "seal",
    "shared_tensor",
    "to_numpy_dtype",
]
