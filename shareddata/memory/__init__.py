"""Per-process memory accounting: :func:`verify`, :class:`MemoryReport`, :func:`measure`.

:func:`verify` runs a ``DataLoader`` for (part of) an epoch and measures every
process of it with the kernel's own accounting, then says how many times the
dataset is held in RAM. It works on any ``torch.utils.data.DataLoader``, not only on
shareddata's datasets, so users can check their own loaders.

Modules, one job each:

- ``_process``: measuring one process (:class:`ProcessMemory`, :func:`measure`);
- ``_size``: the dataset's size (``nbytes`` or an estimate from its object graph);
- ``_baseline``: the private memory of a worker that holds no data;
- ``_received``: what ``spawn``/``forkserver`` workers receive of the dataset by value;
- ``_buffers``: the pages of the dataset's arrays that ``fork`` workers copied;
- ``_account``: the copies between two measurements, and whether they decide;
- ``_report``: :class:`MemoryReport`, its table and its verdict (ok, duplicated,
  cannot tell);
- ``_verify``: :func:`verify` (Note [How duplication is measured]);
- ``_node``: the same measurement across the local ranks of a node;
- ``_plot``: the report as a bar chart.
"""

from ._process import ProcessMemory, measure
from ._report import MemoryReport
from ._verify import verify

__all__ = ["MemoryReport", "ProcessMemory", "measure", "verify"]
