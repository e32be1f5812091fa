"""Crossing processes: tensors over shareddata's memory pickled as handles, batches out of workers.

- ``_outbox``: a worker's batch in one memfd of its own, reused once released;
- ``_inbox``: the main process receives a batch by mapping that memfd;
- ``_batch``: a batch's samples made when first used, and the default collate's shortcut;
- ``_sampler``: whole batches of indices (``IndexBatchSampler``).
"""

from ._sampler import IndexBatchSampler

__all__ = ["IndexBatchSampler"]
