"""Crossing processes: batches out of workers, their default collate, batches of indices.

- ``_transport``: a worker's batch in one memfd, reused once released; the main
  process maps it;
- ``_collate``: a batch's samples made when first used, the default collate's
  shortcut, and collating in a worker into one memfd;
- ``_sampler``: whole batches of indices (``IndexBatchSampler``).
"""

from ._sampler import IndexBatchSampler

__all__ = ["IndexBatchSampler"]
