"""Per-process memory accounting: :func:`verify`, :class:`MemoryReport`, :func:`measure`.

- ``_process``: what the kernel says about one process (:class:`ProcessMemory`);
- ``_dataset``: what a dataset holds (size, arrays, segments, pickle);
- ``_baseline``: the private memory of a worker that holds no data;
- ``_account``: the copies between two measurements, and whether they decide;
- ``_report``: :class:`MemoryReport`, its table and verdict;
- ``_verify``: :func:`verify` (Note [How duplication is measured]);
- ``_node``: the same measurement across the local ranks of a node;
- ``_plot``: the report as a bar chart.
"""

from ._process import ProcessMemory, measure
from ._report import MemoryReport
from ._verify import verify

__all__ = ["MemoryReport", "ProcessMemory", "measure", "verify"]
