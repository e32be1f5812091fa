"""Crossing processes: tensors over shareddata's memory pickled as handles, batches out of workers.

- ``_reduce``: the tensor types over our memory and their ``ForkingPickler`` reducers;
- ``_transport``: a worker's batch in one memfd, received by mapping it;
- ``_batch``: a batch's samples made when first used, and the default collate's shortcut;
- ``_sampler``: whole batches of indices (``IndexBatchSampler``).
"""

from ._sampler import IndexBatchSampler

__all__ = ["IndexBatchSampler"]
