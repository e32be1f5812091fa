"""Shared memory: segments, their pages, and the arrays laid over them.

Lower modules never import higher ones: ``_linux`` (libc), ``_capacity`` (room and
errors), ``_pages``, ``_handoff``, ``_parent``, ``_segment`` (:class:`Segment`, the
owner of a segment in a process), ``_tensor``, ``_array``, ``_writer``, ``_sweep``.
"""

from ._array import SharedArray, allocate, seal, to_numpy_dtype
from ._pages import populate, population_threads
from ._segment import Segment, attach, attached_segments, ready, segment_of
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
    "segment_of",
    "shared_tensor",
    "to_numpy_dtype",
]
